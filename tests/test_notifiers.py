"""DingTalk, WeCom and generic-webhook clients against real local robot servers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote_plus

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from notifiers import (
    ConfigurationError,
    Deliverer,
    DingTalk,
    MessageRejected,
    RetryPolicy,
    Throttled,
    TransientError,
    Webhook,
    WeCom,
    sign,
)
from notifiers.dingtalk import signed_url
from notifiers.wecom import WECOM_IMAGE_MAX_BYTES, image_payload
from trainsentry.config import Secret
from trainsentry.errors import ConfigError

# -- DingTalk signing ----------------------------------------------------------------------

# The robot-server fixtures (dingtalk_server, wecom_server and their factories). The module
# is registered for assert rewriting before it is imported, as pytest does for plugins.
pytest.register_assert_rewrite("tests.chat_servers")
pytest_plugins = ["tests.chat_servers"]
from tests.chat_servers import FakeDingTalk, FakeWeCom, make_alert  # noqa: E402


def test_dingtalk_sign_known_answers() -> None:
    """加签 matches answers computed independently with `openssl dgst -sha256 -hmac … | base64`."""
    # printf '1577262236757\nthis is secret' | openssl dgst -sha256 -hmac 'this is secret' -binary | base64
    assert sign("this is secret", 1577262236757) == "hmPWwU%2B7lVdm3ZZz0r9tSfx0L4Q26jWOZr9%2BGs6EZQM%3D"
    assert sign("SEC0123456789abcdef", 1700000000000) == \
        "TSZbRFUuvaSQaRKUpF970OPCb2%2FLcQAP3wOvwZIzBZk%3D"


@given(secret=st.text(min_size=1, max_size=80), ts=st.integers(min_value=0, max_value=2**45))
def test_dingtalk_sign_is_urlencoded_base64_hmac(secret: str, ts: int) -> None:
    """For any secret and timestamp, the sign decodes to HMAC-SHA256(secret, "ts\\nsecret")."""
    out = sign(secret, ts)
    assert all(c.isalnum() or c == "%" for c in out)  # nothing left for a URL to misread
    mac = hmac.new(secret.encode(), f"{ts}\n{secret}".encode(), hashlib.sha256).digest()
    assert base64.b64decode(unquote_plus(out)) == mac


def test_signed_url_appends_timestamp_and_sign() -> None:
    """The webhook keeps its access_token and gains &timestamp=…&sign=…."""
    url = signed_url("https://oapi.dingtalk.com/robot/send?access_token=T", "this is secret",
                     1577262236757)
    assert url == ("https://oapi.dingtalk.com/robot/send?access_token=T&timestamp=1577262236757"
                   "&sign=hmPWwU%2B7lVdm3ZZz0r9tSfx0L4Q26jWOZr9%2BGs6EZQM%3D")
    assert signed_url("https://x/robot/send?access_token=T", None, 1) == \
        "https://x/robot/send?access_token=T"


# -- DingTalk against the local robot --------------------------------------------------------


async def test_signed_dingtalk_markdown_is_accepted(dingtalk_server: FakeDingTalk) -> None:
    """A correctly signed markdown message is accepted and shows run_id, label and @mobiles."""
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret,
                        at_mobiles=["13800000000"]) as robot:
        await robot.send_alerts([make_alert()])
    [msg] = dingtalk_server.messages
    assert msg.msgtype == "markdown"
    body = msg.payload["markdown"]
    assert "grpo-qwen7b/exp3" in body["text"] and "dataloader_stall" in body["text"]
    assert "dataloader_stall" in body["title"]
    assert msg.payload["at"] == {"atMobiles": ["13800000000"], "isAtAll": False}
    assert "@13800000000" in body["text"]


async def test_dingtalk_warning_does_not_mention_anyone(dingtalk_server: FakeDingTalk) -> None:
    """@mentions are for critical firing alerts only."""
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret,
                        at_mobiles=["13800000000"], at_all_on_critical=True) as robot:
        await robot.send_alerts([make_alert(severity="warning")])
        await robot.send_alerts([make_alert(severity="critical")])
    first, second = dingtalk_server.messages
    assert first.payload["at"] == {"atMobiles": [], "isAtAll": False}
    assert second.payload["at"]["isAtAll"] is True


@pytest.mark.parametrize("msgtype", ["text", "markdown", "actionCard"])
async def test_dingtalk_every_msgtype_has_the_shape_the_robot_wants(
        dingtalk_server: FakeDingTalk, msgtype: Any) -> None:
    """text, markdown and actionCard payloads all pass the robot's shape checks."""
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret, msgtype=msgtype,
                        dashboard_url="http://127.0.0.1:6066/runs/x", language="en") as robot:
        await robot.send_alerts([make_alert(), make_alert(id="b", run_id="r2", fingerprint="f2")])
    [msg] = dingtalk_server.messages
    assert msg.msgtype == msgtype
    assert "grpo-qwen7b/exp3" in msg.text and "r2" in msg.text and "dataloader_stall" in msg.text


