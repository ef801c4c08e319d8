"""Scale-out on the real broker: two ``trainsentry serve`` workers share the partitions, and
when one is SIGKILLed the other takes over its runs with their detector state.

The proof of "with state": the fault injected right after the kill (``dataloader_stall``
at its onset) is caught at that step only by a detector whose baseline saw the healthy
steps before it. Before the kill the group has committed the whole warm-up, so a worker
that took over cold would start at the onset and still be in warm-up (catalog warm-up 10
values; the stalled values would become its baseline): it stays silent.
The first alert step on the alerts topic must equal the offline engine's for every run,
the ones the killed worker held included. And the chat must not get again what the killed
worker had already sent (the ``alert_book`` changelog moves with the partitions).

The full-size figures (hundreds of runs, lag over time, memory per run) are
``python -m bench.scale``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from aiokafka.partitioner import murmur2

from bench import chaos, scale
from bench._common import fresh_prefix, stats
from tests.service_proc import ServiceProcess
from trainsentry.config import Topics
from trainsentry.sink import ChatSink

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PARTITIONS = 4
WARM_STEPS = 61  # healthy steps before the fault (the onset)
EXTRA_STEPS = 6  # faulty steps published after the kill


def _partition(run_id: str) -> int:
    """The partition Kafka's default partitioner (the producers') puts a run's records in."""
    return int(murmur2(run_id.encode()) & 0x7FFFFFFF) % PARTITIONS


