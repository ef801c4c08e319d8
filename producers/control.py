"""ControlListener: receives stop / rollback commands for one run, verified before use.

A daemon thread reads the control topic (all partitions, no consumer group, starting a
little before the listener's start so a command issued while the trainer was starting
is not missed). Every record is checked — signature over exactly what was received,
run_id, age window, single use by id — and only then handed to ``on_command``. Anything
else goes to ``on_reject(raw, reason)`` and the log; it is never applied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from producers.kafka import KafkaOptions, client_options, connect_error
from trainsentry.config import Secret, Topics
from trainsentry.errors import EventError, SignatureError
from trainsentry.events import ControlCommand
from trainsentry.signing import DEFAULT_MAX_AGE_S, verify_command

__all__ = ["ControlListener", "CommandVerifier"]

log = logging.getLogger(__name__)


class CommandVerifier:
    """The pure part: decides whether one received record is a command to apply."""

    def __init__(self, *, run_id: str, secret: str | Secret, max_age_s: float = DEFAULT_MAX_AGE_S,
                 remember: int = 1024, clock: Callable[[], float] = time.time) -> None:
        self.run_id = run_id
        self._secret = secret.get() if isinstance(secret, Secret) else secret
        if not self._secret:
            raise ValueError("the control secret is empty; set TRAINSENTRY_CONTROL_SECRET "
                             "(the same value as the service's)")
        self.max_age_s = max_age_s
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self._clock = clock

    def check(self, value: bytes | str | Mapping[str, Any]) -> ControlCommand:
        """The verified command, or SignatureError/EventError saying why it is refused."""
        if isinstance(value, Mapping):
            raw = dict(value)
        else:
            try:
                raw = json.loads(value)
            except (ValueError, TypeError, RecursionError) as exc:
                raise EventError(f"command is not valid JSON: {type(exc).__name__}: "
                                 f"{str(exc)[:200]}") from None
            if not isinstance(raw, dict):
                raise EventError("command must be a JSON object")
        command = verify_command(raw, self._secret, run_id=self.run_id, now=self._clock(),
                                 max_age_s=self.max_age_s)
        if command.id in self._seen:
            raise SignatureError(f"command {command.id} was already received (replay)")
        self._seen[command.id] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return command


class ControlListener:
    """Consumes the control topic for one run and hands verified commands to a callback."""

    def __init__(
        self,
        *,
        run_id: str,
        secret: str | Secret,
        on_command: Callable[[ControlCommand], None],
        on_reject: Callable[[Mapping[str, Any] | bytes, str], None] | None = None,
        bootstrap: str | KafkaOptions = "127.0.0.1:9092",
        topic_prefix: str = "trainsentry.",
        max_age_s: float = DEFAULT_MAX_AGE_S,
        lookback_s: float = 60.0,
        consumer_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.verifier = CommandVerifier(run_id=run_id, secret=secret, max_age_s=max_age_s)
        self.on_command = on_command
        self.on_reject = on_reject
        self.options = bootstrap if isinstance(bootstrap, KafkaOptions) else KafkaOptions(bootstrap=bootstrap)
        self.topic = Topics(topic_prefix).control
        self.lookback_s = lookback_s
        self._factory = consumer_factory
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.applied: list[ControlCommand] = []
        self.rejected: list[str] = []

    def start(self) -> ControlListener:
        """Start the background thread (returns at once; see :meth:`wait_ready`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainsentry-control",
                                            daemon=True)
            self._thread.start()
        return self

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until the listener is assigned the topic's partitions."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ControlListener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, key: bytes | None, value: bytes | None) -> None:
        """Check one record and dispatch it (public so it is testable without Kafka)."""
        if key is not None and key.decode(errors="replace") != self.run_id:
            return  # another run's command: not ours to judge or report
        if value is None:
            return  # a tombstone (the topic compacted or cleaned up): not a command
        try:
            command = self.verifier.check(value)
        except Exception as exc:  # anything unreadable is refused, never a crash loop
            reason = str(exc) if isinstance(exc, (SignatureError, EventError)) \
                else f"unreadable command ({type(exc).__name__}: {str(exc)[:200]})"
            self.rejected.append(reason)
            log.warning("trainsentry: rejected control command for run %s: %s", self.run_id, reason)
            if self.on_reject is not None:
                try:
                    self.on_reject(value, reason)
                except Exception:
                    log.exception("trainsentry: on_reject callback failed")
            return
        self.applied.append(command)
        log.warning("trainsentry: control command %s %s for run %s (%s)", command.id,
                    command.action, self.run_id, command.reason)
        try:
            self.on_command(command)
        except Exception:
            log.exception("trainsentry: on_command callback failed for %s", command.id)

    def _consumer(self) -> Any:
        if self._factory is not None:
            return self._factory()
        from kafka import KafkaConsumer

        return KafkaConsumer(**client_options(self.options), enable_auto_commit=False,
                             group_id=None, consumer_timeout_ms=500)

    def _run(self) -> None:
        backoff = 0.5
        said = ""
        while not self._stop.is_set():
            try:
                consumer = self._consumer()
            except Exception as exc:
                # A trainer must not die of a broker problem: say what to fix (once per
                # distinct cause, never the password) and keep retrying.
                why = str(connect_error(self.options, exc)) if self._factory is None else repr(exc)
                if why != said:
                    log.warning("trainsentry: control listener for run %s: %s; retrying",
                                self.run_id, why)
                    said = why
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            try:
                self._consume(consumer)
            except Exception:
                log.exception("trainsentry: control listener error; reconnecting")
                self._stop.wait(1.0)
            finally:
                with contextlib.suppress(Exception):
                    consumer.close()

    def _consume(self, consumer: Any) -> None:
        from kafka import TopicPartition

        partitions = None
        deadline = time.monotonic() + 30
        while not partitions and not self._stop.is_set():
            partitions = consumer.partitions_for_topic(self.topic)
            if not partitions:
                if time.monotonic() > deadline:
                    log.warning("trainsentry: control topic %s does not exist yet; waiting",
                                self.topic)
                    deadline = time.monotonic() + 300
                self._stop.wait(0.5)
        if self._stop.is_set():
            return
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions or [])]
        consumer.assign(tps)
        since_ms = int((time.time() - self.lookback_s) * 1000)
        offsets = consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = consumer.end_offsets(tps)
        for tp in tps:
            found = offsets.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
        self._ready.set()
        while not self._stop.is_set():
            batches = consumer.poll(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    self.handle(record.key, record.value)
