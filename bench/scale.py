"""Scale-out: hundreds of concurrent simulated runs through one or more ``trainsentry serve`` workers.

``--runs`` multi-rank runs (``--ranks`` resource samples and heartbeats per step, plus the
driver's data and compute layers) publish one step every ``--step-s`` seconds each, the runs
spread evenly over the step interval as independent trainers would be, for ``--steps``
steps. ``--workers`` (1 or 2) workers of one consumer group share ``--partitions``
partitions. Every ``--sample-s`` the bench samples:

- the group's **committed lag**: end offsets of the four source topics minus the group's
  committed offsets (what ``trainsentry_consumer_lag`` and Kafka tools report; it includes
  up to ~1 s of records processed but not yet committed, because offsets are committed
  every second and only after the run's state is written);
- the **processed lag**: records published minus records the detect agents consumed
  (``/api/stats``), i.e. what is really waiting;
- each worker's RSS.

``--kill-at S`` SIGKILLs the first worker S seconds into publishing (needs 2 workers): the
table then shows the lag while its partitions are orphaned (about the 15 s session
timeout) and the survivor catching up. After the last step the bench waits for the lag to
drain, then prints memory per run (RSS growth over the idle workers / runs) last.

Run contents come from :mod:`trainsentry.simulate`: ``--templates`` distinct healthy
scenarios, each reused under many run_ids (the engine keeps separate state per run_id;
this only saves generating hundreds of scenarios up front).

    python -m bench.scale [--runs 200 --ranks 4 --steps 40 --step-s 2 --workers 2 --kill-at 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import free_port, fresh_prefix, read_topic, rss_mb, stats  # noqa: E402
from trainsentry.config import Topics  # noqa: E402
from trainsentry.simulate import Scenario, generate  # noqa: E402

__all__ = ["workers", "assigned", "wait_split", "Sample", "main"]


# --------------------------------------------------------------------------- workers


@contextlib.contextmanager
def workers(*, bootstrap: str, prefix: str, count: int, partitions: int, app_id: str,
            extra_env: dict[str, str] | None = None) -> Iterator[list[Any]]:
    """``count`` ``trainsentry serve`` processes of one group (same app id), each on its own
    web port, started together (not yet ready); stopped, or killed, on exit."""
    from tests.service_proc import ServiceProcess

    env = {**(extra_env or {}), "TRAINSENTRY_PARTITIONS": str(partitions)}
    procs = [ServiceProcess(bootstrap=bootstrap, prefix=prefix, web_port=free_port(),
                            control_secret="bench-control-secret", app_id=app_id,
                            extra_env=env) for _ in range(count)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(AssertionError, OSError):
                p.stop()
            p.kill()


def assigned(svc: Any) -> list[int]:
    """The source partitions a worker holds now (``/api/stats``); [] when it does not answer."""
    return sorted(stats(svc).get("partitions") or [])


def wait_split(services: list[Any], partitions: int, *, timeout: float,
               polls: int = 3) -> list[list[int]] | None:
    """Wait until the workers hold disjoint, non-empty shares of all partitions, unchanged
    for ``polls`` polls in a row (a group that just formed may rebalance again).
    Returns each worker's partitions, or None on timeout."""
    deadline = time.monotonic() + timeout
    seen: list[list[list[int]] | None] = []
    while time.monotonic() < deadline:
        shares = [assigned(s) for s in services]
        flat = [p for share in shares for p in share]
        full = all(shares) and sorted(flat) == list(range(partitions))
        seen.append(shares if full else None)
        if full and seen[-polls:] == [shares] * polls:
            return shares
        time.sleep(0.5)
    return None


# --------------------------------------------------------------------------- load


