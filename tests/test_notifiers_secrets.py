"""Webhook tokens and the signing secret never show in logs, errors, reprs or health."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import pytest

from notifiers import (
    Deliverer,
    DingTalk,
    NotifierError,
    RetryPolicy,
    Webhook,
    WeCom,
    redact_url,
    scrub,
)

TOKEN = "dtTOKEN-abcdef0123456789-leak"
SECRET = "SECsigning-secret-ffff0000-leak"
KEY = "wcKEY-0123-4567-89ab-leak"
FAST = RetryPolicy(initial_s=0.05, max_backoff_s=0.2, max_total_s=3.0)

# The robot-server fixtures (dingtalk_server, wecom_server and their factories). The module
# is registered for assert rewriting before it is imported, as pytest does for plugins.
pytest.register_assert_rewrite("tests.chat_servers")
pytest_plugins = ["tests.chat_servers"]
from tests.chat_servers import FakeDingTalk, FakeWeCom, make_alert  # noqa: E402


def test_redact_url_masks_tokens_keys_and_signs() -> None:
    """access_token, key and sign values become ***; other parameters stay."""
    assert redact_url(f"https://oapi.dingtalk.com/robot/send?access_token={TOKEN}"
                      "&timestamp=1700000000000&sign=ab%2Bcd%3D") == \
        "https://oapi.dingtalk.com/robot/send?access_token=***&timestamp=1700000000000&sign=***"
    assert redact_url(f"https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key={KEY}") == \
        "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=***"
    assert redact_url("https://user:pw@example.com/hook?x=1") == \
        "https://user:***@example.com/hook?x=1"


def test_scrub_masks_urls_inside_free_text_and_given_secrets() -> None:
    """scrub() cleans credentials out of arbitrary text, including bare secrets it is told about."""
    text = f"POST https://h/robot/send?access_token={TOKEN}&sign=x failed; secret {SECRET}"
    out = scrub(text, [SECRET])
    assert TOKEN not in out and SECRET not in out and "sign=x" not in out


async def test_no_secret_in_logs_errors_reprs_or_health(
        caplog: pytest.LogCaptureFixture,
        dingtalk_server_factory: Callable[..., Awaitable[FakeDingTalk]],
        wecom_server_factory: Callable[..., Awaitable[FakeWeCom]]) -> None:
    """Succeeding and failing sends (bad sign, bad token, 500, down, timeout) leak nothing."""
    caplog.set_level(logging.DEBUG)
    dt = await dingtalk_server_factory(token=TOKEN, secret=SECRET)
    wc = await wecom_server_factory(key=KEY)
    signs: list[str] = []
    texts: list[str] = []

    good = [DingTalk(url=dt.url, secret=SECRET, name="dt-good"),
            WeCom(url=wc.url, name="wc-good")]
    bad = [DingTalk(url=dt.url, secret=SECRET + "x", name="dt-badsign"),
           DingTalk(url=dt.url.replace(TOKEN, TOKEN[::-1]), secret=SECRET, name="dt-badtoken"),
           WeCom(url=wc.url.replace(KEY, KEY[::-1]), name="wc-badkey"),
           Webhook(url=f"http://127.0.0.1:9/hook?token={TOKEN}", name="hook-down",
                   headers={"Authorization": f"Bearer {SECRET}"})]
    receivers = good + bad

    # Direct sends: exceptions as the caller sees them.
    for robot in receivers:
        try:
            await robot.send_alerts([make_alert()])
        except NotifierError as exc:
            texts += [str(exc), repr(exc)]
            assert exc.__cause__ is None or TOKEN not in str(exc.__cause__)
    # Through the deliverer, with 500s, a slow answer and a dead port.
    dt.fail_next(2)
    wc.delay_s = 0.3
    slow = WeCom(url=wc.url, name="wc-slow", timeout=0.05)
    async with Deliverer(receivers=[*receivers, slow], retry=FAST) as d:
        result = await d.deliver([make_alert(id="x"), make_alert(id="y")])
        health = d.health()
    texts += [json.dumps(health), repr(result), repr(d)] + [repr(r) for r in receivers]
    signs += [r.query.get("sign", "") for r in dt.requests if r.query.get("sign")]
    assert signs, "the server saw signed requests"
    assert health["dt-badsign"]["state"] == "config_error"
    assert health["wc-badkey"]["state"] == "config_error"
    assert health["hook-down"]["state"] in ("retrying", "failing")

    for record in caplog.records:
        texts.append(record.getMessage())
        if record.exc_text:
            texts.append(record.exc_text)
    texts.append(caplog.text)
    blob = "\n".join(texts)
    for needle in (TOKEN, TOKEN[::-1], SECRET, KEY, KEY[::-1], *signs):
        assert needle not in blob, f"leaked {needle[:6]}…"
    assert "access_token=***" in blob  # the redacted form is what shows


async def test_httpx_request_log_line_is_redacted(
        caplog: pytest.LogCaptureFixture,
        wecom_server_factory: Callable[..., Awaitable[FakeWeCom]]) -> None:
    """httpx logs each request URL at INFO; the key in it is masked."""
    caplog.set_level(logging.INFO, logger="httpx")
    wc = await wecom_server_factory(key=KEY)
    async with WeCom(url=wc.url) as robot:
        await robot.send_alerts([make_alert()])
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert lines and all(KEY not in line for line in lines)
    assert any("key=***" in line for line in lines)
