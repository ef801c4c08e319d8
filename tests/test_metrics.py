"""/metrics: per-run verl_* metrics read from RunState, the service's own health, and an
end-to-end scrape of the real service during a simulated run."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from detectors.engine import Engine, RunState
from stream_app.app import ServiceState
from stream_app.metrics import (
    METRIC_NAMES,
    Recorder,
    build_registry,
    consumer_lag,
    render,
    run_signals,
    run_status,
)
from trainsentry.events import ControlCommand, MetricEvent, RunEvent
from trainsentry.simulate import Scenario, generate


def _feed(events: list[dict[str, Any]], run_id: str) -> tuple[ServiceState, RunState]:
    """Run simulator events through the engine the way the detect agent does."""
    engine = Engine()
    svc = ServiceState()
    recorder = svc.extra["recorder"] = Recorder()
    state = svc.cache[run_id] = engine.new_state(run_id)
    for raw in events:
        ev = MetricEvent.from_dict(raw) if "layer" in raw else RunEvent.from_dict(raw)
        recorder.on_event(ev)
        out = engine.process(state, ev)
        recorder.on_outcome(state, out, sum(isinstance(o, ControlCommand) for o in out))
    return svc, state


def _scrape(svc: Any, app: Any = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    body, _ = render(build_registry(svc, app=app))
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), s.value))
    return out


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


@pytest.fixture(scope="module")
def nan_run() -> tuple[ServiceState, RunState]:
    events = generate(Scenario(run_id="m/nan", steps=60, fault="nan_loss", fault_onset=40,
                               ranks=2, save_freq=1000, seed=3))
    events = [e for e in events if e.get("type") != "run_finished"]
    return _feed(events, "m/nan")


def test_per_run_metrics_use_the_domain_names_and_units(nan_run: tuple[ServiceState, RunState]) -> None:
    """verl_* gauges come from the run's latest values in bytes/ms, labelled by run_id."""
    svc, state = nan_run
    m = _scrape(svc)
    assert _one(m, "verl_training_steps_total", run_id="m/nan") == state.steps_evaluated
    mem_gib = state.recent["actor/perf/max_memory_allocated_gb"][-1][1]
    assert _one(m, "verl_actor_gpu_memory_bytes", run_id="m/nan") == pytest.approx(mem_gib * 1024**3)
    assert _one(m, "verl_gpu_memory_total_bytes", run_id="m/nan") == pytest.approx(80 * 1024**3)
    sync_s = state.recent["timing_s/update_weights"][-1][1]
    assert _one(m, "verl_hybrid_engine_comm_cost_ms", run_id="m/nan") == pytest.approx(sync_s * 1000)
    assert _one(m, "verl_learning_rate", run_id="m/nan") == pytest.approx(1e-6)
    assert 0.99 <= _one(m, "verl_rollout_success_rate", run_id="m/nan") <= 1.0
    assert 0 < _one(m, "verl_kl_divergence", run_id="m/nan") < 1
    assert _one(m, "trainsentry_run_status", run_id="m/nan") == 2  # red: nan_loss is critical
    assert _one(m, "trainsentry_run_active_alerts", run_id="m/nan", diagnosis="nan_loss",
                severity="critical") == 1


def test_step_duration_histogram_counts_every_step_once(nan_run: tuple[ServiceState, RunState]) -> None:
    """One observation per evaluated step with a timing_s/step value, sum = their total."""
    svc, state = nan_run
    m = _scrape(svc)
    count = _one(m, "verl_training_step_duration_seconds_count", run_id="m/nan")
    total = _one(m, "verl_training_step_duration_seconds_sum", run_id="m/nan")
    steps = [v for _s, v in state.recent["timing_s/step"]]
    assert count == len(steps) or count == state.steps_evaluated - 1  # step 0 has no step time
    assert total >= sum(steps[-10:])
    inf = _one(m, "verl_training_step_duration_seconds_bucket", run_id="m/nan", le="+Inf")
    assert inf == count


