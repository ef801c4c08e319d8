"""The engine: step join, critical conditions, circuit breaker, rollback target, hangs."""

from __future__ import annotations

import math
import random

import pytest

from detectors.engine import Engine, EngineConfig
from trainsentry.events import AlertEvent, ControlCommand, MetricEvent, RunEvent


def _step_events(run_id: str, step: int, ts: float, *, gen: float = 3.0, util: float = 85.0,
                 fwd: float = 2.0, loss: float = 0.1, kl: float = 0.02, empty: float = 0.01,
                 length: float = 500.0, rng: random.Random) -> list[MetricEvent]:
    n = lambda x, s=0.03: x * (1 + rng.gauss(0, s))  # noqa: E731
    return [
        MetricEvent(run_id=run_id, step=step, ts=ts, layer="data", metrics={
            "timing_s/gen": n(gen), "actor/kl_loss": n(kl), "response/aborted_ratio": n(empty),
            "response_length/mean": n(length), "actor/entropy": n(0.5, 0.01)}),
        MetricEvent(run_id=run_id, step=step, ts=ts, layer="compute", metrics={
            "timing_s/old_log_prob": n(fwd), "timing_s/ref": n(fwd), "actor/pg_loss": loss,
            "actor/grad_norm": n(1.0, 0.1), "timing_s/update_weights": n(0.2)}),
        MetricEvent(run_id=run_id, step=step, ts=ts, layer="resource", metrics={
            "gpu/utilization_pct": n(util, 0.02), "gpu/memory_used_gb": n(40.0, 0.005),
            "gpu/memory_total_gb": 80.0}),
    ]


def _run(events: list[MetricEvent | RunEvent], config: EngineConfig | None = None) -> list:
    engine = Engine(config)
    state = engine.new_state(events[0].run_id)
    out = []
    for ev in events:
        out += engine.process(state, ev)
    out += engine.flush(state)
    return out


def _healthy(steps: int, seed: int = 0, run_id: str = "r") -> list[MetricEvent | RunEvent]:
    rng = random.Random(seed)
    out: list[MetricEvent | RunEvent] = []
    for s in range(steps):
        out += _step_events(run_id, s, 1000.0 + 20 * s, rng=rng)
    return out


def test_healthy_run_raises_no_alert() -> None:
    """200 noisy but healthy steps: nothing fires."""
    assert _run(_healthy(200)) == []


def _stall_run(rng: random.Random, steps: int = 120, onset: int = 100) -> list[MetricEvent | RunEvent]:
    """A healthy run whose input pipeline stalls from ``onset`` (latency up, GPU util down)."""
    events: list[MetricEvent | RunEvent] = []
    for s in range(steps):
        stall = s >= onset
        events += _step_events("r", s, 1000.0 + 20 * s, gen=15.0 if stall else 3.0,
                               util=15.0 if stall else 85.0, rng=rng)
    return events


def test_layer_order_does_not_change_the_result() -> None:
    """Shuffling the three layers within and across neighbouring steps gives the same alerts
    (the join waits for every part, whatever the topic interleaving)."""
    events = _stall_run(random.Random(1))
    expected = [(a.step, a.diagnosis, a.status) for a in _run(events) if isinstance(a, AlertEvent)]
    assert expected, "the stall must be detected"
    shuffled = list(events)
    rng2 = random.Random(7)
    for i in range(0, len(shuffled) - 1, 3):  # swap layers inside each step
        block = shuffled[i:i + 3]
        rng2.shuffle(block)
        shuffled[i:i + 3] = block
    got = [(a.step, a.diagnosis, a.status) for a in _run(shuffled) if isinstance(a, AlertEvent)]
    assert got == expected


def test_records_read_twice_after_a_seek_change_nothing() -> None:
    """The stream agent seeks back to records Faust dropped (stream_app/offsets.py), so a
    window of step/layer events can come again: a step already joined or evaluated ignores
    them, the alerts are the same, and a checkpoint read twice is kept once."""
    events = _stall_run(random.Random(3))
    expected = [(a.step, a.diagnosis, a.status) for a in _run(events) if isinstance(a, AlertEvent)]
    assert expected
    ckpt = RunEvent(run_id="r", type="checkpoint_saved", ts=1500.0, step=25)
    again = events[:90] + [ckpt] + events[60:105] + [ckpt] + events[95:]  # two re-reads
    engine = Engine()
    state = engine.new_state("r")
    out = [o for ev in again for o in engine.process(state, ev)] + engine.flush(state)
    assert [(a.step, a.diagnosis, a.status) for a in out if isinstance(a, AlertEvent)] == expected
    assert state.checkpoints == [(25, 1500.0)]


