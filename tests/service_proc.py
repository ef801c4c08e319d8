"""Run the real ``trainsentry serve`` as a subprocess for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


class ServiceProcess:
    """``trainsentry serve`` with the given environment; ``stop()`` checks a clean SIGTERM exit."""

    def __init__(self, *, bootstrap: str, prefix: str, web_port: int, control_secret: str = "",
                 extra_env: dict[str, str] | None = None, app_id: str | None = None) -> None:
        self.web_port = web_port
        self.workdir = Path(tempfile.mkdtemp(prefix="trainsentry-svc-"))
        self.log_path = self.workdir / "service.log"
        self.env = {**os.environ, "TRAINSENTRY_KAFKA_BOOTSTRAP": bootstrap,
                    "TRAINSENTRY_TOPIC_PREFIX": prefix, "TRAINSENTRY_WEB_PORT": str(web_port),
                    "TRAINSENTRY_CONTROL_SECRET": control_secret, "TRAINSENTRY_PARTITIONS": "2",
                    "TRAINSENTRY_APP_ID": app_id or f"ts-test-{prefix.rstrip('.')}",
                    "TRAINSENTRY_DATA_DIR": str(self.workdir / "data"), "TRAINSENTRY_LANGUAGE": "en"}
        for key in ("TRAINSENTRY_DINGTALK_URL", "TRAINSENTRY_DINGTALK_SECRET", "TRAINSENTRY_WECOM_URL",
                    "TRAINSENTRY_WEBHOOK_URL"):
            self.env.pop(key, None)
        self.env.update(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "trainsentry.cli", "serve"],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}{path}", timeout=timeout) as r:
                body = r.read()
                return r.status, (json.loads(body) if body[:1] in (b"{", b"[") else body.decode())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                status, _ = self.get("/readyz", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"service not ready after {timeout}s:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> float:
        """SIGTERM and wait; returns the seconds it took (the contract allows 15)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return 0.0
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"service did not exit within {timeout}s of SIGTERM:\n{self.log()[-3000:]}") from None
        return time.monotonic() - start


def publish_scenario(producer: Any, events: list[dict[str, Any]]) -> None:
    """Feed simulator events through a MetricsProducer the way a trainer would:
    driver metrics with ``log()`` (one dict per step, split into layers by the library),
    per-rank resource samples with ``log_layer()``, lifecycle events as RunEvents."""
    by_step: dict[int, dict[str, float]] = {}
    order: list[tuple[str, Any]] = []
    for ev in events:
        if "layer" in ev and ev.get("rank") is None:
            if ev["step"] not in by_step:
                by_step[ev["step"]] = {}
                order.append(("step", (ev["step"], ev["ts"])))
            by_step[ev["step"]].update(ev["metrics"])
        elif "layer" in ev:
            order.append(("rank", ev))
        else:
            order.append(("run", ev))
    for kind, item in order:
        if kind == "step":
            step, ts = item
            producer.log({k: (float(v) if not isinstance(v, str) else float(v)) for k, v in by_step[step].items()},
                         step=step, ts=ts)
        elif kind == "rank":
            producer.log_layer(item["layer"], {k: float(v) for k, v in item["metrics"].items()},
                               step=item["step"], ts=item["ts"], host=item.get("host"), rank=item["rank"])
        else:
            producer.send_raw("run", item)
