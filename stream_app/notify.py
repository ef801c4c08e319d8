"""The notify agent: the alerts topic is the outbox; chat delivery is at-least-once, deduplicated.

Alerts are taken in small batches (up to 100 or 0.2 s), already-delivered ids are skipped
(the ``sent_alerts`` table, changelog-backed, survives restarts), the rest go to the
:class:`~notifiers.delivery.Deliverer`, which returns only once every receiver has
acknowledged or failed for good; only then are the ids recorded and the batch acked,
so Faust commits the offsets after delivery.
"""

from __future__ import annotations

import logging
from typing import Any

from trainsentry.errors import EventError
from trainsentry.events import AlertEvent, decode_record

__all__ = ["install_notifier"]

log = logging.getLogger(__name__)


def install_notifier(app: Any, *, alerts_topic: Any, notifier: Any, svc: Any, partitions: int,
                     batch: int = 100, within_s: float = 0.2) -> None:
    import faust

    sent = app.Table("sent_alerts", default=None, partitions=partitions,
                     schema=faust.Schema(key_type=bytes, value_type=bytes, key_serializer="raw",
                                         value_serializer="raw"))
    svc.extra["delivered"] = 0
    svc.extra["duplicates_skipped"] = 0

    @app.agent(alerts_topic, name="trainsentry.notify")
    async def notify(stream: Any) -> None:
        async for events in stream.take_events(batch, within=within_s):
            todo: list[AlertEvent] = []
            for event in events:
                try:
                    alert = decode_record(event.value, "alert")
                except EventError as exc:
                    log.warning("skipping undecodable alert record: %s", exc)
                    continue
                assert isinstance(alert, AlertEvent)
                if sent.get(alert.id.encode()) is not None or any(a.id == alert.id for a in todo):
                    svc.extra["duplicates_skipped"] += 1
                    continue
                todo.append(alert)
            if not todo:
                continue
            result = await notifier.deliver(todo)
            svc.extra["notifier_health"] = notifier.health()
            for failure in result.failed:
                log.error("alert %s not delivered to %s (%s): %s", failure.alert_id,
                          failure.receiver, failure.kind, failure.reason)
            if not result.settled:
                # Closed mid-delivery (shutdown): do not mark; the batch is redelivered.
                raise RuntimeError("notifier closed before delivery settled")
            for alert in todo:
                sent[alert.id.encode()] = b"1"
            svc.extra["delivered"] += len(todo)

    @app.timer(interval=5.0, name="trainsentry.notifier_health")
    async def health() -> None:
        svc.extra["notifier_health"] = notifier.health()