def step_records(topics: Topics, *, templates: int, steps: int, ranks: int,
                 step_s: float, start_ts: float) -> list[dict[int, list[tuple[str, bytes]]]]:
    """Per template: step -> ``(topic, value)`` records, with ``\\x00RUN\\x00`` for the run_id.
    Events without a step (``run_started``) go with step 0; ``run_finished`` is dropped: the
    runs stay live."""
    placeholder = "\x00RUN\x00"
    out = []
    for t in range(templates):
        by_step: dict[int, list[tuple[str, bytes]]] = {}
        for ev in generate(Scenario(run_id=placeholder, seed=100 + t, steps=steps, ranks=ranks,
                                    step_time_s=step_s, save_freq=1000, start_ts=start_ts)):
            if ev.get("type") == "run_finished":
                continue
            topic = topics.metrics(ev["layer"]) if "layer" in ev else topics.runs
            value = json.dumps(ev, separators=(",", ":")).encode()
            by_step.setdefault(int(ev.get("step") or 0), []).append((topic, value))
        out.append(by_step)
    return out


@dataclass
class Publisher:
    """Publishes every run's step ``s`` at ``t0 + (s + i / runs) * step_s`` in a thread."""

    bootstrap: str
    runs: int
    step_s: float
    records: list[dict[int, list[tuple[str, bytes]]]]
    sent: int = 0
    behind_s: float = 0.0  # how late the publisher itself ran at worst (a CPU-starved host)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run_id(self, i: int) -> str:
        return f"scale/run-{i:04d}"

    def start(self, t0: float) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(t0,), name="scale-publisher", daemon=True)
        thread.start()
        return thread

    def _run(self, t0: float) -> None:
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=20,
                                 batch_size=256 * 1024)
        last = max(max(r) for r in self.records)  # validation can add a step past the end
        try:
            for s in range(last + 1):
                for i in range(self.runs):
                    due = t0 + (s + i / self.runs) * self.step_s
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    else:
                        self.behind_s = max(self.behind_s, -delay)
                    run_id = self.run_id(i)
                    key = run_id.encode()
                    marker = json.dumps(run_id)[1:-1].encode()
                    for topic, value in self.records[i % len(self.records)].get(s, ()):
                        producer.send(topic, key=key, value=value.replace(b"\\u0000RUN\\u0000", marker))
                        self.sent += 1
            producer.flush(60)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            producer.close(10)
            self.done.set()


# --------------------------------------------------------------------------- sampling


@dataclass
class Sample:
    t: float
    sent: int
    consumed: int
    committed_lag: int
    rss: list[float]
    cpu: list[float]  # CPU seconds used by each worker so far
    note: str = ""

    @property
    def processed_lag(self) -> int:
        return max(0, self.sent - self.consumed)


class LagProbe:
    """The group's committed lag over the source topics (kafka-python admin + consumer)."""

    def __init__(self, bootstrap: str, group: str, topics: list[str]) -> None:
        from kafka import KafkaAdminClient, KafkaConsumer

        self.group = group
        self.topics = topics
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap)

    def lag(self) -> int:
        from kafka import TopicPartition

        tps = [TopicPartition(t, p) for t in self.topics
               for p in sorted(self.consumer.partitions_for_topic(t) or ())]
        ends = self.consumer.end_offsets(tps)
        if hasattr(self.admin, "list_group_offsets"):  # kafka-python 3
            committed = self.admin.list_group_offsets({self.group: tps}).get(self.group, {})
        else:  # kafka-python 2
            committed = self.admin.list_consumer_group_offsets(self.group, partitions=tps)
        total = 0
        for tp in tps:
            done = committed.get(tp)
            total += ends[tp] - (done.offset if done is not None and done.offset >= 0 else 0)
        return int(total)

    def close(self) -> None:
        self.consumer.close()
        self.admin.close()


