"""Alerting end to end on the real broker: the real ``trainsentry serve``, the fake robots.

AlertEvents are published straight to the alerts topic (as the detect agent would), so
each test drives the notify agent exactly. Two tests, three service starts: each start
costs ~10 s here.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import struct
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import pytest
from kafka import KafkaProducer

from bench._common import read_topic
from tests.chat_servers import FakeDingTalk, FakeWeCom
from tests.service_proc import ServiceProcess
from trainsentry import alerting_cli
from trainsentry.config import Topics
from trainsentry.events import AlertEvent, dumps

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

LABELS = ("dataloader_stall", "kl_drift", "numeric_underflow", "comm_degradation", "memory_leak",
          "nan_loss", "straggler", "lr_drift", "entropy_collapse", "stalled_learning")


async def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _alert(run_id: str, diagnosis: str, *, step: int = 10, status: str = "firing",
           severity: str = "critical", n: int = 0, summary: str = "", **kw: Any) -> AlertEvent:
    fields: dict[str, Any] = dict(
        id=f"{run_id}|{diagnosis}|{step}|{status}|{n}".replace("/", "_"),
        fingerprint=f"fp-{run_id}-{diagnosis}".replace("/", "_"), run_id=run_id, status=status,
        severity=severity, diagnosis=diagnosis, step=step, ts=time.time(),
        summary=summary or f"{diagnosis} step {step}",
        evidence={f"sig/{diagnosis}": {"value": 2.0, "baseline": 1.0, "bound": 1.5}},
        actions=["look"], checks=[], secondary=[])
    fields.update(kw)
    return AlertEvent(**fields)


def _publish(producer: KafkaProducer, topics: Topics, alerts: list[AlertEvent]) -> None:
    for a in alerts:
        producer.send(topics.alerts, key=a.run_id.encode(), value=dumps(a))
    producer.flush()


def _cli(url: str, *argv: str) -> str:
    parser = argparse.ArgumentParser()
    alerting_cli.add_cli(parser.add_subparsers())
    args = parser.parse_args([*argv, "--url", url])
    out = io.StringIO()
    with redirect_stdout(out):
        assert args.func(args) == 0
    return out.getvalue()


def _env(robots: dict[str, str], **extra: str) -> dict[str, str]:
    return {**robots, "TRAINSENTRY_ALERT_FOR_S": "0", "TRAINSENTRY_ALERT_FOR_STEPS": "0",
            **extra}


def _robots(ding: FakeDingTalk, wecom: FakeWeCom) -> dict[str, str]:
    return {"TRAINSENTRY_DINGTALK_URL": ding.url, "TRAINSENTRY_DINGTALK_SECRET": ding.secret or "",
            "TRAINSENTRY_WECOM_URL": wecom.url}


def _messages_with(server: FakeDingTalk | FakeWeCom, token: str) -> int:
    pattern = re.compile(rf"\b{re.escape(token)}\b")
    return sum(1 for m in server.messages if pattern.search(m.text))


async def test_burst_of_200_survives_sigkill_each_alert_once_per_robot_within_rate_limits(
        kafka_bootstrap: str, topic_prefix: str, free_port: int,
        dingtalk_server_factory: Any, wecom_server_factory: Any) -> None:
    """200 alerts in a burst reach both robots merged into digests, none dropped, within the
    robots' limit (4 per 3 s here, scaled from 20/min); a notifier SIGKILLed mid-burst and
    restarted delivers the rest (even when Faust drops records it fetched while the restart
    recovered its tables: the offset guard reads them again) and resends none the robots
    had acknowledged."""
    limit, window = 4, 3.0
    ding = await dingtalk_server_factory(limit=limit, window_s=window)
    wecom = await wecom_server_factory(limit=limit, window_s=window)
    topics = Topics(topic_prefix)
    env = _env(_robots(ding, wecom), TRAINSENTRY_NOTIFY_RATE_LIMIT=str(limit),
               TRAINSENTRY_NOTIFY_WINDOW_S=str(int(window)))
    app_id = f"ts-alerting-{topic_prefix.rstrip('.')}"
    alerts = [_alert(f"burst/run{i % 20:02d}", LABELS[i // 20], summary=f"tok{i:03d}",
                     evidence={f"sig/{i}": {"value": 1.0}}) for i in range(200)]
    tokens = [a.summary for a in alerts]
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         extra_env=env, app_id=app_id).start()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)
    try:
        await asyncio.to_thread(svc.wait_ready)
        await asyncio.to_thread(_publish, producer, topics, alerts)
        # Kill it mid-burst, once the first DingTalk window is full. From just before the
        # kill both robots refuse every request (HTTP 503, nothing accepted): a request sent
        # at the very moment of the kill would otherwise be one the robot accepted and the
        # notifier never heard back about, the at-least-once window no webhook client can
        # close. The pause lets the acknowledgements that did come reach the changelog.
        await _wait(lambda: len(ding.messages) >= limit, 60, "the first DingTalk window")
        for server in (ding, wecom):
            server.fail_for(3600, status=503)
        await asyncio.sleep(2.0)
        svc.kill()
        for server in (ding, wecom):
            server.heal()
        before = {"ding": list(ding.messages), "wecom": list(wecom.messages)}
        assert 0 < sum(1 for t in tokens if _messages_with(ding, t)) < 200, "kill came too late"
        svc2 = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                              extra_env=env, app_id=app_id).start()
        try:
            await asyncio.to_thread(svc2.wait_ready)
            await _wait(lambda: all(_messages_with(ding, t) for t in tokens), 120,
                        "every alert on DingTalk")
            await _wait(lambda: all(_messages_with(wecom, t) for t in tokens), 120,
                        "every alert on WeCom")
            await asyncio.sleep(2 * window)  # would a resend still come?
            for server in (ding, wecom):
                counts = {t: _messages_with(server, t) for t in tokens}
                assert {t for t, c in counts.items() if c != 1} == set(), "resent or merged twice"
                assert len(server.messages) <= 200 // 20 + 6  # digests, not one per alert
                assert server.max_in_window(window) <= limit
            # After the restart the new process cannot know the robot's window: at most a
            # few throttled answers, retried, never a lost alert.
            assert ding.errcodes()[130101] + wecom.errcodes()[45009] <= 2 * limit
            assert before["ding"] == ding.messages[:len(before["ding"])]
            status, hist = svc2.get("/api/runs/burst/run07/history")
            assert status == 200 and {r["transition"] for r in hist["history"]} >= {"firing"}
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_delivery_report(tokens, ding, wecom, svc2)}"
                                 f"\n--- first service ---\n{svc.log()[-3000:]}"
                                 f"\n--- restarted service ---\n{svc2.log()[-5000:]}") from None
        finally:
            svc2.stop()
    finally:
        producer.close()
        svc.kill()


async def test_silence_ack_inhibition_escalation_resolve_and_charts_end_to_end(
        kafka_bootstrap: str, topic_prefix: str, free_port: int,
        dingtalk_server: FakeDingTalk, wecom_server: FakeWeCom) -> None:
    """On one service: a silenced run stays quiet (its unsent firing gets no resolve); a
    silence after delivery keeps the resolve; nan_loss inhibits gradient_instability;
    repeats escalate to @on-call after two; an ack stops repeats but not the resolve; the
    chart is attached (WeCom image, DingTalk link served by the service); history, CLI."""
    ding, wecom = dingtalk_server, wecom_server
    topics = Topics(topic_prefix)
    mobile = "13800000000"
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         extra_env=_env(_robots(ding, wecom), TRAINSENTRY_ONCALL_MOBILES=mobile,
                                        TRAINSENTRY_ALERT_ESCALATE_AFTER="2")).start()
    url = f"http://127.0.0.1:{free_port}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)

    def in_chat(run_id: str, diagnosis: str, server: FakeDingTalk | FakeWeCom = ding) -> int:
        return sum(1 for m in server.messages if run_id in m.text and diagnosis in m.text)

    async def send(*alerts: AlertEvent) -> None:
        await asyncio.to_thread(_publish, producer, topics, list(alerts))

    try:
        await asyncio.to_thread(svc.wait_ready)
        # -- silence before the alert: nothing, and no resolve either
        sid = _cli(url, "silence", "add", "--run", "e2e/silenced", "--duration", "1h",
                   "--comment", "maintenance").strip()
        assert sid in _cli(url, "silence", "list")
        # -- inhibition: nan_loss explains gradient_instability (same run, same tick)
        # -- escalation: a warning with a chart, then two repeats
        series = {"actor/grad_norm": [[s, 1.0 if s < 9 else None] for s in range(10)]}
        esc = [_alert("e2e/esc", "lr_drift", severity="warning", step=10 + 50 * i, n=i,
                      series=series, evidence={"actor/grad_norm": {"value": None, "baseline": 1.0,
                                                                   "bound": 2.0}})
               for i in range(4)]
        await send(_alert("e2e/silenced", "kl_drift"),
                   _alert("e2e/inhibit", "gradient_instability", severity="warning",
                          summary="symptom"),
                   _alert("e2e/inhibit", "nan_loss"),
                   _alert("e2e/late", "memory_leak"))
        await _wait(lambda: in_chat("e2e/late", "memory_leak") >= 1
                    and in_chat("e2e/inhibit", "nan_loss") >= 1, 60, "the first notices")
        for i in (0, 1, 2):  # alone, so no critical alert in the same digest @-mentions
            await send(esc[i])
            await _wait(lambda i=i: in_chat("e2e/esc", "lr_drift") >= i + 1, 30, f"repeat {i}")
        esc_msgs = [m for m in ding.messages if "e2e/esc" in m.text]
        assert [m.payload["at"]["atMobiles"] for m in esc_msgs] == [[], [], [mobile]]
        assert f"@{mobile}" in esc_msgs[-1].payload["markdown"]["text"]
        # -- the chart: DingTalk links it, the service serves it; WeCom got the image
        link = re.search(r"\]\((http://[^)]+/charts/[^)]+\.png)\)",
                         esc_msgs[0].payload["markdown"]["text"])
        assert link is not None and link.group(1).startswith(url)
        status, png = await asyncio.to_thread(_get_bytes, link.group(1))
        assert status == 200 and struct.unpack(">II", png[16:24]) == (800, 400)
        assert any(m.msgtype == "image" for m in wecom.messages)
        # -- ack by alert id stops the repeats
        _cli(url, "ack", esc[2].id, "--comment", "on it", "--by", "alice")
        # -- a silence after the firing was delivered: the repeat is muted, the resolve is not
        _cli(url, "silence", "add", "--match", "run_id=~e2e/la.*", "--diagnosis", "memory_leak",
             "--duration", "30m")
        await asyncio.sleep(1.0)  # the silences topic reaches the notify agent's store
        await send(esc[3], _alert("e2e/late", "memory_leak", step=60, n=1),
                   _alert("e2e/silenced", "kl_drift", status="resolved", step=13),
                   _alert("e2e/inhibit", "gradient_instability", severity="warning", step=60, n=1,
                          summary="symptom"))
        await asyncio.sleep(3.0)
        await send(_alert("e2e/esc", "lr_drift", severity="warning", status="resolved", step=170),
                   _alert("e2e/late", "memory_leak", status="resolved", step=63))
        await _wait(lambda: sum("e2e/late" in m.text and "RESOLVED" in m.text for m in ding.messages) == 1
                    and sum("e2e/esc" in m.text and "RESOLVED" in m.text for m in ding.messages) == 1,
                    30, "both resolve notices")
        assert in_chat("e2e/esc", "lr_drift") == 4  # firing, 2 repeats, resolved: not repeat 3
        assert in_chat("e2e/late", "memory_leak") == 2  # firing and resolved, not the repeat
        assert in_chat("e2e/silenced", "kl_drift") == 0
        assert in_chat("e2e/inhibit", "gradient_instability") == 0
        assert in_chat("e2e/inhibit", "nan_loss") == 1
        # -- history, by HTTP and CLI
        hist = json.loads(_cli(url, "history", "--run", "e2e/esc", "--json"))["history"]
        steps = [(r["transition"], r["notified"]) for r in hist]
        assert ("firing", True) in steps and ("repeat", True) in steps
        assert ("escalated", True) in steps and ("acknowledged", False) in steps
        assert ("resolved", True) in steps
        assert any(r["transition"] == "repeat" and not r["notified"] for r in hist)
        inh = json.loads(_cli(url, "history", "--run", "e2e/inhibit", "--json"))["history"]
        assert any(r["transition"] == "inhibited" for r in inh)
        sil = json.loads(_cli(url, "history", "--run", "e2e/silenced", "--json"))["history"]
        assert [(r["transition"], r["notified"]) for r in sil] == [("silenced", False),
                                                                   ("resolved", False)]
        # -- expiring a silence
        assert "expired" in _cli(url, "silence", "expire", sid)
        assert sid not in _cli(url, "silence", "list")
        assert sid in _cli(url, "silence", "list", "--all")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- service log ---\n{svc.log()[-6000:]}") from None
    finally:
        producer.close()
        elapsed = svc.stop()
    assert elapsed < 15


async def test_quiet_alert_books_are_retired_live_and_after_a_restart_open_ones_kept(
        kafka_bootstrap: str, topic_prefix: str, free_port: int,
        dingtalk_server: FakeDingTalk, wecom_server: FakeWeCom) -> None:
    """A run's alert book with nothing open is dropped (memory and a changelog tombstone)
    TRAINSENTRY_ALERT_BOOK_RETENTION_S after its last change: one written by an earlier
    worker (found by the restarted worker's scan of the table) and one of its own. A
    book with a firing episode stays. A run alerting again after that is notified anew."""
    ding, wecom = dingtalk_server, wecom_server
    topics = Topics(topic_prefix)
    app_id = f"ts-books-{topic_prefix.rstrip('.')}"
    changelog = f"{app_id}-alert_book-changelog"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)

    def in_chat(token: str) -> int:
        return _messages_with(ding, token)

    def books() -> dict[bytes, bytes | None]:
        return {r.key: r.value for r in read_topic(kafka_bootstrap, changelog, timeout_ms=1000)}

    def retired(svc: ServiceProcess) -> float:
        status, text = svc.get("/metrics")
        assert status == 200
        line = [ln for ln in text.splitlines()
                if ln.startswith("trainsentry_alert_books_retired_total")]
        return float(line[0].split()[-1]) if line else -1.0

    async def send(*alerts: AlertEvent) -> None:
        await asyncio.to_thread(_publish, producer, topics, list(alerts))

    first = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                           app_id=app_id, extra_env=_env(_robots(ding, wecom))).start()
    try:
        await asyncio.to_thread(first.wait_ready)
        await send(_alert("books/old", "kl_drift", summary="tokOldFire"),
                   _alert("books/open", "memory_leak", summary="tokOpenFire"))
        await _wait(lambda: in_chat("tokOldFire") and in_chat("tokOpenFire"), 60,
                    "the first firing notices")
        await send(_alert("books/old", "kl_drift", step=11, status="resolved",
                          summary="tokOldResolved"))
        await _wait(lambda: in_chat("tokOldResolved") == 1, 60, "the resolved notice")
        assert retired(first) == 0  # the default retention is a day
    finally:
        first.stop()
    stored = books()
    assert stored.get(b"books/old") and stored.get(b"books/open"), stored.keys()
    assert json.loads(stored[b"books/old"])["episodes"] == []

    second = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                            app_id=app_id, extra_env=_env(_robots(ding, wecom),
                                                          TRAINSENTRY_ALERT_BOOK_RETENTION_S="4")
                            ).start()
    try:
        await asyncio.to_thread(second.wait_ready)
        # Written before the restart and not read since: found by the table scan.
        await _wait(lambda: retired(second) >= 1, 30, "the earlier worker's quiet book retired")
        await send(_alert("books/new", "lr_drift", summary="tokNewFire"))
        await _wait(lambda: in_chat("tokNewFire") == 1, 60, "the new run's firing notice")
        await send(_alert("books/new", "lr_drift", step=11, status="resolved",
                          summary="tokNewResolved"))
        await _wait(lambda: in_chat("tokNewResolved") == 1, 60, "the new run's resolve")
        await _wait(lambda: retired(second) >= 2, 30, "the new run's book retired")
        stored = books()
        assert b"books/old" in stored and stored[b"books/old"] is None, "no tombstone"
        assert b"books/new" in stored and stored[b"books/new"] is None, "no tombstone"
        assert stored.get(b"books/open"), "a book with a firing episode must stay"
        assert "alert book of run books/old retired" in second.log()
        # A run alerting again starts a fresh book, and is notified.
        await send(_alert("books/old", "kl_drift", step=90, summary="tokOldAgain"))
        await _wait(lambda: in_chat("tokOldAgain") == 1, 60, "the returning run's notice")
        assert retired(second) == 2 and books().get(b"books/old")
        assert in_chat("tokOldFire") == 1 and in_chat("tokOldResolved") == 1  # nothing resent
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{second.log()[-4000:]}") from None
    finally:
        producer.close()
        second.stop()


def _delivery_report(tokens: list[str], ding: FakeDingTalk, wecom: FakeWeCom,
                     svc: ServiceProcess) -> str:
    """What each robot got (missing / repeated tokens, message times), for a failure."""
    lines = []
    for name, server in (("dingtalk", ding), ("wecom", wecom)):
        counts = {t: _messages_with(server, t) for t in tokens}
        t0 = server.messages[0].at if server.messages else 0.0
        lines.append(f"{name}: {len(server.messages)} messages at "
                     f"{[round(m.at - t0, 2) for m in server.messages]}; "
                     f"missing {[t for t, c in counts.items() if c == 0]}; "
                     f"repeated {[t for t, c in counts.items() if c > 1]}; "
                     f"errcodes {dict(server.errcodes())}")
    try:
        lines.append(f"readyz: {svc.get('/readyz')}")
    except OSError as exc:
        lines.append(f"readyz: {exc}")
    return "\n".join(lines)


def _get_bytes(url: str) -> tuple[int, bytes]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - 127.0.0.1 service
        return r.status, r.read()
