"""The demo's local chat sink takes real notifier traffic and shows what the chat would."""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Iterator

import pytest

from notifiers import ConfigurationError, Deliverer, DingTalk, WeCom
from trainsentry.sink import ChatSink

pytest.register_assert_rewrite("tests.chat_servers")
from tests.chat_servers import make_alert  # noqa: E402


@pytest.fixture
def sink() -> Iterator[tuple[ChatSink, io.StringIO]]:
    """A started sink with 加签 on, printing into a buffer."""
    out = io.StringIO()
    s = ChatSink(dingtalk_secret="SECsink-demo-secret", out=out).start()
    yield s, out
    s.stop()


async def test_sink_accepts_both_robots_and_prints_the_chat(
        sink: tuple[ChatSink, io.StringIO]) -> None:
    """DingTalk (signed) and WeCom messages arrive, are kept, and are printed readably."""
    s, out = sink
    env = s.env()
    assert env["TRAINSENTRY_DINGTALK_SECRET"] == "SECsink-demo-secret"
    robots = [DingTalk(url=env["TRAINSENTRY_DINGTALK_URL"], secret=env["TRAINSENTRY_DINGTALK_SECRET"]),
              WeCom(url=env["TRAINSENTRY_WECOM_URL"], language="en")]
    async with Deliverer(receivers=robots) as d:
        result = await d.deliver([make_alert()])
    assert result.ok
    assert s.wait_for(2)
    assert {m.channel for m in s.messages} == {"dingtalk", "wecom"}
    printed = out.getvalue()
    assert "DingTalk" in printed and "WeCom" in printed
    assert printed.count("grpo-qwen7b/exp3") >= 2 and "dataloader_stall" in printed
    assert "**" not in printed and "<font" not in printed
    assert s.access_token not in printed and s.wecom_key not in printed


async def test_sink_refuses_a_bad_signature(sink: tuple[ChatSink, io.StringIO]) -> None:
    """With the secret configured, the sink checks 加签 like DingTalk does."""
    s, _ = sink
    async with DingTalk(url=s.urls["dingtalk"], secret="SECwrong") as robot:
        with pytest.raises(ConfigurationError) as info:
            await robot.send_alerts([make_alert()])
    assert info.value.errcode == 310000 and s.messages == []


def test_sink_serves_messages_as_json(sink: tuple[ChatSink, io.StringIO]) -> None:
    """GET /messages lists what arrived (for scripts driving the demo)."""
    s, _ = sink
    req = urllib.request.Request(
        s.urls["wecom"], method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"msgtype": "markdown", "markdown": {"content": "run r1 nan_loss"}}).encode())
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert json.loads(resp.read())["errcode"] == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/messages", timeout=5) as resp:
        [msg] = json.loads(resp.read())
    assert msg["channel"] == "wecom" and "nan_loss" in msg["text"]
