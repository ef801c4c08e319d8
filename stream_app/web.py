"""HTTP endpoints of the service, on Faust's web server (``TRAINSENTRY_WEB_PORT``)."""

from __future__ import annotations

import time
from typing import Any

from trainsentry.config import Settings

__all__ = ["install_views"]


def install_views(app: Any, *, svc: Any, settings: Settings, run_table: Any) -> None:
    """/healthz (process up), /readyz (partitions assigned), /api/runs (local runs)."""

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        return web.json({"status": "ok", "uptime_s": round(time.time() - svc.started, 1)})

    @app.page("/readyz")
    async def readyz(web: Any, request: Any) -> Any:
        notifier = svc.extra.get("notifier_health", {})
        config_errors = {name: h for name, h in notifier.items()
                         if isinstance(h, dict) and h.get("config_error")}
        body = {"ready": bool(svc.ready), "control_commands": bool(settings.control_secret),
                "notifier": notifier, "config_errors": config_errors}
        return web.json(body, status=200 if svc.ready else 503)

    @app.page("/api/runs")
    async def runs(web: Any, request: Any) -> Any:
        out = []
        for run_id, state in sorted(svc.cache.items()):
            out.append({
                "run_id": run_id, "attempt": state.attempt, "last_step": state.last_evaluated,
                "diagnoses": list(state.last_diagnoses),
                "firing": sorted({a.label for a in state.alerts.values()}),
                "critical_streak": state.critical_streak, "finished": state.finished,
            })
        return web.json({"runs": out})

    @app.page("/api/stats")
    async def stats(web: Any, request: Any) -> Any:
        return web.json({"consumed": svc.consumed, "deadletters": svc.deadletters,
                         "alerts": svc.alerts, "commands": svc.commands, "errors": svc.errors})