def _run_per_partition(tag: str) -> dict[int, str]:
    """One run_id hashing to each partition."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < PARTITIONS:
        out.setdefault(_partition(f"scale/{tag}-{i}"), f"scale/{tag}-{i}")
        i += 1
    return out


def _logs(*services: ServiceProcess) -> str:
    return "".join(f"\n----- worker on :{s.web_port} ({s.log_path}), last lines:\n{s.log()[-3000:]}"
                   for s in services)


def _wait(predicate: Callable[[], bool], timeout: float, what: str,
          *services: ServiceProcess) -> None:
    if not chaos.wait_until(predicate, timeout):
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{_logs(*services)}")


@pytest.mark.timeout(240)
def test_killed_workers_runs_move_to_the_other_worker_with_their_state(kafka_bootstrap: str) -> None:
    """Two workers split 4 partitions; after worker A is SIGKILLed, worker B takes A's runs
    and catches a fault that only a warm baseline sees at the offline engine's step, and
    sends nothing twice that A had already sent."""
    prefix = fresh_prefix("scale")
    topics = Topics(prefix)
    app_id = f"ts-scale-{prefix.strip('.')}"
    with ChatSink(echo=False) as sink, scale.workers(
            bootstrap=kafka_bootstrap, prefix=prefix, count=2, partitions=PARTITIONS,
            app_id=app_id, extra_env={**sink.env(), **chaos.FAST_NOTIFY},
    ) as (a, b):
        for svc in (a, b):
            svc.wait_ready(150)
        # Both ready; the group may still be rebalancing: wait for a split that holds.
        split = scale.wait_split([a, b], PARTITIONS, timeout=90)
        assert split is not None, ("the two workers did not settle on a share of the 4 "
                                   f"partitions: {scale.assigned(a)}, {scale.assigned(b)}" + _logs(a, b))
        parts_a, parts_b = split

        # A stalled run on every partition (so both workers hold some), plus one run on A's
        # side whose NaN loss A alerts on (and sends to the chat) before it dies.
        stall_runs = _run_per_partition("stall")
        early_id = next(r for p, r in sorted(_run_per_partition("nan").items()) if p in parts_a)
        steps = WARM_STEPS + EXTRA_STEPS
        plans = {run_id: chaos.run_events(run_id, steps=steps, onset=WARM_STEPS, seed=30 + p)
                 for p, run_id in stall_runs.items()}
        early = chaos.run_events(early_id, steps=50, onset=40, fault="nan_loss", seed=3)
        for run_id, events in plans.items():
            chaos.publish(kafka_bootstrap, prefix, run_id, chaos.steps_between(events, 0, WARM_STEPS))
        chaos.publish(kafka_bootstrap, prefix, early_id, early)
        warm = sum(len(chaos.steps_between(e, 0, WARM_STEPS)) for e in plans.values()) + len(early)

        def consumed() -> int:
            return sum(int(sum(stats(s).get("consumed", {}).values())) for s in (a, b))

        _wait(lambda: consumed() >= int(warm * 0.95), 90,
              f"the warm-up to be consumed ({warm} records)", a, b)
        _wait(lambda: any(early_id in m.text and "nan_loss" in m.text for m in sink.messages),
              45, f"worker A's nan_loss message for {early_id}", a, b)
        # Everything consumed is committed (states written, offsets committed): a worker that
        # took over cold would start at the onset, where a fresh detector is still warming up
        # (offline: started 7 or fewer steps before the onset, it misses the stall).
        probe = scale.LagProbe(kafka_bootstrap, app_id, [topics.data, topics.compute,
                                                         topics.resource, topics.runs])
        try:
            _wait(lambda: probe.lag() == 0, 45, "the group to commit the warm-up", a, b)
        finally:
            probe.close()
        time.sleep(1.0)  # the alert book's write after the chat acknowledged
        runs_a = set(stats(a).get("runs", []))
        runs_b = set(stats(b).get("runs", []))
        owned_a = {r for r in plans if _partition(r) in parts_a}
        assert owned_a and owned_a <= runs_a, (parts_a, runs_a, _logs(a, b))
        assert {r for r in plans if _partition(r) in parts_b} <= runs_b, (parts_b, runs_b, _logs(a, b))
        assert early_id in runs_a, (early_id, runs_a, _logs(a, b))
        assert not [m for m in sink.messages if "dataloader_stall" in m.text], \
            "a stall alert before the fault" + _logs(a, b)
        sent_by_a = [(m.channel, m.text) for m in sink.messages]

        a.kill()  # SIGKILL: no leave-group, no commit, no flush
        t_kill = time.monotonic()
        # The fault right away: its first steps arrive while A's partitions are orphaned, and
        # B must catch them with the baselines A built.
        for run_id, events in plans.items():
            chaos.publish(kafka_bootstrap, prefix, run_id, chaos.steps_between(events, WARM_STEPS, 10**9))

        _wait(lambda: scale.assigned(b) == list(range(PARTITIONS)),
              90, "worker B to take over all 4 partitions", a, b)
        took_over_s = time.monotonic() - t_kill
        wanted = {run_id: chaos.WARM_FAULT for run_id in plans}
        _wait(lambda: chaos.chat_tally([m.text for m in sink.messages], wanted)[0] == len(plans),
              60, f"a {chaos.WARM_FAULT} message for each of {sorted(plans)}", a, b)
        time.sleep(3.0)  # anything resent would arrive now
        runs_b_after = set(stats(b).get("runs", []))
        messages = [(m.channel, m.text) for m in sink.messages]

    assert owned_a <= runs_b_after, (owned_a, runs_b_after, _logs(b))
    first = chaos.first_alert_steps(kafka_bootstrap, topics)
    offline = {r: chaos.offline_first_steps(e).get(chaos.WARM_FAULT) for r, e in plans.items()}
    stream = {r: first.get((r, chaos.WARM_FAULT)) for r in plans}
    assert all(s in (WARM_STEPS, WARM_STEPS + 1) for s in offline.values()), offline
    assert stream == offline, (f"first {chaos.WARM_FAULT} step per run (stream vs offline "
                               f"engine) differs: state lost in the takeover? A held "
                               f"{sorted(owned_a)}" + _logs(b))
    repeats = {m: n for m, n in Counter(messages).items() if n > 1}
    assert not repeats, f"chat messages sent more than once: {list(repeats)[:3]}" + _logs(b)
    assert all(m in messages for m in sent_by_a)  # A's messages, each exactly once
    assert took_over_s < 60, took_over_s
