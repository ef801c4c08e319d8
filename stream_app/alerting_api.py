"""Alerting on the service: silences, acks and history stores, their topics, and HTTP views.

Why topics and not a table: a silence created on any worker's HTTP endpoint must apply
on every worker (each owns some runs' alerts), and history must be queryable on any of
them. So both live in compacted topics that *every* worker reads in full with its own
unassigned consumer:

- ``<prefix>silences``: key ``silence:<id>`` or ``ack:<fingerprint>``; value a
  :class:`~notifiers.lifecycle.Silence` or :class:`~notifiers.lifecycle.Ack` dict.
- ``<prefix>alert_history``: key = the transition id (unique, so compaction keeps all);
  value a :class:`~notifiers.lifecycle.HistoryRecord` dict.

HTTP (on ``TRAINSENTRY_WEB_PORT``): ``GET/POST /api/silences``, ``GET/DELETE
/api/silences/{id}``, ``POST /api/alerts/{id}/ack``, ``POST /api/ack`` (``alert_id`` or
``fingerprint``), ``GET /api/runs/{run_id}/history`` (also ``/api/history?run=``) and
``GET /charts/{alert_id}.png``. docs/alerting.md has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

from notifiers.charts import ChartStore, attach_charts
from notifiers.lifecycle import (
    Ack,
    HistoryRecord,
    LifecycleConfig,
    Matcher,
    Silence,
    parse_duration,
    transition_id,
)
from trainsentry.config import Settings
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = [
    "Alerting",
    "SilenceStore",
    "HistoryIndex",
    "install_alerting",
    "lifecycle_config",
    "silence_from_request",
]

log = logging.getLogger(__name__)


def lifecycle_config(settings: Settings | None) -> LifecycleConfig:
    """The lifecycle tunables from Settings (TRAINSENTRY_ALERT_*)."""
    if settings is None:
        return LifecycleConfig()
    return LifecycleConfig(for_steps=settings.alert_for_steps, for_s=float(settings.alert_for_s),
                           repeat_interval_s=float(settings.alert_repeat_interval_s),
                           escalate_after=settings.alert_escalate_after,
                           book_retention_s=float(settings.alert_book_retention_s))


# ------------------------------------------------------------------------------ stores

class SilenceStore:
    """Silences and acks, as read from the silences topic (last value per key wins)."""

    def __init__(self) -> None:
        self.silences: dict[str, Silence] = {}
        self.acks: dict[str, Ack] = {}

    def apply(self, key: str, value: Mapping[str, Any] | None) -> None:
        """One record of the topic; ``None`` is a tombstone."""
        kind, _, ident = key.partition(":")
        if kind == "silence":
            if value is None:
                self.silences.pop(ident, None)
            else:
                try:
                    s = Silence.from_dict(value)
                except ConfigError as exc:  # written by an older version, or by hand
                    log.warning("ignoring silence %s on the silences topic: %s", ident, exc)
                    return
                self.silences[s.id] = s
        elif kind == "ack":
            if value is None:
                self.acks.pop(ident, None)
            else:
                a = Ack.from_dict(value)
                self.acks[a.fingerprint] = a
        else:
            log.warning("ignoring silences-topic record with unknown key kind %r", kind)

    def active(self, now: float) -> list[Silence]:
        return [s for s in self.silences.values() if s.active(now)]


class HistoryIndex:
    """Recent transitions per run, and the latest record per alert id / fingerprint."""

    def __init__(self, *, per_run: int = 2000, max_runs: int = 5000, max_ids: int = 100_000) -> None:
        self.per_run = per_run
        self.max_runs = max_runs
        self.max_ids = max_ids
        self._runs: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._alerts: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._fps: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, record: Mapping[str, Any]) -> None:
        rid = str(record.get("id", ""))
        if rid in self._seen:
            return  # a replayed batch writes the same transition ids
        self._seen[rid] = None
        run_id = str(record.get("run_id", ""))
        runs = self._runs.setdefault(run_id, deque(maxlen=self.per_run))
        runs.append(dict(record))
        self._runs.move_to_end(run_id)
        alert_id = str(record.get("alert_id", ""))
        prev = self._alerts.get(alert_id)
        if prev is None or record.get("series") or not prev.get("series"):
            self._alerts[alert_id] = dict(record)
        self._fps[str(record.get("fingerprint", ""))] = dict(record)
        for d, cap in ((self._seen, self.max_ids), (self._alerts, self.max_ids),
                       (self._fps, self.max_ids), (self._runs, self.max_runs)):
            while len(d) > cap:
                d.popitem(last=False)

    def note(self, alert: AlertEvent) -> None:
        """Know an alert id before its first transition is settled: people may ack it as
        soon as chat shows it, before every receiver has finished."""
        if alert.id not in self._alerts:
            self._alerts[alert.id] = {"alert_id": alert.id, "run_id": alert.run_id,
                                      "fingerprint": alert.fingerprint, "step": alert.step,
                                      "diagnosis": alert.diagnosis, "severity": alert.severity}
        self._fps.setdefault(alert.fingerprint, self._alerts[alert.id])

    def by_run(self, run_id: str, *, limit: int | None = None) -> list[dict[str, Any]]:
        records = sorted(self._runs.get(run_id, ()), key=lambda r: (r.get("ts", 0), r.get("step", 0)))
        return records[-limit:] if limit else records

    def alert(self, alert_id: str) -> dict[str, Any] | None:
        return self._alerts.get(alert_id)

    def fingerprint(self, fingerprint: str) -> dict[str, Any] | None:
        return self._fps.get(fingerprint)

    def chart_alert(self, alert_id: str) -> AlertEvent | None:
        """An AlertEvent good enough to draw the chart of ``alert_id`` from its history."""
        r = self._alerts.get(alert_id)
        if r is None or not r.get("series"):
            return None
        return AlertEvent(id=alert_id, fingerprint=r["fingerprint"], run_id=r["run_id"],
                          status="firing", severity=r["severity"], diagnosis=r["diagnosis"],
                          step=int(r["step"]), ts=float(r["ts"]), summary=r.get("summary", ""),
                          evidence=dict(r.get("evidence") or {}), actions=[],
                          series=dict(r["series"]))


# ------------------------------------------------------------------------------ context

class Alerting:
    """One worker's alerting runtime: stores, topics, chart cache. No I/O in ``__init__``."""

    def __init__(self, settings: Settings | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.config = lifecycle_config(settings)
        self.silences = SilenceStore()
        self.history = HistoryIndex()
        self.charts = ChartStore()
        self.clock = clock
        self.silences_topic: Any = None
        self.history_topic: Any = None
        #: Set once the silences topic has been read to its end (or there is none).
        self.ready = asyncio.Event()
        self.stats: dict[str, int] = {"history_published": 0, "silences_read": 0,
                                      "history_read": 0}

    @property
    def public_url(self) -> str:
        s = self.settings
        if s is None:
            return "http://127.0.0.1:6066"
        host = "127.0.0.1" if s.web_host in ("0.0.0.0", "::", "") else s.web_host
        return (s.public_url or f"http://{host}:{s.web_port}").rstrip("/")

    def fanout(self, notifier: Any) -> dict[str, Any]:
        """One Deliverer per receiver, with charts, the on-call lists and the configured
        rate limit, so each receiver's progress is tracked (and resumed) on its own.
        Anything but a plain Deliverer (a test double) is used as it is, as one lane."""
        from notifiers.delivery import Deliverer

        s = self.settings
        if s is None or type(notifier) is not Deliverer:
            return {"notifier": notifier}
        receivers = list(notifier.receivers)
        _set_oncall(receivers, s)
        doubled: dict[str, int] = {}
        if s.alert_charts:
            receivers, doubled = attach_charts(receivers, base_url=self.public_url,
                                               store=self.charts)
        return {r.name: Deliverer(receivers=[r],
                                  max_messages=max(1, s.notify_rate_limit // doubled.get(r.name, 1)),
                                  window_s=float(s.notify_window_s), retry=notifier.retry,
                                  config_recheck_s=notifier.config_recheck_s)
                for r in receivers}

    async def publish_history(self, records: list[HistoryRecord]) -> None:
        """Send transitions to the history topic (and index them here at once)."""
        for r in records:
            body = r.to_dict()
            self.history.add(body)
            if self.history_topic is not None:
                await self.history_topic.send(key=r.id.encode(), value=_dumps(body))
                self.stats["history_published"] += 1

    async def put(self, key: str, value: Mapping[str, Any]) -> None:
        """Write a silence/ack durably (waits for the broker), then apply it here."""
        if self.silences_topic is not None:
            fut = await self.silences_topic.send(key=key.encode(), value=_dumps(value))
            await fut
        self.silences.apply(key, value)


def _set_oncall(receivers: list[Any], settings: Settings) -> None:
    # The factory does not pass on-call lists yet (lead: move this to receivers_from_settings).
    from notifiers.dingtalk import DingTalk
    from notifiers.wecom import WeCom

    mobiles = tuple(m.strip() for m in settings.oncall_mobiles.split(",") if m.strip())
    users = tuple(u.strip() for u in settings.oncall_wecom_users.split(",") if u.strip())
    for r in receivers:
        if isinstance(r, DingTalk) and mobiles and not r.at_mobiles:
            r.at_mobiles = mobiles
        elif isinstance(r, WeCom) and users and not r.mentioned_list:
            r.mentioned_list = users


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _consumer_kwargs(settings: Settings) -> dict[str, Any]:
    proto = settings.kafka_security_protocol.upper()
    out: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap,
                           "security_protocol": proto}
    if proto in ("SSL", "SASL_SSL"):
        import ssl

        out["ssl_context"] = ssl.create_default_context(cafile=settings.kafka_ssl_cafile or None)
    if proto.startswith("SASL"):
        out.update(sasl_mechanism=settings.kafka_sasl_mechanism or "PLAIN",
                   sasl_plain_username=settings.kafka_sasl_username,
                   sasl_plain_password=settings.kafka_sasl_password.get())
    return out


def ensure_compacted_topic(settings: Settings, topic: str, partitions: int) -> int:
    """Create ``topic`` compacted if it is missing; returns its partition count (blocking)."""
    import warnings

    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    config: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap,
                              "client_id": "trainsentry-alerting",
                              "security_protocol": settings.kafka_security_protocol.upper()}
    if settings.kafka_ssl_cafile:
        config["ssl_cafile"] = settings.kafka_ssl_cafile
    if config["security_protocol"].startswith("SASL"):
        config.update(sasl_mechanism=settings.kafka_sasl_mechanism or "PLAIN",
                      sasl_plain_username=settings.kafka_sasl_username,
                      sasl_plain_password=settings.kafka_sasl_password.get())
    admin = KafkaAdminClient(**config)
    try:
        if topic not in set(admin.list_topics()):
            with warnings.catch_warnings(), contextlib.suppress(TopicAlreadyExistsError):
                warnings.simplefilter("ignore", DeprecationWarning)
                admin.create_topics([NewTopic(name=topic, num_partitions=partitions,
                                              replication_factor=settings.replication_factor,
                                              topic_configs={"cleanup.policy": "compact"})])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for t in admin.describe_topics([topic]):
                if (t.get("topic") or t.get("name")) == topic and t.get("partitions"):
                    return len(t["partitions"])
            time.sleep(0.2)
        raise ConfigError(f"topic {topic} did not appear on {settings.kafka_bootstrap}")
    finally:
        admin.close()


