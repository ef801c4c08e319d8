"""The notify agent: the alerts topic is the outbox; chat delivery is at-least-once, deduplicated.

Alerts are taken in small batches (up to 100 or 0.2 s) and handed to the
:class:`~notifiers.lifecycle.AlertBook`, which decides per run and fingerprint what to
send (pending ``for``, repeats and escalation, silences, acks, inhibition, resolved only
after a delivered firing) and dedups ids already handled. The notices of a batch go to the
:class:`~notifiers.delivery.Deliverer` together, so a run's problems of one tick share one
digest. Only after it settled (every receiver acknowledged or failed for good) are the
run's book states written to the ``alert_book`` table (changelog-backed, keyed by run_id
like the alerts topic) and flushed, the transitions published to the history topic, and
the batch acked, so Faust commits the offsets after delivery.

After a crash, notices that were staged but not settled are finished first (for the
receivers that had not acknowledged them), by the agent for the runs of its batch and by
the timer for the others, before anything new of those runs is decided. The
:class:`OffsetGuard` makes sure no record of the alerts topic is skipped on the way in
(Faust can drop fetched records around a rebalance; see its docstring).

Shutdown (SIGTERM) cancels the agent mid-delivery: the batch's messages are then held
(an extra reference), so they are never acked nor committed and a restart redelivers them.
A timer releases what waited: matured pending warnings, alerts whose silence expired or
whose root cause resolved. It also retires the books of runs with nothing open and nothing
waiting that have not changed for ``TRAINSENTRY_ALERT_BOOK_RETENTION_S`` (default a day):
dropped from memory, with a tombstone on the changelog.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from notifiers.lifecycle import AlertBook, Plan, Send
from stream_app.offsets import STALL_S, OffsetGuard, seek_stalled, start_offset
from trainsentry.errors import EventError
from trainsentry.events import AlertEvent, decode_record

__all__ = ["install_notifier", "OffsetGuard"]

log = logging.getLogger(__name__)

#: How long the agent waits for the silences topic to be read before sending anyway.
READY_WAIT_S = 30.0
def _run_keyed_table(app: Any, name: str, partitions: int) -> Any:
    """A bytes table whose changelog partition is the run's alerts-topic partition.

    Why not Faust's default: it takes the partition of the *current event*, which a timer
    has none of and a batch mixes; ``use_partitioner`` needs producer metadata that is not
    there at the first write. Kafka's default partitioner (murmur2 of the key), which put
    the run's alerts where they are, is a pure function, so compute it here.
    """
    import faust
    from aiokafka.partitioner import murmur2

    class RunKeyedTable(faust.Table[bytes, bytes]):
        def partition_for_key(self, key: Any) -> int | None:
            return int(murmur2(key) & 0x7FFFFFFF) % partitions

    raw: faust.Schema[bytes, bytes] = faust.Schema(key_type=bytes, value_type=bytes,
                                                   key_serializer="raw", value_serializer="raw")
    return app.tables.add(RunKeyedTable(app, name=name, default=None, beacon=app.tables.beacon,
                                        partitions=partitions, schema=raw,
                                        # the types, not just the schema, pick the serializers
                                        # that changelog recovery decodes with
                                        key_type=bytes, value_type=bytes))


def install_notifier(app: Any, *, alerts_topic: Any, notifier: Any, svc: Any, partitions: int,
                     batch: int = 100, within_s: float = 0.2, due_interval_s: float = 1.0,
                     stall_s: float = STALL_S) -> None:
    """Declare the ``alert_book`` table, the notify agent and its timers."""
    from stream_app.alerting_api import Alerting

    ctx: Alerting | None = svc.extra.get("alerting")
    if ctx is None:  # built without install_alerting: no silences/history topics
        ctx = Alerting(None)
        ctx.ready.set()
        svc.extra["alerting"] = ctx
    lanes = ctx.fanout(notifier)
    book = AlertBook(ctx.config)
    table = _run_keyed_table(app, "alert_book", partitions)
    lock = asyncio.Lock()
    waiting: set[str] = set()  # runs with something not notified or not settled: timer work
    dirty: set[str] = set()
    state: dict[str, Any] = {"generation": 0, "seen_generation": 0, "scanned": False,
                             "flusher": None, "retire_check": 0.0}
    # run -> when its book last changed, for every book of this worker's partitions: what
    # retirement looks at (a book's own ``touched``; None: unknown, counted from now).
    ages: dict[str, float | None] = {}
    retire_every_s = min(30.0, ctx.config.book_retention_s / 4)
    guard = OffsetGuard(stall_s=stall_s, name="alerts")
    held: dict[int, list[Any]] = {}  # partition -> messages held back past a hole
    topic_names = set(alerts_topic.topics)
    for key in ("delivered", "duplicates_skipped", "notices", "held_on_shutdown",
                "alert_books_retired"):
        svc.extra[key] = 0
    # shown by GET /api/alerting
    ctx.stats.update(offset_seeks=0, resumed_notices=0)

    def health() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for lane in lanes.values():
            out.update(lane.health())
        return out

    def sync_generation() -> None:
        # Partitions moved: cached run books may belong to another worker now.
        if state["seen_generation"] != state["generation"]:
            book.runs.clear()
            waiting.clear()
            ages.clear()
            state["scanned"] = False
            state["seen_generation"] = state["generation"]

    def owned_tps() -> dict[int, Any]:
        """The alerts-topic partitions this worker holds now (partition -> TP)."""
        try:
            assignment = app.consumer.assignment()
        except Exception:  # the consumer is not started yet: nothing is assigned
            return {}
        return {tp.partition: tp for tp in assignment if tp.topic in topic_names}

    def load(run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            if run_id not in book.runs:
                raw = table.get(run_id.encode())
                book.restore(run_id, json.loads(raw) if raw else None)

    def forget(run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            book.runs.pop(run_id, None)  # reloaded from the table next time

    def persist(run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            run = book.runs.get(run_id)
            dirty.discard(run_id)
            if run is None:
                continue
            table[run_id.encode()] = json.dumps(run.to_dict(), separators=(",", ":")).encode()
            (waiting.add if run.waiting else waiting.discard)(run_id)
            ages[run_id] = run.touched

    def retire_books(now: float) -> None:
        """Drop the books of runs with nothing open or waiting that have not changed for
        TRAINSENTRY_ALERT_BOOK_RETENTION_S: from memory, and from the changelog (a
        tombstone), so neither grows with every run that ever alerted."""
        if now - state["retire_check"] < retire_every_s:
            return
        state["retire_check"] = now
        limit = ctx.config.book_retention_s
        mine = set(owned_tps())
        for run_id, touched in list(ages.items()):
            if (touched is not None and now - touched < limit) or run_id in waiting:
                continue
            key = run_id.encode()
            if table.partition_for_key(key) not in mine:
                ages.pop(run_id, None)  # moved to another worker: its owner decides
                continue
            try:
                load([run_id])
            except (ValueError, KeyError, TypeError) as exc:  # unreadable: kept, never deleted
                ages.pop(run_id, None)
                log.error("alert book of run %r does not load (%s); it is kept as it is",
                          run_id, exc)
                continue
            if not book.retirable(run_id, now=now):
                ages[run_id] = book.runs[run_id].touched
                continue
            if table.get(key) is not None:
                del table[key]  # a tombstone: compaction removes the run's entries
            book.runs.pop(run_id, None)
            ages.pop(run_id, None)
            svc.extra["alert_books_retired"] += 1
            log.info("alert book of run %s retired: nothing open and no change for %.0fs; an "
                     "alert of this run after this starts a fresh book", run_id, limit)

    async def persist_soon() -> None:
        # Receivers acknowledge one digest at a time; write their progress in small batches.
        await asyncio.sleep(0.05)
        state["flusher"] = None
        persist(list(dirty))
        await app.producer.flush()

    async def send_one(name: str, send: Send) -> bool:
        result = await lanes[name].deliver([send.notice])
        for failure in result.failed:
            log.error("alert %s not delivered to %s (%s): %s", failure.alert_id,
                      failure.receiver, failure.kind, failure.reason)
        if not result.settled:
            return False
        ok = bool(result.delivered.get(name)) or (name == "notifier" and result.ok)
        book.mark(send.run_id, send.notice.id, name, ok=ok)
        dirty.add(send.run_id)
        if state["flusher"] is None:
            state["flusher"] = asyncio.ensure_future(persist_soon())
        return True

    async def execute(plan: Plan) -> bool:
        """Stage, deliver per receiver, settle, persist, publish. False: not settled."""
        if not plan.notices and not plan.records:
            return True
        book.stage(plan)
        persist(plan.runs)
        # The changelog must know what is staged before anything goes out.
        await app.producer.flush()
        if plan.records:  # decided without a delivery (pending, silenced, inhibited, ...)
            await ctx.publish_history(plan.records)
            plan.records = []
        jobs = [send_one(name, send) for send in plan.sends
                for name in book.todo(send.run_id, send.notice.id, lanes)]
        if jobs:
            settled = await asyncio.gather(*jobs)
            svc.extra["notifier_health"] = health()
            if not all(settled):
                return False
        delivered = book.delivered(plan)
        records = book.settle(plan, delivered, now=time.time())
        persist(plan.runs)
        await app.producer.flush()
        svc.extra["delivered"] += len(plan.notices)
        svc.extra["notices"] += len(delivered)
        await ctx.publish_history(records)
        return True

    async def resume(run_ids: Sequence[str]) -> bool:
        """Finish the notices these runs staged before a crash, before anything new."""
        staged = [r for r in run_ids if (run := book.runs.get(r)) is not None and run.outbox]
        if not staged:
            return True
        plan = book.resume(staged)
        log.info("resuming %d staged notice(s) of %d run(s) for the receivers that had not "
                 "acknowledged them", len(plan.sends), len(staged))
        ctx.stats["resumed_notices"] += len(plan.sends)
        return await execute(plan)

    def decode(events: Sequence[Any]) -> list[AlertEvent]:
        alerts: list[AlertEvent] = []
        for event in events:
            try:
                alert = decode_record(event.value, "alert")
            except EventError as exc:
                log.warning("skipping undecodable alert record: %s", exc)
                continue
            assert isinstance(alert, AlertEvent)
            alerts.append(alert)
        return alerts

    def hold(events: Sequence[Any]) -> None:
        # One more reference than the stream will release: never acked, never committed.
        for event in events:
            event.message.incref()
        svc.extra["held_on_shutdown"] += len(events)

    async def seek(tp: Any, offset: int, why: str) -> None:
        log.warning("alerts partition %d: %s; seeking back to offset %d to read it again",
                    tp.partition, why, offset)
        ctx.stats["offset_seeks"] += 1
        await app.consumer.seek(tp, offset)

    async def admit(events: Sequence[Any]) -> list[Any]:
        """The events to process now; those past a hole are held until it is read again."""
        out: list[Any] = []
        wanted: dict[int, int] = {}
        for event in events:
            msg = event.message
            if not guard.knows(msg.partition):
                guard.start(msg.partition, await start_offset(app.consumer, msg.tp))
            ok, seek_to = guard.admit(msg.partition, msg.offset)
            if seek_to is not None:
                wanted[msg.partition] = seek_to
            if ok:
                out.append(event)
            else:
                msg.incref()  # not acked by the stream: no commit passes the hole
                held.setdefault(msg.partition, []).append(msg)
        tps = owned_tps()
        for partition, offset in wanted.items():
            if partition in tps:
                await seek(tps[partition], offset, "records were skipped on the way in")
        return out

    def release() -> None:
        """Let go of held messages once the agent has read past them again."""
        for partition, msgs in list(held.items()):
            nxt = guard.expected(partition)
            keep = []
            for msg in msgs:
                if nxt is not None and msg.offset < nxt:
                    msg.ack(app.consumer)
                else:
                    keep.append(msg)
            held[partition] = keep

    @app.agent(alerts_topic, name="trainsentry.notify")  # type: ignore[untyped-decorator]
    async def notify(stream: Any) -> None:
        async for events in stream.take_events(batch, within=within_s):
            guard.busy()
            try:
                await handle(events)
            finally:
                guard.idle()

    async def handle(events: Sequence[Any]) -> None:
        if not ctx.ready.is_set():
            try:
                await asyncio.wait_for(ctx.ready.wait(), READY_WAIT_S)
            except TimeoutError:
                log.warning("silences not loaded after %.0fs; notifying without them",
                            READY_WAIT_S)
                ctx.ready.set()
        events = await admit(events)
        alerts = decode(events)
        if not alerts:
            release()
            return
        for alert in alerts:
            ctx.history.note(alert)
        done = False
        runs = sorted({a.run_id for a in alerts})
        try:
            async with lock:
                sync_generation()
                load(runs)
                if await resume(runs):
                    now = time.time()
                    plan = book.observe(alerts, now=now, silences=ctx.silences.active(now),
                                        acks=ctx.silences.acks)
                    svc.extra["duplicates_skipped"] += plan.duplicates
                    done = await execute(plan)
        except BaseException:
            if not done:
                hold(events)
                forget(runs)
            raise
        if not done:
            hold(events)
            forget(runs)
            raise RuntimeError("notifier closed before delivery settled; batch held")
        release()

    @app.timer(interval=due_interval_s, name="trainsentry.alert_due")  # type: ignore[untyped-decorator]
    async def due() -> None:
        # During a rebalance the table is being recovered: what it holds may be stale.
        if not ctx.ready.is_set() or app.rebalancing:
            return
        async with lock:
            sync_generation()
            if not state["scanned"]:
                mine = set(owned_tps())
                # Only runs of partitions this worker holds: the in-memory store keeps the
                # keys of partitions that moved to another worker, stale.
                for key, raw in list(table.items()):
                    if not raw or table.partition_for_key(key) not in mine:
                        continue
                    run_id = key.decode(errors="replace")
                    if b'"notified":false' in raw or b'"outbox":[{' in raw:
                        waiting.add(run_id)
                    try:
                        touched = json.loads(raw).get("touched")
                    except (ValueError, AttributeError):
                        touched = None  # load() reports an unreadable book when it is used
                    ages[run_id] = touched if isinstance(touched, (int, float)) else None
                state["scanned"] = True
            retire_books(time.time())
            if not waiting:
                return
            run_ids = sorted(waiting)
            load(run_ids)
            now = time.time()
            for step in ("resume", "due"):  # staged before a crash: finish that first
                plan = book.resume(run_ids) if step == "resume" else book.due(
                    now=now, silences=ctx.silences.active(now), acks=ctx.silences.acks,
                    run_ids=run_ids)
                if step == "resume" and plan.sends:
                    log.info("resuming %d staged notice(s) of %d run(s) for the receivers "
                             "that had not acknowledged them", len(plan.sends), len(plan.runs))
                    ctx.stats["resumed_notices"] += len(plan.sends)
                try:
                    ok = await execute(plan)
                except BaseException:
                    forget(plan.runs)
                    raise
                if not ok:
                    forget(plan.runs)
                    return
            for run_id in run_ids:
                run = book.runs.get(run_id)
                if run is not None and not run.waiting:
                    waiting.discard(run_id)

    @app.timer(interval=1.0, name="trainsentry.alert_offsets")  # type: ignore[untyped-decorator]
    async def offsets() -> None:
        # The guard's second half: records that never came while the agent sat idle.
        if app.rebalancing:
            return
        await seek_stalled(app.consumer, guard, owned_tps().items(), seek)

    @app.on_partitions_revoked.connect  # type: ignore[untyped-decorator]
    async def on_revoked(app_: Any, revoked: Any, **_: Any) -> None:
        state["generation"] += 1
        guard.reset()
        held.clear()  # an old generation's messages: the next one reads them again

    @app.timer(interval=5.0, name="trainsentry.notifier_health")  # type: ignore[untyped-decorator]
    async def health_timer() -> None:
        svc.extra["notifier_health"] = health()
