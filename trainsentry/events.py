"""The contract's event types: decoding with validation, and encoding.

Every record that crosses Kafka is one of these. Decoding is strict (a record that
fails goes to the dead-letter topic with the :class:`~trainsentry.errors.EventError`
message as its reason); encoding writes non-finite metric values as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` as the contract asks.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainsentry.errors import EventError

_fast_loads: Callable[[bytes | str], Any] | None
try:  # the [service] extra: a 3-5x faster parser on the stream app's hot path
    from orjson import loads as _fast_loads
except ImportError:  # a trainer-only install decodes with the standard library
    _fast_loads = None

__all__ = [
    "SCHEMA_VERSION",
    "LAYERS",
    "RUN_EVENT_TYPES",
    "MAX_RECORD_BYTES",
    "MetricEvent",
    "RunEvent",
    "AlertEvent",
    "ControlCommand",
    "Event",
    "decode_metric_value",
    "encode_metric_value",
    "decode_event",
    "decode_record",
    "dumps",
    "new_id",
]

SCHEMA_VERSION = 1
LAYERS: tuple[str, ...] = ("data", "compute", "resource")
RUN_EVENT_TYPES: tuple[str, ...] = (
    "run_started",
    "checkpoint_saved",
    "heartbeat",
    "command_applied",
    "command_rejected",
    "run_finished",
)
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
ACTIONS: tuple[str, ...] = ("stop", "rollback", "checkpoint")
#: Records larger than this are refused (dead-lettered): a metrics event is a few KiB.
MAX_RECORD_BYTES = 256 * 1024
#: Longest run_id accepted; it is a Kafka key and appears in every chat message.
MAX_RUN_ID_CHARS = 256

_NONFINITE_IN = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
                 "infinity": math.inf, "-infinity": -math.inf}


def new_id() -> str:
    """A fresh random id for alerts and commands."""
    return uuid.uuid4().hex


def encode_metric_value(value: float) -> float | str:
    """A float as the contract writes it: finite numbers as-is, else ``"nan"``/``"inf"``/``"-inf"``."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode_metric_value(name: str, raw: Any) -> float:
    """One metric value from JSON: a number, ``null`` (verl's file logger's NaN) or a NaN/inf string."""
    if isinstance(raw, bool):
        raise EventError(f"metric {name!r} is a boolean; send a number")
    if isinstance(raw, (int, float)):
        return float(raw)
    if raw is None:
        return math.nan
    if isinstance(raw, str) and raw.strip().lower() in _NONFINITE_IN:
        return _NONFINITE_IN[raw.strip().lower()]
    raise EventError(
        f"metric {name!r} has value {str(raw)[:40]!r} of type {type(raw).__name__}; "
        'send a JSON number or one of "nan", "inf", "-inf"'
    )


