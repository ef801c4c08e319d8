"""Charts in alerts: rendering, and attaching them to DingTalk/WeCom on the fake robots."""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from notifiers import DingTalk, WeCom
from notifiers.charts import (
    MAX_CHART_BYTES,
    ChartedDingTalk,
    ChartedWeCom,
    ChartStore,
    attach_charts,
    chart_alert,
    render_chart,
)
from tests.chat_servers import FakeDingTalk, FakeWeCom, make_alert
from trainsentry.events import AlertEvent


def charted_alert(**kw: Any) -> AlertEvent:
    series = {"timing_s/gen": [[s, 3.0 + (0.1 * (s % 3)) if s < 55 else 12.0] for s in range(0, 60)],
              "gpu/utilization_pct": [[s, 88.0 if s < 55 else 21.0] for s in range(0, 60)],
              "actor/grad_norm": [[s, None if s == 58 else 1.0] for s in range(0, 60)]}
    return make_alert(step=59, series=series, **kw)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def test_chart_is_a_small_800x400_png() -> None:
    """The chart of an alert with series: PNG, 800x400, under 200 KB."""
    png = render_chart(charted_alert())
    assert png is not None
    assert png_size(png) == (800, 400)
    assert len(png) < MAX_CHART_BYTES


def test_alert_without_series_has_no_chart() -> None:
    """Nothing to draw: no chart (and no empty image in chat)."""
    assert render_chart(make_alert()) is None
    assert chart_alert([make_alert()]) is None


def test_chart_goes_to_the_most_severe_firing_alert() -> None:
    """In a digest, the chart belongs to the worst firing alert with series."""
    warn = charted_alert(id="w", severity="warning")
    crit = charted_alert(id="c", severity="critical")
    resolved = charted_alert(id="r", status="resolved")
    chosen = chart_alert([warn, resolved, crit])
    assert chosen is not None and chosen.id == "c"


async def test_store_renders_lazily_once() -> None:
    """A chart link costs a render only when opened, and only once."""
    calls: list[str] = []

    def render(a: AlertEvent) -> bytes:
        calls.append(a.id)
        return b"png"

    store = ChartStore(render=render, capacity=2)
    store.put(charted_alert(id="a"))
    assert await store.png("a") == b"png" and await store.png("a") == b"png"
    assert calls == ["a"]
    assert await store.png("missing") is None
    store.put(charted_alert(id="b"))
    store.put(charted_alert(id="c"))
    assert store.alert("a") is None  # LRU


async def test_wecom_gets_the_chart_as_an_image_after_the_markdown(
        wecom_server_factory: Callable[..., Awaitable[FakeWeCom]]) -> None:
    """WeCom: markdown first, then an image message whose md5 matches (the fake checks it)."""
    server = await wecom_server_factory()
    async with httpx.AsyncClient() as client:
        inner = WeCom(url=server.url, client=client, language="en")
        receiver = ChartedWeCom(inner=inner, store=ChartStore())
        await receiver.send_alerts([charted_alert()])
    assert [m.msgtype for m in server.messages] == ["markdown", "image"]
    image = server.messages[1].payload["image"]
    raw = base64.b64decode(image["base64"])
    assert hashlib.md5(raw).hexdigest() == image["md5"]  # noqa: S324
    assert png_size(raw) == (800, 400)
    assert receiver.images_sent == 1


async def test_wecom_image_failure_does_not_fail_the_delivered_alert(
        wecom_server_factory: Callable[..., Awaitable[FakeWeCom]]) -> None:
    """The image is an attachment: if the robot refuses it, the alert still counts as sent."""
    server = await wecom_server_factory(limit=1)
    async with httpx.AsyncClient() as client:
        receiver = ChartedWeCom(inner=WeCom(url=server.url, client=client), store=ChartStore())
        await receiver.send_alerts([charted_alert()])  # the image is throttled (45009)
    assert [m.msgtype for m in server.messages] == ["markdown"]
    assert receiver.images_failed == 1


async def test_dingtalk_markdown_links_the_chart_served_by_the_service(
        dingtalk_server_factory: Callable[..., Awaitable[FakeDingTalk]]) -> None:
    """DingTalk: the markdown carries ![chart](<public url>/charts/<id>.png); the store has it."""
    server = await dingtalk_server_factory()
    store = ChartStore()
    async with httpx.AsyncClient() as client:
        inner = DingTalk(url=server.url, secret=server.secret, client=client, language="en")
        receiver = ChartedDingTalk(inner=inner, base_url="http://127.0.0.1:6066/", store=store)
        await receiver.send_alerts([charted_alert(id="alert-42")])
    text = server.messages[0].payload["markdown"]["text"]
    assert "![dataloader_stall chart](http://127.0.0.1:6066/charts/alert-42.png)" in text
    assert "grpo-qwen7b/exp3" in text and "dataloader_stall" in text
    png = await store.png("alert-42")
    assert png is not None and png_size(png) == (800, 400)


def test_attach_charts_halves_the_wecom_lane_only() -> None:
    """WeCom sends two messages per alert message; DingTalk one."""
    d = DingTalk(url="http://127.0.0.1:1/robot/send?access_token=x")
    w = WeCom(url="http://127.0.0.1:1/cgi-bin/webhook/send?key=y")
    wrapped, doubled = attach_charts([d, w], base_url="http://x", store=ChartStore())
    assert [type(r).__name__ for r in wrapped] == ["ChartedDingTalk", "ChartedWeCom"]
    assert doubled == {"wecom": 2}