def test_dataloader_stall_is_diagnosed_with_evidence_and_goes_critical() -> None:
    """Latency up + GPU util down + forward flat → dataloader_stall, critical above 5 s."""
    rng = random.Random(2)
    events: list[MetricEvent | RunEvent] = []
    for s in range(110):
        stall = s >= 100
        events += _step_events("r", s, 1000.0 + 20 * s, gen=14.0 if stall else 3.0,
                               util=18.0 if stall else 85.0, rng=rng)
    alerts = [a for a in _run(events) if isinstance(a, AlertEvent)]
    first = alerts[0]
    assert first.diagnosis == "dataloader_stall" and first.step == 100
    assert first.severity == "critical" and first.status == "firing"
    assert first.evidence["timing_s/gen"]["value"] > 5 > first.evidence["timing_s/gen"]["baseline"]
    assert first.evidence["gpu/utilization_pct"]["value"] < 30
    assert any("iostat" in c for c in first.checks) and first.actions


def test_latency_up_with_forward_time_up_is_not_a_dataloader_stall() -> None:
    """If the model's forward time rises too, it is not the input pipeline."""
    rng = random.Random(3)
    events: list[MetricEvent | RunEvent] = []
    for s in range(110):
        slow = s >= 100
        events += _step_events("r", s, 1000.0 + 20 * s, gen=14.0 if slow else 3.0,
                               util=18.0 if slow else 85.0, fwd=8.0 if slow else 2.0, rng=rng)
    labels = {a.diagnosis for a in _run(events) if isinstance(a, AlertEvent)}
    assert "dataloader_stall" not in labels and labels


def test_nan_loss_trips_the_breaker_after_three_steps_with_rollback_to_healthy_checkpoint() -> None:
    """NaN loss for 3 steps → nan_loss alert, then one rollback command to the last healthy checkpoint."""
    rng = random.Random(4)
    events: list[MetricEvent | RunEvent] = [RunEvent(run_id="r", type="run_started", ts=999.0,
                                                     fields={"config": {}})]
    for s in range(60):
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 50 else 0.1, rng=rng)
        if s in (20, 40, 51):
            events.append(RunEvent(run_id="r", type="checkpoint_saved", ts=1000.0 + 20 * s + 1,
                                   step=s, fields={"path": f"/ckpt/global_step_{s}"}))
    out = _run(events)
    alerts = [a for a in out if isinstance(a, AlertEvent)]
    commands = [c for c in out if isinstance(c, ControlCommand)]
    assert alerts[0].diagnosis == "nan_loss" and alerts[0].step == 50
    assert alerts[0].severity == "critical"
    assert len(commands) == 1
    cmd = commands[0]
    assert cmd.action == "rollback" and cmd.to_step == 40  # 51 was saved during the streak
    assert alerts[0].id in cmd.alert_ids and "nan_loss" in cmd.reason
    # ...and a notice of the lead problem that carries it, right after it.
    (notice,) = [a for a in alerts if a.command is not None]
    assert out.index(notice) == out.index(cmd) + 1
    assert notice.command == {"id": cmd.id, "action": "rollback", "to_step": 40,
                              "checkpoint_first": False}
    assert notice.fingerprint == alerts[0].fingerprint and notice.id != alerts[0].id
    assert notice.severity == "critical" and notice.step == 52  # the third critical step
    assert notice.evidence and "actor/pg_loss" in notice.evidence
    assert "roll back to the checkpoint of step 40" in notice.summary
    assert notice.summary_zh and "回滚到第 40 步" in notice.summary_zh
    assert notice.id not in cmd.alert_ids


