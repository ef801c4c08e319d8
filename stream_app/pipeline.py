"""The pure part of the stream app: decode a record, run the engine, encode what comes out.

The Faust agents (stream_app/app.py) stay thin: they fetch a run's state, call
:meth:`Pipeline.handle`, store the state and send the returned records. Everything here
is testable without Kafka.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from detectors.engine import Engine, Output, RunState
from trainsentry.config import Secret, Topics
from trainsentry.errors import EventError
from trainsentry.events import (
    MAX_RECORD_BYTES,
    AlertEvent,
    ControlCommand,
    MetricEvent,
    RunEvent,
    decode_record,
    dumps,
)
from trainsentry.signing import sign_command

__all__ = ["Pipeline", "Record", "Outcome", "dump_state", "load_state"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Record:
    """A record to send: topic, key bytes, value bytes, headers."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass
class Outcome:
    run_id: str | None = None
    records: list[Record] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    deadletter: Record | None = None
    state_changed: bool = False


def dump_state(state: RunState) -> bytes:
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def load_state(raw: bytes) -> RunState:
    state = pickle.loads(raw)  # noqa: S301 - our own changelog topic, written by this service
    if not isinstance(state, RunState):
        raise TypeError("run_state table holds something that is not a RunState")
    return state


class Pipeline:
    """Decode → engine → signed/encoded records (or a dead letter with the reason)."""

    def __init__(self, *, engine: Engine, topics: Topics, control_secret: Secret,
                 max_record_bytes: int = MAX_RECORD_BYTES,
                 clock: Callable[[], float] = time.time,
                 command_max_data_age_s: float = 3600.0) -> None:
        self.engine = engine
        self._clock = clock
        self.command_max_data_age_s = command_max_data_age_s
        self.topics = topics
        self._secret = control_secret
        self.max_record_bytes = max_record_bytes
        self._kind = {topics.data: "metric", topics.compute: "metric", topics.resource: "metric",
                      topics.runs: "run"}
        self._layer = {topics.data: "data", topics.compute: "compute", topics.resource: "resource"}

    def decode(self, topic: str, key: bytes | None, value: bytes | None) -> MetricEvent | RunEvent:
        kind = self._kind.get(topic)
        if kind is None:
            raise EventError(f"record from unexpected topic {topic!r}")
        event = decode_record(value, kind, max_bytes=self.max_record_bytes)  # type: ignore[arg-type]
        assert isinstance(event, (MetricEvent, RunEvent))
        if isinstance(event, MetricEvent) and event.layer != self._layer[topic]:
            raise EventError(f"MetricEvent layer {event.layer!r} sent to the {self._layer[topic]} "
                             f"topic {topic}; publish each layer to its own topic")
        if key is not None and key and key != event.run_id.encode():
            raise EventError(f"record key {key[:80]!r} differs from run_id {event.run_id!r}; "
                             "key records by run_id (plain UTF-8) so a run stays in one partition")
        return event

    def deadletter(self, topic: str, partition: int, offset: int, key: bytes | None,
                   value: bytes | None, reason: str) -> Record:
        headers: tuple[tuple[str, bytes], ...] = (("reason", reason.encode()[:1000]), ("original_topic", topic.encode()),
                   ("original_partition", str(partition).encode()),
                   ("original_offset", str(offset).encode()))
        body = value if value is not None else b""
        if len(body) > self.max_record_bytes:
            body = body[: self.max_record_bytes]
            headers += (("truncated", b"true"),)
        return Record(self.topics.deadletter, key or b"", body, headers)

    def handle(self, state: RunState, event: MetricEvent | RunEvent) -> Outcome:
        outputs = self.engine.process(state, event, arrival=self._clock())
        return self.encode(state.run_id, outputs)

    def poll(self, state: RunState, now: float) -> Outcome:
        """Evaluate the run's steps whose join grace has passed."""
        return self.encode(state.run_id, self.engine.poll(state, now))

    def tick(self, state: RunState, now: float) -> Outcome:
        return self.encode(state.run_id, self.engine.tick(state, now))

    def encode(self, run_id: str, outputs: list[Output]) -> Outcome:
        now = self._clock()
        # The engine dates a command by the data that tripped the breaker: too old (a
        # replay under a new app id, a long backlog) and the run has moved on since.
        stale = {o.id: now - o.issued_at for o in outputs if isinstance(o, ControlCommand)
                 and self.command_max_data_age_s and now - o.issued_at > self.command_max_data_age_s}
        outputs = [self._sent_or_not(o, stale) for o in outputs]
        out = Outcome(run_id=run_id, outputs=outputs, state_changed=True)
        key = run_id.encode()
        for o in outputs:
            if isinstance(o, AlertEvent):
                out.records.append(Record(self.topics.alerts, key, dumps(o)))
            elif isinstance(o, ControlCommand):
                if o.id in stale:
                    log.warning("circuit breaker tripped for run %s (%s) on data %.0f s old, over "
                                "TRAINSENTRY_COMMAND_MAX_DATA_AGE_S=%.0f: no command published",
                                run_id, o.reason, stale[o.id], self.command_max_data_age_s)
                    continue
                if not self._secret:
                    log.error("circuit breaker tripped for run %s (%s) but no control secret is "
                              "set; set TRAINSENTRY_CONTROL_SECRET to publish signed commands",
                              run_id, o.reason)
                    continue
                # Commands are dated by the service's clock: the trainer checks their age.
                signed = sign_command(replace(o, issued_at=self._clock()), self._secret.get())
                out.records.append(Record(self.topics.control, key, dumps(signed)))
        return out

    def _sent_or_not(self, o: Output, stale: dict[str, float]) -> Output:
        """A breaker notice says whether its command really went to the trainer."""
        if not isinstance(o, AlertEvent) or o.command is None or "sent" in o.command \
                or "outcome" in o.command:  # the trainer's answer: nothing was sent now
            return o
        age = stale.get(str(o.command.get("id")))
        if age is not None:
            minutes = f"{age / 60:.0f}"
            return replace(
                o, command={**o.command, "sent": False, "stale_s": round(age)},
                summary=o.summary + f"; NOT SENT: the data is {minutes} min old (a replay or a "
                                    "backlog), over TRAINSENTRY_COMMAND_MAX_DATA_AGE_S; check the "
                                    "run and act on it by hand if it is still failing",
                summary_zh=(o.summary_zh or o.summary) + f"；未下发：数据已是 {minutes} 分钟前的"
                                                         "（回放或积压），超过 TRAINSENTRY_COMMAND_"
                                                         "MAX_DATA_AGE_S；请检查这个运行，如仍异常请手动处理")
        sent = bool(self._secret)
        if sent:
            return replace(o, command={**o.command, "sent": True})
        return replace(
            o, command={**o.command, "sent": False},
            summary=o.summary + "; NOT SENT: TRAINSENTRY_CONTROL_SECRET is not set on the "
                                "service, so act on the run by hand",
            summary_zh=(o.summary_zh or o.summary) + "；未下发：服务没有设置 "
                                                     "TRAINSENTRY_CONTROL_SECRET，请手动处理这个运行")
