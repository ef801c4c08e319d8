"""Prometheus metrics of the service: per-run training signals and the service's own health.

Why a custom collector: the per-run gauges are read from the runs' :class:`RunState`
(``svc.cache``) at scrape time, so the hot path (one record → engine → publish) pays
nothing for them. The only hot-path work is :class:`Recorder`: a few counter bumps per
alert/command and one histogram observation per evaluated step.

Every app gets its own :class:`~prometheus_client.CollectorRegistry` (no module-level
registry), built by :func:`build_registry`.

Names: the ``verl_*`` metrics are the ones operators already scrape (DOMAIN.md), labelled
by ``run_id``; everything else is ``trainsentry_*``. :data:`METRIC_NAMES` lists them all
(deploy/ rules and dashboards are checked against it).
"""

from __future__ import annotations

import bisect
import math
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from detectors.engine import RunState
from detectors.rules import expected_lr
from producers.layers import signal_info
from trainsentry.events import AlertEvent, ControlCommand, RunEvent

__all__ = [
    "Recorder",
    "RunCollector",
    "ServiceCollector",
    "build_registry",
    "render",
    "run_status",
    "run_signals",
    "role_values",
    "METRIC_NAMES",
    "STEP_BUCKETS",
]

#: Buckets of ``verl_training_step_duration_seconds``; 120 s is DOMAIN's p95 limit.
STEP_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600,
                                   1200, 3600)
GIB = 1024.0**3  # verl's and the sampler's "_gb" are GiB (torch / NVML bytes / 1024**3)

#: verl_* gauge → (engine role, factor from the role's canonical unit, help).
#: Roles come from producers/layers.py, so verl's keys and operators' aliases both count.
RUN_GAUGES: dict[str, tuple[str, float, str]] = {
    "verl_actor_gpu_memory_bytes": ("actor_mem", GIB, "Actor peak GPU memory allocated (bytes)"),
    "verl_gpu_memory_used_bytes": ("gpu_mem", GIB, "GPU memory used, max over ranks (bytes)"),
    "verl_gpu_memory_total_bytes": ("gpu_mem_total", GIB, "GPU memory capacity (bytes)"),
    "verl_kl_divergence": ("kl", 1.0, "KL to the reference policy (max over KL keys)"),
    "verl_grad_norm": ("grad_norm", 1.0, "Actor gradient norm (NaN when non-finite)"),
    "verl_learning_rate": ("lr", 1.0, "Actor learning rate"),
    "verl_hybrid_engine_comm_cost_ms": ("comm_time", 1000.0,
                                        "Weight sync / gradient all-reduce time (ms)"),
}

#: The signals the dashboard charts first (by role), after the active alerts' evidence.
KEY_ROLES: tuple[str, ...] = ("latency", "step_time", "kl", "grad_norm", "loss", "lr",
                              "empty_ratio", "entropy", "response_length", "comm_time",
                              "gpu_util", "gpu_mem", "actor_mem", "score")

METRIC_NAMES: frozenset[str] = frozenset({
    # per run (DOMAIN.md)
    "verl_training_step_duration_seconds", "verl_training_steps_total",
    "verl_rollout_success_rate", *RUN_GAUGES,
    # per run (ours)
    "trainsentry_run_status", "trainsentry_run_last_step", "trainsentry_run_critical_streak",
    "trainsentry_run_active_alerts", "trainsentry_run_finished",
    "trainsentry_run_expected_learning_rate", "trainsentry_run_grad_norm_recent_stddev",
    "trainsentry_run_grad_norm_mean", "trainsentry_run_late_events_total",
    # service health
    "trainsentry_up", "trainsentry_ready", "trainsentry_recovering",
    "trainsentry_start_time_seconds",
    "trainsentry_events_consumed_total", "trainsentry_consumer_lag",
    "trainsentry_deadletters_total", "trainsentry_engine_errors_total",
    "trainsentry_alerts_total", "trainsentry_alerts_delivered_total",
    "trainsentry_alert_duplicates_skipped_total",
    "trainsentry_offset_seeks_total", "trainsentry_notify_resumed_notices_total",
    "trainsentry_notifications_sent_total", "trainsentry_notifications_failed_total",
    "trainsentry_notification_retries_total", "trainsentry_notifications_throttled_total",
    "trainsentry_notifier_queue", "trainsentry_notifier_state",
    "trainsentry_notifier_config_error",
    "trainsentry_commands_issued_total", "trainsentry_commands_unpublished_total",
    "trainsentry_commands_applied_total",
    "trainsentry_runs", "trainsentry_runs_active", "trainsentry_runs_retired_total",
    "trainsentry_alert_books_retired_total",
    "trainsentry_detector_monitors", "trainsentry_detector_state_bytes", "trainsentry_scrape_duration_seconds",
})