async def test_dingtalk_messages_carry_the_keyword_trainsentry(
        dingtalk_server_factory: Callable[..., Awaitable[FakeDingTalk]]) -> None:
    """A robot secured by the custom keyword "trainsentry" accepts our messages."""
    server = await dingtalk_server_factory(keywords=("trainsentry",), secret=None)
    async with DingTalk(url=server.url) as robot:
        await robot.send_alerts([make_alert()])
    assert len(server.messages) == 1


async def test_wrongly_signed_dingtalk_is_a_configuration_error(
        dingtalk_server: FakeDingTalk) -> None:
    """A wrong secret gives errcode 310000 as ConfigurationError."""
    async with DingTalk(url=dingtalk_server.url, secret="SECwrong-secret-000000") as robot:
        with pytest.raises(ConfigurationError) as info:
            await robot.send_alerts([make_alert()])
    assert info.value.errcode == 310000
    assert dingtalk_server.messages == []


async def test_wrongly_signed_dingtalk_is_not_retried(dingtalk_server: FakeDingTalk) -> None:
    """Through the deliverer, a signature error is tried once, failed for good, and shown in health."""
    robot = DingTalk(url=dingtalk_server.url, secret="SECwrong-secret-000000")
    async with Deliverer(receivers=[robot], retry=RetryPolicy(initial_s=0.01)) as deliverer:
        result = await deliverer.deliver([make_alert(), make_alert(id="b")])
        health = deliverer.health()["dingtalk"]
    assert not result.ok and result.settled
    assert {f.kind for f in result.failed} == {"config_error"}
    assert len(dingtalk_server.requests) == 1
    assert health["state"] == "config_error" and "310000" in health["reason"]
    assert health["attempts"] == 1 and health["retries"] == 0 and health["failed"] == 2


async def test_dingtalk_stale_timestamp_is_refused(dingtalk_server: FakeDingTalk) -> None:
    """A clock two hours off makes the robot refuse the signature (errcode 310000)."""
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret,
                        clock=lambda: time.time() - 7200) as robot:
        with pytest.raises(ConfigurationError):
            await robot.send_alerts([make_alert()])


async def test_dingtalk_bad_token_is_a_configuration_error(dingtalk_server: FakeDingTalk) -> None:
    """An unknown access_token gives errcode 300001 as ConfigurationError."""
    url = dingtalk_server.url.replace(dingtalk_server.token, "not-the-token-xyz")
    async with DingTalk(url=url, secret=dingtalk_server.secret) as robot:
        with pytest.raises(ConfigurationError) as info:
            await robot.send_alerts([make_alert()])
    assert info.value.errcode == 300001


async def test_dingtalk_21st_message_in_a_minute_is_throttled(
        dingtalk_server: FakeDingTalk) -> None:
    """Past 20 messages a minute the robot answers 130101, read as Throttled."""
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret) as robot:
        for i in range(20):
            await robot.send_alerts([make_alert(id=str(i))])
        with pytest.raises(Throttled) as info:
            await robot.send_alerts([make_alert(id="21")])
    assert info.value.errcode == 130101


async def test_dingtalk_http_500_is_transient(dingtalk_server: FakeDingTalk) -> None:
    """HTTP 5xx is a TransientError (retryable), not a configuration error."""
    dingtalk_server.fail_next(1)
    async with DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret) as robot:
        with pytest.raises(TransientError):
            await robot.send_alerts([make_alert()])


