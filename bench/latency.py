"""Alert latency: the trainer's ``log()`` of a faulty step → the chat robot receiving the alert.

``--runs`` simulated runs (1 rank) are first published healthy up to the step before the
fault and processed by the real ``trainsentry serve`` (notifier pointed at a local fake
DingTalk + WeCom, :class:`trainsentry.sink.ChatSink`). Then, one run at a time, the faulty
step (NaN loss) is published through :class:`producers.MetricsProducer`, exactly as a
verl job's ``Tracking.log`` would, and the time from just before ``log()`` to the first
chat message naming that run is recorded. Includes the producer's batching, Kafka, the
detect agent, the alerts topic, the notify agent's batching (up to 0.2 s) and the HTTP
post. The figure (p50, p99) is printed last.

    python -m bench.latency [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import consumed, fresh_prefix, percentile, service  # noqa: E402
from producers import MetricsProducer  # noqa: E402
from tests.service_proc import publish_scenario  # noqa: E402
from trainsentry.config import Topics  # noqa: E402
from trainsentry.simulate import Scenario, generate  # noqa: E402
from trainsentry.sink import ChatSink  # noqa: E402
from trainsentry.topics import create_topics  # noqa: E402


def _split(events: list[dict[str, Any]], onset: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Events before the faulty step, and the faulty step's own events."""
    before = [e for e in events if e.get("step", -1) < onset and e.get("type") != "run_finished"]
    fault = [e for e in events if e.get("step") == onset and "layer" in e]
    return before, fault


def _breakdown(bootstrap: str, topics: Topics, sent_at: dict[str, float],
               received_at: dict[str, float]) -> None:
    """Split each latency at the alert record's Kafka timestamp: detect side | notify side."""
    import json

    from bench._common import read_topic

    first: dict[str, float] = {}
    for r in read_topic(bootstrap, topics.alerts):
        a = json.loads(r.value)
        if a.get("diagnosis") == "nan_loss" and a.get("status") == "firing":
            first.setdefault(a["run_id"], r.timestamp / 1000)
    detect = [first[k] - sent_at[k] for k in sent_at if k in first]
    notify = [received_at[k] - first[k] for k in sent_at if k in first]
    if detect:
        print(f"  log() -> alert on the alerts topic: p50 {percentile(detect, 50) * 1000:.0f} ms, "
              f"p99 {percentile(detect, 99) * 1000:.0f} ms")
        print(f"  alerts topic -> chat robot:          p50 {percentile(notify, 50) * 1000:.0f} ms, "
              f"p99 {percentile(notify, 99) * 1000:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--onset", type=int, default=40, help="healthy steps before the fault")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between faults")
    ap.add_argument("--timeout", type=float, default=15.0, help="seconds to wait per alert")
    args = ap.parse_args(argv)

    prefix = fresh_prefix("lat")
    topics = Topics(prefix)
    create_topics(bootstrap=args.bootstrap, topics=topics, partitions=4)
    start_ts = time.time() - (args.onset + 1) * 20.0
    runs = []
    for i in range(args.runs):
        run_id = f"bench/latency-{i:03d}"
        events = generate(Scenario(run_id=run_id, steps=args.onset + 2, ranks=1, seed=100 + i,
                                   fault="nan_loss", fault_onset=args.onset, save_freq=1000,
                                   start_ts=start_ts))
        runs.append((run_id, *_split(events, args.onset)))

    sink = ChatSink(echo=False).start()
    env = {**sink.env(), "TRAINSENTRY_NOTIFY_RATE_LIMIT": "100000", "TRAINSENTRY_LANGUAGE": "en"}
    latencies: list[float] = []
    sent_at: dict[str, float] = {}
    received_at: dict[str, float] = {}
    missed: list[str] = []
    try:
        with service(bootstrap=args.bootstrap, prefix=prefix, extra_env=env,
                     app_id=f"bench-lat-{prefix.strip('.')}") as svc:
            warm = 0
            for run_id, before, _fault in runs:
                with MetricsProducer(run_id=run_id, bootstrap=args.bootstrap,
                                     topic_prefix=prefix) as p:
                    publish_scenario(p, before)
                warm += len(before)  # one record per event (publish_scenario re-splits layers)
            deadline = time.monotonic() + 300
            while consumed(svc) < warm * 0.98 and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(2.0)  # let the last healthy steps be evaluated and flushed
            early = len(sink.messages)
            print(f"warmed {args.runs} runs ({warm} records); {early} chat messages before any "
                  f"fault", flush=True)
            producers = {run_id: MetricsProducer(run_id=run_id, bootstrap=args.bootstrap,
                                                 topic_prefix=prefix) for run_id, _, _ in runs}
            for p in producers.values():  # connect before timing, as a running trainer is
                p.run_event("heartbeat", step=args.onset - 1)
                p.flush(10)
            for run_id, _before, fault in runs:
                seen = len(sink.messages)
                t0 = time.time()
                publish_scenario(producers[run_id], fault)
                deadline = time.monotonic() + args.timeout
                got = None
                while got is None and time.monotonic() < deadline:
                    sink.wait_for(seen + 1, timeout=0.05)
                    for m in sink.messages[seen:]:
                        if run_id in m.text and "nan_loss" in m.text:
                            got = m
                            break
                if got is None:
                    missed.append(run_id)
                else:
                    latencies.append(got.received_at - t0)
                    sent_at[run_id], received_at[run_id] = t0, got.received_at
                time.sleep(args.gap)
            for p in producers.values():
                p.close(5)
    finally:
        sink.stop()
    _breakdown(args.bootstrap, topics, sent_at, received_at)
    if missed:
        print(f"no chat message within {args.timeout}s for {len(missed)} runs: {missed[:5]}")
    if not latencies:
        print("no alert arrived")
        return 1
    print(f"alerts timed: {len(latencies)}; min {min(latencies) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms")
    print(f"alert latency log() -> chat: p50 {percentile(latencies, 50) * 1000:.0f} ms, "
          f"p99 {percentile(latencies, 99) * 1000:.0f} ms  (target p99 < 1000 ms)")
    return 0 if not missed else 1


if __name__ == "__main__":
    raise SystemExit(main())