# ------------------------------------------------------------------------------ hot path

#: ``trainsentry_commands_applied_total`` labels take only these values, whatever text a
#: trainer reports (free text would give every run its own series).
_ACTIONS = ("stop", "rollback", "checkpoint", "checkpoint_then_stop")
_RESULTS = (("rolled back", "rolled_back"), ("stopped", "stopped"),
            ("checkpoint saved", "checkpointed"), ("superseded", "superseded"),
            ("rejected", "rejected"))


def _result_class(text: str) -> str:
    """A trainer's result text as one of rolled_back, stopped, checkpointed, superseded,
    rejected or applied."""
    low = text.lower()
    return next((label for prefix, label in _RESULTS if low.startswith(prefix)), "applied")


@dataclass
class _StepHist:
    """One run's cumulative step-duration histogram (bucket counts, sum, count)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0
    attempt: int = 0
    last_step: int = -1

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(STEP_BUCKETS, value)] += 1
        self.total += value
        self.n += 1


class Recorder:
    """Counters the agents bump (alerts, commands, applied commands) and per-run timelines.

    Lives in ``svc.extra["recorder"]``; ``stream_app/app.py`` calls :meth:`on_event` for
    every decoded record and :meth:`on_outcome` after every publish.
    """

    def __init__(self, *, timeline_len: int = 300, max_runs: int = 2000,
                 clock: Callable[[], float] = time.time) -> None:
        self.alerts: dict[tuple[str, str, str], int] = {}  # (diagnosis, severity, status)
        self.commands_issued: dict[str, int] = {}  # action
        self.commands_unpublished = 0
        self.commands_applied: dict[tuple[str, str], int] = {}  # (action, result)
        self.timelines: dict[str, deque[dict[str, Any]]] = {}
        self.step_hists: dict[str, _StepHist] = {}
        self._timeline_len = timeline_len
        self._max_runs = max_runs
        self._clock = clock

    def _timeline(self, run_id: str) -> deque[dict[str, Any]]:
        tl = self.timelines.get(run_id)
        if tl is None:
            tl = self.timelines[run_id] = deque(maxlen=self._timeline_len)
            _cap(self.timelines, self._max_runs)
        return tl

    def on_event(self, event: Any) -> None:
        """A decoded record: counts ``command_applied`` / ``command_rejected`` RunEvents."""
        if not isinstance(event, RunEvent) or event.type not in ("command_applied",
                                                                 "command_rejected"):
            return
        action = str(event.fields.get("action", "?"))
        if action not in _ACTIONS:
            action = "other"
        if event.type == "command_applied":
            result = str(event.fields.get("result", "ok"))[:300] or "ok"
        else:
            result = "rejected"
        key = (action, _result_class(result))  # bounded label values; the text is in the timeline
        self.commands_applied[key] = self.commands_applied.get(key, 0) + 1
        self._timeline(event.run_id).append({
            "kind": "command_applied" if event.type == "command_applied" else "command_rejected",
            "ts": event.ts, "step": event.step, "command_id": event.fields.get("command_id"),
            "action": action, "result": result,
            "reason": str(event.fields.get("reason", ""))[:300]})

    def on_outcome(self, state: RunState, outputs: Iterable[Any], published_commands: int) -> None:
        """After a publish: count alerts and commands, extend the run's timeline, and
        observe the step durations of newly evaluated steps."""
        commands = 0
        for o in outputs:
            if isinstance(o, AlertEvent):
                key = (o.diagnosis, o.severity, o.status)
                self.alerts[key] = self.alerts.get(key, 0) + 1
                self._timeline(o.run_id).append({
                    "kind": "alert", "ts": o.ts, "step": o.step, "id": o.id,
                    "fingerprint": o.fingerprint, "status": o.status, "severity": o.severity,
                    "diagnosis": o.diagnosis, "summary": o.summary[:300],
                    "evidence": sorted(o.evidence)[:6]})
            elif isinstance(o, ControlCommand):
                commands += 1
                published = commands <= published_commands
                if published:
                    self.commands_issued[o.action] = self.commands_issued.get(o.action, 0) + 1
                else:
                    self.commands_unpublished += 1
                self._timeline(o.run_id).append({
                    "kind": "command", "ts": self._clock(), "step": state.last_evaluated,
                    "id": o.id, "action": o.action, "to_step": o.to_step,
                    "reason": o.reason[:300], "published": published})
        self._observe_steps(state)

    def _observe_steps(self, state: RunState) -> None:
        hist = self.step_hists.get(state.run_id)
        if hist is None:
            hist = self.step_hists[state.run_id] = _StepHist(attempt=state.attempt)
            _cap(self.step_hists, self._max_runs)
        if state.attempt != hist.attempt:
            hist.attempt, hist.last_step = state.attempt, -1  # a restart numbers steps anew
        if state.last_evaluated <= hist.last_step:
            return
        points = _step_time_points(state)
        if points is None:
            hist.last_step = state.last_evaluated
            return
        fresh = []
        prev = math.inf
        for step, value in reversed(points):
            # Newest first; stop at what was seen, or where an older attempt's steps begin.
            if step <= hist.last_step or step >= prev:
                break
            prev = step
            fresh.append(value)
        for value in reversed(fresh):
            if math.isfinite(value) and value >= 0:
                hist.observe(value)
        hist.last_step = state.last_evaluated

    def forget(self, keep: Iterable[str]) -> None:
        """Drop per-run data of runs this worker no longer owns."""
        keep = set(keep)
        for d in (self.step_hists, self.timelines):
            for run_id in [r for r in d if r not in keep]:
                del d[run_id]


def _cap(d: dict[str, Any], n: int) -> None:
    """Bound a per-run dict: the runs seen longest ago go first (insertion order)."""
    while len(d) > n:
        del d[next(iter(d))]


def _step_time_points(state: RunState) -> deque[tuple[int, float]] | None:
    for key in ("timing_s/step", "timing/step", "perf/time_per_step"):
        points = state.recent.get(key)
        if points:
            return points
    return None


# ------------------------------------------------------------------------------ run views

def role_values(state: RunState) -> dict[str, float]:
    """The latest value per engine role (canonical units), as the engine aggregates them:
    KL is the max over KL keys, others the first key seen with that role."""
    out: dict[str, float] = {}
    for key, points in state.recent.items():
        if not points:
            continue
        info = signal_info(key)
        if not info.role:
            continue
        value = points[-1][1] * info.scale
        if info.role == "kl":
            if math.isfinite(value):
                out["kl"] = max(out.get("kl", -math.inf), value)
        elif info.role not in out:
            out[info.role] = value
    return out


def run_status(state: RunState) -> tuple[str, str | None, str | None]:
    """(colour, leading diagnosis, its severity): red = a critical alert firing or a
    critical streak, amber = any other alert firing, green = none."""
    order = {"critical": 2, "warning": 1, "info": 0}
    active = sorted(state.alerts.values(), key=lambda a: (-order.get(a.severity, 0), a.since_step))
    if active:
        lead = active[0]
        colour = "red" if lead.severity == "critical" or state.critical_streak else "amber"
        return colour, lead.label, lead.severity
    if state.critical_streak:
        lead_label = state.streak_lead[0] if state.streak_lead else None
        if lead_label is None and state.last_diagnoses:
            lead_label = state.last_diagnoses[0]
        return "red", lead_label, "critical"
    return "green", None, None


def run_signals(state: RunState, *, keys: Iterable[str] | None = None, limit: int = 12,
                alert_steps: Iterable[tuple[int, str]] = ()) -> list[dict[str, Any]]:
    """Chart data of a run's signals: points, the healthy band now, anomalous points.

    Without ``keys``: the evidence of the firing alerts first, then one key per
    :data:`KEY_ROLES` role, up to ``limit``. A point is anomalous when it is not finite,
    when an alert at its step named the key as evidence (``alert_steps``: (step, key)),
    or when it left the band of the values before it (:func:`_rolling_anomalies`).
    """
    flagged: dict[str, set[int]] = {}
    for step, key in alert_steps:
        flagged.setdefault(key, set()).add(step)
    if keys is None:
        chosen: list[str] = []
        for st in state.alerts.values():
            for key in _alert_evidence_keys(state, st.label):
                if key in state.recent and key not in chosen:
                    chosen.append(key)
        by_role: dict[str, str] = {}
        for key in state.recent:
            role = signal_info(key).role
            if role is not None and role in KEY_ROLES and role not in by_role:
                by_role[role] = key
        for role in KEY_ROLES:
            pick = by_role.get(role)
            if pick and pick not in chosen:
                chosen.append(pick)
        keys = chosen[:limit]
    out: list[dict[str, Any]] = []
    for key in keys:
        points = state.recent.get(key)
        if points is None:
            continue
        monitor = state.monitors.get(key)
        base = monitor.baseline() if monitor is not None else None
        band = None
        if base is not None:
            band = {"mean": _num(base[0]), "lower": _num(base[1]), "upper": _num(base[2])}
        pts = [[step, value if math.isfinite(value) else None] for step, value in points]
        marked = _rolling_anomalies(points, monitor.policy if monitor is not None else None)
        marked |= flagged.get(key, set()) & {step for step, _v in points}
        anomalies = sorted(marked)
        out.append({"key": key, "role": signal_info(key).role, "points": pts, "band": band,
                    "anomalies": anomalies,
                    "watch": bool(monitor.policy.watch) if monitor is not None else False})
    return out


def _rolling_anomalies(points: Iterable[tuple[int, float]], policy: Any) -> set[int]:
    """Steps whose value left mean ± k·std of the values before it (the policy's window,
    direction and least effects; DOMAIN's baseline), judged as of that step, so a slow
    healthy drift is not painted red against today's band. Non-finite values always count."""
    out: set[int] = set()
    seen: deque[float] = deque(maxlen=policy.window if policy is not None else 50)
    warm = min(policy.effective_warmup(), 20) if policy is not None else 10
    for step, value in points:
        if not math.isfinite(value):
            out.add(step)
            continue
        if policy is not None and policy.watch and len(seen) >= max(warm, 3):
            n = len(seen)
            mean = sum(seen) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in seen) / (n - 1))
            lower, upper = mean - policy.k * std, mean + policy.k * std
            if policy.nonnegative:
                lower = max(0.0, lower)
            effect = abs(value - mean)
            big = effect > policy.min_abs_effect and effect > policy.min_rel_effect * abs(mean)
            up = value > upper and policy.direction in ("up", "both")
            down = value < lower and policy.direction in ("down", "both")
            if big and (up or down):
                out.add(step)
        seen.append(value)
    return out