def test_dingtalk_constructor_is_keyword_only_and_offline() -> None:
    """Building a robot needs no network and refuses a URL that is not http(s)."""
    robot = DingTalk(url=Secret("https://oapi.dingtalk.com/robot/send?access_token=abc"),
                     secret=Secret("SECxyz"))
    assert "abc" not in repr(robot) and "SECxyz" not in repr(robot)
    with pytest.raises(ConfigError):
        DingTalk(url="oapi.dingtalk.com/robot/send")
    with pytest.raises(TypeError):
        DingTalk("https://x")  # type: ignore[misc]


# -- WeCom ---------------------------------------------------------------------------------


@pytest.mark.parametrize("msgtype", ["markdown", "markdown_v2", "text", "template_card"])
async def test_wecom_every_msgtype_is_accepted(wecom_server: FakeWeCom, msgtype: Any) -> None:
    """markdown, markdown_v2, text and template_card payloads pass the robot's checks."""
    async with WeCom(url=wecom_server.url, msgtype=msgtype, mentioned_list=["zhangsan", "@all"],
                     dashboard_url="http://127.0.0.1:6066/runs/x") as robot:
        await robot.send_alerts([make_alert(), make_alert(id="b", run_id="r2", fingerprint="f2")])
    [msg] = wecom_server.messages
    assert msg.msgtype == msgtype
    assert "grpo-qwen7b/exp3" in msg.text and "dataloader_stall" in msg.text
    if msgtype == "text":
        assert msg.payload["text"]["mentioned_list"] == ["zhangsan", "@all"]
    if msgtype == "markdown":
        assert "<@zhangsan>" in msg.payload["markdown"]["content"]


@pytest.mark.parametrize("language", ["zh", "en"])
async def test_wecom_card_subtitle_is_the_summary_in_the_message_language(
        wecom_server: FakeWeCom, language: str) -> None:
    alert = make_alert(summary="dataloader_stall: GPUs idle at 12%",
                       summary_zh="dataloader_stall：GPU 利用率仅 12%")
    async with WeCom(url=wecom_server.url, msgtype="template_card", language=language,
                     dashboard_url="http://127.0.0.1:6066/runs/x") as robot:
        await robot.send_alerts([alert])
    card = wecom_server.messages[0].payload["template_card"]
    expected = alert.summary_zh if language == "zh" else alert.summary
    assert card["sub_title_text"] == expected


async def test_wecom_long_chinese_markdown_is_truncated_and_accepted(
        wecom_server: FakeWeCom) -> None:
    """A huge Chinese digest is cut below 4096 bytes at a character and the robot accepts it."""
    alert = make_alert(summary="显存持续上涨" * 300,
                       actions=[f"第{i}项：检查数据集挂载并增加加载进程" for i in range(100)])
    async with WeCom(url=wecom_server.url) as robot:
        await robot.send_alerts([alert])
    content = wecom_server.messages[0].payload["markdown"]["content"]
    assert len(content.encode()) <= 4096
    assert "详见看板" in content and "grpo-qwen7b/exp3" in content


async def test_wecom_image_with_base64_and_md5_is_accepted(wecom_server: FakeWeCom) -> None:
    """An image goes as base64 plus the md5 of the raw bytes."""
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 10
    async with WeCom(url=wecom_server.url) as robot:
        await robot.send_image(png)
    assert wecom_server.messages[0].msgtype == "image"


def test_wecom_image_over_2mb_is_rejected_before_sending() -> None:
    """An image over 2 MB never leaves the process."""
    with pytest.raises(MessageRejected):
        image_payload(b"x" * (WECOM_IMAGE_MAX_BYTES + 1))
    assert image_payload(b"x" * 10)["image"]["md5"] == hashlib.md5(b"x" * 10).hexdigest()


async def test_wecom_bad_key_is_a_configuration_error(wecom_server: FakeWeCom) -> None:
    """An unknown key gives errcode 93000 as ConfigurationError."""
    url = wecom_server.url.replace(wecom_server.key, "wrong-key-0000")
    async with WeCom(url=url) as robot:
        with pytest.raises(ConfigurationError) as info:
            await robot.send_alerts([make_alert()])
    assert info.value.errcode == 93000