def _consumed(services: list[Any], counted: dict[int, int]) -> int:
    """Records consumed by all workers; a dead worker keeps its last count (its records
    since the last commit are replayed by the survivor, so this can exceed what was sent)."""
    for i, svc in enumerate(services):
        if svc.proc is not None and svc.proc.poll() is None:
            body = stats(svc)
            if body:
                counted[i] = int(sum(body.get("consumed", {}).values()))
    return sum(counted.values())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _state_bytes(svc: Any) -> int | None:
    try:
        status, body = svc.get("/metrics", timeout=5)
    except OSError:
        return None
    for line in str(body).splitlines() if status == 200 else ():
        if line.startswith("trainsentry_detector_state_bytes"):
            return int(float(line.split()[-1]))
    return None


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-s", type=float, default=2.0,
                    help="each run's step interval (verl's are 10-60 s; 1-2 s is a stress test)")
    ap.add_argument("--workers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--kill-at", type=float, default=0.0,
                    help="SIGKILL the first worker this many seconds into publishing (0: never)")
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--drain-timeout", type=float, default=90.0)
    args = ap.parse_args(argv)
    if args.kill_at and args.workers < 2:
        ap.error("--kill-at needs --workers 2")

    prefix = fresh_prefix("scale")
    topics = Topics(prefix)
    sources = [topics.data, topics.compute, topics.resource, topics.runs]
    app_id = f"bench-scale-{prefix.strip('.')}"
    t_gen = time.monotonic()
    records = step_records(topics, templates=args.templates, steps=args.steps, ranks=args.ranks,
                           step_s=args.step_s, start_ts=time.time() + 30)
    per_run = sum(len(v) for v in records[0].values())
    total = sum(sum(len(v) for v in records[i % len(records)].values()) for i in range(args.runs))
    print(f"{args.runs} runs x {args.steps} steps x {args.ranks} ranks: {total} records "
          f"(~{per_run / args.steps:.0f} per run-step, {args.runs * per_run / args.steps / args.step_s:,.0f} "
          f"records/s offered); scenarios built in {time.monotonic() - t_gen:.1f} s", flush=True)

    # No chat receivers: alerts go to the alerts topic only (none expected: runs are healthy).
    env = {"TRAINSENTRY_ALERT_CHARTS": "0", "TRAINSENTRY_LANGUAGE": "en"}
    with workers(bootstrap=args.bootstrap, prefix=prefix, count=args.workers,
                 partitions=args.partitions, app_id=app_id, extra_env=env) as procs:
        t_start = time.monotonic()
        for svc in procs:
            svc.wait_ready(180)
        split = wait_split(procs, args.partitions, timeout=90)
        if split is None:
            print("workers did not settle on a partition split in 90 s:",
                  [assigned(s) for s in procs], file=sys.stderr)
            return 1
        idle = [rss_mb(s.proc.pid) for s in procs]
        cpu0 = [cpu_s(s.proc.pid) for s in procs]
        print(f"{args.workers} worker(s) ready in {time.monotonic() - t_start:.0f} s, partitions "
              f"{split}, idle RSS {', '.join(f'{r:.0f}' for r in idle)} MiB", flush=True)

        probe = LagProbe(args.bootstrap, app_id, sources)
        pub = Publisher(args.bootstrap, args.runs, args.step_s, records)
        t0 = time.monotonic()
        pub.start(t0)
        samples: list[Sample] = []
        counted: dict[int, int] = {}
        killed_at = took_over = None
        publish_end = None
        next_sample = t0
        try:
            while True:
                now = time.monotonic()
                note = ""
                if args.kill_at and killed_at is None and now - t0 >= args.kill_at:
                    procs[0].kill()
                    killed_at = now
                    note = "worker 1 SIGKILLed"
                if killed_at is not None and took_over is None and \
                        assigned(procs[1]) == list(range(args.partitions)):
                    took_over = now
                    note = f"worker 2 holds all partitions ({now - killed_at:.0f} s after the kill)"
                if now >= next_sample or note:
                    up = [p.proc.poll() is None for p in procs]
                    rss = [rss_mb(p.proc.pid) if ok else 0.0 for p, ok in zip(procs, up, strict=True)]
                    cpu = [cpu_s(p.proc.pid) if ok else last
                           for p, ok, last in zip(procs, up, samples[-1].cpu if samples else cpu0,
                                                  strict=True)]
                    s = Sample(now - t0, pub.sent, _consumed(procs, counted), probe.lag(), rss, cpu,
                               note)
                    samples.append(s)
                    next_sample = now + args.sample_s
                if pub.done.is_set() and publish_end is None:
                    publish_end = now
                if publish_end is not None and samples[-1].committed_lag == 0 and \
                        samples[-1].t >= publish_end - t0:
                    break
                if publish_end is not None and now - publish_end > args.drain_timeout:
                    print(f"lag not drained {args.drain_timeout:.0f} s after the last step",
                          file=sys.stderr)
                    break
                time.sleep(0.25)
        finally:
            probe.close()
        if pub.error is not None:
            raise pub.error
        time.sleep(min(3.0, args.sample_s))  # a last flush of the states
        live = [i for i, s in enumerate(procs) if s.proc.poll() is None]
        final = {i: rss_mb(procs[i].proc.pid) for i in live}
        state_bytes = {i: _state_bytes(procs[i]) for i in live}
        runs_held = {i: len(stats(procs[i]).get("runs", [])) for i in live}
    alerts = Counter(json.loads(r.value)["diagnosis"] for r in read_topic(args.bootstrap, topics.alerts)
                     if json.loads(r.value).get("status") == "firing")

    assert publish_end is not None
    print()
    print("  t(s)    sent  consumed  processed lag  committed lag  worker CPU %   RSS per worker (MiB)")
    prev: Sample | None = None
    for s in samples:
        dt = s.t - prev.t if prev is not None else 0.0
        cpu = " ".join(f"{100 * (c - pc) / dt:5.0f}" if prev is not None and dt > 0 and r else "    -"
                       for c, pc, r in zip(s.cpu, prev.cpu if prev else s.cpu, s.rss, strict=True))
        rss = " ".join(f"{r:5.0f}" if r else "    -" for r in s.rss)
        print(f"{s.t:6.1f} {s.sent:7d} {s.consumed:9d} {s.processed_lag:14d} {s.committed_lag:14d}  "
              f"{cpu}   {rss}  {s.note}")
        prev = s
    print()
    pub_s = publish_end - t0
    at_end = min(samples, key=lambda s: abs(s.t - pub_s))
    last = samples[-1]
    cpu_used = sum(c - c0 for c, c0 in zip(last.cpu, cpu0, strict=True))
    done = min(last.consumed, pub.sent)
    print(f"published {pub.sent} records in {pub_s:.1f} s ({pub.sent / pub_s:,.0f} records/s; "
          f"publisher at worst {pub.behind_s:.2f} s behind schedule); firing alerts on healthy "
          f"runs: {sum(alerts.values())} {dict(alerts) if alerts else ''}")
    print(f"consumed {at_end.consumed / max(at_end.t, 1e-9):,.0f} records/s while publishing; "
          f"worker CPU {cpu_used:.0f} s for {done} records = {done / max(cpu_used, 1e-9):,.0f} records "
          f"per CPU-second (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    drained = f"drained {last.t - pub_s:.1f} s after the last step" if last.committed_lag == 0 \
        else f"NOT drained: {last.processed_lag} records still waiting {last.t - pub_s:.0f} s after"
    print(f"lag: max {max(s.processed_lag for s in samples)} records processed / "
          f"{max(s.committed_lag for s in samples)} committed; {at_end.processed_lag} at the last "
          f"step; {drained}")
    if killed_at is not None:
        print(f"takeover: worker 2 held all partitions "
              f"{(took_over - killed_at) if took_over else float('nan'):.1f} s after the SIGKILL")
    for i in live:
        sb = state_bytes[i]
        print(f"worker {i + 1}: {runs_held[i]} runs, RSS {idle[i]:.0f} -> {final[i]:.0f} MiB"
              + (f", pickled state {sb / 2**20:.1f} MiB ({sb / max(1, runs_held[i]) / 1024:.0f} KiB/run)"
                 if sb else ""))
    grown = sum(final[i] - idle[i] for i in live)
    held = sum(runs_held.values()) or args.runs
    print(f"memory per run: {grown / held:.2f} MiB (RSS +{grown:.0f} MiB over idle for {held} runs "
          f"on {len(live)} worker(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