def _require(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise EventError(f"{what} is missing required field {key!r}")
    value = obj[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise EventError(f"{what} field {key!r} must be {_type_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise EventError(
            f"{what} field {key!r} must be {_type_names(types)}, got {type(value).__name__}"
        )
    return value


def _optional(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str,
              default: Any) -> Any:
    if key not in obj or obj[key] is None:
        return default
    return _require(obj, key, types, what)


def _type_names(types: type | tuple[type, ...]) -> str:
    seq = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in seq)


def _check_version(obj: Mapping[str, Any], what: str) -> None:
    v = _require(obj, "v", int, what)
    if v != SCHEMA_VERSION:
        raise EventError(f"{what} has schema version v={v}; this service reads v={SCHEMA_VERSION}")


def _run_id(obj: Mapping[str, Any], what: str) -> str:
    run_id = _require(obj, "run_id", str, what)
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS:
        raise EventError(f"{what} run_id must be 1..{MAX_RUN_ID_CHARS} characters")
    return str(run_id)


def _finite_number(obj: Mapping[str, Any], key: str, what: str) -> float:
    value = float(_require(obj, key, (int, float), what))
    if not math.isfinite(value):
        raise EventError(f"{what} field {key!r} must be finite")
    return value


@dataclass(frozen=True, slots=True)
class MetricEvent:
    """One layer of one step of one run."""

    run_id: str
    step: int
    ts: float
    layer: str
    metrics: dict[str, float]
    attempt: int = 0
    host: str | None = None
    rank: int | None = None
    v: int = SCHEMA_VERSION

    kind = "metric"

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> MetricEvent:
        what = "MetricEvent"
        _check_version(obj, what)
        layer = _require(obj, "layer", str, what)
        if layer not in LAYERS:
            raise EventError(f"MetricEvent layer {layer!r} is not one of {', '.join(LAYERS)}")
        raw_metrics = _require(obj, "metrics", dict, what)
        metrics = {}
        for name, raw in raw_metrics.items():
            if not isinstance(name, str) or not name:
                raise EventError("MetricEvent metric names must be non-empty strings")
            metrics[name] = decode_metric_value(name, raw)
        step = _require(obj, "step", int, what)
        if step < 0:
            raise EventError(f"MetricEvent step must be >= 0, got {step}")
        rank = _optional(obj, "rank", int, what, None)
        return cls(
            run_id=_run_id(obj, what),
            step=int(step),
            ts=_finite_number(obj, "ts", what),
            layer=str(layer),
            metrics=metrics,
            attempt=int(_optional(obj, "attempt", int, what, 0)),
            host=_optional(obj, "host", str, what, None),
            rank=None if rank is None else int(rank),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": self.v, "run_id": self.run_id, "attempt": self.attempt, "step": self.step,
            "ts": self.ts, "layer": self.layer,
            "metrics": {k: encode_metric_value(x) for k, x in self.metrics.items()},
        }
        if self.host is not None:
            out["host"] = self.host
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True, slots=True)
class RunEvent:
    """A run's lifecycle event: started, checkpoint, heartbeat, command applied, finished."""

    run_id: str
    type: str
    ts: float
    attempt: int = 0
    step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    v: int = SCHEMA_VERSION

    kind = "run"

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> RunEvent:
        what = "RunEvent"
        _check_version(obj, what)
        etype = _require(obj, "type", str, what)
        if etype not in RUN_EVENT_TYPES:
            raise EventError(f"RunEvent type {etype!r} is not one of {', '.join(RUN_EVENT_TYPES)}")
        step = _optional(obj, "step", int, what, None)
        if etype in ("checkpoint_saved", "heartbeat") and step is None:
            raise EventError(f"RunEvent {etype} needs an integer 'step'")
        if etype == "run_started" and not isinstance(obj.get("config", {}), dict):
            raise EventError("RunEvent run_started 'config' must be a flat JSON object")
        if etype == "command_applied":
            _require(obj, "command_id", str, what)
            _require(obj, "action", str, what)
        extra = {k: v for k, v in obj.items()
                 if k not in ("v", "run_id", "type", "ts", "attempt", "step")}
        return cls(
            run_id=_run_id(obj, what),
            type=str(etype),
            ts=_finite_number(obj, "ts", what),
            attempt=int(_optional(obj, "attempt", int, what, 0)),
            step=None if step is None else int(step),
            fields=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": self.v, "run_id": self.run_id, "attempt": self.attempt,
                               "ts": self.ts, "type": self.type}
        if self.step is not None:
            out["step"] = self.step
        out.update(self.fields)
        return out