@pytest.mark.parametrize("answer, words", [
    ("command_applied", "the trainer applied command"),
    ("command_rejected", "the trainer REJECTED command"),
])
def test_the_trainers_answer_to_a_command_is_told_once(answer: str, words: str) -> None:
    """command_applied / command_rejected of a command this engine issued: one notice of the
    same problem; a second answer, or one about a command we never issued, says nothing."""
    rng = random.Random(4)
    events: list[MetricEvent | RunEvent] = []
    for s in range(56):
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 50 else 0.1, rng=rng)
    engine = Engine()
    state = engine.new_state("r")
    out: list = []
    for ev in events:
        out += engine.process(state, ev)
    (cmd,) = [c for c in out if isinstance(c, ControlCommand)]
    field = "result" if answer == "command_applied" else "reason"

    def reply(cid: str, attempt: int = 0) -> list:
        return engine.process(state, RunEvent(run_id="r", type=answer, ts=2200.0, step=55,
                                              attempt=attempt, fields={
                                                  "command_id": cid, "action": "stop",
                                                  field: "stopped at step 55"}))

    assert reply("not-ours") == []
    (told,) = reply(cmd.id)
    assert isinstance(told, AlertEvent) and told.diagnosis == "nan_loss"
    assert told.command == {"id": cmd.id, "action": "stop", "to_step": None,
                            "outcome": answer.split("_")[1], "detail": "stopped at step 55"}
    assert words in told.summary and "stopped at step 55" in told.summary
    assert told.summary_zh and ("已执行" if answer == "command_applied" else "拒绝") in told.summary_zh
    assert told.evidence and told.fingerprint == next(
        a for a in out if isinstance(a, AlertEvent)).fingerprint
    if answer == "command_rejected":
        assert "TRAINSENTRY_CONTROL_SECRET" in told.summary
    assert reply(cmd.id) == [] and reply(cmd.id, attempt=1) == []  # told once


def test_breaker_threshold_is_configurable_and_fires_once_per_streak() -> None:
    """N=5: no command after 4 critical steps; exactly one after 5+."""
    rng = random.Random(5)
    events: list[MetricEvent | RunEvent] = []
    for s in range(70):
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 50 else 0.1, rng=rng)
    out = _run(events, EngineConfig(breaker_threshold=5))
    commands = [c for c in out if isinstance(c, ControlCommand)]
    assert len(commands) == 1 and commands[0].action == "stop"  # no checkpoint: stop
    assert "no healthy checkpoint" in commands[0].reason
    (notice,) = [a for a in out if isinstance(a, AlertEvent) and a.command]
    assert notice.command["action"] == "stop"
    assert "circuit breaker after 5 consecutive critical steps" in notice.summary
    assert "stops instead" in notice.summary and "改为停止" in (notice.summary_zh or "")


def test_alert_resolves_after_the_hold_and_ids_are_deterministic() -> None:
    """A fault that ends resolves after 3 clear steps; running twice gives identical ids."""
    rng = random.Random(6)
    events: list[MetricEvent | RunEvent] = []
    for s in range(130):
        stall = 100 <= s < 105
        events += _step_events("r", s, 1000.0 + 20 * s, gen=14.0 if stall else 3.0,
                               util=18.0 if stall else 85.0, rng=rng)
    out1 = [a for a in _run(events) if isinstance(a, AlertEvent)]
    out2 = [a for a in _run(events) if isinstance(a, AlertEvent)]
    assert [a.id for a in out1] == [a.id for a in out2]
    statuses = [(a.diagnosis, a.status) for a in out1]
    assert ("dataloader_stall", "firing") in statuses and ("dataloader_stall", "resolved") in statuses
    resolved = next(a for a in out1 if a.status == "resolved")
    assert resolved.step == 107


@pytest.mark.parametrize("heartbeats, words", [(True, "alive but stuck"), (False, "silent")])
def test_hang_fires_within_two_minutes_and_tells_stuck_from_dead(heartbeats: bool, words: str) -> None:
    """Steps every 20 s, then none: training_hang at most 120 s after the last step."""
    engine = Engine()
    state = engine.new_state("r")
    for ev in _healthy(30):
        engine.process(state, ev)
    last_ts = 1000.0 + 20 * 29
    fired = []
    for t in range(1, 200):
        now = last_ts + t
        if heartbeats and t % 10 == 0:
            fired += engine.process(state, RunEvent(run_id="r", type="heartbeat", ts=now, step=29,
                                                    fields={"host": "node-0", "rank": 0}))
        fired += engine.tick(state, now)
        if fired:
            break
    assert fired and fired[0].diagnosis == "training_hang"
    assert fired[0].ts - last_ts <= 120
    assert words in fired[0].summary


