"""The detection and diagnosis engine: one engine for the stream app and ``trainsentry detect``.

Per run it keeps a :class:`RunState` (pickle-able; the stream app stores it in a
changelog-backed Faust table keyed by run_id). Events go in one at a time; out come
:class:`~trainsentry.events.AlertEvent` and unsigned
:class:`~trainsentry.events.ControlCommand` objects. Nothing here does I/O or reads a
clock: time comes from the events (``ts``) or from the caller's tick, so the same input
gives the same output online and offline.

The step join: a run's three layers (and every rank's resource events) for a step
arrive separately and in any order across topics. A step is evaluated as soon as every
*part* (layer, rank) seen on the previous evaluated step has arrived, or when the
watermark — the lowest latest-step over the run's live parts — has passed it.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from detectors.catalog import Catalog
from detectors.knowledge import FIX_BEFORE_RESTART, for_run
from detectors.monitor import Finding, SignalMonitor, _round
from detectors.rules import Diagnosis, StepContext, diagnose
from producers.layers import signal_info
from trainsentry.events import AlertEvent, ControlCommand, MetricEvent, RunEvent

__all__ = ["EngineConfig", "Engine", "RunState", "Output", "REMEDIATION_DEFAULTS"]

Output = AlertEvent | ControlCommand
Part = tuple[str, int]  # (layer, rank or -1 for driver-level events)

#: Diagnosis → action when the circuit breaker trips (issue: remediation policy).
REMEDIATION_DEFAULTS: dict[str, str] = {
    "nan_loss": "rollback",
    "kl_drift": "rollback",
    "entropy_collapse": "rollback",
    "memory_leak": "checkpoint_then_stop",
    "numeric_underflow": "rollback",
    "stalled_learning": "stop",
    "training_hang": "alert",
    "dataloader_stall": "alert",
    "comm_degradation": "alert",
    "straggler": "alert",
    "lr_drift": "alert",
    "gradient_instability": "alert",
    "unknown": "stop",
}

_MEAN_AGG = ("utilization", "cpu_load")


@dataclass(frozen=True)
class EngineConfig:
    """Tunables of the engine (docs/configuration.md)."""

    breaker_threshold: int = 3  #: consecutive critical steps before a command
    resolve_after_steps: int = 3  #: clear steps before a firing alert resolves
    repeat_every_steps: int = 50  #: re-send a still-firing alert every N steps
    watermark_lag_steps: int = 2  #: while the join is new, wait until every part is this far ahead
    join_warm_steps: int = 3  #: steps evaluated before the join trusts the parts it has seen
    stale_part_steps: int = 8  #: a part this far behind the newest step...
    stale_part_s: float = 30.0  #: ...and silent this long (arrival clock) no longer holds the join
    join_grace_s: float = 0.3  #: stream only: a step waits this long after its first record
    max_signals: int = 400  #: bound on monitored keys per run
    chart_points: int = 60  #: recent values per signal kept for alert charts
    hang_factor: float = 5.0  #: hang when no step for factor x p95 step interval...
    hang_floor_s: float = 60.0  #: ...but never sooner than this
    hang_min_steps: int = 5
    finished_retention_s: float = 86400.0  #: stream only: keep a finished run's state this long
    idle_retention_s: float = 7 * 86400.0  #: ...and an unfinished run's, after its last event
    remediation: tuple[tuple[str, str], ...] = tuple(REMEDIATION_DEFAULTS.items())
    catalog: Catalog = field(default_factory=Catalog)

    def action_for(self, label: str) -> str:
        return dict(self.remediation).get(label, "stop")


@dataclass
class _Pending:
    ts: float
    parts: dict[Part, dict[str, float]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    first_arrival: float | None = None  # wall clock of the step's first record (stream only)


@dataclass
class _AlertState:
    label: str
    fingerprint: str
    since_step: int
    last_sent_step: int
    clear_steps: int = 0
    repeats: int = 0
    severity: str = "warning"
    last_alert_id: str = ""
    #: Evidence and confidence of the latest alert sent (states pickled before these
    #: existed lack them: read with getattr).
    last_evidence: dict[str, Any] = field(default_factory=dict)
    last_confidence: float = 1.0
    #: The latest alert's own summary, without the label (both languages), for the notices
    #: that speak of this problem later (the breaker's, when it was not diagnosed again).
    last_summary: tuple[str, str | None] | None = None


class RunState:
    """Everything the engine remembers about one run; pickled into the Faust table."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.attempt = 0
        self.config: dict[str, Any] = {}
        self.pending: dict[int, _Pending] = {}
        self.part_latest: dict[Part, int] = {}
        self.part_arrival: dict[Part, float] = {}
        self.arrival: float | None = None  # wall clock of the latest event (stream only)
        self.last_evaluated = -1
        self.max_step = -1
        self.monitors: dict[str, SignalMonitor] = {}
        self.history: dict[str, deque[float]] = {}
        self.recent: dict[str, deque[tuple[int, float]]] = {}  # key -> (step, value), for charts
        self.streaks: dict[str, int] = {}
        self.alerts: dict[str, _AlertState] = {}
        self.critical_streak = 0
        self.streak_start_step = -1
        self.streak_alert_ids: list[str] = []
        self.streak_lead: tuple[str, str] | None = None
        self.breaker_fired = False
        self.checkpoints: list[tuple[int, float]] = []
        self.critical_steps: deque[int] = deque(maxlen=500)
        self.last_step_ts: float | None = None
        self.last_seen_ts: float | None = None
        self.last_beat_ts: float | None = None
        self.intervals: deque[float] = deque(maxlen=100)
        self.hang_fired = False
        self.clock_offset = 0.0  # event time minus wall time at the latest arrival
        self.last_step_arrival: float | None = None  # wall clock when the last step was evaluated
        self.last_beat_arrival: float | None = None  # wall clock of the latest proof of life
        self.finished = False
        self.finish_at: tuple[float, float | None] | None = None  # run_finished (ts, arrival)
        self.late_events = 0
        self.steps_evaluated = 0
        self.last_diagnoses: list[str] = []
        #: Commands this run's breaker issued (id -> what the notices need), newest 20, so
        #: the trainer's answer to each is told once (older pickles lack it: getattr).
        self.issued: dict[str, dict[str, Any]] = {}
        #: ``run_finished`` of a run that failed (exit code, error), until the run closes.
        self.exit: dict[str, Any] | None = None