def test_histogram_observes_steps_evaluated_in_one_batch_and_restarts() -> None:
    """A flush that evaluates several steps at once observes each; a new attempt starts over."""
    state = RunState("h")
    rec = Recorder()
    state.recent["timing_s/step"] = deque(((s, 10.0 * s) for s in range(1, 6)), maxlen=60)
    state.last_evaluated = 5
    rec.on_outcome(state, [], 0)
    rec.on_outcome(state, [], 0)  # nothing new: no double counting
    hist = rec.step_hists["h"]
    assert hist.n == 5 and hist.total == 150.0
    state.attempt, state.last_evaluated = 1, 1
    state.recent["timing_s/step"].append((1, 7.0))
    rec.on_outcome(state, [], 0)
    assert hist.n == 6 and hist.total == 157.0


def test_alerts_commands_and_applied_commands_are_counted(nan_run: tuple[ServiceState, RunState]) -> None:
    """alerts_total by diagnosis/severity/status; command_applied RunEvents by action/result."""
    svc, state = nan_run
    rec: Recorder = svc.extra["recorder"]
    rec.on_event(RunEvent(run_id="m/nan", type="command_applied", ts=time.time(),
                          fields={"command_id": "c1", "action": "stop", "result": "stopped"}))
    m = _scrape(svc)
    assert _one(m, "trainsentry_alerts_total", diagnosis="nan_loss", severity="critical",
                status="firing") >= 1
    assert _one(m, "trainsentry_commands_issued_total", action="stop") == 1
    assert _one(m, "trainsentry_commands_applied_total", action="stop", result="stopped") == 1
    kinds = [e["kind"] for e in rec.timelines["m/nan"]]
    assert "alert" in kinds and "command" in kinds and "command_applied" in kinds


def test_notifier_health_becomes_per_receiver_series() -> None:
    """Deliverer.health() counters map to sent/failed/retries, and config errors to 1."""
    svc = ServiceState()
    svc.extra["notifier_health"] = {
        "dingtalk": {"state": "ok", "sent": 4, "failed": 0, "retries": 2, "throttled": 1,
                     "queued": 0},
        "wecom": {"state": "config_error", "sent": 0, "failed": 3, "retries": 0, "queued": 2}}
    m = _scrape(svc)
    assert _one(m, "trainsentry_notifications_sent_total", receiver="dingtalk") == 4
    assert _one(m, "trainsentry_notification_retries_total", receiver="dingtalk") == 2
    assert _one(m, "trainsentry_notifications_failed_total", receiver="wecom") == 3
    assert _one(m, "trainsentry_notifier_config_error", receiver="wecom") == 1
    assert _one(m, "trainsentry_notifier_config_error", receiver="dingtalk") == 0
    assert _one(m, "trainsentry_notifier_state", receiver="wecom", state="config_error") == 1


def test_offset_seeks_and_resumed_notices_are_exported_per_agent() -> None:
    """Both agents' OffsetGuard seeks and the notify agent's resumed notices (0 at start)."""
    svc = ServiceState()
    m = _scrape(svc)
    assert _one(m, "trainsentry_offset_seeks_total", agent="notify") == 0
    svc.extra["offset_seeks"] = 2
    svc.extra["alerting"] = type("Ctx", (), {"stats": {"offset_seeks": 3, "resumed_notices": 7}})()
    m = _scrape(svc)
    assert _one(m, "trainsentry_offset_seeks_total", agent="detect") == 2
    assert _one(m, "trainsentry_offset_seeks_total", agent="notify") == 3
    assert _one(m, "trainsentry_notify_resumed_notices_total") == 7


def test_every_exported_family_is_listed_in_metric_names(nan_run: tuple[ServiceState, RunState]) -> None:
    """METRIC_NAMES (which deploy/ rules are checked against) names every family we export."""
    svc, _ = nan_run
    svc.extra["notifier_health"] = {"x": {"state": "ok"}}
    body, _ = render(build_registry(svc))
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    exported = {n + "_total" if n + "_total" in METRIC_NAMES else n for n in families}
    assert exported <= METRIC_NAMES, exported - METRIC_NAMES


