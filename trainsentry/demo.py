"""``trainsentry demo``: the whole loop on one machine, with nothing to configure.

Broker (started if none answers), the service (``trainsentry serve`` as a subprocess),
a local chat sink that prints what DingTalk and WeCom would show, a control listener
standing in for the trainer, and a simulated verl run with an injected fault. Everything
the demo started is stopped at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainsentry.errors import TrainsentryError

__all__ = ["run_demo"]


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise TrainsentryError(f"the service exited with code {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - 127.0.0.1 only
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TrainsentryError(f"the service did not become ready at {url} within {timeout:.0f}s; "
                           f"see {log_path}")


def run_demo(*, fault: str = "nan_loss", steps: int = 80, port: int = 9092,
             web_port: int = 6066, keep: bool = False, language: str = "en",
             timeout: float = 180.0) -> int:
    from producers import ControlListener, make_sender
    from trainsentry import kafka_local
    from trainsentry.config import Topics
    from trainsentry.simulate import SCENARIO_LABELS, Scenario, generate, publish
    from trainsentry.sink import ChatSink
    from trainsentry.topics import create_topics

    if fault not in SCENARIO_LABELS:
        raise TrainsentryError(f"unknown fault {fault!r}; choose one of {', '.join(SCENARIO_LABELS)}")
    started_broker = False
    data_dir = str(Path.home() / ".cache" / "trainsentry" / f"kafka-data-{port}")
    if _reachable(port):
        bootstrap = f"127.0.0.1:{port}"
        _say(f"using the Kafka broker already at {bootstrap}")
    else:
        _say(f"starting Apache Kafka on 127.0.0.1:{port} (first run downloads the jars with Maven)")
        bootstrap = kafka_local.start(port=port, data_dir=data_dir)
        started_broker = True
    stamp = time.strftime("%H%M%S")
    prefix = f"demo-{stamp}-{secrets.token_hex(2)}."
    create_topics(bootstrap=bootstrap, topics=Topics(prefix), partitions=2)

    ding_secret = "SEC" + secrets.token_hex(16)
    control_secret = secrets.token_hex(16)
    sink = ChatSink(dingtalk_secret=ding_secret)
    sink.start()
    urls = sink.urls
    _say(f"chat sink listening: DingTalk {urls['dingtalk'].split('?')[0]}, WeCom {urls['wecom'].split('?')[0]}")

    workdir = Path(tempfile.mkdtemp(prefix="trainsentry-demo-"))
    log_path = workdir / "service.log"
    env = {**os.environ,
           "TRAINSENTRY_KAFKA_BOOTSTRAP": bootstrap, "TRAINSENTRY_TOPIC_PREFIX": prefix,
           "TRAINSENTRY_DINGTALK_URL": urls["dingtalk"], "TRAINSENTRY_DINGTALK_SECRET": ding_secret,
           "TRAINSENTRY_WECOM_URL": urls["wecom"], "TRAINSENTRY_CONTROL_SECRET": control_secret,
           "TRAINSENTRY_WEB_PORT": str(web_port), "TRAINSENTRY_APP_ID": f"trainsentry-demo-{stamp}",
           "TRAINSENTRY_LANGUAGE": language, "TRAINSENTRY_PARTITIONS": "2",
           "TRAINSENTRY_DATA_DIR": str(workdir / "worker")}
    _say(f"starting the service (trainsentry serve), log: {log_path}")
    with log_path.open("wb") as log_file:
        service = subprocess.Popen([sys.executable, "-m", "trainsentry.cli", "serve"], env=env,
                                   stdout=log_file, stderr=subprocess.STDOUT)
    run_id = f"demo/grpo-qwen7b-{fault}"
    commands: list[Any] = []
    got_command = threading.Event()

    def on_command(cmd: Any) -> None:
        commands.append(cmd)
        got_command.set()

    listener = ControlListener(run_id=run_id, secret=control_secret, on_command=on_command,
                               bootstrap=bootstrap, topic_prefix=prefix)
    try:
        _wait_http(f"http://127.0.0.1:{web_port}/readyz", 120, service, log_path)
        _say(f"service ready; dashboard and metrics on http://127.0.0.1:{web_port}/")
        listener.start()
        listener.wait_ready(30)
        onset = max(30, int(steps * 0.6))
        scenario = Scenario(run_id=run_id, steps=steps, fault=fault, fault_onset=onset, ranks=4,
                            step_time_s=20.0, seed=7, test_freq=25, save_freq=10)
        events = generate(scenario)
        _say(f"simulating run {run_id}: {steps} steps of a verl GRPO run (0.2 s per step), 4 ranks, "
             f"fault {fault} injected at step {onset}")
        sender = make_sender(bootstrap, prefix)

        def send_now(kind: str, event: Mapping[str, Any]) -> None:
            sender(kind, {**event, "ts": time.time()})  # replay at wall-clock time

        publish(events, send=send_now, speed=100.0)  # 20 s steps in 0.2 s
        sender.close()  # type: ignore[attr-defined]
        _say("run published; waiting for the diagnosis, the chat messages and the command")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sink.messages and got_command.is_set():
                break
            if fault == "training_hang" and sink.messages:
                break
            time.sleep(0.5)
        time.sleep(1.0)
        ok = bool(sink.messages)
        _say(f"chat messages received: {len(sink.messages)}")
        if commands:
            cmd = commands[0]
            _say("control command received and its signature verified by the trainer side:")
            print(json.dumps(cmd.to_dict(), indent=2, ensure_ascii=False), flush=True)
        elif fault in ("dataloader_stall", "comm_degradation", "straggler", "training_hang"):
            _say(f"no command: the remediation policy for {fault} is alert-only "
                 "(a rollback cannot fix a disk or a network)")
        else:
            _say("no control command arrived within the timeout")
            ok = False
        return 0 if ok else 1
    finally:
        listener.stop()
        if service.poll() is None:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                service.kill()
        sink.stop()
        if started_broker and not keep:
            kafka_local.stop(port=port, data_dir=data_dir)
            _say("stopped the broker the demo started")
        _say("done")