def test_one_long_validation_step_is_not_a_hang() -> None:
    """A single 80 s step (validation) after 20 s steps does not fire."""
    engine = Engine()
    state = engine.new_state("r")
    out = []
    ts = 1000.0
    rng = random.Random(8)
    for s in range(40):
        gap = 80.0 if s == 30 else 20.0
        for t in range(5, int(gap), 5):  # the service's timer runs every few seconds
            out += engine.tick(state, ts + t)
        ts += gap
        for ev in _step_events("r", s, ts, rng=rng):
            out += engine.process(state, ev)
    assert [a for a in out if isinstance(a, AlertEvent)] == []
    assert engine.tick(state, ts + 200)  # whereas a real silence is caught


# ----------------------------------------------------------------- retention and takeover
def _streamed(engine: Engine, events: list[MetricEvent | RunEvent], *, arrival0: float,
              state: object | None = None) -> tuple[object, list, float]:
    """Feed ``events`` the way the stream app does: arrival (wall clock) = ts - 1000 +
    arrival0, join grace polled after each step. Returns (state, outputs, last arrival)."""
    st = state if state is not None else engine.new_state(events[0].run_id)
    out: list = []
    arrival = arrival0
    for ev in events:
        arrival = ev.ts - 1000.0 + arrival0
        out += engine.process(st, ev, arrival=arrival)  # type: ignore[arg-type]
        out += engine.poll(st, arrival + 1.0)  # type: ignore[arg-type]
    return st, out, arrival + 1.0


def test_a_finished_run_is_retired_after_its_retention_and_not_before() -> None:
    engine = Engine(EngineConfig(finished_retention_s=600.0))
    events = _healthy(20) + [RunEvent(run_id="r", type="run_finished", ts=1000.0 + 20 * 20,
                                      fields={"exit_code": 0})]
    state, _, last = _streamed(engine, events, arrival0=5000.0)
    engine.poll(state, last + 5.0)  # type: ignore[arg-type]
    assert state.finished  # type: ignore[attr-defined]
    assert engine.retire(state, last + 590.0) is None  # type: ignore[arg-type]
    assert engine.retire(state, last + 601.0) == []  # type: ignore[arg-type]


def test_a_silent_unfinished_run_is_retired_with_its_alerts_resolved() -> None:
    """A trainer killed without run_finished: after idle_retention_s the state goes, and
    every alert still firing is resolved first (no chat thread stays open forever)."""
    engine = Engine(EngineConfig(idle_retention_s=7200.0))
    events = _healthy(30)
    rng = random.Random(3)
    for s in range(30, 34):  # NaN loss: critical alerts firing
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan, rng=rng)
    state, out, last = _streamed(engine, events, arrival0=5000.0)
    firing = {a.fingerprint for a in out if isinstance(a, AlertEvent) and a.status == "firing"}
    assert firing
    assert engine.retire(state, last + 7199.0) is None  # type: ignore[arg-type]
    outputs = engine.retire(state, last + 7201.0)  # type: ignore[arg-type]
    assert outputs is not None
    resolved = [a for a in outputs if isinstance(a, AlertEvent)]
    assert {a.fingerprint for a in resolved} == firing
    assert all(a.status == "resolved" and "stopped watching" in a.summary for a in resolved)
    assert state.alerts == {}  # type: ignore[attr-defined]


def test_an_offline_run_is_never_retired() -> None:
    engine = Engine(EngineConfig(idle_retention_s=3600.0, finished_retention_s=0.0))
    state = engine.new_state("r")
    for ev in _healthy(10):
        engine.process(state, ev)  # no arrival: `trainsentry detect`
    assert engine.retire(state, 1e12) is None


