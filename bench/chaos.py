"""Fault suite: each scenario against a real broker, printing expected, delivered, duplicated, lost.

Scenarios (``--only NAME`` runs one):

- ``worker_kill``: ``trainsentry serve`` is SIGKILLed after every run's healthy warm-up and
  a new worker (same group) takes over; the fault comes right after, at a step where only
  a warm detector baseline catches it (dataloader_stall at its onset), so a lost state
  shows as a missed or late alert.
- ``broker_down``: a private broker is stopped for ``--broker-down-s`` (60) mid-run and
  restarted on the same port; trainers keep logging, the service keeps running.
- ``webhook_down``: the chat robots refuse connections for ``--webhook-down-s`` (600) while
  runs turn faulty; then they come back.
- ``malformed``: hypothesis-generated bad records mixed with good runs: every bad one must
  be in the dead-letter topic with a reason, every good run diagnosed.
- ``trainer_offline``: a training loop logs with the broker unreachable for the whole run:
  ``log()`` stays within its budget and memory stays bounded.

Counting: *expected* is what should arrive (a chat alert per faulty run; dead letters;
metric steps), *delivered* what did, *duplicated* repeats of an identical chat message
(a resend), *lost* = expected - delivered. Acceptance: lost=0 everywhere, duplicates <= 1%.

    python -m bench.chaos [--only worker_kill] [--webhook-down-s 600] [--broker-down-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import consumed, free_port, fresh_prefix, own_broker, read_topic, rss_mb  # noqa: E402
from trainsentry.config import Topics  # noqa: E402
from trainsentry.simulate import Scenario, generate  # noqa: E402

#: A fault that only a warm detector baseline catches at its onset step (checked offline:
#: with 60 healthy steps before it, the alert is at the onset; with 5, there is none).
WARM_FAULT = "dataloader_stall"
#: Service settings for the scenarios: notify at once, no rate limit in the way.
FAST_NOTIFY = {"TRAINSENTRY_ALERT_FOR_S": "0", "TRAINSENTRY_ALERT_FOR_STEPS": "0",
               "TRAINSENTRY_NOTIFY_RATE_LIMIT": "100000", "TRAINSENTRY_ALERT_CHARTS": "0",
               "TRAINSENTRY_LANGUAGE": "en"}


@dataclass
class Result:
    """One scenario's tally."""

    name: str
    expected: int
    delivered: int
    duplicated: int
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return max(0, self.expected - self.delivered)

    def line(self) -> str:
        note = f"  ({'; '.join(self.notes)})" if self.notes else ""
        return (f"{self.name:16} expected={self.expected} delivered={self.delivered} "
                f"duplicated={self.duplicated} lost={self.lost}{note}")


# --------------------------------------------------------------------------- helpers


def run_events(run_id: str, *, steps: int, onset: int, fault: str | None = WARM_FAULT,
               ranks: int = 2, seed: int = 7) -> list[dict[str, Any]]:
    """A simulated run whose last step is ``steps - 1``, stamped to end about now."""
    start = time.time() - steps * 20.0
    return [e for e in generate(Scenario(run_id=run_id, steps=steps, ranks=ranks, seed=seed,
                                         fault=fault, fault_onset=onset, save_freq=1000,
                                         start_ts=start))
            if e.get("type") != "run_finished"]


def steps_between(events: list[dict[str, Any]], lo: int, hi: int) -> list[dict[str, Any]]:
    """Events of steps lo..hi-1 (run events without a step go with the first slice)."""
    return [e for e in events if (e.get("step") is None and lo == 0)
            or (e.get("step") is not None and lo <= e["step"] < hi)]


def records_of(events: list[dict[str, Any]]) -> int:
    """Kafka records these events become through MetricsProducer: ``publish_scenario``
    merges a step's driver layers into one ``log()`` dict, which the producer splits back
    into the same layers, so one record per event."""
    return len(events)


def publish(bootstrap: str, prefix: str, run_id: str, events: list[dict[str, Any]]) -> None:
    from producers import MetricsProducer
    from tests.service_proc import publish_scenario

    with MetricsProducer(run_id=run_id, bootstrap=bootstrap, topic_prefix=prefix) as p:
        publish_scenario(p, events)


def chat_tally(texts: list[str], wanted: dict[str, str]) -> tuple[int, int]:
    """(runs whose diagnosis reached the chat, duplicated messages)."""
    delivered = sum(1 for run_id, label in wanted.items()
                    if any(run_id in t and label in t for t in texts))
    counts = Counter(texts)
    return delivered, sum(n - 1 for n in counts.values() if n > 1)


