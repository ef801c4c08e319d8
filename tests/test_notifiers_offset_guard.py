"""The offset guard (both agents) and the commit check: no record is skipped on the way in.

Pure bookkeeping, so no Kafka here; tests/test_alerting_e2e.py drives it for real (a
SIGKILL and a restart whose table recovery made Faust drop fetched records).
"""

from __future__ import annotations

from stream_app.offsets import OffsetGuard, new_offset


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock, **kw: float) -> OffsetGuard:
    return OffsetGuard(clock=clock, stall_s=kw.get("stall_s", 5.0),
                       max_seeks=int(kw.get("max_seeks", 3)))


def test_records_in_order_pass_without_seeks() -> None:
    """Consecutive offsets from the committed one are all processed; nothing is sought."""
    g = guard(Clock())
    g.start(0, 10)
    assert [g.admit(0, o) for o in range(10, 20)] == [(True, None)] * 10
    assert g.expected(0) == 20 and g.seeks == 0


def test_record_past_a_hole_is_held_and_the_hole_read_again() -> None:
    """A record after a hole is held back with one seek to the hole; the re-read fills it,
    the held records then come again and pass, as does a redelivery below the hole."""
    clock = Clock()
    g = guard(clock)
    g.start(1, 0)
    for o in range(0, 50):
        g.admit(1, o)
    assert g.admit(1, 71) == (False, 50)
    assert g.admit(1, 72) == (False, None)  # the seek is on its way: hold, do not ask again
    assert [g.admit(1, o)[0] for o in range(50, 80)] == [True] * 30
    assert g.expected(1) == 80
    assert g.admit(1, 12) == (True, None)  # read twice: the book skips it by alert id


def test_first_record_past_the_committed_offset_is_a_hole() -> None:
    """Records dropped before the agent saw any: the committed offset reveals the hole."""
    g = guard(Clock())
    g.start(0, 9)
    assert g.admit(0, 20) == (False, 9)


def test_idle_agent_with_unread_records_seeks_back_once_per_stall() -> None:
    """Idle for stall_s while the partition's end is past the expected offset: one seek,
    repeated only after another stall_s; never while busy or with nothing unread."""
    clock = Clock()
    g = guard(clock)
    g.start(0, 0)
    for o in range(50):
        g.admit(0, o)
    g.idle()
    assert g.stalled(0, 100) is None  # not idle long enough yet
    clock.now += 5.0
    assert g.stalled(0, 50) is None  # everything was read
    assert g.stalled(0, 100) == 50
    assert g.stalled(0, 100) is None
    clock.now += 5.0
    assert g.stalled(0, 100) == 50
    g.busy()
    clock.now += 60.0
    assert g.stalled(0, 100) is None


def test_a_hole_that_stays_after_max_seeks_is_taken_for_a_gap() -> None:
    """Transaction markers or retention leave offsets that never come: skipped, not looped on."""
    clock = Clock()
    g = guard(clock, max_seeks=2)
    g.start(0, 5)
    assert g.admit(0, 7) == (False, 5)
    clock.now += 5.0
    assert g.admit(0, 7) == (False, 5)
    clock.now += 5.0
    assert g.admit(0, 7) == (True, None)
    assert g.expected(0) == 8 and g.gaps_skipped == 1


def test_reset_forgets_positions_after_a_rebalance() -> None:
    """Partitions moved: the next generation starts from its own committed offsets."""
    g = guard(Clock())
    g.start(0, 0)
    g.admit(0, 0)
    g.reset()
    assert not g.knows(0)
    g.start(0, 40)
    assert g.admit(0, 40) == (True, None)


def test_commit_never_passes_an_unacked_record_at_the_head() -> None:
    """Faust's own check commits 13 here (it refuses only when min(acked) - committed > 1)
    and skips the check when nothing was committed yet; the detect agent acks out of order."""
    assert new_offset([11, 12], committed=10, first=0) is None  # record 10 is still held
    assert new_offset([5, 6], committed=None, first=0) is None  # 0..4 are still held
    assert new_offset([3, 4], committed=0, first=0) is None  # 0 is falsy upstream
    acked = [12, 10, 11, 14]
    assert new_offset(acked, committed=10, first=0) == 13
    assert acked == [14]  # the committed run is taken off, the rest waits
    assert new_offset([0, 1], committed=None, first=0) == 2


def test_patched_consumer_uses_the_fixed_check() -> None:
    """The consumer install_commit_fix puts on the app's transport refuses the head gap."""
    from faust.types import TP

    from stream_app.offsets import install_commit_fix

    class Transport:
        class Consumer:
            def __init__(self) -> None:
                from collections import defaultdict

                from intervaltree import IntervalTree

                self._acked: dict = defaultdict(list)
                self._acked_index: dict = defaultdict(set)
                self._gap: dict = defaultdict(IntervalTree)
                self._committed_offset: dict = defaultdict(lambda: None)

            def track_message(self, message: object) -> None:
                pass

    class App:
        transport = Transport()

    install_commit_fix(App)
    consumer = App.transport.Consumer()
    tp = TP("metrics", 0)
    consumer._committed_offset[tp] = 10
    consumer._acked[tp] = [11, 12]
    consumer._acked_index[tp] = {11, 12}
    assert consumer._new_offset(tp) is None
    from faust.transport.consumer import Consumer as FaustConsumer  # the bug itself

    upstream = App.transport.Consumer()
    upstream._committed_offset[tp] = 10
    upstream._acked[tp] = [11, 12]
    assert FaustConsumer._new_offset(upstream, tp) == 13  # commits past un-acked 10
    consumer._acked[tp].append(10)
    consumer._acked_index[tp].add(10)
    assert consumer._new_offset(tp) == 13 and not consumer._acked_index[tp]