def _exit_of(ev: RunEvent) -> dict[str, Any] | None:
    """``{"exit_code", "error"}`` of a ``run_finished`` that reports a failure, else None."""
    code, error = ev.fields.get("exit_code"), ev.fields.get("error")
    code = code if isinstance(code, int) and not isinstance(code, bool) else None
    error = " ".join(error.split())[:300] if isinstance(error, str) and error.strip() else None
    if not code and error is None:
        return None
    return {"exit_code": code, "error": error}


def _fingerprint(run_id: str, label: str, rank: int | None = None) -> str:
    raw = f"{run_id}|{label}" + (f"|rank={rank}" if rank is not None else "")
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _alert_id(fp: str, attempt: int, step: int, status: str, n: int) -> str:
    return hashlib.sha1(f"{fp}|{attempt}|{step}|{status}|{n}".encode()).hexdigest()[:24]


class Engine:
    """Stateless logic over a caller-held :class:`RunState` (one per run)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()

    # ----------------------------------------------------------------- entry points
    def new_state(self, run_id: str) -> RunState:
        return RunState(run_id)

    def process(self, state: RunState, event: MetricEvent | RunEvent, *,
                arrival: float | None = None) -> list[Output]:
        """Feed one event of ``state``'s run; returns alerts and commands to publish.

        ``arrival`` is the wall-clock time the event arrived (the stream app passes it):
        it maps the wall clock of later :meth:`tick` calls onto the run's event time, so
        a trainer whose clock is off (or a replay) is judged by its own pace.
        """
        state.arrival = arrival
        if arrival is not None and event.ts >= (state.last_seen_ts or -math.inf):
            state.clock_offset = event.ts - arrival
        if isinstance(event, RunEvent):
            return self._on_run_event(state, event)
        return self._on_metric(state, event)

    def poll(self, state: RunState, now: float) -> list[Output]:
        """Evaluate pending steps whose join grace has passed (the stream app's fast timer)."""
        if not state.pending:
            return []
        state.arrival = now
        return self._evaluate_ready(state)

    def tick(self, state: RunState, now: float) -> list[Output]:
        """Periodic check with the wall clock (the stream app's timer): hang detection."""
        if state.last_step_arrival is None:
            return self._check_hang(state, now + state.clock_offset, source="timer")
        return self._check_hang(state, now, source="timer", wall=True)

    def retire(self, state: RunState, now: float) -> list[Output] | None:
        """Stream only: whether the run's state can be dropped at wall clock ``now``.

        ``None`` while it is still needed. A finished run is kept ``finished_retention_s``
        after its last event (its alerts resolved when it finished), an unfinished one
        ``idle_retention_s`` (a trainer killed without ``run_finished``: its hang was
        reported long before). Otherwise the list of outputs to send before the state goes:
        the alerts still firing, resolved, so no chat thread stays open on a run nobody
        watches any more. A run that sends again later starts from a fresh state.
        """
        if state.arrival is None:  # offline: nothing is ever retired
            return None
        idle = now - state.arrival
        if state.finished:
            return [] if idle >= self.config.finished_retention_s else None
        if idle < self.config.idle_retention_s:
            return None
        return self._resolve_all(state, now + state.clock_offset,
                                 reason=f"no event for {idle / 86400:.1f} days; the watchdog "
                                        "stopped watching this run")

    def adopt(self, state: RunState, now: float) -> None:
        """A stored state taken over after a restart or a rebalance, before any new record
        of its run: the hang clock restarts at ``now``. The silence of a run that stopped
        while no worker watched it is then measured from the takeover (a backlog of its
        records may still be on the way, which must not read as a hang), and a run that
        never steps again is still reported, one hang limit after the takeover."""
        if state.last_step_arrival is not None:
            state.last_step_arrival = max(state.last_step_arrival, now)
        if state.last_beat_arrival is not None:
            state.last_beat_arrival = max(state.last_beat_arrival, now)

    def flush(self, state: RunState) -> list[Output]:
        """Evaluate every pending step (end of an offline file)."""
        out: list[Output] = []
        for step in sorted(state.pending):
            out += self._evaluate(state, step)
        return out

    # ----------------------------------------------------------------- run events
    def _on_run_event(self, state: RunState, ev: RunEvent) -> list[Output]:
        out: list[Output] = []
        self._new_attempt(state, ev.attempt)
        if ev.type == "run_started":
            cfg = ev.fields.get("config")
            if isinstance(cfg, dict):
                state.config = dict(cfg)
            state.finished = False
        elif ev.type == "checkpoint_saved" and ev.step is not None:
            if (ev.step, ev.ts) not in state.checkpoints:  # read twice after a seek
                state.checkpoints.append((ev.step, ev.ts))
            del state.checkpoints[:-50]
        elif ev.type == "heartbeat":
            state.last_beat_ts = max(state.last_beat_ts or ev.ts, ev.ts)
            state.last_beat_arrival = state.arrival
            if state.arrival is None:  # offline: event time is the only clock
                out += self._check_hang(state, ev.ts, source="heartbeat")
        elif ev.type in ("command_applied", "command_rejected"):
            out += self._command_outcome(state, ev)
        elif ev.type == "run_finished":
            # Offline the file is in order: finish now. In the stream the run's last steps
            # may still be in flight on other topics: finish once they are joined.
            state.finish_at = (ev.ts, state.arrival)
            state.exit = _exit_of(ev)
            out += self._maybe_finish(state)
        state.last_seen_ts = max(state.last_seen_ts or ev.ts, ev.ts)
        return out

    def _new_attempt(self, state: RunState, attempt: int) -> None:
        if attempt > state.attempt:
            # A restart/rollback: the join and streaks start over; baselines are kept.
            state.attempt = attempt
            state.pending.clear()
            state.part_latest.clear()
            state.part_arrival.clear()
            state.last_evaluated = -1
            state.max_step = -1
            state.critical_streak = 0
            state.breaker_fired = False
            state.hang_fired = False
            state.streaks.clear()
            state.last_step_ts = None

    # ----------------------------------------------------------------- the join
    def _on_metric(self, state: RunState, ev: MetricEvent) -> list[Output]:
        if ev.attempt < state.attempt:
            state.late_events += 1
            return []
        self._new_attempt(state, ev.attempt)
        out: list[Output] = []
        if ev.layer == "resource" and ev.step <= state.last_evaluated:
            # A resource sample of a step already evaluated: still proof of life.
            state.last_beat_ts = max(state.last_beat_ts or ev.ts, ev.ts)
            state.last_beat_arrival = state.arrival
            if state.arrival is None:
                out += self._check_hang(state, ev.ts, source="resource")
            return out
        if ev.step <= state.last_evaluated:
            state.late_events += 1
            return out
        part: Part = (ev.layer, ev.rank if ev.rank is not None else -1)
        pending = state.pending.get(ev.step)
        if pending is None:
            pending = state.pending[ev.step] = _Pending(ts=ev.ts, first_arrival=state.arrival)
        pending.ts = min(pending.ts, ev.ts)
        pending.parts.setdefault(part, {}).update(ev.metrics)
        if ev.host is not None and ev.rank is not None:
            pending.hosts[ev.rank] = ev.host
        state.part_latest[part] = max(state.part_latest.get(part, -1), ev.step)
        if state.arrival is not None:
            state.part_arrival[part] = state.arrival
        state.max_step = max(state.max_step, ev.step)
        state.last_seen_ts = max(state.last_seen_ts or ev.ts, ev.ts)
        if ev.layer == "resource":
            state.last_beat_ts = max(state.last_beat_ts or ev.ts, ev.ts)
        out += self._evaluate_ready(state)
        return out

    def _evaluate_ready(self, state: RunState) -> list[Output]:
        out: list[Output] = []
        for step in sorted(state.pending):
            if not self._ready(state, step):
                break
            out += self._evaluate(state, step)
        if state.finish_at is not None:
            out += self._maybe_finish(state)
        return out

    def _maybe_finish(self, state: RunState) -> list[Output]:
        """Close the run after ``run_finished`` once its pending steps are joined (or
        ``stale_part_s`` after it arrived, whatever is still missing)."""
        assert state.finish_at is not None
        ts, arrived = state.finish_at
        waited = (state.arrival or 0.0) - arrived if arrived is not None else math.inf
        if state.pending and arrived is not None and waited < self.config.stale_part_s:
            live_ahead = any(latest >= max(state.pending) for latest in state.part_latest.values())
            if not live_ahead or waited < self.config.join_grace_s:
                return []
        out = self.flush(state)
        state.finished = True
        state.finish_at = None
        failed = getattr(state, "exit", None)  # states pickled before it lack it
        state.exit = None
        return out + self._resolve_all(state, ts, reason="run finished", failed=failed)

    def _ready(self, state: RunState, step: int) -> bool:
        """Every live part has reached ``step`` (each part's records arrive in order, so
        nothing more of this step can come from it). While the join is new, every part
        must be ``watermark_lag_steps`` ahead, so parts whose topic is consumed later
        (a backlog across topics) are seen before the first evaluation. A part that
        has fallen ``stale_part_steps`` behind *and* (in the stream) has not arrived for
        ``stale_part_s`` seconds — a dead sampler — stops holding the join."""
        cfg = self.config
        now = state.arrival
        progress = None
        for part, latest in state.part_latest.items():
            if state.max_step - latest > cfg.stale_part_steps:
                seen = state.part_arrival.get(part)
                if now is None or seen is None or now - seen > cfg.stale_part_s:
                    continue
            progress = latest if progress is None else min(progress, latest)
        if progress is None:
            return False
        lag = 0 if state.steps_evaluated >= cfg.join_warm_steps else cfg.watermark_lag_steps
        if progress - step < lag:
            return False
        # In the stream, the layers of one step leave the trainer within milliseconds but
        # can reach us in any order across topics (producer batching, fetch order), and a
        # part never seen before cannot be waited for by name: a short grace covers it.
        first = state.pending[step].first_arrival
        return now is None or first is None or now - first >= cfg.join_grace_s

    # ----------------------------------------------------------------- evaluation
    def _evaluate(self, state: RunState, step: int) -> list[Output]:
        pending = state.pending.pop(step)
        for older in [s for s in state.pending if s < step]:
            state.pending.pop(older)  # cannot happen in order; keep the table bounded anyway
        state.last_evaluated = step
        state.steps_evaluated += 1
        if state.last_step_ts is not None and pending.ts > state.last_step_ts:
            state.intervals.append(pending.ts - state.last_step_ts)
        state.last_step_ts = pending.ts if state.last_step_ts is None else max(state.last_step_ts, pending.ts)
        state.last_step_arrival = state.arrival
        state.hang_fired = False

        values, ranks = self._aggregate(pending)
        roles: dict[str, float] = {}
        findings: dict[str, Finding] = {}
        role_findings: dict[str, Finding] = {}
        baselines: dict[str, tuple[float, float, float]] = {}
        nonfinite: list[str] = []
        role_sums: dict[str, float] = {}
        for key, value in values.items():
            info = signal_info(key)
            recent = state.recent.get(key)
            if recent is None and len(state.recent) < self.config.max_signals:
                recent = state.recent[key] = deque(maxlen=self.config.chart_points)
            if recent is not None:
                recent.append((step, value))
            if not math.isfinite(value):
                nonfinite.append(key)
                continue
            if info.role:
                scaled = value * info.scale
                if info.role == "forward_time":
                    role_sums["forward_time"] = role_sums.get("forward_time", 0.0) + scaled
                elif info.role == "kl":
                    roles["kl"] = max(roles.get("kl", -math.inf), scaled)
                else:
                    roles.setdefault(info.role, scaled)
            monitor = state.monitors.get(key)
            if monitor is None:
                if len(state.monitors) >= self.config.max_signals:
                    continue
                monitor = state.monitors[key] = SignalMonitor(key, self.config.catalog.policy(key))
            finding = monitor.observe(value)
            if info.role and info.role not in baselines:
                base = monitor.baseline()
                if base is not None:
                    baselines[info.role] = base
            if finding is not None and monitor.policy.watch:
                findings[key] = finding
            if finding is not None and info.role and info.role not in role_findings:
                role_findings[info.role] = finding
        roles.update(role_sums)
        if "forward_time" in role_sums:
            self._role_monitor(state, "forward_time", role_sums["forward_time"], role_findings,
                               baselines)
        for role, value in roles.items():
            state.history.setdefault(role, deque(maxlen=30)).append(value)

        ctx = StepContext(run_id=state.run_id, step=step, ts=pending.ts, values=values,
                          roles=roles, findings=findings, role_findings=role_findings,
                          baselines=baselines, history=state.history, ranks=ranks,
                          hosts=pending.hosts, config=state.config, streaks=state.streaks,
                          nonfinite=nonfinite)
        diagnoses = diagnose(ctx)
        return self._lifecycle(state, step, pending.ts, diagnoses)

    def _role_monitor(self, state: RunState, role: str, value: float,
                      role_findings: dict[str, Finding], baselines: dict[str, tuple[float, float, float]]) -> None:
        """A monitor over a derived role value (e.g. total forward time)."""
        key = f"role:{role}"
        monitor = state.monitors.get(key)
        if monitor is None:
            from detectors.catalog import DEFAULT_BY_ROLE

            monitor = state.monitors[key] = SignalMonitor(key, DEFAULT_BY_ROLE[role])
        finding = monitor.observe(value)
        base = monitor.baseline()
        role_findings.pop(role, None)
        if finding is not None:
            role_findings[role] = finding
        if base is not None:
            baselines[role] = base

    @staticmethod
    def _aggregate(pending: _Pending) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
        """Driver-level values as they are; per-rank values reduced over ranks (mean for
        utilisation and load, max otherwise) and kept per rank for peer comparison."""
        values: dict[str, float] = {}
        ranks: dict[int, dict[str, float]] = {}
        per_key: dict[str, list[float]] = {}
        for (_layer, rank), metrics in pending.parts.items():
            if rank < 0:
                values.update(metrics)
                continue
            ranks.setdefault(rank, {}).update(metrics)
            for key, value in metrics.items():
                per_key.setdefault(key, []).append(value)
        for key, xs in per_key.items():
            if key in values:
                continue
            finite = [x for x in xs if math.isfinite(x)]
            if not finite:
                values[key] = math.nan
            elif any(tag in key for tag in _MEAN_AGG):
                values[key] = sum(finite) / len(finite)
            else:
                values[key] = max(finite)
        return values, ranks

    # ----------------------------------------------------------------- alerts
    def _lifecycle(self, state: RunState, step: int, ts: float,
                   diagnoses: list[Diagnosis]) -> list[Output]:
        out: list[Output] = []
        primary: list[Diagnosis] = []
        secondary_of: dict[str, list[str]] = {}
        for d in diagnoses:
            owner = next((p for p in primary if set(p.evidence) & set(d.evidence)
                          or (d.label == "unknown" and p.label != "unknown")), None)
            if owner is None:
                primary.append(d)
            else:
                secondary_of.setdefault(owner.label, []).append(d.label)
        state.last_diagnoses = [d.label for d in primary]
        holding = set()
        for d in primary:
            fp = _fingerprint(state.run_id, d.label, d.rank if d.label == "straggler" else None)
            holding.add(fp)
            st = state.alerts.get(fp)
            if st is None:
                st = state.alerts[fp] = _AlertState(d.label, fp, step, step, severity=d.severity)
                out.append(self._alert(state, st, d, step, ts, "firing", secondary_of.get(d.label, [])))
            else:
                st.clear_steps = 0
                escalated = d.severity == "critical" and st.severity != "critical"
                if escalated or step - st.last_sent_step >= self.config.repeat_every_steps:
                    st.repeats += 0 if escalated else 1
                    st.severity = d.severity
                    st.last_sent_step = step
                    out.append(self._alert(state, st, d, step, ts, "firing",
                                           secondary_of.get(d.label, [])))
        for fp, st in list(state.alerts.items()):
            if fp in holding:
                continue
            st.clear_steps += 1
            if st.clear_steps >= self.config.resolve_after_steps:
                del state.alerts[fp]
                out.append(self._resolved(state, st, step, ts, f"clear for {st.clear_steps} steps"))
        out += self._breaker(state, step, ts, primary, out)
        return out

    def _alert(self, state: RunState, st: _AlertState, d: Diagnosis, step: int, ts: float,
               status: str, secondary: list[str]) -> AlertEvent:
        know = for_run(d.label, state.config)
        aid = _alert_id(st.fingerprint, state.attempt, step, status, st.repeats)
        st.last_alert_id = aid
        st.last_evidence, st.last_confidence = d.evidence, round(d.confidence, 3)
        st.last_summary = (d.summary, d.summary_zh)
        summary = f"{d.label}: {d.summary}"
        return AlertEvent(
            id=aid, fingerprint=st.fingerprint, run_id=state.run_id, status=status,
            severity=d.severity, diagnosis=d.label, step=step, ts=ts, summary=summary,
            evidence=d.evidence, actions=list(know.actions), attempt=state.attempt,
            confidence=round(d.confidence, 3), secondary=sorted(set(secondary)),
            checks=list(know.checks), host=d.host, rank=d.rank,
            series=self._series(state, d.evidence),
            summary_zh=f"{d.label}：{d.summary_zh}" if d.summary_zh else None,
        )

    @staticmethod
    def _series(state: RunState, evidence: dict[str, Any]) -> dict[str, list[list[float]]]:
        """Recent ``[step, value]`` points of the evidence signals (for the alert's chart)."""
        out: dict[str, list[list[float]]] = {}
        for key in list(evidence)[:4]:
            points = state.recent.get(key)
            if points:
                out[key] = [[s, v if math.isfinite(v) else None] for s, v in points]  # type: ignore[list-item]
        return out

    def _resolved(self, state: RunState, st: _AlertState, step: int, ts: float,
                  reason: str, failed: dict[str, Any] | None = None) -> AlertEvent:
        aid = _alert_id(st.fingerprint, state.attempt, step, "resolved", st.repeats)
        if failed is not None:
            return self._ended_failing(state, st, aid, step, ts, failed)
        return AlertEvent(
            id=aid, fingerprint=st.fingerprint, run_id=state.run_id, status="resolved",
            severity=st.severity, diagnosis=st.label, step=step, ts=ts,
            summary=f"{st.label}: resolved at step {step} ({reason}); firing since step {st.since_step}",
            evidence={}, actions=[], attempt=state.attempt,
        )

    def _ended_failing(self, state: RunState, st: _AlertState, aid: str, step: int, ts: float,
                       failed: dict[str, Any]) -> AlertEvent:
        """The episode closes because the run died with it still firing: not a recovery.
        The notice keeps the problem's evidence and actions (fix it before a restart)."""
        code, error = failed.get("exit_code"), failed.get("error")
        how = f"with exit code {code}" if code is not None else "with an error"
        how_zh = f"退出码 {code}" if code is not None else "报错退出"
        summary = (f"{st.label}: the run exited {how} at step {step} while this alert was firing "
                   f"(since step {st.since_step}): it did not recover"
                   + (f"; error: {error}" if error else ""))
        summary_zh = (f"{st.label}：训练进程在第 {step} 步异常退出（{how_zh}），退出时这个告警仍在"
                      f"触发（自第 {st.since_step} 步起）：问题没有恢复"
                      + (f"；错误：{error}" if error else ""))
        know = for_run(st.label, state.config)
        evidence = dict(getattr(st, "last_evidence", None) or {})
        return AlertEvent(
            id=aid, fingerprint=st.fingerprint, run_id=state.run_id, status="resolved",
            severity=st.severity, diagnosis=st.label, step=step, ts=ts, summary=summary,
            summary_zh=summary_zh, evidence=evidence,
            actions=[FIX_BEFORE_RESTART, *know.actions],
            checks=list(know.checks), attempt=state.attempt, run_exit=dict(failed))

    def _resolve_all(self, state: RunState, ts: float, *, reason: str,
                     failed: dict[str, Any] | None = None) -> list[Output]:
        out: list[Output] = []
        for fp, st in list(state.alerts.items()):
            del state.alerts[fp]
            out.append(self._resolved(state, st, max(state.last_evaluated, 0), ts, reason, failed))
        return out

    # ----------------------------------------------------------------- circuit breaker
    def _breaker(self, state: RunState, step: int, ts: float, primary: list[Diagnosis],
                 emitted: list[Output]) -> list[Output]:
        """Count consecutive steps with a critical alert firing; act at the threshold.

        A critical alert stays firing until it has been clear for ``resolve_after_steps``,
        so a fault that recurs every other step (verl skips NaN updates, then hits the
        next NaN) keeps the streak going, while one that really clears resets it.
        """
        critical = [d for d in primary if d.severity == "critical"]
        if critical:
            lead_d = critical[0]
            state.streak_lead = (lead_d.label, lead_d.critical_reason or lead_d.summary)
        active = [st for st in state.alerts.values() if st.severity == "critical"]
        if not critical and not active:
            state.critical_streak = 0
            state.streak_alert_ids = []
            return []
        if state.critical_streak == 0:
            state.streak_start_step = step
        state.critical_streak += 1
        state.critical_steps.append(step)
        for a in emitted:
            if isinstance(a, AlertEvent) and a.severity == "critical" and a.status == "firing":
                state.streak_alert_ids.append(a.id)
        for st in active:
            if st.last_alert_id and st.last_alert_id not in state.streak_alert_ids:
                state.streak_alert_ids.append(st.last_alert_id)
        if state.critical_streak < self.config.breaker_threshold or state.breaker_fired:
            return []
        label, why = state.streak_lead or (active[0].label, "critical alert firing")
        action = self.config.action_for(label)
        if action == "alert":
            return []
        state.breaker_fired = True
        reason = f"{state.critical_streak} consecutive critical alerts: {label} ({why})"
        to_step = None
        if action == "rollback":
            to_step = self.rollback_target(state)
            if to_step is None:
                action, reason = "stop", reason + "; no healthy checkpoint to roll back to"
        wire_action = "stop" if action == "checkpoint_then_stop" else action
        if action == "checkpoint_then_stop":
            reason += "; save a checkpoint first"
        cid = hashlib.sha1(f"{state.run_id}|{state.attempt}|{step}|{wire_action}".encode()).hexdigest()[:24]
        command = ControlCommand(id=cid, run_id=state.run_id, action=wire_action, reason=reason,
                                 issued_at=ts, alert_ids=list(dict.fromkeys(state.streak_alert_ids)),
                                 to_step=to_step)
        lead = next((d for d in critical if d.label == label), None)
        notice = self._command_notice(state, command, label, lead, step, ts,
                                      checkpoint_first=action == "checkpoint_then_stop")
        # What the trainer answers is told too (_command_outcome), once per command.
        issued = getattr(state, "issued", None)
        if issued is None:  # a state pickled before commands were remembered
            issued = state.issued = {}
        issued[cid] = {"label": label, "fingerprint": notice.fingerprint, "action": wire_action,
                       "to_step": to_step, "evidence": notice.evidence}
        while len(issued) > 20:
            del issued[next(iter(issued))]
        return [command, notice]

    def _command_outcome(self, state: RunState, ev: RunEvent) -> list[Output]:
        """The trainer applied or rejected a command this engine issued: tell the people,
        once. A rejection leaves the run going, so it says what to fix."""
        issued: dict[str, dict[str, Any]] = getattr(state, "issued", None) or {}
        cid = ev.fields.get("command_id")
        info = issued.get(cid) if isinstance(cid, str) else None
        if info is None or info.get("outcome"):
            return []  # not ours (a forgery, a replay of an old one) or already told
        applied = ev.type == "command_applied"
        info["outcome"] = "applied" if applied else "rejected"
        action = str(ev.fields.get("action") or info["action"])
        label = str(info["label"])
        detail = str(ev.fields.get("result" if applied else "reason") or "")[:500]
        if applied:
            summary = f"{label}: the trainer applied command {cid} ({action}): {detail}"
            summary_zh = f"{label}：训练进程已执行命令 {cid}（{action}）：{detail}"
        else:
            summary = (f"{label}: the trainer REJECTED command {cid} ({action}): {detail}; the "
                       "run goes on: check that the trainer and the service share "
                       "TRAINSENTRY_CONTROL_SECRET and that their clocks agree, or act by hand")
            summary_zh = (f"{label}：训练进程拒绝了命令 {cid}（{action}）：{detail}；训练仍在继续："
                          "请确认训练侧与服务使用相同的 TRAINSENTRY_CONTROL_SECRET、两边时钟一致，"
                          "或手动处理")
        know = for_run(label, state.config)
        fp = str(info["fingerprint"])
        step = ev.step if ev.step is not None else max(state.last_evaluated, 0)
        evidence = dict(info.get("evidence") or {})
        command = {"id": cid, "action": action, "to_step": ev.fields.get("to_step",
                                                                         info.get("to_step")),
                   "outcome": info["outcome"], "detail": detail}
        return [AlertEvent(
            id=_alert_id(fp, ev.attempt, step, f"{info['outcome']}:{cid}", 0), fingerprint=fp,
            run_id=state.run_id, status="firing", severity="critical", diagnosis=label,
            step=step, ts=ev.ts, summary=summary, summary_zh=summary_zh, evidence=evidence,
            actions=list(know.actions), attempt=ev.attempt, checks=list(know.checks),
            confidence=1.0, series=self._series(state, evidence), command=command)]

    def _command_notice(self, state: RunState, command: ControlCommand, label: str,
                        lead: Diagnosis | None, step: int, ts: float, *,
                        checkpoint_first: bool) -> AlertEvent:
        """The breaker's order told to the people: an alert of the lead problem (same
        fingerprint, so chat shows it as that problem's latest notice) carrying the command."""
        st = next((s for s in state.alerts.values() if s.label == label), None)
        fp = st.fingerprint if st is not None else _fingerprint(state.run_id, label)
        n = state.critical_streak
        if command.action == "rollback":
            what = (f"roll back to the checkpoint of step {command.to_step}: the trainer stops at "
                    f"the next step boundary, moves newer checkpoints aside, and "
                    f"`trainsentry supervise` restarts it from step {command.to_step}")
            what_zh = (f"回滚到第 {command.to_step} 步的 checkpoint：训练进程在下一个训练步的边界停止，"
                       f"把更新的 checkpoint 移到一旁，由 `trainsentry supervise` 从第 "
                       f"{command.to_step} 步重启")
        elif checkpoint_first:
            what = "save a checkpoint, then stop the run at the next step boundary"
            what_zh = "先保存 checkpoint，然后在下一个训练步的边界停止训练"
        else:
            what = "stop the run at the next step boundary"
            what_zh = "在下一个训练步的边界停止训练"
        fallback = "no healthy checkpoint to roll back to" in command.reason
        # What is wrong first (the message's reader has not seen the earlier alert), then
        # what the breaker does about it.
        said = (lead.summary, lead.summary_zh) if lead is not None else \
            getattr(st, "last_summary", None)  # states pickled before it lack it
        problem = f"{said[0]}; " if said else ""
        problem_zh = f"{said[1] or said[0]}；" if said else ""
        summary = (f"{label}: {problem}circuit breaker after {n} consecutive critical steps, "
                   f"command {command.id}: {what}" + ("; no healthy checkpoint to roll back "
                                                      "to, so it stops instead" if fallback else ""))
        summary_zh = (f"{label}：{problem_zh}连续 {n} 步严重告警，触发熔断，命令 {command.id}：{what_zh}"
                      + ("；没有可回滚的健康 checkpoint，因此改为停止" if fallback else ""))
        know = for_run(label, state.config)
        if lead is not None:
            evidence, confidence = lead.evidence, round(lead.confidence, 3)
        else:  # still firing, not diagnosed again this step: its latest alert's evidence
            evidence = dict(getattr(st, "last_evidence", None) or {})
            confidence = float(getattr(st, "last_confidence", 1.0))
        return AlertEvent(
            id=_alert_id(fp, state.attempt, step, f"command:{command.id}", 0), fingerprint=fp,
            run_id=state.run_id, status="firing", severity="critical", diagnosis=label,
            step=step, ts=ts, summary=summary, summary_zh=summary_zh, evidence=evidence,
            actions=list(know.actions), attempt=state.attempt, confidence=confidence,
            checks=list(know.checks), host=lead.host if lead else None,
            rank=lead.rank if lead else None, series=self._series(state, evidence),
            command={"id": command.id, "action": command.action, "to_step": command.to_step,
                     "checkpoint_first": checkpoint_first})

    def rollback_target(self, state: RunState) -> int | None:
        """Newest checkpoint saved before the streak's first anomaly, at a step with no
        critical alert."""
        bad = set(state.critical_steps)
        for ckpt_step, _ts in sorted(state.checkpoints, reverse=True):
            if ckpt_step < state.streak_start_step and ckpt_step not in bad:
                return ckpt_step
        return None

    # ----------------------------------------------------------------- hangs
    def _check_hang(self, state: RunState, now: float, *, source: str,
                    wall: bool = False) -> list[Output]:
        """Fire training_hang when no step came for far longer than the run's usual interval.

        Offline, ``now`` is event time (a heartbeat's ``ts``). In the stream (``wall``),
        silence is measured on the arrival clock since the last step was evaluated: a
        backlog being consumed, or a trainer whose clock is off, is never a hang, while
        the limit still comes from the run's own step intervals (event time).
        """
        if (state.hang_fired or state.finished or state.last_step_ts is None
                or state.steps_evaluated < self.config.hang_min_steps):
            return []
        ordered = sorted(state.intervals)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0
        limit = max(self.config.hang_floor_s, self.config.hang_factor * p95)
        last_step = state.last_step_arrival if wall else state.last_step_ts
        last_beat = state.last_beat_arrival if wall else state.last_beat_ts
        if last_step is None:
            return []
        silent_for = now - last_step
        if silent_for <= limit:
            return []
        state.hang_fired = True
        beats = last_beat is not None and last_beat > last_step + 1.0
        alive = beats and (now - (last_beat or 0.0)) < limit
        how = ("process alive but stuck (heartbeats/resource samples still arrive): "
               "a hung collective (NCCL) or a deadlock" if alive else
               "everything went silent: the process or host is probably dead")
        how_zh = ("进程还在（心跳和资源采样仍在到达）但卡住了：集合通信（NCCL）挂起或死锁" if alive
                  else "全部静默：进程或主机很可能已经挂掉")
        d = Diagnosis("training_hang", "critical", 0.9 if alive else 0.8,
                      f"no new step for {silent_for:.0f}s after step {state.last_evaluated} "
                      f"(usual p95 step interval {p95:.0f}s, limit {limit:.0f}s); {how}",
                      {"seconds_since_last_step": {"value": _round(silent_for),
                                                   "baseline": _round(p95), "bound": _round(limit),
                                                   "heartbeats": bool(alive)}},
                      critical_reason="no step for far longer than usual",
                      summary_zh=f"第 {state.last_evaluated} 步之后 {silent_for:.0f}s 没有新的步"
                      f"（通常 p95 步间隔 {p95:.0f}s，上限 {limit:.0f}s）；{how_zh}")
        fp = _fingerprint(state.run_id, "training_hang")
        st = state.alerts.get(fp)
        if st is not None:
            return []
        st = state.alerts[fp] = _AlertState("training_hang", fp, state.last_evaluated,
                                            state.last_evaluated, severity="critical")
        return [self._alert(state, st, d, state.last_evaluated, now, "firing", [])]
