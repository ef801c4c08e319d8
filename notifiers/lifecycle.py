"""Alert lifecycle on the notification side: what to send, what to hold back, and why.

The engine says *what is wrong* (firing / repeat / resolved per fingerprint, see
``detectors/engine.py``). This module decides *what people hear about it*, like
Alertmanager does after Prometheus: a warning must hold for a while before it is sent
(``for``), repeats may be throttled and escalate to @-mentions, silences and
acknowledgements mute it, a root cause inhibits the symptoms it explains, and a resolved
notice goes out only when the firing one was delivered. Every transition becomes a
:class:`HistoryRecord` for the history topic.

Everything here is pure (no I/O, no clock reads): the caller passes ``now`` and the
current silences and acks, then delivers :attr:`Plan.notices` and calls
:meth:`AlertBook.settle` with what was delivered. A run's state (:class:`RunBook`) is a
JSON-able dict, so the stream app keeps it in a changelog-backed table keyed by run_id.

>>> book = AlertBook(LifecycleConfig(for_s=0, for_steps=0))
>>> plan = book.observe([_example()], now=100.0)
>>> [n.diagnosis for n in plan.notices]
['nan_loss']
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = [
    "TRANSITIONS",
    "Transition",
    "LifecycleConfig",
    "InhibitRule",
    "DEFAULT_INHIBIT_RULES",
    "Matcher",
    "Silence",
    "Ack",
    "HistoryRecord",
    "Notice",
    "Plan",
    "Send",
    "RunBook",
    "AlertBook",
    "alert_labels",
    "parse_duration",
]

logger = logging.getLogger(__name__)

Transition = Literal["pending", "firing", "repeat", "escalated", "acknowledged", "silenced",
                     "inhibited", "resolved"]
TRANSITIONS: tuple[str, ...] = ("pending", "firing", "repeat", "escalated", "acknowledged",
                                "silenced", "inhibited", "resolved")
_SEVERITY_RANK = {"info": 1, "warning": 2, "critical": 3}


# ------------------------------------------------------------------------------ config

@dataclass(frozen=True, slots=True)
class InhibitRule:
    """A firing ``source`` diagnosis mutes ``targets`` of the same run.

    ``evidence``: a regex that one of the target's evidence keys must match (so
    ``dataloader_stall`` mutes only *latency* ``unknown`` alerts, not every one).
    """

    source: str
    targets: tuple[str, ...]
    evidence: str | None = None


#: The root causes we know explain other alerts of the same run (docs/alerting.md).
DEFAULT_INHIBIT_RULES: tuple[InhibitRule, ...] = (
    InhibitRule("dataloader_stall", ("unknown",), evidence=r"timing|latency|time|_ms\b|_s\b|throughput"),
    InhibitRule("nan_loss", ("gradient_instability", "unknown")),
    InhibitRule("training_hang", ("straggler", "comm_degradation")),
    InhibitRule("memory_leak", ("unknown",), evidence=r"memory|mem_"),
)


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    """Tunables of the notification lifecycle (docs/alerting.md, TRAINSENTRY_ALERT_*)."""

    #: A warning (or info) is held as *pending* until it has held for this many steps...
    for_steps: int = 10
    #: ...or this many seconds, whichever comes first. Both 0: sent at once.
    for_s: float = 60.0
    #: Severities that wait; critical always goes out at once.
    pending_severities: tuple[str, ...] = ("warning", "info")
    #: Least seconds between two notifications of one problem (0: every engine repeat).
    repeat_interval_s: float = 0.0
    #: From this many notified repeats on, notices @-mention the on-call list (0: never).
    escalate_after: int = 2
    #: Alert ids remembered per run for deduplication of redelivered records.
    max_seen_ids: int = 512
    inhibit_rules: tuple[InhibitRule, ...] = DEFAULT_INHIBIT_RULES
    #: A run's book with nothing open and nothing waiting for delivery is dropped this
    #: long after it last changed (its remembered ids only matter for redelivered records,
    #: which come within minutes of the original).
    book_retention_s: float = 86400.0

    def __post_init__(self) -> None:
        if self.for_steps < 0 or self.for_s < 0 or self.repeat_interval_s < 0:
            raise ConfigError("alert for_steps, for_s and repeat_interval_s must be >= 0")
        if not self.book_retention_s > 0:
            raise ConfigError(f"alert book_retention_s must be > 0 seconds, got "
                              f"{self.book_retention_s} (TRAINSENTRY_ALERT_BOOK_RETENTION_S)")
        if self.escalate_after < 0:
            raise ConfigError("alert escalate_after must be >= 0")


# ------------------------------------------------------------------------------ silences, acks

_MATCHER_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)(.*)$")


@dataclass(frozen=True, slots=True)
class Matcher:
    """One Alertmanager-style label matcher: ``=``, ``!=``, ``=~`` (regex), ``!~``.

    Regexes are anchored at both ends, as in Alertmanager.

    >>> Matcher.parse("diagnosis=~nan_.*").matches({"diagnosis": "nan_loss"})
    True
    """

    name: str
    value: str
    op: str = "="

    def __post_init__(self) -> None:
        if self.op not in ("=", "!=", "=~", "!~"):
            raise ConfigError(f"matcher operator must be =, !=, =~ or !~, got {self.op!r}")
        if not self.name:
            raise ConfigError("a matcher needs a label name")
        if self.op in ("=~", "!~"):
            try:
                re.compile(self.value)
            except re.error as exc:
                raise ConfigError(f"matcher {self.name}{self.op}{self.value!r}: bad regex: {exc}") from exc

    @classmethod
    def parse(cls, text: str) -> Matcher:
        """``name=value``, ``name!=value``, ``name=~regex`` or ``name!~regex``."""
        m = _MATCHER_RE.match(text)
        if not m:
            raise ConfigError(f"matcher {text!r} must look like name=value, name!=value, "
                              "name=~regex or name!~regex")
        return cls(name=m.group(1), value=m.group(3).strip().strip('"'), op=m.group(2))

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.name, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        hit = re.fullmatch(self.value, actual) is not None
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value}"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "value": self.value, "op": self.op}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Matcher:
        if not isinstance(obj, Mapping):
            raise ConfigError("a matcher must be an object {name, value, op}")
        op = str(obj.get("op") or ("=~" if obj.get("isRegex") else "="))
        if obj.get("isEqual") is False:
            op = "!~" if op == "=~" else "!="
        return cls(name=str(obj.get("name", "")), value=str(obj.get("value", "")), op=op)


@dataclass(frozen=True, slots=True)
class Silence:
    """Mutes alerts whose labels match every matcher, between ``starts_at`` and ``ends_at``."""

    id: str
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str = ""
    comment: str = ""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.matchers:
            raise ConfigError("a silence needs at least one matcher (e.g. run_id=…)")
        if self.ends_at <= self.starts_at:
            raise ConfigError("a silence must end after it starts")

    def state(self, now: float) -> str:
        """``pending`` (not started), ``active`` or ``expired``."""
        if now < self.starts_at:
            return "pending"
        return "active" if now < self.ends_at else "expired"

    def active(self, now: float) -> bool:
        return self.starts_at <= now < self.ends_at

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(m.matches(labels) for m in self.matchers)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "silence", "id": self.id,
                               "matchers": [m.to_dict() for m in self.matchers],
                               "starts_at": self.starts_at, "ends_at": self.ends_at,
                               "created_by": self.created_by, "comment": self.comment,
                               "created_at": self.created_at}
        if now is not None:
            out["state"] = self.state(now)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Silence:
        try:
            return cls(id=str(obj["id"]),
                       matchers=tuple(Matcher.from_dict(m) for m in obj["matchers"]),
                       starts_at=float(obj["starts_at"]), ends_at=float(obj["ends_at"]),
                       created_by=str(obj.get("created_by", "")),
                       comment=str(obj.get("comment", "")),
                       created_at=float(obj.get("created_at", obj["starts_at"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a silence: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Ack:
    """Someone owns this problem: stop repeating it (its resolve notice still goes out)."""

    fingerprint: str
    run_id: str = ""
    alert_id: str = ""
    created_at: float = 0.0
    created_by: str = ""
    comment: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ack", **asdict(self)}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Ack:
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as exc:
            raise ConfigError(f"not an ack: {exc}") from exc


def alert_labels(alert: AlertEvent | Mapping[str, Any]) -> dict[str, str]:
    """The labels silences match on: run_id (also ``run``), diagnosis (also ``alertname``),
    severity, fingerprint, status, attempt, host and rank when known."""
    a = alert.to_dict() if isinstance(alert, AlertEvent) else alert
    labels = {"run_id": str(a.get("run_id", "")), "diagnosis": str(a.get("diagnosis", "")),
              "severity": str(a.get("severity", "")), "fingerprint": str(a.get("fingerprint", "")),
              "status": str(a.get("status", "")), "attempt": str(a.get("attempt", 0))}
    labels["run"] = labels["run_id"]
    labels["alertname"] = labels["diagnosis"]
    for key in ("host", "rank"):
        if a.get(key) is not None:
            labels[key] = str(a[key])
    return labels


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s|ms)")


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``30m``, ``2h``, ``1h30m``, ``1d``, ``1w`` or a bare number of seconds.

    >>> parse_duration("1h30m")
    5400.0
    """
    s = text.strip().lower()
    try:
        return float(s)
    except ValueError:
        pass
    pos, total = 0, 0.0
    unit = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * unit[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ConfigError(f"duration {text!r} must look like 90s, 30m, 2h, 1h30m or 1d")
    return total


# ------------------------------------------------------------------------------ history

@dataclass(frozen=True, slots=True)
class HistoryRecord:
    """One transition of one alert, for the compacted history topic (key: ``id``).

    ``notified``: a chat message carried it. ``evidence``/``series`` ride along on the
    records that carry a chart (firing/repeat/escalated), so any worker can draw it later.
    """

    id: str
    ts: float
    run_id: str
    fingerprint: str
    alert_id: str
    diagnosis: str
    severity: str
    step: int
    transition: str
    notified: bool = False
    reason: str = ""
    by: str = ""
    summary: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not out["evidence"]:
            del out["evidence"]
        if not out["series"]:
            del out["series"]
        return {"v": 1, **out}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> HistoryRecord:
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as exc:
            raise ConfigError(f"not a history record: {exc}") from exc


def transition_id(*parts: object) -> str:
    """Deterministic, so a replayed batch writes the same keys (compaction keeps one)."""
    return hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------ state

@dataclass(frozen=True, slots=True)
class Notice(AlertEvent):
    """An AlertEvent as it goes to chat: ``escalated`` asks receivers to @-mention on-call."""

    escalated: bool = False
    repeat: int = 0

    @classmethod
    def of(cls, alert: AlertEvent, *, escalated: bool = False, repeat: int = 0) -> Notice:
        values = {f.name: getattr(alert, f.name) for f in fields(AlertEvent)}
        return cls(**values, escalated=escalated, repeat=repeat)


@dataclass
class _Episode:
    """One problem (fingerprint) from its first firing alert to its resolve."""

    fingerprint: str
    run_id: str
    diagnosis: str
    severity: str
    status: str  # "pending" | "firing"
    since_step: int
    since_wall: float
    alert: dict[str, Any]  # the latest AlertEvent, as a dict
    ids: list[str] = field(default_factory=list)
    notified: bool = False
    notified_at: float | None = None
    repeats: int = 0  # notified repeats
    escalated: bool = False
    suppressed: str = ""  # "", "silenced", "inhibited", "acknowledged": last reason held back

    @property
    def evidence_keys(self) -> set[str]:
        return set(self.alert.get("evidence") or {})

    @property
    def secondary(self) -> list[str]:
        return list(self.alert.get("secondary") or [])

    def event(self) -> AlertEvent:
        return AlertEvent.from_dict(self.alert)


class RunBook:
    """What the notifier remembers about one run: open episodes and recently seen ids."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.episodes: dict[str, _Episode] = {}
        self.seen: list[str] = []
        self.max_step = -1
        #: Notices staged for delivery and the receivers that already acknowledged each:
        #: after a crash, delivery resumes for the other receivers only.
        self.outbox: list[dict[str, Any]] = []
        #: Wall time of the last alert observed or notice settled (None: not known, a book
        #: written before this was recorded; its retention counts from when it is read).
        self.touched: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"v": 1, "run_id": self.run_id, "max_step": self.max_step, "seen": list(self.seen),
                "episodes": [asdict(e) for e in self.episodes.values()],
                "outbox": [dict(o) for o in self.outbox], "touched": self.touched}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> RunBook:
        book = cls(str(obj["run_id"]))
        book.max_step = int(obj.get("max_step", -1))
        book.seen = [str(i) for i in obj.get("seen", [])]
        for e in obj.get("episodes", []):
            ep = _Episode(**e)
            book.episodes[ep.fingerprint] = ep
        book.outbox = [dict(o) for o in obj.get("outbox", [])]
        touched = obj.get("touched")
        book.touched = float(touched) if isinstance(touched, (int, float)) else None
        return book

    @property
    def open(self) -> bool:
        """Something is still to happen for this run: an episode not resolved (pending or
        firing), or a notice staged and not settled."""
        return bool(self.episodes) or bool(self.outbox)

    @property
    def waiting(self) -> bool:
        """Some episode was not notified yet (:meth:`AlertBook.due` may release it), or
        some notice is staged but not settled (:meth:`AlertBook.resume`)."""
        return bool(self.outbox) or any(not e.notified for e in self.episodes.values())


@dataclass
class Send:
    """One notice to deliver: which run and problem, and as what (firing, repeat, resolved)."""

    run_id: str
    fingerprint: str
    kind: str  # firing | repeat | resolved
    notice: Notice


@dataclass
class Plan:
    """What to deliver now (``notices``) and the transitions decided without a delivery."""

    notices: list[Notice] = field(default_factory=list)
    records: list[HistoryRecord] = field(default_factory=list)
    duplicates: int = 0
    runs: set[str] = field(default_factory=set)
    sends: list[Send] = field(default_factory=list)


# ------------------------------------------------------------------------------ the book

class AlertBook:
    """Decides, per run and fingerprint, what goes to chat. Holds :class:`RunBook` objects.

    The caller loads a run's state with :meth:`restore` (or lets :meth:`run` create it),
    calls :meth:`observe` for new alerts and :meth:`due` periodically, delivers
    ``plan.notices``, then :meth:`settle` with the delivered ids and persists
    :meth:`dump` of every run in ``plan.runs``.
    """

    def __init__(self, config: LifecycleConfig | None = None) -> None:
        self.config = config or LifecycleConfig()
        self.runs: dict[str, RunBook] = {}

    # -- state --------------------------------------------------------------------------
    def run(self, run_id: str) -> RunBook:
        book = self.runs.get(run_id)
        if book is None:
            book = self.runs[run_id] = RunBook(run_id)
        return book

    def restore(self, run_id: str, state: Mapping[str, Any] | None) -> RunBook:
        self.runs[run_id] = RunBook.from_dict(state) if state else RunBook(run_id)
        return self.runs[run_id]

    def dump(self, run_id: str) -> dict[str, Any]:
        return self.run(run_id).to_dict()

    def retirable(self, run_id: str, *, now: float) -> bool:
        """Whether the run's book can be dropped: nothing open, nothing staged, and not
        changed for ``config.book_retention_s``. A book of unknown age starts its count
        now."""
        run = self.runs.get(run_id)
        if run is None or run.open:
            return False
        if run.touched is None:
            run.touched = now
        return now - run.touched >= self.config.book_retention_s

    # -- decisions ------------------------------------------------------------------------
    def observe(self, alerts: Iterable[AlertEvent], *, now: float,
                silences: Sequence[Silence] = (), acks: Mapping[str, Ack] | None = None) -> Plan:
        """Take the engine's alerts (in topic order) and plan the notifications."""
        acks = acks or {}
        plan = Plan()
        by_run: dict[str, list[AlertEvent]] = {}
        for alert in alerts:
            by_run.setdefault(alert.run_id, []).append(alert)
        for run_id, run_alerts in by_run.items():
            run = self.run(run_id)
            run.touched = now
            plan.runs.add(run_id)
            # fingerprint -> (episode, latest firing alert, first?, upgraded?): several
            # firings of one problem in a batch make one notice, of the latest.
            touched: dict[str, tuple[_Episode, AlertEvent, bool, bool]] = {}
            ctx = (now, silences, acks, plan)
            for alert in run_alerts:
                if alert.id in run.seen:
                    plan.duplicates += 1
                    continue
                run.seen.append(alert.id)
                run.max_step = max(run.max_step, alert.step)
                fp = alert.fingerprint
                if alert.status == "resolved":
                    if fp in touched:  # fired and resolved within this batch: decide first
                        self._decide_touched(run, touched.pop(fp), *ctx)
                    self._resolve(run, alert, now, plan)
                    continue
                ep = run.episodes.get(fp)
                first = ep is None
                if ep is None:
                    ep = run.episodes[fp] = _Episode(
                        fingerprint=fp, run_id=run_id, diagnosis=alert.diagnosis,
                        severity=alert.severity, status="pending", since_step=alert.step,
                        since_wall=now, alert=alert.to_dict())
                upgraded = not first and alert.severity == "critical" and ep.severity != "critical"
                if not first:
                    ep.alert = alert.to_dict()
                    ep.severity = alert.severity
                ep.ids = [*ep.ids, alert.id][-20:]
                if fp in touched:
                    _, _, was_first, was_upgraded = touched[fp]
                    first, upgraded = first or was_first, upgraded or was_upgraded
                touched[fp] = (ep, alert, first, upgraded)
            del run.seen[:-self.config.max_seen_ids]
            # Decide after the whole batch is in, so a root cause that arrives in the same
            # tick as its symptoms inhibits them.
            for item in touched.values():
                self._decide_touched(run, item, *ctx)
        return plan

    def due(self, *, now: float, silences: Sequence[Silence] = (),
            acks: Mapping[str, Ack] | None = None, run_ids: Iterable[str] | None = None) -> Plan:
        """Release what waited: pending alerts that held long enough, and alerts whose
        silence expired or whose inhibiting root cause resolved."""
        acks = acks or {}
        plan = Plan()
        for run_id in list(run_ids if run_ids is not None else self.runs):
            run = self.runs.get(run_id)
            if run is None:
                continue
            staged = {o["fingerprint"] for o in run.outbox}
            for ep in list(run.episodes.values()):
                if ep.notified or ep.fingerprint in staged:
                    continue  # sent, or on its way (resume() finishes it)
                before = len(plan.records) + len(plan.sends)
                self._decide(run, ep, ep.event(), now, silences, acks, plan, first=False,
                             quiet=True)
                if len(plan.records) + len(plan.sends) != before:
                    plan.runs.add(run_id)
        return plan

    # -- the outbox: per-receiver progress, so a crash resends to nobody who got it ----------
    def stage(self, plan: Plan) -> None:
        """Put the plan's notices in their runs' outboxes (persist the runs after this)."""
        for send in plan.sends:
            run = self.run(send.run_id)
            if any(o["id"] == send.notice.id for o in run.outbox):
                continue
            run.outbox.append({"id": send.notice.id, "fingerprint": send.fingerprint,
                               # no series: keeps the table record small (a resumed
                               # notice goes out without its chart)
                               "kind": send.kind,
                               "notice": {**send.notice.to_dict(), "series": {}},
                               "sent": [], "failed": []})

    def mark(self, run_id: str, alert_id: str, receiver: str, *, ok: bool) -> None:
        """One receiver acknowledged (``ok``) or gave up on one staged notice."""
        for o in self.run(run_id).outbox:
            if o["id"] == alert_id:
                o["sent" if ok else "failed"] = sorted({*o["sent" if ok else "failed"], receiver})

    def todo(self, run_id: str, alert_id: str, receivers: Iterable[str]) -> list[str]:
        """The receivers that still have to be tried for a staged notice."""
        for o in self.run(run_id).outbox:
            if o["id"] == alert_id:
                done = {*o["sent"], *o["failed"]}
                return [r for r in receivers if r not in done]
        return list(receivers)

    def resume(self, run_ids: Iterable[str] | None = None) -> Plan:
        """A plan of what was staged but not settled (after a crash or restart)."""
        plan = Plan()
        for run_id in list(run_ids if run_ids is not None else self.runs):
            run = self.runs.get(run_id)
            if run is None or not run.outbox:
                continue
            plan.runs.add(run_id)
            for o in run.outbox:
                values = dict(o["notice"])
                escalated, repeat = bool(values.pop("escalated", False)), int(values.pop("repeat", 0))
                notice = Notice.of(AlertEvent.from_dict(values), escalated=escalated, repeat=repeat)
                plan.sends.append(Send(run_id, o["fingerprint"], o["kind"], notice))
                plan.notices.append(notice)
        return plan

    def delivered(self, plan: Plan) -> set[str]:
        """Ids of the plan's notices that at least one receiver acknowledged."""
        out: set[str] = set()
        for send in plan.sends:
            run = self.runs.get(send.run_id)
            for o in run.outbox if run is not None else ():
                if o["id"] == send.notice.id and o["sent"]:
                    out.add(o["id"])
        return out

    def settle(self, plan: Plan, delivered: Collection[str] | None = None, *,
               now: float) -> list[HistoryRecord]:
        """Record what was delivered (default: what the outbox says) and clear the plan's
        outbox entries; returns every history record of the plan."""
        if delivered is None:
            delivered = self.delivered(plan)
        for run_id in plan.runs:
            if (changed := self.runs.get(run_id)) is not None:
                changed.touched = now
        records = list(plan.records)
        for send in plan.sends:
            n = send.notice
            ok = n.id in delivered
            run = self.runs.get(send.run_id)
            if run is not None:
                run.outbox = [o for o in run.outbox if o["id"] != n.id]
            ep = run.episodes.get(send.fingerprint) if run is not None else None
            transition = send.kind
            if ep is not None and ok:
                ep.notified_at = now
                ep.suppressed = ""
                if send.kind == "firing":
                    ep.notified = True
                elif send.kind == "repeat":
                    ep.repeats += 1
                    if n.escalated and not ep.escalated:
                        ep.escalated = True
                        transition = "escalated"
            reason = "" if ok else "not delivered"
            records.append(_record(n, transition, now, notified=ok, reason=reason,
                                   chart=send.kind != "resolved"))
        return records

    # -- internals ------------------------------------------------------------------------
    def _resolve(self, run: RunBook, alert: AlertEvent, now: float, plan: Plan) -> None:
        ep = run.episodes.pop(alert.fingerprint, None)
        planned = any(x.fingerprint == alert.fingerprint and x.kind == "firing"
                      for x in plan.sends if x.run_id == run.run_id)
        if ep is not None and (ep.notified or planned):
            # Sent even when silenced or acknowledged since: whoever saw it fire hears it end.
            plan.sends.append(Send(run.run_id, alert.fingerprint, "resolved", Notice.of(alert)))
            plan.notices.append(plan.sends[-1].notice)
            return
        why = "never notified" if ep is not None else "no open episode"
        if ep is not None and ep.suppressed:
            why = f"never notified ({ep.suppressed})"
        plan.records.append(_record(alert, "resolved", now, reason=why))

    def _decide_touched(self, run: RunBook, item: tuple[_Episode, AlertEvent, bool, bool],
                        now: float, silences: Sequence[Silence], acks: Mapping[str, Ack],
                        plan: Plan) -> None:
        ep, alert, first, upgraded = item
        if run.episodes.get(ep.fingerprint) is ep:
            self._decide(run, ep, alert, now, silences, acks, plan, first=first,
                         upgraded=upgraded)

    def _matured(self, run: RunBook, ep: _Episode, severity: str, now: float) -> bool:
        c = self.config
        if severity not in c.pending_severities or (c.for_steps == 0 and c.for_s == 0):
            return True
        if c.for_steps and run.max_step >= ep.since_step + c.for_steps:
            return True
        return bool(c.for_s and now - ep.since_wall >= c.for_s)

    def _decide(self, run: RunBook, ep: _Episode, alert: AlertEvent, now: float,
                silences: Sequence[Silence], acks: Mapping[str, Ack], plan: Plan, *,
                first: bool, quiet: bool = False, upgraded: bool = False) -> None:
        """One firing alert of ``ep``: send it, hold it (pending) or suppress it."""
        if not ep.notified and ep.status == "pending":
            if not self._matured(run, ep, alert.severity, now):
                if first:
                    plan.records.append(_record(alert, "pending", now, reason=self._for_text()))
                return
            ep.status = "firing"
        # The breaker's order (a stop or a rollback of the run) goes out even when the
        # problem was acknowledged or is explained by another: only a silence holds it.
        command = alert.command is not None
        held = self._suppressed(run, ep, now, silences, acks, command=command)
        if held is not None:
            what, why = held
            if quiet and ep.suppressed == what:
                return  # the timer re-checks often; record changes only
            ep.suppressed = what
            if what == "acknowledged":
                if not quiet:
                    plan.records.append(_record(alert, "repeat", now, reason=why))
                return
            plan.records.append(_record(alert, what, now, reason=why))
            return
        if not ep.notified:
            paged = command and (alert.command or {}).get("outcome") != "applied"
            plan.sends.append(Send(run.run_id, ep.fingerprint, "firing",
                                   Notice.of(alert, escalated=paged)))
            plan.notices.append(plan.sends[-1].notice)
            return
        if quiet:
            return
        c = self.config
        if c.repeat_interval_s and ep.notified_at is not None and not upgraded \
                and not command and now - ep.notified_at < c.repeat_interval_s:
            plan.records.append(_record(alert, "repeat", now, reason="within repeat_interval"))
            return
        number = ep.repeats + 1
        # A stop or rollback of the run pages the on-call list at once, and so does a
        # command the trainer refused (the run goes on); that it was applied does not.
        paged = command and (alert.command or {}).get("outcome") != "applied"
        escalate = paged or (bool(c.escalate_after) and number >= c.escalate_after)
        plan.sends.append(Send(run.run_id, ep.fingerprint, "repeat",
                                 Notice.of(alert, escalated=escalate,
                                           # a command notice is news, not a reminder
                                           repeat=0 if command else number)))
        plan.notices.append(plan.sends[-1].notice)

    def _for_text(self) -> str:
        c = self.config
        parts = [f"{c.for_steps} steps" if c.for_steps else "", f"{c.for_s:g}s" if c.for_s else ""]
        return "waiting for " + " or ".join(p for p in parts if p)

    def _suppressed(self, run: RunBook, ep: _Episode, now: float, silences: Sequence[Silence],
                    acks: Mapping[str, Ack], *, command: bool = False) -> tuple[str, str] | None:
        ack = acks.get(ep.fingerprint)
        if not command and ack is not None and (ack.alert_id in ep.ids
                                                or ack.created_at >= ep.since_wall):
            return "acknowledged", f"acknowledged by {ack.created_by or 'someone'}"
        labels = alert_labels(ep.alert)
        for s in silences:
            if s.active(now) and s.matches(labels):
                return "silenced", f"silence {s.id}"
        if command:
            return None
        source = self._inhibitor(run, ep)
        if source is not None:
            return "inhibited", f"inhibited by {source.diagnosis} ({source.fingerprint})"
        return None

    def _inhibits(self, b: _Episode, a: _Episode) -> bool:
        """Does source ``b`` explain target ``a`` (same run)?"""
        for rule in self.config.inhibit_rules:
            if rule.source == b.diagnosis and a.diagnosis in rule.targets and (
                    rule.evidence is None
                    or any(re.search(rule.evidence, k) for k in a.evidence_keys)):
                return True
        rank_a = _SEVERITY_RANK.get(a.severity, 1)
        rank_b = _SEVERITY_RANK.get(b.severity, 1)
        if a.diagnosis in b.secondary and a.diagnosis != b.diagnosis and rank_b >= rank_a:
            return True
        return b.severity == "critical" and rank_a < rank_b and bool(b.evidence_keys & a.evidence_keys)

    def _inhibitor(self, run: RunBook, a: _Episode) -> _Episode | None:
        def weight(e: _Episode) -> tuple[int, int, str]:
            return (_SEVERITY_RANK.get(e.severity, 1), -e.since_step, e.fingerprint)

        for b in run.episodes.values():
            if b is a or not self._inhibits(b, a):
                continue
            if self._inhibits(a, b) and weight(a) > weight(b):
                continue  # mutual: the heavier one wins, never both muted
            return b
        return None


def _record(alert: AlertEvent, transition: str, now: float, *, notified: bool = False,
            reason: str = "", chart: bool = False) -> HistoryRecord:
    return HistoryRecord(
        id=transition_id(alert.id, transition, notified, reason), ts=now, run_id=alert.run_id,
        fingerprint=alert.fingerprint, alert_id=alert.id, diagnosis=alert.diagnosis,
        severity=alert.severity, step=alert.step, transition=transition, notified=notified,
        reason=reason, summary=alert.summary[:300],
        evidence=dict(alert.evidence) if chart else {},
        series=dict(alert.series) if chart else {})


def _example() -> AlertEvent:
    return AlertEvent(id="a1", fingerprint="fp1", run_id="r", status="firing",
                      severity="critical", diagnosis="nan_loss", step=1, ts=0.0, summary="",
                      evidence={}, actions=[])
