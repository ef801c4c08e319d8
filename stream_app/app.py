"""The Faust application: thin agents over the pure pipeline.

- ``detect`` agent: the three metrics topics and the runs topic (co-partitioned by
  run_id) → per-run state in the ``run_state`` table (changelog-backed, so a restarted or
  new worker resumes detection without re-warming) → alerts and signed commands.
- ``hang`` timer: wall-clock check of every local run (training_hang).
- ``notify`` agent: alerts topic → chat (see stream_app/notify.py).
- HTTP: ``/healthz``, ``/readyz``, ``/metrics`` and the dashboard on the web port.

Nothing here connects in a constructor: :func:`build_app` only declares.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from detectors.engine import Engine, EngineConfig, RunState
from stream_app.offsets import (
    OffsetGuard,
    RecoveryWatch,
    install_commit_fix,
    recovery_progress,
    seek_stalled,
    start_offset,
)
from stream_app.pipeline import Outcome, Pipeline, Record, dump_state, load_state
from trainsentry.config import Settings
from trainsentry.errors import EventError

__all__ = ["build_app", "engine_config_for", "ServiceState"]

log = logging.getLogger(__name__)


@dataclass
class ServiceState:
    """In-process counters and caches, shared by agents and HTTP views of one worker."""

    consumed: dict[str, int] = field(default_factory=dict)
    deadletters: int = 0
    alerts: int = 0
    commands: int = 0
    started: float = field(default_factory=time.time)
    ready: bool = False  #: partitions were assigned
    cache: dict[str, RunState] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    #: True while partitions move or the tables are being restored (``build_app`` sets it).
    recovering: Callable[[], bool] = field(default=lambda: False)

    @property
    def serving(self) -> bool:
        """Ready for /readyz: partitions assigned and their state restored."""
        return self.ready and not self.recovering()


def engine_config_for(settings: Settings, catalog: Any | None = None) -> EngineConfig:
    """The engine's settings from the service's (the catalog: ``load_catalog``'s)."""
    extra: dict[str, Any] = {} if catalog is None else {"catalog": catalog}
    return EngineConfig(breaker_threshold=settings.breaker_threshold,
                        finished_retention_s=float(settings.finished_run_retention_s),
                        idle_retention_s=float(settings.idle_run_retention_s), **extra)


def _broker_url(bootstrap: str) -> str:
    return ";".join(f"kafka://{h.strip()}" for h in bootstrap.split(",") if h.strip())


def build_app(settings: Settings, *, engine_config: EngineConfig | None = None,
              notifier: Any | None = None, hang_interval_s: float = 5.0,
              state_flush_s: float = 1.0, session_timeout_s: float = 15.0) -> Any:
    """Declare the Faust app (agents, tables, timer, web views). Returns ``faust.App``.

    ``state_flush_s``: how often run states changed without output are written to the
    ``run_state`` table (states that produced alerts or commands are written at once).
    ``session_timeout_s``: how long the group waits for a worker that died without leaving
    (SIGKILL, OOM, a lost node) before its partitions move; Faust's default is 60 s.
    """
    import faust

    topics = settings.topics
    engine = Engine(engine_config or engine_config_for(settings))
    pipeline = Pipeline(engine=engine, topics=topics, control_secret=settings.control_secret,
                        command_max_data_age_s=float(settings.command_max_data_age_s))
    svc = ServiceState()
    from stream_app.metrics import Recorder  # issue 7: metrics and dashboard timeline

    recorder = svc.extra["recorder"] = Recorder()

    app_kwargs: dict[str, Any] = dict(
        broker=_broker_url(settings.kafka_bootstrap),
        store="memory://",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        web_enabled=True,
        web_port=settings.web_port,
        web_bind=settings.web_host,
        web_host=settings.web_host,
        consumer_auto_offset_reset="earliest",
        table_standby_replicas=0,
        broker_commit_every=100,
        broker_commit_interval=1.0,
        producer_acks=-1,
        stream_wait_empty=False,
        broker_session_timeout=session_timeout_s,
        broker_heartbeat_interval=min(3.0, session_timeout_s / 5),
    )
    if settings.data_dir:
        app_kwargs["datadir"] = settings.data_dir
    credentials = _credentials(settings)
    if credentials is not None:
        app_kwargs["broker_credentials"] = credentials
    app = faust.App(settings.app_id, **app_kwargs)
    # detect acks out of order (dirty runs below): Faust's commit check alone could commit
    # past a record still held (stream_app/offsets.py, docs/operations.md).
    install_commit_fix(app)
    app.trainsentry = svc  # type: ignore[attr-defined]
    # From a rebalance's start to the end of the table recovery that follows it: a worker
    # whose recovery stalls (a known Faust failure) is then not ready, and alerted on.
    svc.recovering = lambda: bool(app.rebalancing)
    app.trainsentry_pipeline = pipeline  # type: ignore[attr-defined]

    raw: dict[str, Any] = dict(key_type=bytes, value_type=bytes, key_serializer="raw",
                               value_serializer="raw")
    source = app.topic(topics.data, topics.compute, topics.resource, topics.runs,
                       partitions=settings.partitions, **raw)
    alerts_topic = app.topic(topics.alerts, partitions=settings.partitions, **raw)
    control_topic = app.topic(topics.control, partitions=settings.partitions, **raw)
    deadletter_topic = app.topic(topics.deadletter, partitions=settings.partitions, **raw)
    sinks = {topics.alerts: alerts_topic, topics.control: control_topic,
             topics.deadletter: deadletter_topic}
    raw_schema: Any = faust.Schema(key_type=bytes, value_type=bytes, key_serializer="raw",
                              value_serializer="raw")
    run_partition: dict[bytes, int] = {}  # run key -> partition of its latest record
    run_table = _run_state_table(app, partitions=settings.partitions, schema=raw_schema,
                                 known=run_partition)
    # Runs whose state changed since it was last written, with the records that changed
    # it. Those records stay un-acked (so their offsets are not committed) until the state
    # is written: a crash then replays them onto the last written state, never skips them.
    dirty: dict[str, list[Any]] = {}
    # Faust can drop records it fetched when a rebalance's table recovery completes: the
    # guard finds the hole, holds the records past it (un-acked) and seeks back to it.
    guard = OffsetGuard(name="metrics")
    held: dict[Any, dict[int, list[Any]]] = {}  # TP -> offset -> messages held past a hole
    source_topics = set(source.topics)
    svc.extra["offset_seeks"] = 0
    svc.extra["runs_retired"] = 0

    async def send(record: Record) -> None:
        await sinks[record.topic].send(key=record.key, value=record.value,
                                       headers=list(record.headers) or None)

    def get_state(run_id: str) -> RunState:
        state = svc.cache.get(run_id)
        if state is None:
            stored = run_table.get(run_id.encode())
            if stored:
                state = load_state(stored)
                engine.adopt(state, time.time())  # taken over: the hang clock restarts
            else:
                state = engine.new_state(run_id)
            svc.cache[run_id] = state
        return state

    def owns(key: bytes) -> bool:
        """Whether this worker holds the run's partition now (the table can still hold
        runs of partitions that moved to another worker)."""
        try:
            assignment = app.consumer.assignment()
        except Exception:  # the consumer is not started yet: nothing is assigned
            return False
        return (topics.data, run_table.partition_for_key(key)) in assignment

    unreadable: set[bytes] = set()

    def adopt_stored(now: float) -> None:
        """Cache the stored state of every run of this worker's partitions that is not
        cached yet: after a restart or a rebalance, a run that never sends another record
        (hung, killed) is then still checked for hangs and retired in time."""
        if app.rebalancing:  # the table is being recovered: wait for it to be complete
            return
        for key in list(run_table.keys()):
            if not isinstance(key, bytes) or key in unreadable:
                continue
            run_id = key.decode(errors="replace")
            if run_id in svc.cache or not owns(key):
                continue
            stored = run_table.get(key)
            if not stored:
                continue
            try:
                state = load_state(stored)
            except Exception as exc:  # noqa: BLE001 - one bad entry must not stop the others
                unreadable.add(key)
                log.error("run_state entry of run %r does not load (%s: %s); it is skipped until "
                          "the run sends again (which starts a fresh state)", run_id,
                          type(exc).__name__, exc)
                continue
            engine.adopt(state, now)
            svc.cache[run_id] = state

    async def retire_runs(now: float) -> None:
        """Drop the states the engine no longer needs (finished, or silent for days):
        their alerts resolved first, then a tombstone on the changelog, so neither this
        worker's memory nor the table grows with every run ever seen."""
        if app.rebalancing:  # partitions are moving: the next owner decides
            return
        retired = 0
        for state in list(svc.cache.values()):
            outputs = engine.retire(state, now)
            if outputs is None:
                continue
            outcome = pipeline.encode(state.run_id, outputs)
            for record in outcome.records:
                await send(record)
                if record.topic == topics.alerts:
                    svc.alerts += 1
            recorder.on_outcome(state, outcome.outputs, 0)
            key = state.run_id.encode()
            if run_table.get(key) is not None:
                del run_table[key]  # a tombstone: compaction removes the run's entries
            for message in dirty.pop(state.run_id, ()):
                message.ack(app.consumer)
            svc.cache.pop(state.run_id, None)
            run_partition.pop(key, None)
            unreadable.discard(key)
            svc.extra["runs_retired"] += 1
            retired += 1
            log.info("run %s retired (%s): its state is dropped; a later record starts a "
                     "fresh one", state.run_id,
                     "finished" if state.finished else "no event for days")
        if retired:
            recorder.forget(svc.cache)  # their timelines and step histograms too

    def store(state: RunState) -> None:
        # Pickling a RunState costs ~1 ms and ~80 KB of changelog: once per flush, not
        # once per record (docs/performance.md).
        run_table[state.run_id.encode()] = dump_state(state)
        for message in dirty.pop(state.run_id, ()):
            message.ack(app.consumer)

    def hold(state: RunState, message: Any | None, companions: list[Any]) -> None:
        waiting = dirty.setdefault(state.run_id, [])
        if message is not None:
            message.incref()
            waiting.append(message)
        waiting.extend(companions)  # already holding a reference

    def ack_all(messages: list[Any]) -> None:
        for message in messages:
            message.ack(app.consumer)

    async def flush_states() -> None:
        for run_id in list(dirty):
            state = svc.cache.get(run_id)
            if state is not None:
                store(state)
            else:  # not cached (revoked): nothing newer than the table to write
                for message in dirty.pop(run_id, ()):
                    message.ack(app.consumer)

    async def publish(outcome: Outcome, state: RunState, message: Any | None = None,
                      companions: list[Any] | None = None) -> None:
        if outcome.outputs:
            store(state)  # what goes out must be in the changelog first
            ack_all(companions or [])
        else:
            hold(state, message, companions or [])
        sent_commands = svc.commands
        for record in outcome.records:
            await send(record)
            if record.topic == topics.alerts:
                svc.alerts += 1
            elif record.topic == topics.control:
                svc.commands += 1
        recorder.on_outcome(state, outcome.outputs, svc.commands - sent_commands)

    async def seek(tp: Any, offset: int, why: str) -> None:
        log.warning("%s[%d]: %s; seeking back to offset %d to read it again", tp.topic,
                    tp.partition, why, offset)
        svc.extra["offset_seeks"] += 1
        await app.consumer.seek(tp, offset)

    async def admit(msg: Any) -> list[Any] | None:
        """None: ``msg`` is past a hole, held back. Else the originals of this offset that
        were held back before, to be acked together with ``msg``."""
        tp = msg.tp
        if not guard.knows(tp):
            guard.start(tp, await start_offset(app.consumer, tp))
        ok, seek_to = guard.admit(tp, msg.offset)
        if seek_to is not None and tp in app.consumer.assignment():
            await seek(tp, seek_to, "records were skipped on the way in")
        if not ok:
            msg.incref()  # not acked by the stream: no commit passes the hole
            held.setdefault(tp, {}).setdefault(msg.offset, []).append(msg)
            return None
        return held.get(tp, {}).pop(msg.offset, [])

    @app.agent(source, name="trainsentry.detect")
    async def detect(stream: Any) -> None:
        async for event in stream.events():
            guard.busy()
            try:
                await handle(event)
            finally:
                guard.idle()

    async def handle(event: Any) -> None:
        msg = event.message
        companions = await admit(msg)
        if companions is None:
            return
        svc.consumed[msg.topic] = svc.consumed.get(msg.topic, 0) + 1
        try:
            decoded = pipeline.decode(msg.topic, event.key, event.value)
        except EventError as exc:
            svc.deadletters += 1
            log.warning("dead-lettered record %s[%d]@%d: %s", msg.topic, msg.partition,
                        msg.offset, exc)
            await send(pipeline.deadletter(msg.topic, msg.partition, msg.offset, event.key,
                                           event.value, str(exc)))
            ack_all(companions)
            return
        recorder.on_event(decoded)
        run_partition[event.key or decoded.run_id.encode()] = msg.partition
        state = get_state(decoded.run_id)
        try:
            outcome = pipeline.handle(state, decoded)
        except Exception as exc:  # a bug must not stop every other run
            svc.deadletters += 1
            svc.extra["engine_errors"] = svc.extra.get("engine_errors", 0) + 1
            svc.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            del svc.errors[:-20]
            log.exception("engine failed on %s[%d]@%d; dead-lettered", msg.topic,
                          msg.partition, msg.offset)
            await send(pipeline.deadletter(msg.topic, msg.partition, msg.offset, event.key,
                                           event.value, f"engine error: {type(exc).__name__}: {exc}"))
            ack_all(companions)
            return
        await publish(outcome, state, msg, companions)

    @app.timer(interval=state_flush_s, name="trainsentry.state_flush")  # type: ignore[untyped-decorator]
    async def state_flush() -> None:
        await flush_states()

    @app.timer(interval=hang_interval_s, name="trainsentry.hang")  # type: ignore[untyped-decorator]
    async def hang_check() -> None:
        now = time.time()
        adopt_stored(now)
        await retire_runs(now)
        for state in list(svc.cache.values()):
            outcome = pipeline.tick(state, now)
            if outcome.outputs:
                await publish(outcome, state)

    @app.timer(interval=0.1, name="trainsentry.join")  # type: ignore[untyped-decorator]
    async def join_flush() -> None:
        # Steps wait a short grace for layers still in flight (engine.join_grace_s).
        now = time.time()
        for state in list(svc.cache.values()):
            if not state.pending:
                continue
            before = state.last_evaluated
            outcome = pipeline.poll(state, now)
            if state.last_evaluated != before or outcome.outputs:
                await publish(outcome, state)

    @app.timer(interval=1.0, name="trainsentry.metrics_offsets")  # type: ignore[untyped-decorator]
    async def metrics_offsets() -> None:
        # The guard's second half: records that never came while the agent sat idle.
        if app.rebalancing:
            return
        try:
            assignment = app.consumer.assignment()
        except Exception:  # the consumer is not started yet: nothing is assigned
            return
        await seek_stalled(app.consumer, guard,
                           ((tp, tp) for tp in assignment if tp.topic in source_topics), seek)

    watch = RecoveryWatch(float(settings.recovery_stall_s))

    @app.timer(interval=5.0, name="trainsentry.recovery_watch")  # type: ignore[untyped-decorator]
    async def recovery_watch() -> None:
        stuck = watch.observe(time.monotonic(), recovering=bool(app.rebalancing),
                              progress=recovery_progress(app))
        if stuck is not None and not svc.extra.get("exit_code"):
            stop_stalled_worker(svc, stuck, settings.recovery_stall_s)

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app_: Any, revoked: Any, **_: Any) -> None:
        # The cache is only valid for partitions we own; the table is the truth.
        await flush_states()
        await app.producer.flush()
        svc.cache.clear()
        guard.reset()
        held.clear()  # an old generation's messages: the next one reads them again

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: Any, **_: Any) -> None:
        svc.ready = True

    from stream_app.alerting_api import install_alerting; install_alerting(app, svc=svc, settings=settings)  # noqa: E702, I001 - issue 5
    if notifier is not None:
        from stream_app.notify import install_notifier

        install_notifier(app, alerts_topic=alerts_topic, notifier=notifier, svc=svc,
                         partitions=settings.partitions)

    from stream_app.web import install_views

    install_views(app, svc=svc, settings=settings, run_table=run_table)
    return app


