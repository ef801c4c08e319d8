"""Helpers shared by the performance and fault benches (bench/throughput.py, latency.py, ...).

Everything talks to 127.0.0.1 only: the lead's broker, or a broker a bench starts for
itself (:func:`own_broker`) when it needs to stop and restart one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainsentry.config import Topics
from trainsentry.simulate import Scenario, generate

__all__ = ["Loaded", "free_port", "fresh_prefix", "own_broker", "scenario_records", "preload",
           "service", "stats", "wait_consumed", "end_offsets", "read_topic", "rss_mb",
           "percentile"]

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/x.py` as well as `python -m bench.x`
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_prefix(tag: str) -> str:
    """A topic prefix no earlier run used, so every measurement starts from empty topics."""
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}."


@contextlib.contextmanager
def own_broker(port: int | None = None) -> Iterator[tuple[str, int, str]]:
    """A private broker (``(bootstrap, port, data_dir)``) for scenarios that stop it."""
    from trainsentry import kafka_local

    port = port or free_port()
    data_dir = tempfile.mkdtemp(prefix="trainsentry-bench-kafka-")
    address = kafka_local.start(port=port, data_dir=data_dir)
    try:
        yield address, port, data_dir
    finally:
        kafka_local.stop(port=port, data_dir=data_dir)


def scenario_records(run_id: str, topics: Topics, **scenario: Any) -> list[tuple[str, bytes, bytes]]:
    """A simulated run as ``(topic, key, value)`` records, in the order a trainer sends them."""
    out = []
    key = run_id.encode()
    for ev in generate(Scenario(run_id=run_id, **scenario)):
        topic = topics.metrics(ev["layer"]) if "layer" in ev else topics.runs
        out.append((topic, key, json.dumps(ev, separators=(",", ":")).encode()))
    return out


@dataclass
class Loaded:
    records: int
    runs: int
    seconds: float


def preload(bootstrap: str, topics: Topics, *, runs: int, steps: int, ranks: int,
            seed: int = 0, partitions: int = 4, fault: str | None = None) -> Loaded:
    """Create the topics and write ``runs`` simulated runs into them (acks=all), interleaved
    step by step across runs the way concurrent trainers would."""
    from kafka import KafkaProducer

    from trainsentry.topics import create_topics

    create_topics(bootstrap=bootstrap, topics=topics, partitions=partitions)
    start_ts = time.time() - steps * 20.0 - 60
    per_run = [scenario_records(f"bench/run-{i:04d}", topics, steps=steps, ranks=ranks,
                                seed=seed + i, start_ts=start_ts, fault=fault, save_freq=1000)
               for i in range(runs)]
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20,
                             batch_size=256 * 1024)
    t0 = time.perf_counter()
    n = 0
    longest = max(len(r) for r in per_run)
    chunk = 8  # a few records of one run, then the next run: realistic interleaving
    for lo in range(0, longest, chunk):
        for recs in per_run:
            for topic, key, value in recs[lo:lo + chunk]:
                producer.send(topic, key=key, value=value)
                n += 1
    producer.flush(120)
    producer.close(10)
    return Loaded(records=n, runs=runs, seconds=time.perf_counter() - t0)


@contextlib.contextmanager
def service(*, bootstrap: str, prefix: str, partitions: int = 4, web_port: int | None = None,
            extra_env: dict[str, str] | None = None, app_id: str | None = None,
            ready_timeout: float = 180.0) -> Iterator[Any]:
    """The real ``trainsentry serve`` (tests/service_proc.py), ready, stopped on exit."""
    from tests.service_proc import ServiceProcess

    env = {"TRAINSENTRY_PARTITIONS": str(partitions), **(extra_env or {})}
    svc = ServiceProcess(bootstrap=bootstrap, prefix=prefix, web_port=web_port or free_port(),
                         control_secret="bench-control-secret", extra_env=env, app_id=app_id)
    svc.start()
    try:
        svc.wait_ready(ready_timeout)
        yield svc
    finally:
        try:
            svc.stop()
        except AssertionError:
            svc.kill()


def stats(svc: Any) -> dict[str, Any]:
    """``/api/stats`` of a running service (empty dict when it does not answer)."""
    try:
        status, body = svc.get("/api/stats", timeout=2)
    except OSError:
        return {}
    return body if status == 200 and isinstance(body, dict) else {}


def consumed(svc: Any) -> int:
    return int(sum(stats(svc).get("consumed", {}).values()))


def wait_consumed(svc: Any, total: int, *, timeout: float,
                  poll_s: float = 0.1) -> list[tuple[float, int]]:
    """Poll the detect agent's consumed counter until it reaches ``total``.

    Returns ``(perf_counter, consumed)`` samples, one per poll.
    """
    samples: list[tuple[float, int]] = []
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        n = consumed(svc)
        samples.append((time.perf_counter(), n))
        if n >= total:
            return samples
        time.sleep(poll_s)
    raise TimeoutError(f"consumed {samples[-1][1] if samples else 0} of {total} in {timeout}s")


def end_offsets(bootstrap: str, names: list[str]) -> dict[str, int]:
    """Total records per topic (sum of partition end offsets)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        out = {}
        for name in names:
            parts = c.partitions_for_topic(name) or set()
            ends = c.end_offsets([TopicPartition(name, p) for p in parts]) if parts else {}
            out[name] = int(sum(ends.values()))
        return out
    finally:
        c.close()


def read_topic(bootstrap: str, name: str, *, timeout_ms: int = 3000) -> list[Any]:
    """Every record of a topic from the beginning (kafka-python ConsumerRecords)."""
    from kafka import KafkaConsumer

    c = KafkaConsumer(name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=timeout_ms, enable_auto_commit=False)
    try:
        return list(c)
    finally:
        c.close()


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process in MiB (Linux /proc)."""
    path = f"/proc/{pid or os.getpid()}/status"
    with open(path) as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]