@dataclass(frozen=True, slots=True)
class AlertEvent:
    """A diagnosed problem of a run, as published on the alerts topic."""

    id: str
    fingerprint: str
    run_id: str
    status: str
    severity: str
    diagnosis: str
    step: int
    ts: float
    summary: str
    evidence: dict[str, dict[str, Any]]
    actions: list[str]
    attempt: int = 0
    confidence: float | None = None
    secondary: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    host: str | None = None
    rank: int | None = None
    #: Recent ``[step, value]`` points of the evidence signals (value null when non-finite),
    #: so a notifier can draw the chart without asking the service.
    series: dict[str, list[list[Any]]] = field(default_factory=dict)
    #: ``summary`` in Chinese with the same figures, where the engine wrote one (chat
    #: messages in zh show it; absent on the wire when there is none).
    summary_zh: str | None = None
    #: The circuit breaker's order this notice announces: ``id`` (the ControlCommand's),
    #: ``action`` (stop, rollback), ``to_step``, ``checkpoint_first`` and, from the stream
    #: app, ``sent`` (False: no control secret, nothing went to the trainer).
    command: dict[str, Any] | None = None
    #: On a resolved notice: the run ended with this problem still firing, and how it
    #: ended (``exit_code``, ``error``; either may be null). Not a recovery.
    run_exit: dict[str, Any] | None = None
    v: int = SCHEMA_VERSION

    kind = "alert"

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> AlertEvent:
        what = "AlertEvent"
        _check_version(obj, what)
        status = _require(obj, "status", str, what)
        if status not in ("firing", "resolved"):
            raise EventError(f"AlertEvent status {status!r} must be 'firing' or 'resolved'")
        severity = _require(obj, "severity", str, what)
        if severity not in SEVERITIES:
            raise EventError(f"AlertEvent severity {severity!r} is not one of {', '.join(SEVERITIES)}")
        conf = _optional(obj, "confidence", (int, float), what, None)
        rank = _optional(obj, "rank", int, what, None)
        return cls(
            id=_require(obj, "id", str, what),
            fingerprint=_require(obj, "fingerprint", str, what),
            run_id=_run_id(obj, what),
            status=status,
            severity=severity,
            diagnosis=_require(obj, "diagnosis", str, what),
            step=int(_require(obj, "step", int, what)),
            ts=_finite_number(obj, "ts", what),
            summary=_require(obj, "summary", str, what),
            evidence=dict(_require(obj, "evidence", dict, what)),
            actions=list(_require(obj, "actions", list, what)),
            attempt=int(_optional(obj, "attempt", int, what, 0)),
            confidence=None if conf is None else float(conf),
            secondary=list(_optional(obj, "secondary", list, what, [])),
            checks=list(_optional(obj, "checks", list, what, [])),
            host=_optional(obj, "host", str, what, None),
            rank=None if rank is None else int(rank),
            series=dict(_optional(obj, "series", dict, what, {})),
            summary_zh=_optional(obj, "summary_zh", str, what, None),
            command=_optional(obj, "command", dict, what, None),
            run_exit=_optional(obj, "run_exit", dict, what, None),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("confidence", "host", "rank", "summary_zh", "command", "run_exit"):
            if out[key] is None:
                del out[key]
        if not out["series"]:
            del out["series"]
        return {"v": out.pop("v"), **out}


@dataclass(frozen=True, slots=True)
class ControlCommand:
    """A stop / rollback / checkpoint order for one run. ``sig`` is set by :mod:`trainsentry.signing`."""

    id: str
    run_id: str
    action: str
    reason: str
    issued_at: float
    alert_ids: list[str] = field(default_factory=list)
    to_step: int | None = None
    sig: str = ""
    v: int = SCHEMA_VERSION

    kind = "control"

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ControlCommand:
        what = "ControlCommand"
        _check_version(obj, what)
        action = _require(obj, "action", str, what)
        if action not in ACTIONS:
            raise EventError(f"ControlCommand action {action!r} is not one of {', '.join(ACTIONS)}")
        to_step = _optional(obj, "to_step", int, what, None)
        if action == "rollback" and to_step is None:
            raise EventError("ControlCommand rollback needs an integer 'to_step'")
        return cls(
            id=_require(obj, "id", str, what),
            run_id=_run_id(obj, what),
            action=action,
            reason=_require(obj, "reason", str, what),
            issued_at=_finite_number(obj, "issued_at", what),
            alert_ids=[str(a) for a in _optional(obj, "alert_ids", list, what, [])],
            to_step=None if to_step is None else int(to_step),
            sig=str(_optional(obj, "sig", str, what, "")),
        )

    def body(self) -> dict[str, Any]:
        """The command without ``sig``: what the signature covers."""
        out: dict[str, Any] = {"v": self.v, "id": self.id, "run_id": self.run_id,
                               "action": self.action, "reason": self.reason,
                               "alert_ids": list(self.alert_ids), "issued_at": self.issued_at}
        if self.to_step is not None:
            out["to_step"] = self.to_step
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.body(), "sig": self.sig}


Event = MetricEvent | RunEvent | AlertEvent | ControlCommand


def decode_event(obj: Mapping[str, Any]) -> MetricEvent | RunEvent:
    """A MetricEvent or RunEvent from a decoded JSON object (offline files mix both)."""
    if not isinstance(obj, Mapping):
        raise EventError(f"an event must be a JSON object, got {type(obj).__name__}")
    if "layer" in obj or "metrics" in obj:
        return MetricEvent.from_dict(obj)
    if "type" in obj:
        return RunEvent.from_dict(obj)
    raise EventError("record is neither a MetricEvent (has 'layer'/'metrics') nor a RunEvent (has 'type')")


def decode_record(value: bytes | str | None, kind: Literal["metric", "run", "alert", "control"],
                  *, max_bytes: int = MAX_RECORD_BYTES) -> Event:
    """Decode one Kafka record value of the given kind, raising EventError with the reason."""
    if value is None:
        raise EventError("record has no value (tombstone); send a JSON object")
    size = len(value)
    if size > max_bytes:
        raise EventError(f"record is {size} bytes, over the {max_bytes}-byte limit")
    try:
        obj = _fast_loads(value) if _fast_loads is not None else json.loads(value)
    except (UnicodeDecodeError, ValueError):
        # orjson refuses some inputs the standard parser reads (bare NaN, integers over
        # 64 bits, lone surrogates); the standard parser decides, so behaviour and error
        # messages stay exactly those of json.loads.
        try:
            obj = json.loads(value)
        except (UnicodeDecodeError, ValueError) as exc:
            raise EventError(f"record is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise EventError(f"record must be a JSON object, got {type(obj).__name__}")
    decoder = {"metric": MetricEvent, "run": RunEvent, "alert": AlertEvent,
               "control": ControlCommand}[kind]
    return decoder.from_dict(obj)  # type: ignore[attr-defined, no-any-return]


def dumps(event: Event | Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON of an event (or a plain dict) as it goes on the wire."""
    obj = event if isinstance(event, Mapping) else event.to_dict()
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def now() -> float:
    """Wall-clock seconds; one place so tests and the simulator can reason about it."""
    return time.time()
