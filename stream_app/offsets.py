"""Offset bookkeeping that works around faust-streaming 0.15 behaviours (both agents).

- :class:`OffsetGuard`: records Faust fetched but dropped around a rebalance's table
  recovery (see its docstring) are found and read again. Used by the notify agent
  (stream_app/notify.py) and the detect agent (stream_app/app.py).
- :func:`install_commit_fix`: Faust's commit check lets a commit pass a record that was
  never acked when acks come out of order (see :func:`new_offset`). The detect agent
  acks out of order on purpose (a run's records stay un-acked until its state is written).
- :class:`RecoveryWatch`: a table recovery that stops making progress (Faust waits for
  changelog events that never come) is told apart from a slow one, so the worker can be
  replaced instead of staying not-ready for good.

Pure bookkeeping apart from :func:`start_offset` and :func:`install_commit_fix`, which
touch Faust's consumer (faust-streaming is pinned; docs/operations.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, MutableMapping
from typing import Any

__all__ = ["OffsetGuard", "STALL_S", "RecoveryWatch", "recovery_progress", "start_offset",
           "highwater", "seek_stalled", "new_offset",
           "install_commit_fix"]

log = logging.getLogger(__name__)

#: How long the agent may sit idle while a partition has records it never got before the
#: guard seeks back to them, and the least time between two seeks to the same offset.
STALL_S = 5.0


class OffsetGuard:
    """Finds records the stream skipped, so the agent can seek back to them.

    Why: Faust (faust-streaming 0.15) can lose records it has already fetched when a
    rebalance's table recovery completes. ``flow_control.resume()`` clears the stream
    queues, and the seek back to the committed offsets that should fetch them again does
    nothing when the group has no committed offset yet, or is undone by a fetch still in
    flight (whose records move the read offset past the re-fetched ones, which are then
    dropped as already read). Those records never reach the agent in this process: a
    burst after a SIGKILL stalled half-delivered, or lost a run of alerts in the middle.
    The agents are idempotent (the notify book skips alert ids it has handled; the detect
    engine ignores a step/layer it has already joined or evaluated), so reading a record
    twice is harmless; skipping one is not.

    Per partition (any hashable key: a partition number for one topic, a ``TP`` for an
    agent reading several topics) the guard keeps the next offset the agent expects. A
    record past a hole is held back (neither processed nor acked, so no commit can pass
    the hole) and the agent seeks back to the hole; when the agent sits idle for ``stall_s`` while a
    partition's high-water mark is past the expected offset, it seeks back too. A hole
    that is still there after ``max_seeks`` seeks is taken for a real gap (transaction
    markers, retention) and skipped. Pure bookkeeping: the agent feeds it offsets and
    performs the seeks; ``clock`` is injectable for tests.
    """

    def __init__(self, *, stall_s: float = STALL_S, max_seeks: int = 10,
                 clock: Callable[[], float] = time.monotonic, name: str = "") -> None:
        self.name = name
        self.stall_s = stall_s
        self.max_seeks = max_seeks
        self._clock = clock
        self._next: dict[Hashable, int] = {}
        #: partition -> (offset sought, seeks to it so far, when the last one was asked)
        self._seeks: dict[Hashable, tuple[int, int, float]] = {}
        self._idle_since: float | None = clock()
        self.seeks = 0
        self.gaps_skipped = 0

    def reset(self) -> None:
        """Partitions moved (a rebalance): forget every position."""
        self._next.clear()
        self._seeks.clear()

    def knows(self, partition: Hashable) -> bool:
        return partition in self._next

    def expected(self, partition: Hashable) -> int | None:
        """The next offset the agent has to see on ``partition`` (None: not known yet)."""
        return self._next.get(partition)

    def start(self, partition: Hashable, offset: int) -> None:
        """Reading ``partition`` begins at ``offset`` (its committed offset), unless known."""
        self._next.setdefault(partition, offset)

    def busy(self) -> None:
        """The agent took a batch."""
        self._idle_since = None

    def idle(self) -> None:
        """The agent is waiting for the next batch."""
        self._idle_since = self._clock()

    def admit(self, partition: Hashable, offset: int) -> tuple[bool, int | None]:
        """``(process, seek_to)`` for one record: process it now or hold it back, and the
        offset to seek ``partition`` back to (None: no seek now)."""
        nxt = self._next.get(partition)
        if nxt is None or offset == nxt:
            self._next[partition] = offset + 1
            return True, None
        if offset < nxt:  # read again after a seek: the book skips what it handled
            return True, None
        target, count, at = self._seeks.get(partition, (nxt, 0, float("-inf")))
        if target != nxt:
            count, at = 0, float("-inf")
        if count >= self.max_seeks:
            log.warning("%s partition %s: offsets %d..%d stayed missing after %d seeks; "
                        "taking them for a gap in the topic", self.name, partition, nxt,
                        offset - 1, count)
            self._next[partition] = offset + 1
            self._seeks.pop(partition, None)
            self.gaps_skipped += 1
            return True, None
        return False, self._ask(partition, nxt, count, at)

    def stalled(self, partition: Hashable, highwater: int | None) -> int | None:
        """The offset to seek ``partition`` back to when the agent sat idle for ``stall_s``
        while records up to ``highwater`` (the partition's end offset) never came."""
        nxt = self._next.get(partition)
        if (nxt is None or highwater is None or highwater <= nxt or self._idle_since is None
                or self._clock() - self._idle_since < self.stall_s):
            return None
        target, count, at = self._seeks.get(partition, (nxt, 0, float("-inf")))
        if target != nxt:
            count, at = 0, float("-inf")
        return self._ask(partition, nxt, count, at)

    def _ask(self, partition: Hashable, offset: int, count: int, at: float) -> int | None:
        now = self._clock()
        if now - at < self.stall_s:
            return None  # a seek to it is on its way
        self._seeks[partition] = (offset, count + 1, now)
        self.seeks += 1
        return offset


async def start_offset(consumer: Any, tp: Any) -> int:
    """Where this generation's reading of ``tp`` began: the group's committed offset."""
    # Faust keeps the committed offsets it sought to at the last rebalance (faust-
    # streaming is pinned; without it the guard starts at the first record it sees).
    committed = getattr(consumer, "_committed_offset", {}).get(tp)
    if committed is not None:
        return int(committed)
    # None: nothing committed (or 0): the group reads from the earliest record
    earliest = await consumer.earliest_offsets(tp)
    return int(earliest.get(tp) or 0)


def highwater(consumer: Any, tp: Any) -> int | None:
    """``tp``'s end offset, or None while a rebalance takes it away (aiokafka asserts the
    partition is assigned, and Faust's view of the assignment can run ahead of it)."""
    try:
        found = consumer.highwater(tp)
    except Exception:  # AssertionError("Partition is not assigned") mid-rebalance
        return None
    return None if found is None else int(found)


async def seek_stalled(consumer: Any, guard: OffsetGuard, tps: Iterable[tuple[Hashable, Any]],
                       seek: Callable[[Any, int, str], Awaitable[None]]) -> None:
    """The guard's second half, for an agent's timer: ``(key, tp)`` pairs whose records
    never came while the agent sat idle are sought back to (``seek(tp, offset, why)``)."""
    for key, tp in tps:
        end = highwater(consumer, tp)
        if end is None:
            continue
        if not guard.knows(key):
            guard.start(key, await start_offset(consumer, tp))
        target = guard.stalled(key, end)
        if target is not None:
            await seek(tp, target, f"records up to offset {end - 1} never reached the agent")


def new_offset(acked: list[int], committed: int | None, first: int | None) -> int | None:
    """The offset to commit for one partition, or None; takes the committed run off ``acked``.

    ``acked``: offsets acked since the last commit (any order, no duplicates; sorted in
    place); ``committed``: the group's committed offset (the next record to read), None
    when nothing was committed yet; ``first``: the lowest offset delivered since the
    partition was assigned (the base when nothing was committed).

    Faust's own ``Consumer._new_offset`` (transport/consumer.py) only refuses to commit
    when ``min(acked) - committed > 1`` and skips that check entirely when ``committed``
    is falsy (None: nothing committed yet; 0). So with ``committed == 10`` and record 10
    still un-acked, acked ``[11, 12]`` commits 13; with nothing committed, acked
    ``[5, 6]`` commits 7 past un-acked records 0..4. A crash then skips those records.
    Here the acked run has to start exactly at the base.
    """
    if not acked:
        return None
    acked.sort()
    base = committed if committed is not None else first
    if base is not None and acked[0] > base:
        return None  # the record at the base is not acked yet
    n = 1
    while n < len(acked) and acked[n] == acked[n - 1] + 1:
        n += 1
    end = acked[n - 1] + 1
    del acked[:n]
    return end


def install_commit_fix(app: Any) -> None:
    """Make ``app``'s consumer use :func:`new_offset` (call before the consumer exists)."""
    transport = app.transport
    base_cls = transport.Consumer
    if getattr(base_cls, "_trainsentry_commit_fix", False):
        return

    class Consumer(base_cls):  # type: ignore[misc, valid-type]
        """Faust's consumer with the head-of-acked check of :func:`new_offset`."""

        _trainsentry_commit_fix = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._first_offset: MutableMapping[Any, int] = {}

        def track_message(self, message: Any) -> None:
            first = self._first_offset.get(message.tp)
            if first is None or message.offset < first:
                self._first_offset[message.tp] = message.offset
            super().track_message(message)

        async def on_partitions_revoked(self, revoked: Any) -> None:
            for tp in revoked:
                self._first_offset.pop(tp, None)
            await super().on_partitions_revoked(revoked)

        def _new_offset(self, tp: Any) -> int | None:
            acked = self._acked[tp]
            if not acked:
                return None
            gap_for_tp = self._gap[tp]
            if gap_for_tp:  # offsets never in the log (Faust's gap bookkeeping, as upstream)
                max_offset = max(acked)
                candidates = sorted(gap_for_tp.overlap(0, max_offset), key=lambda x: x.begin)
                if candidates:
                    extra: list[int] = []
                    for entry in candidates:
                        extra.extend(range(entry.begin, entry.end))
                    present = set(acked)
                    acked.extend(o for o in dict.fromkeys(extra) if o not in present)
                    gap_for_tp.chop(0, max(extra[-1], max_offset + 1))
            before = len(acked)
            offset = new_offset(acked, self._committed_offset[tp], self._first_offset.get(tp))
            if offset is not None:
                self._acked_index[tp].difference_update(range(offset - (before - len(acked)),
                                                              offset))
            return offset

    transport.Consumer = Consumer


class RecoveryWatch:
    """Tells a table recovery that has made no progress for ``limit_s`` seconds.

    Why: faust-streaming can wait forever for changelog events of an active partition
    that never arrive ("No event received for active tp … since recovery start",
    faust-streaming#74, robinhood/faust#218). The worker is then not ready for good; a
    fresh process recovers. Progress is the sum of the recovery's read offsets: a slow
    recovery of a big changelog keeps moving and is left alone.

    >>> w = RecoveryWatch(60.0)
    >>> w.observe(0.0, recovering=True, progress=10), w.observe(59.0, recovering=True, progress=10)
    (None, None)
    >>> w.observe(60.0, recovering=True, progress=10)
    60.0
    >>> w.observe(70.0, recovering=True, progress=11)  # moved: the clock starts over
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None
        self._progress: int | None = None

    def observe(self, now: float, *, recovering: bool, progress: int | None) -> float | None:
        """Seconds without progress once they reach ``limit_s`` while recovering, else None."""
        if not recovering or self.limit_s <= 0:
            self._since = self._progress = None
            return None
        if self._since is None or progress != self._progress:
            self._since, self._progress = now, progress
            return None
        stuck = now - self._since
        return stuck if stuck >= self.limit_s else None


def recovery_progress(app: Any) -> int:
    """Sum of the offsets Faust's table recovery has read (active and standby)."""
    recovery = app.tables.recovery
    total = 0
    for offsets in (recovery.active_offsets, recovery.standby_offsets):
        total += sum(int(v) for v in offsets.values() if v is not None)
    return total