def test_a_taken_over_state_measures_silence_from_the_takeover() -> None:
    """A worker restarts 1000 s after the run's last step and loads its stored state.
    Without adopt() the hang fires at once (the run's backlog may still be on its way);
    with it, one hang limit after the takeover if no step comes, and never before."""
    import pickle

    engine = Engine()
    state, _, last = _streamed(engine, _healthy(30), arrival0=5000.0)
    stored = pickle.dumps(state)
    restart = last + 1000.0

    stale = pickle.loads(stored)
    assert [a.diagnosis for a in engine.tick(stale, restart + 1.0)] == ["training_hang"]

    taken = pickle.loads(stored)
    engine.adopt(taken, restart)
    quiet = [a for t in range(1, 60, 5) for a in engine.tick(taken, restart + t)]
    assert quiet == []
    fired = [a for t in range(60, 200, 5) for a in engine.tick(taken, restart + t)]
    assert [a.diagnosis for a in fired] == ["training_hang"]
    assert fired[0].ts - restart <= 130


def test_a_state_pickled_before_commands_were_remembered_still_trips_and_tells() -> None:
    """RunStates in the changelog from an older version lack ``issued`` (and alert states
    lack their last evidence): the breaker and the answer to its command still work."""
    import pickle

    rng = random.Random(4)
    engine = Engine()
    state = engine.new_state("r")
    out: list = []
    for s in range(51):
        for ev in _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 50 else 0.1,
                               rng=rng):
            out += engine.process(state, ev)
    del state.issued
    for st in state.alerts.values():
        del st.last_evidence, st.last_confidence
    state = pickle.loads(pickle.dumps(state))
    for s in range(51, 54):
        for ev in _step_events("r", s, 1000.0 + 20 * s, loss=math.nan, rng=rng):
            out += engine.process(state, ev)
    (cmd,) = [c for c in out if isinstance(c, ControlCommand)]
    assert [a for a in out if isinstance(a, AlertEvent) and a.command]
    told = engine.process(state, RunEvent(run_id="r", type="command_applied", ts=3000.0,
                                          step=53, fields={"command_id": cmd.id,
                                                           "action": "stop", "result": "ok"}))
    assert len(told) == 1 and told[0].command["outcome"] == "applied"


def _nan_then_finish(exit_fields: dict) -> list:
    rng = random.Random(11)
    events: list[MetricEvent | RunEvent] = []
    for s in range(60):
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 55 else 0.1, rng=rng)
    events.append(RunEvent(run_id="r", type="run_finished", ts=1000.0 + 20 * 60,
                           fields=exit_fields))
    return [a for a in _run(events, EngineConfig(breaker_threshold=100))
            if isinstance(a, AlertEvent) and a.status == "resolved"]


def test_a_run_that_dies_with_a_firing_problem_is_not_reported_recovered() -> None:
    """run_finished with a non-zero exit code (or an error) while nan_loss fires: the
    episode closes with ``run_exit``, a summary that says it did not recover, the problem's
    evidence and 'fix this before restarting'; a clean exit resolves as before."""
    (died,) = _nan_then_finish({"exit_code": 1, "error": "RuntimeError:\n  loss is nan"})
    assert died.diagnosis == "nan_loss" and died.run_exit == {"exit_code": 1,
                                                              "error": "RuntimeError: loss is nan"}
    assert "exited with exit code 1" in died.summary and "did not recover" in died.summary
    assert "异常退出" in (died.summary_zh or "") and "退出码 1" in (died.summary_zh or "")
    assert died.evidence and died.actions[0] == "fix this before restarting the run"
    assert AlertEvent.from_dict(died.to_dict()) == died  # the field survives the wire
    (errored,) = _nan_then_finish({"error": "killed by the scheduler"})
    assert errored.run_exit == {"exit_code": None, "error": "killed by the scheduler"}
    (clean,) = _nan_then_finish({"exit_code": 0})
    assert clean.run_exit is None and "resolved at step" in clean.summary
    assert "run_exit" not in clean.to_dict()


def test_the_breaker_notice_says_what_is_wrong_before_what_it_does() -> None:
    """The notice a team may read first names the problem's own summary (which signal, which
    value), then the breaker's order, in both languages."""
    rng = random.Random(12)
    events: list[MetricEvent | RunEvent] = []
    for s in range(60):
        events += _step_events("r", s, 1000.0 + 20 * s, loss=math.nan if s >= 50 else 0.1, rng=rng)
    (notice,) = [a for a in _run(events) if isinstance(a, AlertEvent) and a.command]
    problem, breaker = notice.summary.split("circuit breaker", 1)
    assert "actor/pg_loss" in problem
    zh_problem = (notice.summary_zh or "").split("触发熔断", 1)[0]
    assert "actor/pg_loss" in zh_problem