def wait_settled(svc: Any, at_least: int, timeout: float, quiet_s: float = 3.0) -> int:
    """Wait until the service consumed ``at_least`` records and nothing more came for
    ``quiet_s`` (a step's layers may be fewer than :func:`records_of` guesses)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = consumed(svc)
        if n != last:
            last, since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.3)
    return last


def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def offline_first_steps(events: list[dict[str, Any]]) -> dict[str, int]:
    """diagnosis -> first firing step when the same events run through the offline engine
    (what the stream must match if no state is lost)."""
    from detectors.engine import Engine, EngineConfig
    from trainsentry.events import AlertEvent, decode_event

    engine = Engine(EngineConfig())
    state = engine.new_state(str(events[0]["run_id"]))
    out = []
    for e in events:
        out += engine.process(state, decode_event(e))
    out += engine.flush(state)
    first: dict[str, int] = {}
    for a in out:
        if isinstance(a, AlertEvent) and a.status == "firing":
            first.setdefault(a.diagnosis, a.step)
    return first


def first_alert_steps(bootstrap: str, topics: Topics) -> dict[tuple[str, str], int]:
    """(run_id, diagnosis) -> step of its first firing alert on the alerts topic."""
    out: dict[tuple[str, str], int] = {}
    for r in read_topic(bootstrap, topics.alerts):
        a = json.loads(r.value)
        if a.get("status") == "firing":
            key = (a["run_id"], a["diagnosis"])
            out[key] = min(out.get(key, a["step"]), a["step"])
    return out


# --------------------------------------------------------------------------- scenarios


def worker_kill(bootstrap: str, *, runs: int = 3, warm_steps: int = 61,
                extra_steps: int = 6) -> Result:
    """SIGKILL the worker after warm-up; the restarted worker must catch the fault at onset."""
    from bench._common import service
    from trainsentry.sink import ChatSink

    prefix = fresh_prefix("kill")
    topics = Topics(prefix)
    app_id = f"chaos-kill-{prefix.strip('.')}"
    onset = warm_steps
    plans = {f"chaos/kill-{i}": run_events(f"chaos/kill-{i}", steps=warm_steps + extra_steps,
                                           onset=onset, seed=20 + i) for i in range(runs)}
    notes: list[str] = []
    with ChatSink(echo=False) as sink:
        env = {**sink.env(), **FAST_NOTIFY}
        svc_cm = service(bootstrap=bootstrap, prefix=prefix, extra_env=env, app_id=app_id,
                         partitions=2)
        svc = svc_cm.__enter__()
        warm = 0
        for run_id, events in plans.items():
            part = steps_between(events, 0, onset)
            publish(bootstrap, prefix, run_id, part)
            warm += records_of(part)
        t_warm = time.monotonic()
        wait_settled(svc, int(warm * 0.9), 120)
        notes.append(f"warm-up consumed in {time.monotonic() - t_warm:.0f}s")
        time.sleep(2.5)  # past one state flush: the kill does not depend on luck either way
        early = len(sink.messages)
        svc.kill()  # SIGKILL: no leave-group, no commit, no flush
        with contextlib.suppress(Exception):  # the process is already gone
            svc_cm.__exit__(None, None, None)
        t_kill = time.monotonic()
        with service(bootstrap=bootstrap, prefix=prefix, extra_env=env, app_id=app_id,
                     partitions=2) as svc2:
            notes.append(f"restarted worker ready {time.monotonic() - t_kill:.0f}s after the kill")
            for run_id, events in plans.items():
                publish(bootstrap, prefix, run_id, steps_between(events, onset, 10**9))
            wanted = {run_id: WARM_FAULT for run_id in plans}
            t_fault = time.monotonic()
            wait_until(lambda: chat_tally([m.text for m in sink.messages], wanted)[0] == runs, 60)
            notes.append(f"alerts in chat {time.monotonic() - t_fault:.1f}s after the fault")
            time.sleep(2.0)  # anything duplicated would arrive now
            _, body = svc2.get("/api/stats")
        texts = [m.text for m in sink.messages]
    delivered, dups = chat_tally(texts, wanted)
    steps = first_alert_steps(bootstrap, topics)
    offline = {r: offline_first_steps(e).get(WARM_FAULT) for r, e in plans.items()}
    late = {r: (steps.get((r, WARM_FAULT)), offline[r]) for r in plans
            if steps.get((r, WARM_FAULT)) != offline[r]}
    if late:
        notes.append(f"first alert step differs from the offline engine's (stream, offline): {late}")
        delivered -= len(late)
    notes.append(f"{early} chat messages during warm-up; onset {onset}, first alert steps "
                 f"{[steps.get((r, WARM_FAULT)) for r in plans]} = offline")
    return Result("worker_kill", expected=runs, delivered=delivered, duplicated=dups, notes=notes)


def webhook_down(bootstrap: str, *, down_s: float = 600.0, runs: int = 3) -> Result:
    """Chat robots refuse connections while runs turn faulty; everything arrives after."""
    from bench._common import service
    from tests.chat_servers import FakeDingTalk, FakeWeCom

    prefix = fresh_prefix("hook")
    plans = {f"chaos/hook-{i}": run_events(f"chaos/hook-{i}", steps=48, onset=40, seed=40 + i,
                                           fault="nan_loss", ranks=1) for i in range(runs)}
    wanted = {run_id: "nan_loss" for run_id in plans}
    loop = asyncio.new_event_loop()
    ding = FakeDingTalk(limit=100000)
    wecom = FakeWeCom(limit=100000)
    loop.run_until_complete(ding.start())
    loop.run_until_complete(wecom.start())
    notes: list[str] = []
    try:
        env = {"TRAINSENTRY_DINGTALK_URL": ding.url, "TRAINSENTRY_DINGTALK_SECRET": ding.secret or "",
               "TRAINSENTRY_WECOM_URL": wecom.url, **FAST_NOTIFY}
        with service(bootstrap=bootstrap, prefix=prefix, extra_env=env,
                     app_id=f"chaos-hook-{prefix.strip('.')}", partitions=2):
            loop.run_until_complete(ding.go_down())
            loop.run_until_complete(wecom.go_down())
            t0 = time.monotonic()
            for run_id, events in plans.items():
                publish(bootstrap, prefix, run_id, events)
            while time.monotonic() - t0 < down_s:
                loop.run_until_complete(asyncio.sleep(min(5.0, down_s - (time.monotonic() - t0))))
            loop.run_until_complete(ding.come_up())
            loop.run_until_complete(wecom.come_up())
            t_up = time.monotonic()

            def done() -> bool:
                return all(chat_tally([m.text for m in s.messages], wanted)[0] == runs
                           for s in (ding, wecom))
            while not done() and time.monotonic() - t_up < 120:
                loop.run_until_complete(asyncio.sleep(0.5))
            notes.append(f"all delivered {time.monotonic() - t_up:.1f}s after the robots came back")
            loop.run_until_complete(asyncio.sleep(2.0))
        d1, dup1 = chat_tally([m.text for m in ding.messages], wanted)
        d2, dup2 = chat_tally([m.text for m in wecom.messages], wanted)
    finally:
        loop.run_until_complete(ding.stop())
        loop.run_until_complete(wecom.stop())
        loop.close()
    notes.append(f"DingTalk {d1}/{runs}, WeCom {d2}/{runs}")
    return Result("webhook_down", expected=2 * runs, delivered=d1 + d2, duplicated=dup1 + dup2,
                  notes=notes)


def malformed_records(seed: int = 0, count: int = 200) -> list[tuple[bytes, str]]:
    """``count`` bad record values with the kind of defect each has (hypothesis-drawn)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = {"v": 1, "run_id": "chaos/bad", "step": 1, "ts": 1764528000.0, "layer": "data",
            "metrics": {"timing_s/gen": 3.0}}
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                               lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                               max_leaves=6)
    defects = st.one_of(
        st.binary(min_size=1, max_size=200).filter(lambda b: not _is_json_object(b))
          .map(lambda b: (b, "not json")),
        st.sampled_from(sorted(good)).map(
            lambda k: (json.dumps({x: y for x, y in good.items() if x != k}).encode(), f"missing {k}")),
        st.tuples(st.sampled_from(["v", "run_id", "step", "ts", "layer", "metrics"]), json_values)
          .filter(lambda kv: not _valid_field(kv[0], kv[1]))
          .map(lambda kv: (json.dumps({**good, kv[0]: kv[1]}).encode(), f"bad {kv[0]}")),
        st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=10), min_size=1, max_size=4)
          .filter(lambda m: any(v.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity",
                                                          "-infinity") for v in m.values()))
          .map(lambda m: (json.dumps({**good, "metrics": m}).encode(), "bad metric value")),
    )
    out: list[tuple[bytes, str]] = []

    @settings(max_examples=count, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(defects)
    def collect(item: tuple[bytes, str]) -> None:
        if len(out) < count:
            out.append(item)

    collect()
    return out


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def _valid_field(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return {"v": value == 1, "run_id": isinstance(value, str) and 0 < len(value) <= 256,
            "step": isinstance(value, int) and value >= 0,
            "ts": isinstance(value, (int, float)),
            "layer": value in ("data", "compute", "resource"),
            "metrics": isinstance(value, dict) and all(
                isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in value.items())}[key]


def malformed(bootstrap: str, *, bad: int = 200, good_runs: int = 2) -> Result:
    """Bad records mixed between good runs' records: all dead-lettered with reasons."""
    from kafka import KafkaProducer

    from bench._common import service

    prefix = fresh_prefix("bad")
    topics = Topics(prefix)
    records = malformed_records(count=bad)
    plans = {f"chaos/good-{i}": run_events(f"chaos/good-{i}", steps=45, onset=35, seed=60 + i,
                                           fault="nan_loss", ranks=1) for i in range(good_runs)}
    notes: list[str] = []
    with service(bootstrap=bootstrap, prefix=prefix, extra_env=FAST_NOTIFY,
                 app_id=f"chaos-bad-{prefix.strip('.')}", partitions=2) as svc:
        raw = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        half = len(records) // 2
        for value, _ in records[:half]:
            raw.send(topics.data, key=b"chaos/bad", value=value)
        raw.flush()
        for run_id, events in plans.items():
            publish(bootstrap, prefix, run_id, events)
        for value, _ in records[half:]:
            raw.send(topics.data, key=b"chaos/bad", value=value)
        raw.flush()
        raw.close()
        total = len(records) + sum(records_of(e) for e in plans.values())
        wait_until(lambda: consumed(svc) >= total, 120)
        steps = {}
        wait_until(lambda: len(steps.update(first_alert_steps(bootstrap, topics)) or steps)
                   >= good_runs, 30, poll=1.0)
        _, body = svc.get("/api/stats")
    dead = read_topic(bootstrap, topics.deadletter)
    with_reason = [r for r in dead if dict(r.headers).get("reason")]
    diagnosed = sum(1 for r in plans if (r, "nan_loss") in steps)
    notes.append(f"good runs diagnosed {diagnosed}/{good_runs}; engine errors "
                 f"{len(body.get('errors', []))}")
    values = Counter(v for v, _ in records)
    got = Counter(r.value for r in with_reason)
    dups = sum(max(0, got[v] - values[v]) for v in got)
    missing = sum(max(0, values[v] - got[v]) for v in values)
    delivered = len(records) - missing + (diagnosed - good_runs)
    return Result("malformed", expected=len(records), delivered=delivered, duplicated=dups,
                  notes=notes)


def broker_down(*, down_s: float = 60.0, runs: int = 2, steps: int = 40) -> Result:
    """A private broker stops for ``down_s`` mid-run; trainers and the service ride it out."""
    from bench._common import service
    from producers import MetricsProducer
    from tests.service_proc import publish_scenario
    from trainsentry import kafka_local

    notes: list[str] = []
    with own_broker() as (bootstrap, port, data_dir):
        prefix = fresh_prefix("down")
        topics = Topics(prefix)
        plans = {f"chaos/down-{i}": run_events(f"chaos/down-{i}", steps=steps, onset=steps - 5,
                                               seed=80 + i, fault="nan_loss", ranks=1)
                 for i in range(runs)}
        with service(bootstrap=bootstrap, prefix=prefix, extra_env=FAST_NOTIFY,
                     app_id=f"chaos-down-{prefix.strip('.')}", partitions=2) as svc:
            producers = {r: MetricsProducer(run_id=r, bootstrap=bootstrap, topic_prefix=prefix)
                         for r in plans}
            half = steps // 2
            for r, events in plans.items():
                publish_scenario(producers[r], steps_between(events, 0, half))
                producers[r].flush(30)
            kafka_local.stop(port=port, data_dir=data_dir)
            t_down = time.monotonic()
            for r, events in plans.items():  # the trainers go on while the broker is away
                publish_scenario(producers[r], steps_between(events, half, 10**9))
            time.sleep(max(0.0, down_s - (time.monotonic() - t_down)))
            kafka_local.start(port=port, data_dir=data_dir)
            notes.append(f"broker away {time.monotonic() - t_down:.0f}s")
            for p in producers.values():
                p.close(120)
            expected = sum(records_of(e) for e in plans.values())
            ok = wait_until(lambda: consumed(svc) >= expected, 180, poll=1.0)
            notes.append(f"service consumed {consumed(svc)}/{expected} records"
                         + ("" if ok else " (timed out)"))
            steps_found = first_alert_steps(bootstrap, topics)
        counts = _source_counts(bootstrap, topics, list(plans))
    dropped = sum(p.stats.dropped for p in producers.values())
    notes.append(f"producer re-sent {sum(p.stats.resent for p in producers.values())} records "
                 f"kafka-python had given up on")
    notes.append(f"producer drops {dropped}; alerts for {sum(1 for r in plans if (r, 'nan_loss') in steps_found)}/{runs} runs")
    expected_by_run = {r: records_of(e) for r, e in plans.items()}
    delivered = sum(min(counts.get(r, 0), n) for r, n in expected_by_run.items())
    dups = sum(max(0, counts.get(r, 0) - n) for r, n in expected_by_run.items())
    return Result("broker_down", expected=sum(expected_by_run.values()), delivered=delivered,
                  duplicated=dups, notes=notes)


def _source_counts(bootstrap: str, topics: Topics, run_ids: list[str]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for name in (topics.data, topics.compute, topics.resource, topics.runs):
        for r in read_topic(bootstrap, name):
            counts[r.key.decode()] += 1
    return {r: counts[r] for r in run_ids}


def trainer_offline(*, steps: int = 20_000, max_buffer: int = 2_000,
                    budget_us: float = 50.0) -> Result:
    """A training loop with the broker unreachable for the whole run."""
    from producers import MetricsProducer

    metrics = {f"actor/m{i}": float(i) for i in range(40)}
    p = MetricsProducer(run_id="chaos/offline", bootstrap=f"127.0.0.1:{free_port()}",
                        max_buffer=max_buffer)
    rss0 = rss_mb()
    worst = 0.0
    calls = []
    for step in range(steps):
        t0 = time.perf_counter()
        p.log(metrics, step=step)
        dt = (time.perf_counter() - t0) * 1e6
        calls.append(dt)
        worst = max(worst, dt)
    rss1 = rss_mb()
    buffered, dropped = p.buffered, p.stats.dropped
    t0 = time.perf_counter()
    p.close(timeout=1.0)
    close_s = time.perf_counter() - t0
    calls.sort()
    p99 = calls[int(len(calls) * 0.99)]
    over = sum(1 for c in calls if c > budget_us)
    notes = [f"log() p50 {calls[len(calls) // 2]:.1f}us p99 {p99:.1f}us max {worst:.0f}us; "
             f"{over} calls over {budget_us:.0f}us", f"buffered {buffered} (max {max_buffer}), "
             f"dropped {dropped} (counted)", f"rss +{rss1 - rss0:.1f} MiB", f"close {close_s:.1f}s"]
    # Nothing can be delivered without a broker; what is accounted for is what the trainer
    # was promised: every step either buffered or counted as dropped, none vanished.
    accounted = buffered + dropped
    return Result("trainer_offline", expected=steps, delivered=accounted, duplicated=0,
                  notes=notes)


SCENARIOS = ("worker_kill", "broker_down", "webhook_down", "malformed", "trainer_offline")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"))
    ap.add_argument("--only", choices=SCENARIOS, action="append")
    ap.add_argument("--broker-down-s", type=float, default=60.0)
    ap.add_argument("--webhook-down-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    results = []
    for name in args.only or SCENARIOS:
        t0 = time.monotonic()
        if name == "worker_kill":
            r = worker_kill(args.bootstrap)
        elif name == "broker_down":
            r = broker_down(down_s=args.broker_down_s)
        elif name == "webhook_down":
            r = webhook_down(args.bootstrap, down_s=args.webhook_down_s)
        elif name == "malformed":
            r = malformed(args.bootstrap)
        else:
            r = trainer_offline()
        r.notes.append(f"{time.monotonic() - t0:.0f}s")
        print(r.line(), flush=True)
        results.append(r)
    alerts = sum(r.expected for r in results if r.name in ("worker_kill", "webhook_down"))
    dups = sum(r.duplicated for r in results if r.name in ("worker_kill", "webhook_down"))
    ok = all(r.lost == 0 for r in results) and dups <= max(0.01 * alerts, 0)
    print(f"chaos: {'PASS' if ok else 'FAIL'} — lost {sum(r.lost for r in results)}, "
          f"duplicated alerts {dups} of {alerts}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
