"""Run-state retention and takeover on the real broker, across a worker restart.

Two runs step every 2 s (event time). One ends with ``run_finished``; the other simply
stops (a trainer killed without a word). The worker is restarted with a 5 s retention for
finished runs, and neither run sends anything more:

- the finished run's state is dropped (gone from ``/api/runs``, counted in
  ``trainsentry_runs_retired_total``, a tombstone on the ``run_state`` changelog);
- the stopped run is picked up from the table although no record of it comes again, and
  its ``training_hang`` is reported one hang limit (60 s) after the takeover, not before.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from bench._common import read_topic
from producers import MetricsProducer
from tests.service_proc import ServiceProcess
from tests.test_hang_e2e import _steps
from trainsentry.config import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _runs(svc: ServiceProcess) -> dict[str, dict]:
    status, body = svc.get("/api/runs")
    return {r["run_id"]: r for r in body["runs"]} if status == 200 else {}


def _wait(what: str, check, timeout: float, svc: ServiceProcess):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1.0)
    raise AssertionError(f"{what} not within {timeout:.0f}s; runs: {_runs(svc)}\n"
                         f"{svc.log()[-3000:]}")


def test_restarted_worker_retires_a_finished_run_and_reports_a_stopped_one(
        kafka_bootstrap: str, topic_prefix: str, free_port: int) -> None:
    topics = Topics(topic_prefix)
    app_id = f"ts-retention-{uuid.uuid4().hex[:8]}"
    first = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                           app_id=app_id).start()
    try:
        first.wait_ready()
        t0 = time.time() - 40
        done = MetricsProducer(run_id="keep/finished", bootstrap=kafka_bootstrap,
                               topic_prefix=topic_prefix)
        stopped = MetricsProducer(run_id="keep/stopped", bootstrap=kafka_bootstrap,
                                  topic_prefix=topic_prefix)
        for i, metrics in enumerate(_steps("x", 12)):
            done.log(metrics, step=i, ts=t0 + 2 * i)
            stopped.log(metrics, step=i, ts=t0 + 2 * i)
        done.run_finished(0)
        done.close(10)
        stopped.close(10)
        _wait("both runs evaluated, one finished", lambda: (
            (r := _runs(first)).get("keep/finished", {}).get("finished")
            and r.get("keep/stopped", {}).get("steps", 0) >= 10), 60, first)
    finally:
        first.stop()  # SIGTERM: the states are written before it exits
    # No worker for a while: a hang clock that kept counting from the last step would fire
    # within seconds of the restart (the limit is 60 s).
    time.sleep(40)

    second = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                            app_id=app_id,
                            extra_env={"TRAINSENTRY_FINISHED_RUN_RETENTION_S": "5"}).start()
    try:
        second.wait_ready()
        ready_at = time.time()
        status, body = second.get("/readyz")
        assert status == 200 and body["assigned"] and not body["recovering"], body
        status, body = second.get("/api/stats")  # TRAINSENTRY_EVENT_LOOP=auto, uvloop installed
        assert status == 200 and body["event_loop"] == "uvloop", body
        # Taken over without a new record of it, and the finished run dropped.
        _wait("the stopped run adopted and the finished one retired", lambda: (
            "keep/stopped" in (r := _runs(second)) and "keep/finished" not in r), 60, second)
        status, text = second.get("/metrics")
        assert status == 200
        retired = [ln for ln in text.splitlines() if ln.startswith("trainsentry_runs_retired_total")]
        assert retired and float(retired[0].split()[-1]) >= 1, retired
        assert "keep/finished" in second.log() and "retired" in second.log()

        last: dict[bytes, bytes | None] = {
            r.key: r.value for r in read_topic(kafka_bootstrap, f"{app_id}-run_state-changelog")}
        assert b"keep/finished" in last and last[b"keep/finished"] is None, "no tombstone"
        assert last.get(b"keep/stopped"), "the stopped run's state must stay"

        def alerts() -> list[dict]:
            return [json.loads(r.value) for r in read_topic(kafka_bootstrap, topics.alerts,
                                                            timeout_ms=1000)]

        def hang_alert() -> dict | None:
            return next((a for a in alerts() if a["run_id"] == "keep/stopped"
                         and a["diagnosis"] == "training_hang"), None)

        alert = _wait("training_hang of the stopped run", hang_alert, 150, second)
        fired_after = time.time() - ready_at
        print(f"training_hang {fired_after:.0f}s after the restarted worker was ready")
        assert alert["status"] == "firing" and alert["severity"] == "critical"
        assert "everything went silent" in alert["summary"], alert["summary"]
        # Measured from the takeover (hang limit 60 s), not from the last step before the
        # restart: that would have fired at once or within seconds of the restart.
        assert fired_after >= 50, fired_after
        assert [a for a in alerts() if a["run_id"] == "keep/finished"] == []  # it was healthy
    finally:
        second.stop()