async def test_wecom_21st_message_in_a_minute_is_throttled(wecom_server: FakeWeCom) -> None:
    """Past 20 messages a minute the robot answers 45009, read as Throttled."""
    async with WeCom(url=wecom_server.url) as robot:
        for i in range(20):
            await robot.send_alerts([make_alert(id=str(i))])
        with pytest.raises(Throttled) as info:
            await robot.send_alerts([make_alert(id="21")])
    assert info.value.errcode == 45009


async def test_wecom_invalid_message_type_is_a_configuration_error(
        wecom_server: FakeWeCom) -> None:
    """errcode 40008 (a msgtype the robot does not take) is not retried."""
    async with WeCom(url=wecom_server.url) as robot:
        with pytest.raises(ConfigurationError) as info:
            await robot.send({"msgtype": "voice", "voice": {"media_id": "x"}})
    assert info.value.errcode == 40008


async def test_wecom_oversized_markdown_from_elsewhere_is_rejected(
        wecom_server: FakeWeCom) -> None:
    """A hand-built markdown over 4096 bytes is MessageRejected (this message only)."""
    async with WeCom(url=wecom_server.url) as robot:
        with pytest.raises(MessageRejected):
            await robot.send({"msgtype": "markdown", "markdown": {"content": "中" * 2000}})


def test_wecom_template_card_needs_a_dashboard_url() -> None:
    """A text_notice card must have a click action, so it needs dashboard_url."""
    with pytest.raises(ConfigError):
        WeCom(url="https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=k", msgtype="template_card")


# -- generic webhook -----------------------------------------------------------------------


class _Hook:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answers: list[tuple[int, dict[str, str]]] = []
        self.url = ""


@pytest.fixture
async def hook_server() -> AsyncIterator[_Hook]:
    """A plain HTTP endpoint that records bodies and answers what the test queued (default 200)."""
    hook = _Hook()

    async def handle(request: web.Request) -> web.Response:
        hook.bodies.append(json.loads(await request.read()))
        status, headers = hook.answers.pop(0) if hook.answers else (200, {})
        return web.Response(status=status, headers=headers, text="{}")

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hook.url = f"http://127.0.0.1:{port}/hook?token=hook-secret-123456"
    yield hook
    await runner.cleanup()


async def test_webhook_posts_alert_json(hook_server: _Hook) -> None:
    """The body is {"alerts": [AlertEvent JSON, ...]} and a 2xx is success."""
    async with Webhook(url=hook_server.url) as hook:
        await hook.send_alerts([make_alert(), make_alert(id="b")])
    [body] = hook_server.bodies
    assert [a["id"] for a in body["alerts"]] == ["a-0001", "b"]
    assert body["alerts"][0]["run_id"] == "grpo-qwen7b/exp3" and body["alerts"][0]["v"] == 1


@pytest.mark.parametrize(("status", "error"), [(503, TransientError), (429, Throttled),
                                               (404, ConfigurationError),
                                               (400, MessageRejected)])
async def test_webhook_status_codes_map_to_errors(hook_server: _Hook, status: int,
                                                  error: type[Exception]) -> None:
    """5xx retry, 429 throttle (Retry-After kept), 404 configuration, other 4xx rejected."""
    hook_server.answers.append((status, {"Retry-After": "7"}))
    async with Webhook(url=hook_server.url) as hook:
        with pytest.raises(error) as info:
            await hook.send_alerts([make_alert()])
    if status == 429:
        assert info.value.retry_after == 7.0  # type: ignore[attr-defined]
    assert "hook-secret-123456" not in str(info.value)


async def test_injected_client_is_used_and_not_closed(dingtalk_server: FakeDingTalk) -> None:
    """A caller's httpx.AsyncClient is used as given and left open (STYLE rule 7)."""
    async with httpx.AsyncClient() as client:
        robot = DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret, client=client)
        await robot.send_alerts([make_alert()])
        await robot.aclose()
        assert not client.is_closed
    assert len(dingtalk_server.messages) == 1


async def test_mock_transport_works_for_unit_tests() -> None:
    """httpx.MockTransport can stand in for the robot (no server needed)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"errcode": 0, "errmsg": "ok"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        robot = WeCom(url="https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=k", client=client)
        await robot.send_alerts([make_alert()])
    assert json.loads(seen[0].content)["msgtype"] == "markdown"