#: Exit code of a worker that stopped itself because its table recovery stalled.
RECOVERY_STALL_EXIT = 70


def stop_stalled_worker(svc: ServiceState, stuck_s: float, limit_s: int, *,
                        kill: Callable[[int, int], None] | None = None,
                        force_after_s: float = 60.0) -> None:
    """Stop this worker (SIGTERM, as an operator would; forced exit if that hangs) with
    :data:`RECOVERY_STALL_EXIT`, so its supervisor starts a fresh one that recovers."""
    import os
    import signal
    import threading

    log.error("table recovery has made no progress for %.0fs (a known faust-streaming stall, "
              "logged as 'No event received for active tp'): stopping this worker with exit "
              "code %d so its supervisor starts a fresh one; nothing is lost (uncommitted "
              "records are read again, state comes back from the changelogs). "
              "TRAINSENTRY_RECOVERY_STALL_S=%d", stuck_s, RECOVERY_STALL_EXIT, limit_s)
    svc.extra["exit_code"] = RECOVERY_STALL_EXIT
    svc.extra["recovery_stall_exits"] = svc.extra.get("recovery_stall_exits", 0) + 1
    timer = threading.Timer(force_after_s, os._exit, (RECOVERY_STALL_EXIT,))
    timer.daemon = True
    timer.start()
    (kill or os.kill)(os.getpid(), signal.SIGTERM)