def _alert_evidence_keys(state: RunState, label: str) -> list[str]:
    # The engine's alert state keeps no evidence; the recorder's timeline has it, but the
    # view must work without a recorder too, so fall back to the roles the rules use.
    fallback = {"nan_loss": ("actor/grad_norm", "actor/pg_loss"),
                "kl_drift": ("actor/kl_loss", "actor/ppo_kl"),
                "memory_leak": ("gpu/memory_used_gb", "actor/perf/max_memory_allocated_gb"),
                "dataloader_stall": ("timing_s/gen", "gpu/utilization_pct"),
                "comm_degradation": ("timing_s/update_weights",),
                "numeric_underflow": ("response/aborted_ratio", "response_length/mean"),
                "gradient_instability": ("actor/grad_norm",), "lr_drift": ("actor/lr",),
                "entropy_collapse": ("actor/entropy", "critic/score/mean"),
                "stalled_learning": ("actor/grad_norm", "response_length/clip_ratio"),
                "straggler": ("timing_s/rank_step",), "training_hang": ("timing_s/step",)}
    return list(fallback.get(label, ()))


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


# ------------------------------------------------------------------------------ collectors

def _families() -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class RunCollector:
    """Per-run metrics read from ``svc.cache`` (the runs this worker owns) at scrape time."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families vary with the runs present

    def collect(self) -> Iterator[Any]:
        Counter, Gauge, Histogram = _families()
        recorder: Recorder | None = self.svc.extra.get("recorder")
        runs = dict(self.svc.cache)
        lab = ["run_id"]
        steps = Counter("verl_training_steps", "Training steps evaluated", labels=lab)
        success = Gauge("verl_rollout_success_rate",
                        "Share of responses neither empty nor aborted (1 - empty ratio)",
                        labels=lab)
        gauges = {name: Gauge(name, help_, labels=lab)
                  for name, (_role, _f, help_) in RUN_GAUGES.items()}
        hist = Histogram("verl_training_step_duration_seconds",
                         "Step time (timing_s/step) of evaluated steps, since this worker "
                         "took the run", labels=lab)
        status = Gauge("trainsentry_run_status", "Run status: 0 green, 1 amber, 2 red",
                       labels=lab)
        last = Gauge("trainsentry_run_last_step", "Last evaluated step", labels=lab)
        streak = Gauge("trainsentry_run_critical_streak", "Consecutive critical steps",
                       labels=lab)
        finished = Gauge("trainsentry_run_finished", "1 once run_finished was seen", labels=lab)
        late = Counter("trainsentry_run_late_events", "Events that arrived after their step "
                       "was evaluated", labels=lab)
        active = Gauge("trainsentry_run_active_alerts", "Firing alerts of a run",
                       labels=["run_id", "diagnosis", "severity"])
        exp_lr = Gauge("trainsentry_run_expected_learning_rate",
                       "The configured lr schedule at the last step", labels=lab)
        gn_std = Gauge("trainsentry_run_grad_norm_recent_stddev",
                       "Std of actor/grad_norm over the last 3 steps", labels=lab)
        gn_mean = Gauge("trainsentry_run_grad_norm_mean",
                        "Historical mean of actor/grad_norm (the detector's baseline)",
                        labels=lab)
        colour_num = {"green": 0, "amber": 1, "red": 2}
        for run_id, state in sorted(runs.items()):
            lv = [run_id]
            steps.add_metric(lv, state.steps_evaluated)
            late.add_metric(lv, state.late_events)
            last.add_metric(lv, state.last_evaluated)
            streak.add_metric(lv, state.critical_streak)
            finished.add_metric(lv, 1 if state.finished else 0)
            colour, _diag, _sev = run_status(state)
            status.add_metric(lv, colour_num[colour])
            for st in state.alerts.values():
                active.add_metric([run_id, st.label, st.severity], 1)
            roles = role_values(state)
            for name, (role, factor, _h) in RUN_GAUGES.items():
                if role in roles:
                    gauges[name].add_metric(lv, roles[role] * factor)
            if "empty_ratio" in roles and math.isfinite(roles["empty_ratio"]):
                success.add_metric(lv, max(0.0, 1.0 - roles["empty_ratio"]))
            if state.last_evaluated >= 0 and state.config:
                lr = expected_lr(state.config, state.last_evaluated)
                if lr is not None:
                    exp_lr.add_metric(lv, lr)
            gn = state.recent.get("actor/grad_norm")
            if gn and len(gn) >= 3:
                xs = [v for _s, v in list(gn)[-3:]]
                if all(math.isfinite(x) for x in xs):
                    m = sum(xs) / 3
                    gn_std.add_metric(lv, math.sqrt(sum((x - m) ** 2 for x in xs) / 2))
            mon = state.monitors.get("actor/grad_norm")
            base = mon.baseline() if mon is not None else None
            if base is not None:
                gn_mean.add_metric(lv, base[0])
            h = recorder.step_hists.get(run_id) if recorder is not None else None
            if h is not None:
                cum, buckets = 0, []
                for bound, count in zip((*STEP_BUCKETS, math.inf), h.counts, strict=True):
                    cum += count
                    buckets.append((_le(bound), cum))
                hist.add_metric(lv, buckets, sum_value=h.total)
        yield from (steps, success, *gauges.values(), hist, status, last, streak, finished, late,
                    active, exp_lr, gn_std, gn_mean)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class ServiceCollector:
    """The service's own health: consumption, lag, dead letters, alerts, notifications,
    commands, detector state size."""

    def __init__(self, svc: Any, *, app: Any = None, state_size_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.svc = svc
        self.app = app
        self._ttl = state_size_ttl_s
        self._clock = clock
        self._size_cache: tuple[float, int] = (-math.inf, 0)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        t0 = time.perf_counter()
        Counter, Gauge, _H = _families()
        svc = self.svc
        recorder: Recorder | None = svc.extra.get("recorder")
        yield Gauge("trainsentry_up", "1 while the worker's process serves HTTP", value=1)
        yield Gauge("trainsentry_ready", "1 once partitions are assigned and their state "
                    "restored (/readyz)", value=1 if svc.serving else 0)
        yield Gauge("trainsentry_recovering", "1 while partitions move or their tables are "
                    "being restored", value=1 if svc.recovering() else 0)
        yield Gauge("trainsentry_start_time_seconds", "Worker start (unix time)",
                    value=svc.started)
        consumed = Counter("trainsentry_events_consumed", "Records consumed by the detect agent",
                           labels=["topic"])
        for topic, n in sorted(svc.consumed.items()):
            consumed.add_metric([topic], n)
        yield consumed
        yield self._lag()
        yield Counter("trainsentry_deadletters", "Records sent to the dead-letter topic",
                      value=svc.deadletters)
        yield Counter("trainsentry_engine_errors", "Records the engine failed on (also "
                      "dead-lettered)", value=int(svc.extra.get("engine_errors", 0)))
        alerts = Counter("trainsentry_alerts", "Alert events published",
                         labels=["diagnosis", "severity", "status"])
        issued = Counter("trainsentry_commands_issued", "Signed control commands published",
                         labels=["action"])
        applied = Counter("trainsentry_commands_applied", "command_applied / command_rejected "
                          "events from trainers", labels=["action", "result"])
        unpublished = 0
        if recorder is not None:
            for (diag, sev, status), n in sorted(recorder.alerts.items()):
                alerts.add_metric([diag, sev, status], n)
            for action, n in sorted(recorder.commands_issued.items()):
                issued.add_metric([action], n)
            for (action, result), n in sorted(recorder.commands_applied.items()):
                applied.add_metric([action, result], n)
            unpublished = recorder.commands_unpublished
        yield from (alerts, issued, applied)
        yield Counter("trainsentry_commands_unpublished", "Breaker trips with no control "
                      "secret set (no command sent)", value=unpublished)
        yield Counter("trainsentry_alerts_delivered", "Alerts every receiver acknowledged",
                      value=int(svc.extra.get("delivered", 0)))
        yield Counter("trainsentry_alert_duplicates_skipped", "Alerts skipped as already "
                      "delivered", value=int(svc.extra.get("duplicates_skipped", 0)))
        ctx_stats = getattr(svc.extra.get("alerting"), "stats", None) or {}
        seeks = Counter("trainsentry_offset_seeks", "Seeks back to records the stream skipped "
                        "after a rebalance (stream_app/offsets.py OffsetGuard)", labels=["agent"])
        seeks.add_metric(["detect"], int(svc.extra.get("offset_seeks", 0)))
        seeks.add_metric(["notify"], int(ctx_stats.get("offset_seeks", 0)))
        yield seeks
        yield Counter("trainsentry_notify_resumed_notices", "Notices staged before a restart "
                      "and sent after it", value=int(ctx_stats.get("resumed_notices", 0)))
        yield from self._notifier()
        runs = dict(svc.cache)
        yield Gauge("trainsentry_runs", "Runs held by this worker", value=len(runs))
        yield Gauge("trainsentry_runs_active", "Runs held by this worker not finished",
                    value=sum(1 for s in runs.values() if not s.finished))
        yield Counter("trainsentry_runs_retired", "Run states dropped: finished longer than "
                      "TRAINSENTRY_FINISHED_RUN_RETENTION_S, or silent longer than "
                      "TRAINSENTRY_IDLE_RUN_RETENTION_S", value=int(svc.extra.get("runs_retired", 0)))
        yield Counter("trainsentry_alert_books_retired", "Alert books dropped: nothing open "
                      "or waiting for delivery and unchanged for "
                      "TRAINSENTRY_ALERT_BOOK_RETENTION_S",
                      value=int(svc.extra.get("alert_books_retired", 0)))
        yield Gauge("trainsentry_detector_monitors", "Signal monitors over all runs",
                    value=sum(len(s.monitors) for s in runs.values()))
        yield Gauge("trainsentry_detector_state_bytes", "Pickled size of all RunStates of "
                    "this worker (refreshed at most every 30 s)", value=self._state_bytes(runs))
        yield Gauge("trainsentry_scrape_duration_seconds", "Time to collect service metrics",
                    value=time.perf_counter() - t0)

    def _state_bytes(self, runs: dict[str, RunState]) -> int:
        at, size = self._size_cache
        now = self._clock()
        if now - at < self._ttl:
            return size
        size = sum(len(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)) for s in runs.values())
        self._size_cache = (now, size)
        return size

    def _lag(self) -> Any:
        _C, Gauge, _H = _families()
        g = Gauge("trainsentry_consumer_lag", "Records behind the log end (highwater - "
                  "committed offset) per source partition", labels=["topic", "partition"])
        for (topic, partition), lag in sorted(consumer_lag(self.app).items()):
            g.add_metric([topic, str(partition)], lag)
        return g

    def _notifier(self) -> Iterator[Any]:
        Counter, Gauge, _H = _families()
        health: dict[str, dict[str, Any]] = self.svc.extra.get("notifier_health") or {}
        lab = ["receiver"]
        sent = Counter("trainsentry_notifications_sent", "Chat messages sent", labels=lab)
        failed = Counter("trainsentry_notifications_failed", "Chat messages failed for good",
                         labels=lab)
        retries = Counter("trainsentry_notification_retries", "Chat send retries", labels=lab)
        throttled = Counter("trainsentry_notifications_throttled", "Sends delayed by the rate "
                            "limit", labels=lab)
        queue = Gauge("trainsentry_notifier_queue", "Alerts queued per receiver", labels=lab)
        state = Gauge("trainsentry_notifier_state", "Receiver state (1 for the current one)",
                      labels=["receiver", "state"])
        cfg = Gauge("trainsentry_notifier_config_error", "1 when the receiver's webhook "
                    "configuration is rejected (bad token/key/secret)", labels=lab)
        for name, h in sorted(health.items()):
            if not isinstance(h, dict):
                continue
            lv = [name]
            sent.add_metric(lv, float(h.get("sent", 0) or 0))
            failed.add_metric(lv, float(h.get("failed", 0) or 0))
            retries.add_metric(lv, float(h.get("retries", 0) or 0))
            throttled.add_metric(lv, float(h.get("throttled", 0) or 0))
            queue.add_metric(lv, float(h.get("queued", 0) or 0))
            st = str(h.get("state", "ok"))
            state.add_metric([name, st], 1)
            is_cfg = st == "config_error" or bool(h.get("config_error"))
            cfg.add_metric(lv, 1 if is_cfg else 0)
        yield from (sent, failed, retries, throttled, queue, state, cfg)


def consumer_lag(app: Any) -> dict[tuple[str, int], int]:
    """Per assigned source partition: highwater minus the committed offset (or the next
    offset to read, when nothing is committed yet). Changelog partitions are left out."""
    out: dict[tuple[str, int], int] = {}
    consumer = getattr(app, "_consumer", None) if app is not None else None
    if consumer is None:
        return out
    try:
        assignment = set(consumer.assignment())
    except Exception:  # not started / mid-rebalance: no lag to report
        return out
    monitor = getattr(app, "monitor", None)
    read = dict(getattr(monitor, "tp_read_offsets", None) or {})
    end = dict(getattr(monitor, "tp_end_offsets", None) or {})
    committed = getattr(consumer, "_committed_offset", {})
    for tp in assignment:
        if tp.topic.endswith("-changelog") or tp.topic.startswith("__"):
            continue
        hw: int | None
        try:
            hw = consumer.highwater(tp)
        except Exception:
            hw = None
        if hw is None:
            hw = end.get(tp)
        if hw is None:
            continue
        position = committed.get(tp) if hasattr(committed, "get") else None
        if position is None:
            r = read.get(tp)
            position = r + 1 if r is not None else None
        if position is None:
            continue
        out[(tp.topic, tp.partition)] = max(0, int(hw) - int(position))
    return out


# ------------------------------------------------------------------------------ registry

def build_registry(svc: Any, *, app: Any = None) -> Any:
    """A fresh registry with the run and service collectors (one per app)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(svc))
    registry.register(ServiceCollector(svc, app=app))
    return registry


def render(registry: Any) -> tuple[bytes, str]:
    """The text exposition of ``registry`` and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST
