"""Metric events per second through the real ``trainsentry serve`` vs a bare aiokafka consumer.

Pre-loads ``--runs`` simulated runs (``--ranks`` ranks, ``--steps`` steps: driver metrics in
three layers plus one resource sample per rank per step) into fresh topics, then:

1. baseline: one aiokafka consumer reads the four source topics to their end offsets, five
   times over (the ceiling for a Python consumer on this machine);
2. framework ceiling: a Faust worker whose agent only counts records (what Faust itself
   costs per record, before any trainsentry code);
3. the service: ``trainsentry serve`` (decode, validate, step join, detectors, diagnosis,
   state table, alerts) consumes the same records; progress is the detect agent's consumed
   counter from ``/api/stats``;
4. for reference, parsing the JSON values only (orjson; what any consumer that reads the
   contract's values pays, and how much of the target's per-record budget it takes),
   decoding and validating the records against the contract (the floor of
   any consumer that looks at a record), and the service's own logic in process, without Kafka or Faust: the records
   the bare consumer read, through ``stream_app.pipeline.Pipeline`` (decode, validate,
   engine: join, detectors, diagnosis, alert encoding and signing), then every run's
   state pickled once (the table write). This is the most any consumer design could
   reach with today's engine on this machine;
5. the same logic fed by the bare consumer's ``getmany`` batches in one loop: the ceiling
   of a detect path that bypasses Faust's per-record streams (no state writes or commits).

Both rates are (records after the first observation) / (time from the first observation to
the last record), so start-up and group joins are excluded from both. The ratio is last.

    python -m bench.throughput [--runs 200 --steps 30 --ranks 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import fresh_prefix, preload, rss_mb, service, wait_consumed  # noqa: E402
from trainsentry.config import Topics  # noqa: E402


async def _bare_consume(bootstrap: str, names: list[str], total: int,
                        keep: list[tuple[str, bytes | None, bytes | None]] | None = None,
                        passes: int = 5) -> tuple[float, int]:
    """Read ``total`` records with a bare AIOKafkaConsumer; returns (seconds, records timed).

    ``keep``: if given, the records are appended to it after the clock stops (for
    :func:`_pipeline_rate`)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()  # noqa: SLF001 - no public call
        tps = [TopicPartition(n, p) for n in names
               for p in sorted(cluster.partitions_for_topic(n) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        # The topics are read ``passes`` times (a seek back to the start between passes): one
        # pass of ~40k records takes a few tens of ms, too short to time on a shared VM.
        n = 0
        t0: float | None = None
        first = 0
        fetched = []
        for i in range(passes):
            if i:
                await consumer.seek_to_beginning(*tps)
            got_pass = 0
            while got_pass < total:
                batches = await consumer.getmany(timeout_ms=1000, max_records=10_000)
                got = sum(len(v) for v in batches.values())
                if got and t0 is None:
                    t0, first = time.perf_counter(), got
                got_pass += got
                if i == 0:
                    fetched.append(batches)
            n += got_pass
        assert t0 is not None
        t1 = time.perf_counter()
        if keep is not None:
            for batches in fetched:
                for recs in batches.values():
                    keep.extend((r.topic, r.key, r.value) for r in recs)
        if n == first:  # everything came in the first batch: time it whole
            return max(t1 - t0, 1e-6), n
        return t1 - t0, n - first
    finally:
        await consumer.stop()


def _noop_worker(bootstrap: str, prefix: str, port: int, partitions: int) -> None:
    """Run a Faust worker whose agent over the four source topics only counts records."""
    import logging

    import faust
    from faust.worker import Worker

    topics = Topics(prefix)
    app = faust.App(f"bench-noop-{prefix.strip('.')}-{os.getpid()}", broker=f"kafka://{bootstrap}",
                    store="memory://", web_port=port, web_bind="127.0.0.1",
                    web_host="127.0.0.1", consumer_auto_offset_reset="earliest",
                    topic_partitions=partitions, topic_replication_factor=1,
                    stream_wait_empty=False, datadir=f"/tmp/{prefix}noop")
    count = {"n": 0}
    source = app.topic(topics.data, topics.compute, topics.resource, topics.runs,
                       key_type=bytes, value_type=bytes, key_serializer="raw",
                       value_serializer="raw", partitions=partitions)

    @app.agent(source, name="noop")
    async def noop(stream):  # type: ignore[no-untyped-def]
        async for _event in stream.events():
            count["n"] += 1

    @app.page("/readyz")
    async def readyz(web, request):  # type: ignore[no-untyped-def]
        return web.json({"ready": True})

    @app.page("/api/stats")
    async def stats(web, request):  # type: ignore[no-untyped-def]
        return web.json({"consumed": {"all": count["n"]}})

    from stream_app.service import install_event_loop

    install_event_loop(os.environ.get("TRAINSENTRY_EVENT_LOOP", "auto"))  # as the service does
    Worker(app, loglevel="warning", redirect_stdouts=False, override_logging=False,
           quiet=True).execute_from_commandline()
    logging.shutdown()


class _NoopProcess:
    """The no-op worker as a subprocess that quacks like tests.service_proc.ServiceProcess."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int) -> None:
        import subprocess

        from bench._common import free_port

        self.web_port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.throughput", "--noop-worker", prefix,
             "--bootstrap", bootstrap, "--port", str(self.web_port),
             "--partitions", str(partitions)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, object]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}{path}", timeout=timeout) as r:
            return r.status, json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except Exception:
            self.proc.kill()


def _noop_rate(bootstrap: str, prefix: str, partitions: int, total: int,
               timeout: float) -> tuple[float, int]:
    noop = _NoopProcess(bootstrap, prefix, partitions)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                noop.get("/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.3)
        samples = wait_consumed(noop, total, timeout=timeout)
    finally:
        noop.stop()
    return _service_rate(samples, total)


def _parse_rate(records: list[tuple[str, bytes | None, bytes | None]]) -> tuple[float, int]:
    """Seconds to parse every value with orjson and touch each metric once: what any
    consumer that reads the contract's JSON values pays before it checks or joins anything."""
    from orjson import loads

    t0 = time.perf_counter()
    for _topic, _key, value in records:
        obj = loads(value) if value else None
        metrics = obj.get("metrics") if isinstance(obj, dict) else None
        if isinstance(metrics, dict):
            for _name, _x in metrics.items():
                pass
    return time.perf_counter() - t0, len(records)


def _decode_rate(topics: Topics,
                 records: list[tuple[str, bytes | None, bytes | None]]) -> tuple[float, int]:
    """Seconds to decode and validate ``records`` against the contract only (no engine)."""
    from detectors.engine import Engine, EngineConfig
    from stream_app.pipeline import Pipeline
    from trainsentry.config import Secret
    from trainsentry.errors import EventError

    pipeline = Pipeline(engine=Engine(EngineConfig()), topics=topics,
                        control_secret=Secret("bench-secret"))
    t0 = time.perf_counter()
    for topic, key, value in records:
        try:
            pipeline.decode(topic, key, value)
        except EventError:
            continue
    return time.perf_counter() - t0, len(records)


class _Logic:
    """The service's pure logic, driven the way the detect agent drives it: decode, the
    run's state, the engine; :meth:`finish` polls every join grace and pickles every state
    once (the table write)."""

    def __init__(self, topics: Topics) -> None:
        from detectors.engine import Engine, EngineConfig
        from stream_app.pipeline import Pipeline
        from trainsentry.config import Secret

        self.engine = Engine(EngineConfig())
        self.pipeline = Pipeline(engine=self.engine, topics=topics,
                                 control_secret=Secret("bench-secret"))
        self.states: dict[str, object] = {}

    def feed(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        from trainsentry.errors import EventError

        try:
            event = self.pipeline.decode(topic, key, value)
        except EventError:
            return
        state = self.states.get(event.run_id)
        if state is None:
            state = self.states[event.run_id] = self.engine.new_state(event.run_id)
        self.pipeline.handle(state, event)  # type: ignore[arg-type]

    def finish(self) -> None:
        from stream_app.pipeline import dump_state

        now = time.time() + 3600.0  # every join grace has passed
        for state in self.states.values():
            self.pipeline.poll(state, now)  # type: ignore[arg-type]
            dump_state(state)  # type: ignore[arg-type]


def _pipeline_rate(topics: Topics,
                   records: list[tuple[str, bytes | None, bytes | None]]) -> tuple[float, int]:
    """Seconds for the service's pure logic over ``records`` in this process (no Kafka,
    no Faust), the way the detect agent drives it; returns (seconds, records)."""
    logic = _Logic(topics)
    t0 = time.perf_counter()
    for topic, key, value in records:
        logic.feed(topic, key, value)
    logic.finish()
    return time.perf_counter() - t0, len(records)


async def _batched_rate(bootstrap: str, names: list[str], topics: Topics,
                        total: int) -> tuple[float, int]:
    """The service's logic fed by a bare aiokafka consumer's ``getmany`` batches in one
    loop: what a detect path off Faust's per-record streams could reach at best (no
    state writes, offset commits, rebalances or timers). Returns (seconds, records)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    logic = _Logic(topics)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()  # noqa: SLF001 - no public call
        consumer.assign([TopicPartition(n, p) for n in names
                         for p in sorted(cluster.partitions_for_topic(n) or ())])
        n = 0
        t0 = time.perf_counter()
        while n < total:
            batches = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for recs in batches.values():
                n += len(recs)
                for r in recs:
                    logic.feed(r.topic, r.key, r.value)
        logic.finish()
        return time.perf_counter() - t0, n
    finally:
        await consumer.stop()


def _service_rate(samples: list[tuple[float, int]], total: int) -> tuple[float, int]:
    """(seconds, records) from the first poll that saw records to the last one.

    When every record came between two polls (a small run), time them from the poll
    before: a lower bound on the rate rather than a division by zero."""
    i0 = next(i for i, (_, n) in enumerate(samples) if n > 0)
    t0, n0 = samples[i0]
    t1 = samples[-1][0]
    if t1 > t0 and total > n0:
        return t1 - t0, total - n0
    before = samples[i0 - 1][0] if i0 > 0 else t0 - 0.1
    return max(t1 - before, 1e-6), total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--noop-worker", metavar="PREFIX", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.noop_worker:
        _noop_worker(args.bootstrap, args.noop_worker, args.port, args.partitions)
        return 0

    prefix = fresh_prefix("tput")
    topics = Topics(prefix)
    sources = [topics.data, topics.compute, topics.resource, topics.runs]
    loaded = preload(args.bootstrap, topics, runs=args.runs, steps=args.steps, ranks=args.ranks,
                     partitions=args.partitions)
    total = loaded.records
    print(f"loaded {total} records ({args.runs} runs x {args.steps} steps x {args.ranks} ranks) "
          f"into {prefix}* in {loaded.seconds:.1f} s", flush=True)

    fetched: list[tuple[str, bytes | None, bytes | None]] = []
    secs, n = asyncio.run(_bare_consume(args.bootstrap, sources, total, keep=fetched))
    bare = n / secs
    print(f"bare aiokafka consumer: {n} records in {secs:.2f} s = {bare:,.0f} records/s", flush=True)
    secs, n = _parse_rate(fetched)
    # At the target the service may spend per record what the bare consumer spends: 1/bare.
    print(f"JSON parse only (orjson.loads, each metric touched once), in process: "
          f"{n / secs:,.0f} records/s = {n / secs / bare:.3f} of bare; at the 0.5 target a "
          f"consumer has {1e6 / bare:.2f} us per record beyond the fetch, and the parse alone "
          f"takes {secs / n * 1e6:.2f} us of it", flush=True)
    secs, n = _decode_rate(topics, fetched)
    print(f"decode + validate only, in process: {n / secs:,.0f} records/s = "
          f"{n / secs / bare:.3f} of bare", flush=True)
    secs, n = _pipeline_rate(topics, fetched)
    inproc = n / secs
    del fetched
    print(f"service logic in process, no Kafka/Faust (ceiling of any consumer design): {n} "
          f"records in {secs:.2f} s = {inproc:,.0f} records/s = {inproc / bare:.3f} of bare",
          flush=True)

    secs, n = asyncio.run(_batched_rate(args.bootstrap, sources, topics, total))
    print(f"bare consumer's getmany batches through the service logic, one loop (ceiling of a "
          f"batched detect path): {n / secs:,.0f} records/s = {n / secs / bare:.3f} of bare",
          flush=True)

    secs, n = _noop_rate(args.bootstrap, prefix, args.partitions, total, args.timeout)
    noop = n / secs
    print(f"faust no-op agent (framework ceiling): {n} records in {secs:.2f} s = "
          f"{noop:,.0f} records/s", flush=True)

    with service(bootstrap=args.bootstrap, prefix=prefix, partitions=args.partitions,
                 app_id=f"bench-tput-{prefix.strip('.')}") as svc:
        samples = wait_consumed(svc, total, timeout=args.timeout)
        assert svc.proc is not None
        rss = rss_mb(svc.proc.pid)
        _, body = svc.get("/api/stats")
    secs, n = _service_rate(samples, total)
    full = n / secs
    print(f"trainsentry serve: {n} records in {secs:.2f} s = {full:,.0f} records/s "
          f"(alerts {body.get('alerts')}, dead letters {body.get('deadletters')}, "
          f"rss {rss:.0f} MiB, event loop {body.get('event_loop')})", flush=True)
    print(f"service / faust no-op agent: {full / noop:.2f}")
    print(f"throughput ratio (service / bare consumer): {full / bare:.3f}  (target >= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
