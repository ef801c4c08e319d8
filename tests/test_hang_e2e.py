"""Hang detection on the real broker, at true scale: a run whose usual step takes 20 s
stops stepping (heartbeats continue) → training_hang within 2 minutes; a run that merely
has one 80 s validation step does not fire."""

from __future__ import annotations

import json
import time

import pytest
from kafka import KafkaConsumer

from producers import MetricsProducer
from tests.service_proc import ServiceProcess
from trainsentry.config import Topics
from trainsentry.simulate import Scenario, generate

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _steps(run_id: str, n: int) -> list[dict]:
    """Driver metrics of n healthy steps (one dict per step), from the simulator."""
    by_step: dict[int, dict[str, float]] = {}
    for ev in generate(Scenario(run_id=run_id, steps=n, ranks=1, seed=8, test_freq=1000,
                                save_freq=1000, val_before_train=False)):
        if "layer" in ev and ev.get("rank") is None:
            by_step.setdefault(ev["step"], {}).update(
                {k: float(v) for k, v in ev["metrics"].items()})
    return [by_step[s] for s in sorted(by_step)]


def test_hang_fires_within_two_minutes_and_a_long_validation_step_does_not(
        kafka_bootstrap: str, topic_prefix: str, free_port: int) -> None:
    """Both runs step every 20 s (event time); the hung one sends only heartbeats after
    step 11 and must be flagged ≤ 120 s later, as alive-but-stuck; the other pauses 80 s
    of wall time before its next step and must stay quiet."""
    topics = Topics(topic_prefix)
    # The plain asyncio loop (TRAINSENTRY_EVENT_LOOP=asyncio), so both loops run end to end.
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         extra_env={"TRAINSENTRY_EVENT_LOOP": "asyncio"}).start()
    try:
        svc.wait_ready()
        assert svc.get("/api/stats")[1]["event_loop"] == "asyncio"
        t0 = time.time() - 12 * 20
        hung = MetricsProducer(run_id="hang/stuck", bootstrap=kafka_bootstrap, topic_prefix=topic_prefix)
        slow = MetricsProducer(run_id="hang/validation", bootstrap=kafka_bootstrap,
                               topic_prefix=topic_prefix)
        steps = _steps("x", 14)
        for i in range(12):  # history: steps 20 s apart in event time
            hung.log(steps[i], step=i, ts=t0 + 20 * i)
            slow.log(steps[i], step=i, ts=t0 + 20 * i)
        hung.flush(10)
        slow.flush(10)
        last_step_wall = time.time()
        fired_at = None
        alerts: list[dict] = []
        validation_done = False
        while time.time() - last_step_wall < 150:
            time.sleep(5)
            hung.heartbeat(11)
            if not validation_done and time.time() - last_step_wall >= 80:
                slow.log(steps[12], step=12, ts=time.time())  # the long validation step ends
                slow.log(steps[13], step=13, ts=time.time() + 20)
                slow.flush(10)
                validation_done = True
            consumer = KafkaConsumer(topics.alerts, bootstrap_servers=kafka_bootstrap,
                                     auto_offset_reset="earliest", consumer_timeout_ms=1000)
            alerts = [json.loads(r.value) for r in consumer]
            consumer.close()
            if fired_at is None and any(a["run_id"] == "hang/stuck" for a in alerts):
                fired_at = time.time()
            if fired_at is not None and validation_done and time.time() - last_step_wall > 100:
                break
        hung.close(5)
        slow.close(5)
        stuck = [a for a in alerts if a["run_id"] == "hang/stuck"]
        assert stuck and stuck[0]["diagnosis"] == "training_hang" and stuck[0]["severity"] == "critical"
        assert "alive but stuck" in stuck[0]["summary"]
        assert fired_at is not None and fired_at - last_step_wall <= 120, fired_at - last_step_wall
        assert [a for a in alerts if a["run_id"] == "hang/validation"] == []
    finally:
        svc.stop()
