"""Straggler detection across ranks: peer-relative, names the slow rank and its host."""

from __future__ import annotations

import random

import pytest

from bench.diagnosis import sim_events
from detectors.engine import Engine
from detectors.offline import detect_events
from detectors.rules import peer_outlier
from trainsentry.events import AlertEvent, MetricEvent
from trainsentry.simulate import Scenario


def _alerts(sc: Scenario) -> list[AlertEvent]:
    return [a for a in detect_events(sim_events(sc))
            if isinstance(a, AlertEvent) and a.status == "firing"]


@pytest.mark.parametrize("slow_rank", [0, 5, 7])
def test_eight_rank_run_names_the_slow_rank_and_its_host(slow_rank: int) -> None:
    """8 ranks on 2 hosts of 4 GPUs: the first alert is a straggler naming rank and host."""
    sc = Scenario(run_id="s8", seed=5, steps=100, ranks=8, gpus_per_host=4, step_time_s=15.0,
                  fault="straggler", fault_rank=slow_rank, fault_onset=50)
    alerts = _alerts(sc)
    first = alerts[0]
    assert first.diagnosis == "straggler" and 50 <= first.step <= 52
    assert first.rank == slow_rank and first.host == sc.host_of(slow_rank)
    assert f"rank {slow_rank} on {sc.host_of(slow_rank)}" in first.summary
    ev = first.evidence[f"timing_s/rank_step[rank={slow_rank}]"]
    assert ev["value"] > ev["bound"] > ev["baseline"] > 0
    assert all(a.diagnosis != "dataloader_stall" for a in alerts)


def test_two_ranks_are_enough() -> None:
    """With 2 ranks the other rank is the reference (a median of 2 would hide the culprit)."""
    sc = Scenario(run_id="s2", seed=9, steps=100, ranks=2, fault="straggler", fault_rank=0,
                  fault_onset=50, fault_severity=0.7)
    first = _alerts(sc)[0]
    assert first.diagnosis == "straggler" and first.rank == 0 and first.host == "node-0"


def _rank_events(step: int, times: dict[int, float]) -> list[MetricEvent]:
    return [MetricEvent(run_id="r", step=step, ts=1000.0 + 30 * step + 0.1 * r, layer="resource",
                        host=f"node-{r // 4}", rank=r,
                        metrics={"timing_s/rank_step": t, "gpu/utilization_pct": 85.0})
            for r, t in times.items()]


def test_the_whole_run_slowing_down_is_not_a_straggler() -> None:
    """Every rank 2.5x slower at once: peers stay alike, no straggler."""
    rng = random.Random(1)
    engine = Engine()
    state = engine.new_state("r")
    out = []
    for s in range(60):
        base = 20.0 if s < 30 else 50.0
        for ev in _rank_events(s, {r: base * (1 + rng.gauss(0, 0.015)) for r in range(8)}):
            out += engine.process(state, ev)
    out += engine.flush(state)
    assert [a.diagnosis for a in out if isinstance(a, AlertEvent)
            and a.diagnosis == "straggler"] == []


def test_one_slow_step_of_one_rank_does_not_fire() -> None:
    """A single slow step (e.g. a rank's own checkpoint I/O) needs a second to count."""
    rng = random.Random(2)
    engine = Engine()
    state = engine.new_state("r")
    out = []
    for s in range(40):
        times = {r: 20.0 * (1 + rng.gauss(0, 0.01)) for r in range(8)}
        if s == 25:
            times[3] = 45.0
        for ev in _rank_events(s, times):
            out += engine.process(state, ev)
    out += engine.flush(state)
    assert not any(isinstance(a, AlertEvent) and a.diagnosis == "straggler" for a in out)


def test_peer_outlier_is_relative_to_the_other_ranks() -> None:
    """The outlier test compares the slowest rank with the others' median and spread."""
    out = peer_outlier({0: 10.0, 1: 10.1, 2: 9.9, 3: 15.0})
    assert out is not None and (out.rank, out.value, out.slow_ranks) == (3, 15.0, (3,))
    assert out.reference == pytest.approx(9.95) and out.z > 6
    assert peer_outlier({0: 10.0, 1: 10.1, 2: 9.9, 3: 11.0}) is None  # 1.1x: not enough
    both = peer_outlier({0: 10.0, 1: 30.0, 2: 10.0, 3: 31.0})  # up to half the ranks can be slow
    assert both is not None and both.slow_ranks == (3, 1)
    assert peer_outlier({0: 10.0, 1: 25.0}) is not None  # 2 ranks: the other is the reference
    assert peer_outlier({0: 10.0}) is None