def _run_state_table(app: Any, *, partitions: int, schema: Any, known: dict[bytes, int]) -> Any:
    """The ``run_state`` table, writable from timers too (hang check, join grace, flush).

    Why not Faust's default: it takes the changelog partition from the *current event*,
    and a timer has none (``TypeError: Cannot modify table key from outside of stream
    iteration``). Outside an event, use the partition the run's records came from, or
    Kafka's default partitioner (murmur2 of the key), which put them there.
    """
    import faust
    from aiokafka.partitioner import murmur2
    from faust.streams import current_event

    class RunStateTable(faust.Table):  # type: ignore[type-arg]
        def partition_for_key(self, key: Any) -> int | None:
            if current_event() is not None:
                return super().partition_for_key(key)
            found = known.get(key)
            return found if found is not None else (murmur2(key) & 0x7FFFFFFF) % partitions

    # key_type/value_type as well as the schema: recovery from the changelog decodes with
    # them, and without them Faust reads the raw pickles back as JSON.
    return app.tables.add(RunStateTable(app, name="run_state", default=None,
                                        beacon=app.tables.beacon, partitions=partitions,
                                        schema=schema, key_type=bytes, value_type=bytes))


def _credentials(settings: Settings) -> Any:
    import faust

    proto = settings.kafka_security_protocol.upper()
    if proto == "PLAINTEXT":
        return None
    ssl_context = None
    if proto in ("SSL", "SASL_SSL"):
        import ssl

        ssl_context = ssl.create_default_context(cafile=settings.kafka_ssl_cafile or None)
    if proto.startswith("SASL"):
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password.get(),
            mechanism=settings.kafka_sasl_mechanism or "PLAIN",
            ssl_context=ssl_context,
        )
    return faust.SSLCredentials(ssl_context)