async def _tail(settings: Settings, topic: str, partitions: int,
                on_record: Callable[[bytes, bytes | None], None],
                on_caught_up: Callable[[], None]) -> None:
    """Read every partition of ``topic`` from the start, forever (no consumer group)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    count = await asyncio.to_thread(ensure_compacted_topic, settings, topic, partitions)
    consumer = AIOKafkaConsumer(enable_auto_commit=False, group_id=None,
                                auto_offset_reset="earliest", **_consumer_kwargs(settings))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(count)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        caught_up = False
        while True:
            if not caught_up:
                positions = {tp: await consumer.position(tp) for tp in tps}
                if all(positions[tp] >= end[tp] for tp in tps):
                    caught_up = True
                    on_caught_up()
            batches = await consumer.getmany(timeout_ms=500, max_records=500)
            for records in batches.values():
                for rec in records:
                    try:
                        on_record(rec.key or b"", rec.value)
                    except (ConfigError, ValueError, KeyError, TypeError) as exc:
                        log.warning("skipping bad record in %s@%d: %s", topic, rec.offset, exc)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer.stop(), 5)


# ------------------------------------------------------------------------------ requests

#: The labels a silence can match (notifiers.lifecycle.alert_labels).
SILENCE_LABELS = ("run_id", "run", "diagnosis", "alertname", "severity", "fingerprint",
                  "status", "attempt", "host", "rank")
MAX_SILENCE_S = 90 * 86400


def _time(body: Mapping[str, Any], key: str, default: float) -> float:
    raw = body.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a Unix time in seconds (e.g. 1764528000), got "
                          f"{str(raw)[:40]!r}; or give a duration instead") from None
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite Unix time in seconds")
    return value


def silence_from_request(body: Mapping[str, Any], *, now: float) -> Silence:
    """A Silence from a POST body: ``matchers`` (objects or ``"name=~re"`` strings) and/or
    ``run``/``run_id``, ``diagnosis``, ``severity``; ``duration`` ("2h") or ``ends_at``;
    optional ``starts_at``, ``comment``, ``created_by``, ``id``."""
    if not isinstance(body, Mapping):
        raise ConfigError("the body must be a JSON object")
    matchers: list[Matcher] = []
    for m in body.get("matchers") or []:
        matchers.append(Matcher.parse(m) if isinstance(m, str) else Matcher.from_dict(m))
    for key, label in (("run", "run_id"), ("run_id", "run_id"), ("diagnosis", "diagnosis"),
                       ("severity", "severity"), ("fingerprint", "fingerprint")):
        if body.get(key):
            matchers.append(Matcher(label, str(body[key])))
    if not matchers:
        raise ConfigError("a silence needs matchers or one of run, diagnosis, severity, "
                          "fingerprint")
    for m in matchers:  # a misspelt label would silently match nothing (or everything)
        if m.name not in SILENCE_LABELS:
            raise ConfigError(f"matcher {m}: no alert has a label {m.name!r}; labels: "
                              f"{', '.join(SILENCE_LABELS)}")
    starts = _time(body, "starts_at", now)
    if body.get("ends_at") is not None:
        ends = _time(body, "ends_at", now)
    else:
        ends = starts + parse_duration(str(body.get("duration") or "2h"))
    if ends - starts > MAX_SILENCE_S:
        raise ConfigError(f"a silence of {(ends - starts) / 86400:.0f} days is longer than the "
                          f"{MAX_SILENCE_S // 86400} days allowed; renew a shorter one when it "
                          "ends, or fix what it mutes")
    return Silence(id=str(body.get("id") or uuid.uuid4().hex[:12]), matchers=tuple(matchers),
                   starts_at=starts, ends_at=ends, created_by=str(body.get("created_by", ""))[:100],
                   comment=str(body.get("comment", ""))[:500], created_at=now)


# ------------------------------------------------------------------------------ install

def install_alerting(app: Any, *, svc: Any, settings: Settings) -> Alerting:
    """Declare the alerting topics, their readers and the HTTP views; the notify agent
    (stream_app/notify.py) finds the context in ``svc.extra["alerting"]``."""
    from faust.web import View

    ctx = Alerting(settings)
    svc.extra["alerting"] = ctx
    prefix = settings.topic_prefix
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    ctx.silences_topic = app.topic(f"{prefix}silences", partitions=1, compacting=True, **raw)
    ctx.history_topic = app.topic(f"{prefix}alert_history", partitions=settings.partitions,
                                  compacting=True, **raw)

    def on_silence(key: bytes, value: bytes | None) -> None:
        ctx.stats["silences_read"] += 1
        ctx.silences.apply(key.decode(), None if value is None else json.loads(value))

    def on_history(key: bytes, value: bytes | None) -> None:
        if value is not None:
            ctx.stats["history_read"] += 1
            ctx.history.add(json.loads(value))

    @app.task  # type: ignore[untyped-decorator]
    async def alerting_readers() -> None:
        await asyncio.gather(
            _tail(settings, ctx.silences_topic.get_topic_name(), 1, on_silence, ctx.ready.set),
            _tail(settings, ctx.history_topic.get_topic_name(), settings.partitions, on_history,
                  lambda: None))

    def body_error(exc: Exception) -> dict[str, str]:
        return {"error": str(exc)}

    class Silences(View):
        async def get(self, request: Any) -> Any:
            now = ctx.clock()
            show_all = request.query.get("all", "") in ("1", "true", "yes")
            out = [s.to_dict(now) for s in sorted(ctx.silences.silences.values(),
                                                  key=lambda s: s.created_at)
                   if show_all or s.state(now) != "expired"]
            return self.json({"silences": out})

        async def post(self, request: Any) -> Any:
            try:
                body = await request.json()
                silence = silence_from_request(body, now=ctx.clock())
            except (ConfigError, ValueError, TypeError) as exc:
                return self.json(body_error(exc), status=400)
            await ctx.put(f"silence:{silence.id}", silence.to_dict())
            log.info("silence %s created by %s until %.0f: %s", silence.id,
                     silence.created_by or "?", silence.ends_at,
                     ", ".join(str(m) for m in silence.matchers))
            return self.json(silence.to_dict(ctx.clock()), status=201)

    class OneSilence(View):
        async def get(self, request: Any, silence_id: str) -> Any:
            s = ctx.silences.silences.get(silence_id)
            if s is None:
                return self.json({"error": f"no silence {silence_id}"}, status=404)
            return self.json(s.to_dict(ctx.clock()))

        async def delete(self, request: Any, silence_id: str) -> Any:
            s = ctx.silences.silences.get(silence_id)
            if s is None:
                return self.json({"error": f"no silence {silence_id}"}, status=404)
            now = ctx.clock()
            if s.state(now) != "expired":
                s = Silence(id=s.id, matchers=s.matchers, starts_at=min(s.starts_at, now - 1e-3),
                            ends_at=now, created_by=s.created_by, comment=s.comment,
                            created_at=s.created_at)
                await ctx.put(f"silence:{s.id}", s.to_dict())
                log.info("silence %s expired", s.id)
            return self.json(s.to_dict(now))

    async def acknowledge(view: Any, body: Mapping[str, Any]) -> Any:
        alert_id = str(body.get("alert_id") or "")
        fingerprint = str(body.get("fingerprint") or "")
        known = ctx.history.alert(alert_id) if alert_id else ctx.history.fingerprint(fingerprint)
        if known is None:
            what = f"alert {alert_id}" if alert_id else f"fingerprint {fingerprint}"
            return view.json({"error": f"{what} is not in this service's alert history"},
                             status=404)
        now = ctx.clock()
        ack = Ack(fingerprint=known["fingerprint"], run_id=known["run_id"],
                  alert_id=alert_id or known.get("alert_id", ""), created_at=now,
                  created_by=str(body.get("by") or body.get("created_by") or "")[:100],
                  comment=str(body.get("comment", ""))[:500])
        await ctx.put(f"ack:{ack.fingerprint}", ack.to_dict())
        record = HistoryRecord(
            id=transition_id("ack", ack.fingerprint, now), ts=now, run_id=ack.run_id,
            fingerprint=ack.fingerprint, alert_id=ack.alert_id, diagnosis=known["diagnosis"],
            severity=known["severity"], step=int(known.get("step", 0)), transition="acknowledged",
            reason=ack.comment, by=ack.created_by)
        await ctx.publish_history([record])
        log.info("alert %s (%s) acknowledged by %s", ack.alert_id, ack.fingerprint,
                 ack.created_by or "?")
        return view.json(ack.to_dict(), status=202)

    class AckById(View):
        async def post(self, request: Any, alert_id: str) -> Any:
            body = await _body(request)
            return await acknowledge(self, {**body, "alert_id": alert_id})

    class AckByBody(View):
        async def post(self, request: Any) -> Any:
            body = await _body(request)
            if not body.get("alert_id") and not body.get("fingerprint"):
                return self.json({"error": "give alert_id or fingerprint"}, status=400)
            return await acknowledge(self, body)

    class RunHistory(View):
        async def get(self, request: Any, run_id: str) -> Any:
            return self.json(_history(run_id, request))

    class History(View):
        async def get(self, request: Any) -> Any:
            run_id = request.query.get("run") or request.query.get("run_id")
            if not run_id:
                return self.json({"error": "give ?run=RUN_ID"}, status=400)
            return self.json(_history(run_id, request))

    def _history(run_id: str, request: Any) -> dict[str, Any]:
        try:
            limit = int(request.query.get("limit", "0")) or None
        except ValueError:
            limit = None
        records = ctx.history.by_run(run_id, limit=limit)
        slim = [{k: v for k, v in r.items() if k not in ("series", "evidence")} for r in records]
        return {"run_id": run_id, "history": slim}

    class Chart(View):
        async def get(self, request: Any, alert_id: str) -> Any:
            png = await ctx.charts.png(alert_id, fallback=ctx.history.chart_alert(alert_id))
            if png is None:
                return self.json({"error": f"no chart for alert {alert_id}"}, status=404)
            return self.bytes(png, content_type="image/png",
                              headers={"Cache-Control": "max-age=86400"})

    class Status(View):
        async def get(self, request: Any) -> Any:
            now = ctx.clock()
            return self.json({"ready": ctx.ready.is_set(), **ctx.stats,
                              "silences_active": len(ctx.silences.active(now)),
                              "acks": len(ctx.silences.acks), "charts_cached": len(ctx.charts),
                              "config": {"for_s": ctx.config.for_s,
                                         "for_steps": ctx.config.for_steps,
                                         "repeat_interval_s": ctx.config.repeat_interval_s,
                                         "escalate_after": ctx.config.escalate_after},
                              "public_url": ctx.public_url})

    app.page("/api/silences")(Silences)
    app.page("/api/silences/{silence_id}")(OneSilence)
    app.page("/api/alerts/{alert_id}/ack")(AckById)
    app.page("/api/ack")(AckByBody)
    app.page("/api/runs/{run_id:.+}/history")(RunHistory)
    app.page("/api/history")(History)
    app.page("/api/alerting")(Status)
    app.page("/charts/{alert_id}.png")(Chart)
    return ctx


async def _body(request: Any) -> dict[str, Any]:
    try:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