def test_each_app_has_its_own_registry() -> None:
    """Two registries never share runs (no module-level registry state)."""
    a, b = ServiceState(), ServiceState()
    a.cache["only-a"] = RunState("only-a")
    body_a, _ = render(build_registry(a))
    body_b, _ = render(build_registry(b))
    assert b'run_id="only-a"' in body_a and b"only-a" not in body_b


def test_detector_state_size_is_measured_and_cached(nan_run: tuple[ServiceState, RunState]) -> None:
    """trainsentry_detector_state_bytes is the pickled size of the runs, within a TTL."""
    svc, _ = nan_run
    m = _scrape(svc)
    size = _one(m, "trainsentry_detector_state_bytes")
    assert 10_000 < size < 2_000_000
    assert _one(m, "trainsentry_detector_monitors") >= 40


@dataclass(frozen=True)
class _TP:
    topic: str
    partition: int


class _Consumer:
    def __init__(self) -> None:
        self._committed_offset = {_TP("t.metrics.data", 0): 90}

    def assignment(self) -> set[_TP]:
        return {_TP("t.metrics.data", 0), _TP("t.metrics.data", 1),
                _TP("app-run_state-changelog", 0)}

    def highwater(self, tp: _TP) -> int:
        return 100


class _Monitor:
    tp_read_offsets = {_TP("t.metrics.data", 1): 39}
    tp_end_offsets: dict[_TP, int] = {}


class _App:
    _consumer = _Consumer()
    monitor = _Monitor()


def test_consumer_lag_is_highwater_minus_committed_without_changelogs() -> None:
    """Lag per source partition: committed offset, else the read offset + 1."""
    assert consumer_lag(_App()) == {("t.metrics.data", 0): 10, ("t.metrics.data", 1): 60}
    assert consumer_lag(None) == {}


def test_run_status_and_signals_for_the_dashboard(nan_run: tuple[ServiceState, RunState]) -> None:
    """Red with the critical diagnosis; the evidence signal charts first, with its NaNs marked."""
    _svc, state = nan_run
    assert run_status(state)[:2] == ("red", "nan_loss")
    signals = run_signals(state)
    assert signals[0]["key"] in ("actor/grad_norm", "actor/pg_loss")
    grad = next(s for s in signals if s["key"] == "actor/grad_norm")
    nan_steps = [p[0] for p in grad["points"] if p[1] is None]
    assert nan_steps and set(nan_steps) <= set(grad["anomalies"])
    assert grad["band"] is not None and grad["band"]["lower"] <= grad["band"]["upper"]
    assert run_status(RunState("fresh")) == ("green", None, None)


# ------------------------------------------------------------------------------ end to end

