"""Trustworthy delivery: rate limits, digests instead of drops, bounded retries, health.

Each receiver (robot) gets a lane: a queue, a sliding-window rate limiter (DingTalk and
WeCom allow 20 messages a minute per robot) and one worker. When the worker may send and
the queue holds several alerts, it sends them as ONE digest message, so a burst is
merged, never dropped. Timeouts, connection errors, 5xx, 429 and the robots' throttle
errcodes are retried with exponential backoff and jitter for up to ``max_total_s``
(15 minutes by default: a webhook that is down for 10 minutes still gets everything).
Configuration errors (bad token, bad signature) are never retried: they are logged at
ERROR (without secrets) and shown by :meth:`Deliverer.health`.

:meth:`Deliverer.deliver` returns only when every alert is acknowledged (errcode 0) or
has failed for good, so a Kafka consumer can commit its offset right after.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from notifiers.errors import ConfigurationError, MessageRejected, Throttled, TransientError
from notifiers.redact import scrub
from trainsentry.errors import ConfigError, NotifierError
from trainsentry.events import AlertEvent

__all__ = [
    "Receiver",
    "RetryPolicy",
    "SlidingWindowLimiter",
    "Failure",
    "FailureKind",
    "DeliveryResult",
    "Deliverer",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_WINDOW_S",
]

logger = logging.getLogger(__name__)

#: DingTalk and WeCom: 20 messages per minute per robot.
DEFAULT_MAX_MESSAGES = 20
DEFAULT_WINDOW_S = 60.0

FailureKind = Literal["config_error", "rejected", "gave_up", "internal", "closed"]
#: Failures after which the alert will never be delivered by retrying it: commit past them.
PERMANENT_KINDS: frozenset[str] = frozenset({"config_error", "rejected", "gave_up", "internal"})


@runtime_checkable
class Receiver(Protocol):
    """Something that turns alerts into one chat message and sends it.

    ``send_alerts`` returns once the server acknowledged the message, or raises
    :class:`~notifiers.errors.Throttled` / :class:`~notifiers.errors.TransientError`
    (retried), :class:`~notifiers.errors.ConfigurationError` (never retried) or
    :class:`~notifiers.errors.MessageRejected` (this message cannot be sent).
    ``max_batch`` is the most alerts one digest may hold (so it fits the size limit).
    """

    name: str
    max_batch: int

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, bounded by the total time spent on one message."""

    initial_s: float = 1.0
    multiplier: float = 2.0
    max_backoff_s: float = 60.0
    #: Fraction of each backoff taken off at random, so many workers do not retry in step.
    jitter: float = 0.5
    max_total_s: float = 900.0

    def backoff(self, retry: int, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        base = min(self.max_backoff_s, self.initial_s * self.multiplier ** max(retry - 1, 0))
        return base * (1.0 - self.jitter * rng())


class SlidingWindowLimiter:
    """At most ``max_events`` in any ``window_s`` seconds, by the injected clock."""

    def __init__(self, *, max_events: int = DEFAULT_MAX_MESSAGES,
                 window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_events < 1 or window_s <= 0:
            raise ConfigError("a rate limit needs max_events >= 1 and window_s > 0")
        self.max_events = max_events
        self.window_s = window_s
        self._clock = clock
        self._events: deque[float] = deque()

    def _expire(self, now: float) -> None:
        while self._events and self._events[0] <= now - self.window_s:
            self._events.popleft()

    def wait_time(self) -> float:
        """Seconds until one more event is allowed (0 when it is allowed now)."""
        now = self._clock()
        self._expire(now)
        if len(self._events) < self.max_events:
            return 0.0
        return max(self._events[0] + self.window_s - now, 1e-6)

    def record(self) -> None:
        """Count an event now. Recorded when a request *finished*, which is never before the
        server saw it, so the server's window can never hold more than ours."""
        now = self._clock()
        self._expire(now)
        self._events.append(now)

    def count(self) -> int:
        self._expire(self._clock())
        return len(self._events)


@dataclass(frozen=True, slots=True)
class Failure:
    """One alert that one receiver did not get, and why."""

    receiver: str
    alert_id: str
    kind: FailureKind
    reason: str


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """What :meth:`Deliverer.deliver` did: alert ids acknowledged per receiver, and failures."""

    delivered: dict[str, tuple[str, ...]] = field(default_factory=dict)
    failed: tuple[Failure, ...] = ()

    @property
    def ok(self) -> bool:
        """Every receiver acknowledged every alert."""
        return not self.failed

    @property
    def settled(self) -> bool:
        """Nothing is left that a later retry could deliver: safe to commit the offset.

        False only when the deliverer was closed before it finished (kind ``closed``).
        """
        return all(f.kind in PERMANENT_KINDS for f in self.failed)


@dataclass(slots=True)
class _Item:
    alert: AlertEvent
    future: asyncio.Future[tuple[bool, FailureKind | None, str]]


@dataclass(slots=True)
class _Lane:
    receiver: Receiver
    limiter: SlidingWindowLimiter
    max_batch: int
    queue: deque[_Item] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    in_flight: int = 0
    state: str = "ok"
    reason: str | None = None
    last_error: str | None = None
    disabled_until: float | None = None
    attempts: int = 0
    sent: int = 0
    alerts_sent: int = 0
    failed: int = 0
    retries: int = 0
    throttled: int = 0
    last_ok: float | None = None


class Deliverer:
    """Delivers alerts to every receiver, within rate limits, merging bursts into digests.

    ``clock`` and ``sleep`` drive the rate limiter and the backoff (tests pass a fake pair
    or a short ``window_s``); ``limits`` overrides ``(max_messages, window_s)`` per receiver
    name. After a configuration error a receiver is not tried again for ``config_recheck_s``
    seconds; alerts for it fail at once (kind ``config_error``) meanwhile.
    """

    def __init__(self, *, receivers: Sequence[Receiver],
                 max_messages: int = DEFAULT_MAX_MESSAGES, window_s: float = DEFAULT_WINDOW_S,
                 limits: Mapping[str, tuple[int, float]] | None = None,
                 retry: RetryPolicy | None = None, config_recheck_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 rng: Callable[[], float] = random.random) -> None:
        names = [r.name for r in receivers]
        if len(set(names)) != len(names):
            raise ConfigError(f"receiver names must be unique, got {names}")
        limits = dict(limits or {})
        self.retry = retry or RetryPolicy()
        self.config_recheck_s = config_recheck_s
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._closed = False
        self._lanes: dict[str, _Lane] = {}
        for r in receivers:
            n, w = limits.get(r.name, (max_messages, window_s))
            self._lanes[r.name] = _Lane(
                receiver=r, limiter=SlidingWindowLimiter(max_events=n, window_s=w, clock=clock),
                max_batch=max(1, int(getattr(r, "max_batch", 20))))

    def __repr__(self) -> str:
        return f"Deliverer(receivers={list(self._lanes)})"

    @property
    def receivers(self) -> list[Receiver]:
        return [lane.receiver for lane in self._lanes.values()]

    # -- public API ------------------------------------------------------------------------
    async def deliver(self, alerts: Sequence[AlertEvent]) -> DeliveryResult:
        """Queue ``alerts`` for every receiver; return when each is acknowledged or failed for good."""
        if self._closed:
            raise NotifierError("this Deliverer is closed; build a new one")
        if not alerts or not self._lanes:
            return DeliveryResult(delivered={name: () for name in self._lanes})
        loop = asyncio.get_running_loop()
        pending: list[tuple[str, AlertEvent, asyncio.Future[tuple[bool, FailureKind | None, str]]]] = []
        for name, lane in self._lanes.items():
            self._ensure_worker(lane)
            for alert in alerts:
                fut: asyncio.Future[tuple[bool, FailureKind | None, str]] = loop.create_future()
                lane.queue.append(_Item(alert, fut))
                pending.append((name, alert, fut))
            lane.wakeup.set()
        outcomes = await asyncio.gather(*(fut for _, _, fut in pending))
        delivered: dict[str, list[str]] = {name: [] for name in self._lanes}
        failed: list[Failure] = []
        for (name, alert, _), (ok, kind, reason) in zip(pending, outcomes, strict=True):
            if ok:
                delivered[name].append(alert.id)
            else:
                failed.append(Failure(name, alert.id, kind or "internal", reason))
        return DeliveryResult({k: tuple(v) for k, v in delivered.items()}, tuple(failed))

    def health(self) -> dict[str, dict[str, Any]]:
        """Per receiver: state (``ok`` / ``retrying`` / ``config_error``), reason and counters.

        Safe to serve on a status endpoint: reasons are redacted error texts.
        """
        out: dict[str, dict[str, Any]] = {}
        for name, lane in self._lanes.items():
            out[name] = {
                "state": lane.state,
                "reason": lane.reason,
                "last_error": lane.last_error,
                "attempts": lane.attempts,
                "sent": lane.sent,
                "alerts_sent": lane.alerts_sent,
                "failed": lane.failed,
                "retries": lane.retries,
                "throttled": lane.throttled,
                "queued": sum(1 for i in lane.queue if not i.future.done()),
                "in_flight": lane.in_flight,
                "window_used": lane.limiter.count(),
                "window_max": lane.limiter.max_events,
            }
        return out

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queue is empty and nothing is in flight; False on timeout."""
        async def _wait() -> None:
            while any(lane.queue or lane.in_flight for lane in self._lanes.values()):
                await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(_wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def aclose(self, *, drain_timeout: float = 0.0) -> None:
        """Stop the workers (after up to ``drain_timeout`` s of draining) and close the receivers.

        Alerts still queued fail with kind ``closed`` (not settled: do not commit them).
        """
        if self._closed:
            return
        if drain_timeout > 0:
            await self.drain(drain_timeout)
        self._closed = True
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
                try:
                    await lane.task
                except asyncio.CancelledError:
                    pass
                except Exception:  # already logged by the worker
                    pass
            self._fail(lane, list(lane.queue), "closed", "the deliverer was closed", count=False)
            lane.queue.clear()
            close = getattr(lane.receiver, "aclose", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> Deliverer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the worker ------------------------------------------------------------------------
    def _ensure_worker(self, lane: _Lane) -> None:
        if lane.task is None or lane.task.done():
            lane.task = asyncio.get_running_loop().create_task(
                self._worker(lane), name=f"trainsentry-notify-{lane.receiver.name}")

    async def _worker(self, lane: _Lane) -> None:
        while True:
            await lane.wakeup.wait()
            lane.wakeup.clear()
            while any(not i.future.done() for i in lane.queue):
                batch: list[_Item] = []
                try:
                    await self._send_batch(lane, batch)
                except asyncio.CancelledError:
                    self._fail(lane, batch, "closed", "the deliverer was closed", count=False)
                    raise
                except Exception as exc:  # a bug of ours: fail the batch, keep the lane alive
                    reason = f"internal error: {type(exc).__name__}"
                    logger.error("%s: %s; %d alert(s) not sent", lane.receiver.name, reason,
                                 len(batch))
                    logger.debug("internal error details", exc_info=True)
                    self._fail(lane, batch, "internal", reason)
            lane.queue.clear()

    def _take(self, lane: _Lane, batch: list[_Item]) -> None:
        """Top ``batch`` up from the queue: alerts that queued meanwhile join the same message."""
        while lane.queue and len(batch) < lane.max_batch:
            item = lane.queue.popleft()
            if not item.future.done():  # done = its deliver() call was cancelled
                batch.append(item)
        lane.in_flight = len(batch)

    async def _send_batch(self, lane: _Lane, batch: list[_Item]) -> None:
        name = lane.receiver.name
        started: float | None = None
        retries = 0
        try:
            while True:
                if lane.disabled_until is not None and self._clock() < lane.disabled_until:
                    self._take(lane, batch)
                    self._fail(lane, batch, "config_error", lane.reason or "configuration error")
                    return
                while (delay := lane.limiter.wait_time()) > 0:
                    if started is not None:  # the time bound covers waits for a rate slot too
                        elapsed = self._clock() - started
                        if elapsed >= self.retry.max_total_s:
                            self._give_up(lane, batch, retries, elapsed)
                            return
                        delay = min(delay, self.retry.max_total_s - elapsed)
                    await self._sleep(delay)
                self._take(lane, batch)
                batch[:] = [i for i in batch if not i.future.done()]
                if not batch:
                    return
                if started is None:
                    started = self._clock()
                lane.attempts += 1
                try:
                    await lane.receiver.send_alerts([i.alert for i in batch])
                except ConfigurationError as exc:
                    lane.limiter.record()
                    reason = scrub(str(exc))
                    lane.state, lane.reason, lane.last_error = "config_error", reason, reason
                    lane.disabled_until = self._clock() + self.config_recheck_s
                    logger.error("configuration error, not retrying (%d alert(s) lost; fix the "
                                 "setting and restart): %s", len(batch), reason)
                    self._fail(lane, batch, "config_error", reason)
                    return
                except MessageRejected as exc:
                    lane.limiter.record()
                    reason = scrub(str(exc))
                    lane.last_error = reason
                    logger.error("message rejected, not retrying (%d alert(s) lost): %s",
                                 len(batch), reason)
                    self._fail(lane, batch, "rejected", reason)
                    return
                except TransientError as exc:
                    lane.limiter.record()
                    reason = scrub(str(exc))
                    lane.last_error = reason
                    lane.retries += 1
                    retries += 1
                    delay = self.retry.backoff(retries, self._rng)
                    if isinstance(exc, Throttled):
                        lane.throttled += 1
                        # The robot counts messages we cannot see (other senders); wait at
                        # least one slot's worth, or what the server asked for.
                        slot = lane.limiter.window_s / lane.limiter.max_events
                        delay = max(delay, slot, exc.retry_after or 0.0)
                    elapsed = self._clock() - started
                    if elapsed >= self.retry.max_total_s:
                        self._give_up(lane, batch, retries, elapsed)
                        return
                    delay = min(delay, self.retry.max_total_s - elapsed)
                    lane.state = "retrying"
                    logger.warning("%s; retry %d in %.2fs", reason, retries, delay)
                    await self._sleep(delay)
                    continue
                lane.limiter.record()
                lane.sent += 1
                lane.alerts_sent += len(batch)
                lane.state, lane.reason, lane.disabled_until = "ok", None, None
                lane.last_ok = time.time()
                if retries:
                    logger.info("%s: delivered %d alert(s) after %d retries", name, len(batch),
                                retries)
                for item in batch:
                    if not item.future.done():
                        item.future.set_result((True, None, ""))
                batch.clear()
                return
        finally:
            lane.in_flight = 0

    def _give_up(self, lane: _Lane, batch: list[_Item], retries: int, elapsed: float) -> None:
        lane.state = "failing"
        reason = lane.last_error or "no answer"
        logger.error("%s: giving up after %d retries in %.0fs (%d alert(s) lost); last error: %s",
                     lane.receiver.name, retries, elapsed, len(batch), reason)
        self._fail(lane, batch, "gave_up", f"gave up after {retries} retries: {reason}")

    def _fail(self, lane: _Lane, items: list[_Item], kind: FailureKind, reason: str,
              *, count: bool = True) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_result((False, kind, reason))
                if count:
                    lane.failed += 1
        items.clear()
