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


def _consume_all(bootstrap: str, topics: Topics) -> list[tuple[str, bytes, bytes]]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topics.data, topics.compute, topics.resource, topics.runs,
                             bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000, max_partition_fetch_bytes=1 << 20)
    try:
        return [(r.topic, r.key, r.value) for r in consumer]
    finally:
        consumer.close()


@pytest.mark.kafka
def test_an_event_that_cannot_be_encoded_never_blocks_the_steps_after_it(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """Through a real broker: a config with inf in a list, a numpy rank, an int beyond any
    float, a 2**64 step, a NaN ts, a name that is not text, an empty name and a step of
    8,000 metrics (over the service's record limit). Every record that arrives passes the
    service's decoder, and every good step after them arrives."""
    import numpy as np

    from trainsentry.events import decode_record

    topics = Topics(topic_prefix)
    p = MetricsProducer(run_id="proj/poison", bootstrap=kafka_bootstrap, topic_prefix=topic_prefix,
                        rank=np.int64(0), attempt=np.int64(0))  # type: ignore[arg-type]
    p.run_started({"trainer": {"x": [0.0, float("inf")], "y": (math.nan, 1)}})
    p.log({"actor/pg_loss": 10**400}, step=1)
    p.log(STEP, step=2**64)
    p.log(STEP, step=2, ts=math.nan)
    p.log({"\ud800bad": 1.0, "actor/pg_loss": 0.5}, step=3)
    p.log({"": 1.0, "actor/pg_loss": 1.0}, step=4)
    big = {f"actor/extra_{i:05d}_{'x' * 20}": float(i) for i in range(8000)}
    p.log(big, step=5)
    p.log(STEP, step=6)
    assert p.flush(30)
    p.close(5)
    records = _consume_all(kafka_bootstrap, topics)
    events = [decode_record(value, "metric" if topic != topics.runs else "run")
              for topic, _, value in records]
    steps = {e.step for e in events if e.kind == "metric"}
    assert steps == {1, 2, 3, 4, 5, 6}
    loss = [e.metrics["actor/pg_loss"] for e in events if e.kind == "metric" and e.step == 1]
    assert loss == [math.inf]
    step5 = {k for e in events if e.kind == "metric" and e.step == 5 for k in e.metrics}
    assert big.keys() <= step5
    assert all(len(v) <= 256 * 1024 for _, _, v in records)
    started = next(e for e in events if e.kind == "run")
    assert started.fields["config"]["trainer.x"] == [0.0, "inf"]
    assert p.stats.rejected == 1 and p.stats.bad_values == 2  # the 2**64 step; two names


@pytest.mark.kafka
def test_a_script_that_exits_without_close_still_delivers_its_steps(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """No close(): the exit hook flushes (before kafka-python's own hook closes its
    producer), so the last steps of a script that just ends are not lost."""
    import subprocess
    import sys

    script = ("import sys; from producers import MetricsProducer\n"
              f"p = MetricsProducer(run_id='proj/exit', bootstrap={kafka_bootstrap!r}, "
              f"topic_prefix={topic_prefix!r})\n"
              "for s in range(50): p.log({'actor/pg_loss': 0.1, 'timing_s/gen': 1.0}, step=s)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = _consume_all(kafka_bootstrap, Topics(topic_prefix))
    steps = {json.loads(v)["step"] for t, _, v in records if t == Topics(topic_prefix).compute}
    assert steps == set(range(50)), sorted(steps)


@pytest.mark.kafka
def test_a_forked_child_publishes_with_its_own_sender(kafka_bootstrap: str,
                                                      topic_prefix: str) -> None:
    """A producer created before fork() works in the child (its own thread and connection)
    and the child does not resend what the parent had buffered."""
    import os

    p = MetricsProducer(run_id="proj/fork", bootstrap=kafka_bootstrap, topic_prefix=topic_prefix)
    p.log(STEP, step=1)
    assert p.flush(20)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            p.log({"actor/pg_loss": 0.2}, step=2)
            code = 0 if p.flush(20) else 1
            p.close(5)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    p.log({"actor/pg_loss": 0.3}, step=3)
    assert p.flush(20)
    p.close(5)
    topics = Topics(topic_prefix)
    steps = sorted(json.loads(v)["step"] for t, _, v in _consume_all(kafka_bootstrap, topics)
                   if t == topics.compute)
    assert steps == [1, 2, 3]


def test_a_tensor_is_read_when_logged_and_its_graph_is_not_kept() -> None:
    """log() reads tensors and arrays at once: a later in-place change is not published,
    and the buffered step holds no reference to the tensor (no autograd graph kept alive
    while the broker is down)."""
    import gc
    import weakref

    import numpy as np

    torch = pytest.importorskip("torch")
    sent: list[tuple[str, bytes, bytes]] = []
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), producer_factory=lambda: _Recorder(sent))
    w = torch.ones(4, requires_grad=True)
    loss = (w * 2.0).sum()
    ref = weakref.ref(loss)
    arr = np.array(1.0)
    p.log({"actor/pg_loss": loss, "actor/grad_norm": arr}, step=1)
    arr += 5.0
    del loss
    gc.collect()
    assert ref() is None
    assert p.flush(5)
    p.close(1)
    (compute,) = [json.loads(v) for t, _, v in sent if t.endswith("compute")]
    assert compute["metrics"] == {"actor/pg_loss": 8.0, "actor/grad_norm": 1.0}


def test_odd_numbers_are_read_and_unreadable_ones_are_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np

    caplog.set_level(logging.WARNING)
    sent: list[tuple[str, bytes, bytes]] = []
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), producer_factory=lambda: _Recorder(sent))
    for step in range(3):
        p.log({"a/dec": Decimal("1.5"), "a/frac": Fraction(1, 4), "a/long": np.longdouble(1.25),
               "a/bad": object()}, step=step)
    assert p.flush(5)
    p.close(1)
    metrics = [json.loads(v)["metrics"] for _, _, v in sent]
    assert metrics == [{"a/dec": 1.5, "a/frac": 0.25, "a/long": 1.25}] * 3
    said = [r.getMessage() for r in caplog.records if "a/bad" in r.getMessage()]
    assert len(said) == 1 and "not a number" in said[0]
    assert p.stats.bad_values == 3