@pytest.mark.kafka
@pytest.mark.slow
async def test_scrape_during_a_simulated_run_shows_run_and_service_metrics(
        kafka_bootstrap: str, topic_prefix: str, free_port: int) -> None:
    """The real service: steps_total equals the steps published, dead letters 0,
    alerts_total{diagnosis="nan_loss"} >= 1, a stop command issued and applied, lag 0."""
    from producers import MetricsProducer
    from tests.service_proc import ServiceProcess, publish_scenario

    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         control_secret="metrics-secret").start()
    try:
        await asyncio.to_thread(svc.wait_ready)
        run_id = "metrics/grpo-nan"
        events = generate(Scenario(run_id=run_id, steps=50, fault="nan_loss", fault_onset=35,
                                   ranks=2, save_freq=1000, seed=3, start_ts=time.time() - 3000))
        published_steps = len({e["step"] for e in events if "layer" in e})
        with MetricsProducer(run_id=run_id, bootstrap=kafka_bootstrap, topic_prefix=topic_prefix) as p:
            publish_scenario(p, events)
            p.send_raw("run", {"v": 1, "run_id": run_id, "ts": time.time(),
                               "type": "command_applied", "command_id": "c-1", "action": "stop",
                               "result": "stopped"})

        def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
            status, body = svc.get("/metrics")
            assert status == 200
            out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
            for fam in text_string_to_metric_families(body):
                for s in fam.samples:
                    out[s.name].append((dict(s.labels), s.value))
            return out

        deadline = time.monotonic() + 90
        m: dict[str, list[tuple[dict[str, str], float]]] = {}
        while time.monotonic() < deadline:
            m = await asyncio.to_thread(scrape)
            done = [v for lab, v in m.get("trainsentry_commands_applied_total", [])]
            steps = [v for lab, v in m.get("verl_training_steps_total", [])
                     if lab.get("run_id") == run_id]
            if done and steps and steps[0] == published_steps:
                break
            await asyncio.sleep(1)
        assert _one(m, "verl_training_steps_total", run_id=run_id) == published_steps
        assert _one(m, "trainsentry_deadletters_total") == 0
        assert sum(v for lab, v in m["trainsentry_alerts_total"]
                   if lab["diagnosis"] == "nan_loss" and lab["status"] == "firing") >= 1
        assert _one(m, "trainsentry_commands_issued_total", action="stop") == 1
        assert _one(m, "trainsentry_commands_applied_total", action="stop", result="stopped") == 1
        assert _one(m, "trainsentry_ready") == 1
        assert _one(m, "verl_training_step_duration_seconds_count", run_id=run_id) >= published_steps - 1
        assert _one(m, "verl_learning_rate", run_id=run_id) == pytest.approx(1e-6)
        assert 0 < _one(m, "verl_kl_divergence", run_id=run_id) < 1
        # Resource samples may all arrive after run_finished flushed the join (another
        # topic), so GPU memory is checked only when the run's state has it.
        for _lab, v in [x for x in m.get("verl_gpu_memory_used_bytes", [])
                        if x[0].get("run_id") == run_id]:
            assert 40 * 1024**3 < v < 80 * 1024**3
        consumed = {lab["topic"]: v for lab, v in m["trainsentry_events_consumed_total"]}
        assert consumed[f"{topic_prefix}metrics.data"] == published_steps
        # Offsets are committed every second: the lag drains to 0 once everything is read.
        lags: list[float] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lags = [v for _lab, v in (await asyncio.to_thread(scrape))["trainsentry_consumer_lag"]]
            if lags and all(v == 0 for v in lags):
                break
            await asyncio.sleep(1)
        assert lags and all(v == 0 for v in lags), lags
    finally:
        svc.stop()


def test_ready_only_once_partitions_are_assigned_and_their_state_restored() -> None:
    """A worker in the middle of a rebalance or a table recovery is not ready: a stalled
    recovery shows as trainsentry_ready 0 (TrainsentryNotReady) and recovering 1."""
    svc = ServiceState()
    moving = {"now": True}
    svc.recovering = lambda: moving["now"]
    m = _scrape(svc)
    assert _one(m, "trainsentry_ready") == 0
    svc.ready = True  # partitions assigned, tables still being restored
    m = _scrape(svc)
    assert _one(m, "trainsentry_ready") == 0 and _one(m, "trainsentry_recovering") == 1
    assert not svc.serving
    moving["now"] = False
    m = _scrape(svc)
    assert _one(m, "trainsentry_ready") == 1 and _one(m, "trainsentry_recovering") == 0
    assert svc.serving


def test_command_results_become_a_few_label_values_and_the_text_stays_in_the_timeline() -> None:
    """A trainer's free-text result must not make a series per run: it is classed into a
    fixed set of label values; the timeline keeps the text."""
    from stream_app.metrics import Recorder
    from trainsentry.events import RunEvent

    rec = Recorder()
    for i, (action, text) in enumerate([("rollback", "rolled back to step 30 from step 52; x"),
                                        ("rollback", "rolled back to step 10 from step 14; y"),
                                        ("stop", "stopped at step 9; checkpoint saved"),
                                        ("weird", "done, somehow")]):
        rec.on_event(RunEvent(run_id=f"r{i}", type="command_applied", ts=1.0,
                              fields={"action": action, "result": text, "command_id": str(i)}))
    assert rec.commands_applied == {("rollback", "rolled_back"): 2, ("stop", "stopped"): 1,
                                    ("other", "applied"): 1}
    assert rec.timelines["r0"][-1]["result"].startswith("rolled back to step 30")
