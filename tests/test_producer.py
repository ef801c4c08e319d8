"""MetricsProducer: never raises, never blocks, bounded memory, delivers through real Kafka."""

from __future__ import annotations

import json
import logging
import math
import time
import tracemalloc

import pytest

from producers import MetricsProducer
from trainsentry.config import Topics

STEP = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.2, "timing_s/gen": 3.1, "actor/entropy": 0.4,
        "gpu/utilization_pct": 88.0, "critic/score/mean": 0.3}


def _unreachable() -> str:
    return "127.0.0.1:1"  # nothing listens on port 1


def test_log_never_raises_on_garbage_or_without_broker() -> None:
    """Bad values, bad steps and an unreachable broker never raise into training."""
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), max_buffer=10)
    p.log({"x": object(), "y": "not a number", "z": None}, step=1)
    p.log(STEP, step="not-an-int")  # type: ignore[arg-type]
    p.log(None, step=3)  # type: ignore[arg-type]
    p.run_started({"a": {"b": object()}})
    p.close(timeout=0.5)


def test_buffer_is_bounded_and_drops_oldest_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    """With the broker down, at most max_buffer events are held; drops are counted and logged."""
    caplog.set_level(logging.WARNING)
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), max_buffer=100)
    for step in range(5000):
        p.log(STEP, step=step)
    assert p.buffered <= 100
    assert p.stats.dropped >= 4900
    assert any("dropped" in r.getMessage() for r in caplog.records)
    p.close(timeout=0.2)


def test_memory_stays_bounded_while_broker_is_unreachable() -> None:
    """Memory after 20k steps is close to memory after 2k steps (bounded buffer)."""
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), max_buffer=1000)
    tracemalloc.start()
    for step in range(2000):
        p.log(STEP, step=step)
    first, _ = tracemalloc.get_traced_memory()
    for step in range(2000, 20000):
        p.log(STEP, step=step)
    second, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    p.close(timeout=0.2)
    assert second < first * 1.5 + 200_000


def test_log_is_fast_when_broker_is_down() -> None:
    """log() only enqueues: a thousand calls take well under a second even with no broker."""
    p = MetricsProducer(run_id="r", bootstrap=_unreachable())
    start = time.perf_counter()
    for step in range(1000):
        p.log(STEP, step=step)
    elapsed = time.perf_counter() - start
    p.close(timeout=0.2)
    assert elapsed < 1.0  # generous: it is ~µs per call; see bench/producer_overhead.py


@pytest.mark.kafka
def test_events_reach_the_three_layer_topics_keyed_by_run_id(kafka_bootstrap: str, topic_prefix: str) -> None:
    """Through a real broker: one step becomes three MetricEvents plus RunEvents, keyed by run_id."""
    from kafka import KafkaConsumer

    topics = Topics(topic_prefix)
    with MetricsProducer(run_id="proj/exp1", bootstrap=kafka_bootstrap, topic_prefix=topic_prefix,
                         host="node-0", rank=0) as p:
        p.run_started({"trainer": {"total_training_steps": 10}})
        p.log({**STEP, "actor/pg_loss": math.nan}, step=7)
        p.run_finished(0)
    consumer = KafkaConsumer(topics.data, topics.compute, topics.resource, topics.runs,
                             bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000)
    got = {}
    for record in consumer:
        got.setdefault(record.topic, []).append((record.key, json.loads(record.value)))
    consumer.close()
    assert {k for recs in got.values() for k, _ in recs} == {b"proj/exp1"}
    compute = got[topics.compute][0][1]
    assert compute["step"] == 7 and compute["layer"] == "compute"
    assert compute["metrics"]["actor/pg_loss"] == "nan"
    assert got[topics.data][0][1]["metrics"]["timing_s/gen"] == 3.1
    assert got[topics.resource][0][1]["metrics"]["gpu/utilization_pct"] == 88.0
    types = [e["type"] for _, e in got[topics.runs]]
    assert types == ["run_started", "run_finished"]
    assert got[topics.runs][0][1]["config"] == {"trainer.total_training_steps": 10}