def test_close_keeps_its_timeout_and_a_second_close_or_later_log_is_harmless(
        caplog: pytest.LogCaptureFixture) -> None:
    """With the broker down: close(2) returns in about 2 s (not 2 s plus a 5 s join), a
    non-finite timeout is clamped, a second close returns at once, a log() after close is
    refused with one warning."""
    from producers.producer import _clamp_timeout

    assert _clamp_timeout(math.nan) == 10.0 and _clamp_timeout(math.inf) == 3600.0
    assert _clamp_timeout(-1) == 0.0 and _clamp_timeout("x") == 10.0
    caplog.set_level(logging.WARNING)
    p = MetricsProducer(run_id="r", bootstrap=_unreachable())
    p.log(STEP, step=1)
    t0 = time.monotonic()
    p.close(2.0)
    assert time.monotonic() - t0 < 4.5
    t0 = time.monotonic()
    p.close(10.0)
    assert time.monotonic() - t0 < 0.5
    p.log(STEP, step=2)
    p.log(STEP, step=3)
    assert p.stats.rejected == 2
    assert sum("after close" in r.getMessage() for r in caplog.records) == 1
    if p._thread is not None:  # its last connect attempt may outlive close(): let it end here
        p._thread.join(10)


def test_run_started_with_an_unreadable_config_still_starts_the_run() -> None:
    """An OmegaConf config with a missing (???) value: run_started never raises, the run
    is announced without the config, and why is logged."""
    omegaconf = pytest.importorskip("omegaconf")
    sent: list[tuple[str, bytes, bytes]] = []
    p = MetricsProducer(run_id="r", bootstrap=_unreachable(), producer_factory=lambda: _Recorder(sent))
    p.run_started(omegaconf.OmegaConf.create({"trainer": {"name": "???"}}))
    assert p.flush(5)
    p.close(1)
    (started,) = [json.loads(v) for t, _, v in sent if t.endswith("runs")]
    assert started["type"] == "run_started" and started["config"] == {}
    assert p.stats.rejected == 1


class _Recorder:
    """Stands in for kafka-python's KafkaProducer in the unit tests above: keeps what it is
    asked to send (the real broker tests above check the transport)."""

    def __init__(self, sent: list[tuple[str, bytes, bytes]]) -> None:
        self.sent = sent

    def send(self, topic: str, key: bytes, value: bytes) -> _Done:
        self.sent.append((topic, key, value))
        return _Done()

    def flush(self, timeout: float | None = None) -> None:
        return None

    def close(self, timeout: float | None = None) -> None:
        return None


class _Done:
    def add_errback(self, *args: object) -> None:
        return None
