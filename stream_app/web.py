"""HTTP endpoints of the service, on Faust's web server (``TRAINSENTRY_WEB_PORT``).

- ``/healthz``: the process is up (liveness). ``/readyz``: partitions are assigned and their
  state is restored (readiness; 503 while a rebalance or its table recovery is going on).
- ``/metrics``: Prometheus text format (stream_app/metrics.py; one registry per app).
- ``/api/runs``, ``/api/runs/{run_id}/signals``, ``/api/runs/{run_id}/timeline``,
  ``/api/stats``: JSON for the dashboard and scripts; runs are this worker's runs
  (``/api/stats`` also names the partitions it holds and the runs it has cached).
- ``/`` and ``/runs/{run_id}``: the dashboard (stream_app/dashboard/, no build step, no CDN).

Silences, acks and alert history are stream_app/alerting_api.py's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stream_app.metrics import build_registry, render, run_signals, run_status
from trainsentry.config import Settings

__all__ = ["install_views", "DASHBOARD_DIR"]

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
_ASSETS = {"app.js": "application/javascript", "style.css": "text/css",
           "index.html": "text/html", "favicon.svg": "image/svg+xml"}


def _run_summary(run_id: str, state: Any, svc: Any) -> dict[str, Any]:
    colour, diagnosis, severity = run_status(state)
    alerts = [{"diagnosis": a.label, "severity": a.severity, "fingerprint": a.fingerprint,
               "alert_id": a.last_alert_id, "since_step": a.since_step}
              for a in sorted(state.alerts.values(), key=lambda a: a.since_step)]
    return {
        "run_id": run_id, "attempt": state.attempt, "last_step": state.last_evaluated,
        "steps": state.steps_evaluated, "status": colour, "diagnosis": diagnosis,
        "severity": severity, "diagnoses": list(state.last_diagnoses),
        "firing": sorted({a.label for a in state.alerts.values()}), "alerts": alerts,
        "critical_streak": state.critical_streak, "breaker_fired": state.breaker_fired,
        "finished": state.finished, "last_seen_ts": state.last_seen_ts,
        "checkpoints": [s for s, _ts in state.checkpoints[-10:]],
    }


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats become null (browsers' JSON.parse rejects NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def install_views(app: Any, *, svc: Any, settings: Settings, run_table: Any) -> None:
    """Declare the health, metrics, API and dashboard views on ``app``."""
    from faust.web import View

    registry = build_registry(svc, app=app)
    page: Callable[[str], Callable[[Any], Any]] = app.page  # app is untyped (faust)

    @page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        return web.json({"status": "ok", "uptime_s": round(time.time() - svc.started, 1)})

    @page("/readyz")
    async def readyz(web: Any, request: Any) -> Any:
        notifier = svc.extra.get("notifier_health", {})
        config_errors = {name: h for name, h in notifier.items()
                         if isinstance(h, dict)
                         and (h.get("config_error") or h.get("state") == "config_error")}
        ready = svc.serving
        body = {"ready": ready, "assigned": bool(svc.ready), "recovering": bool(svc.recovering()),
                "control_commands": bool(settings.control_secret),
                "notifier": notifier, "config_errors": config_errors}
        return web.json(_clean(body), status=200 if ready else 503)

    @page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        body, content_type = render(registry)
        # aiohttp wants the charset apart from the media type.
        media = content_type.split(";")[0].strip()
        return web.bytes(body, content_type=media, headers={"Cache-Control": "no-store"})

    @page("/api/runs")
    async def runs(web: Any, request: Any) -> Any:
        order = {"red": 0, "amber": 1, "green": 2}
        out = [_run_summary(run_id, state, svc) for run_id, state in svc.cache.items()]
        out.sort(key=lambda r: (r["finished"], order[r["status"]], r["run_id"]))
        return web.json(_clean({"runs": out, "ts": time.time()}))

    def lookup(run_id: str) -> Any:
        return svc.cache.get(run_id)

    class Signals(View):
        async def get(self, request: Any, run_id: str) -> Any:
            state = lookup(run_id)
            if state is None:
                return self.json({"error": f"run {run_id} is not on this worker"}, status=404)
            keys = request.query.get("keys")
            limit = _int(request.query.get("limit"), 12)
            wanted = [k for k in keys.split(",") if k] if keys else None
            if request.query.get("all") in ("1", "true"):
                wanted = sorted(state.recent)
            recorder = svc.extra.get("recorder")
            alert_steps = []
            if recorder is not None:
                alert_steps = [{"step": e["step"], "diagnosis": e["diagnosis"],
                                "severity": e["severity"], "status": e["status"],
                                "evidence": e.get("evidence", [])}
                               for e in recorder.timelines.get(run_id, ()) if e["kind"] == "alert"]
            if wanted is None:
                # Evidence of this run's alerts first: those are the charts people open.
                evidence: list[str] = []
                for e in reversed(alert_steps):
                    for k in e["evidence"]:
                        if k in state.recent and k not in evidence:
                            evidence.append(k)
                rest = [s["key"] for s in run_signals(state, limit=limit)]
                wanted = list(dict.fromkeys(evidence + rest))[:limit]
            flagged = [(e["step"], k) for e in alert_steps if e["status"] == "firing"
                       for k in e["evidence"]]
            body = {"run": _run_summary(run_id, state, svc),
                    "signals": run_signals(state, keys=wanted, alert_steps=flagged),
                    "alert_steps": alert_steps,
                    "available": sorted(state.recent)}
            return self.json(_clean(body))

    class Timeline(View):
        async def get(self, request: Any, run_id: str) -> Any:
            recorder = svc.extra.get("recorder")
            events = list(recorder.timelines.get(run_id, ())) if recorder is not None else []
            state = lookup(run_id)
            if state is None and not events:
                return self.json({"error": f"run {run_id} is not on this worker"}, status=404)
            commands = [e for e in events if e["kind"] == "command"]
            applied = [e for e in events if e["kind"] in ("command_applied", "command_rejected")]
            return self.json(_clean({"run_id": run_id, "events": events, "commands": commands,
                                     "applied": applied}))

    page("/api/runs/{run_id:.+}/signals")(Signals)
    page("/api/runs/{run_id:.+}/timeline")(Timeline)

    source_topics = {settings.topics.data, settings.topics.compute, settings.topics.resource,
                     settings.topics.runs}

    def assigned_partitions() -> list[int]:
        # Co-partitioned: the source topics' partitions this worker owns, one index per run
        # shard (scale-out checks and operators see which runs a worker holds).
        try:
            assignment = app.consumer.assignment()
        except Exception:  # the consumer is not started yet: nothing is assigned
            return []
        return sorted({tp.partition for tp in assignment if tp.topic in source_topics})

    @page("/api/stats")
    async def stats(web: Any, request: Any) -> Any:
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop or asyncio
        return web.json({"consumed": svc.consumed, "deadletters": svc.deadletters,
                         "alerts": svc.alerts, "commands": svc.commands, "errors": svc.errors,
                         "partitions": assigned_partitions(), "runs": sorted(svc.cache),
                         "event_loop": loop})

    # ------------------------------------------------------------------ dashboard
    def asset(name: str) -> tuple[bytes, str] | None:
        media = _ASSETS.get(name)
        path = DASHBOARD_DIR / name
        if media is None or not path.is_file():
            return None
        return path.read_bytes(), media

    def index(web: Any) -> Any:
        found = asset("index.html")
        if found is None:
            return web.json({"error": "dashboard files are missing"}, status=500)
        return web.bytes(found[0], content_type="text/html",
                         headers={"Cache-Control": "no-cache"})

    @page("/")
    async def dashboard(web: Any, request: Any) -> Any:
        return index(web)

    class RunPage(View):
        async def get(self, request: Any, run_id: str) -> Any:
            return index(self)

    class Asset(View):
        async def get(self, request: Any, name: str) -> Any:
            found = asset(name)
            if found is None:
                return self.json({"error": f"no asset {name}"}, status=404)
            return self.bytes(found[0], content_type=found[1],
                              headers={"Cache-Control": "no-cache"})

    page("/runs/{run_id:.+}")(RunPage)
    page("/dashboard/{name}")(Asset)


def _int(raw: str | None, default: int) -> int:
    try:
        return max(1, min(100, int(raw))) if raw else default
    except ValueError:
        return default
