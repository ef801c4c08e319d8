"""Charts in alerts: a small PNG of the offending signals, attached to the chat message.

People act faster on a picture of "this line left its band at step 431" than on three
numbers. :func:`render_chart` draws, from ``AlertEvent.series`` and ``evidence``, the recent
steps of up to three signals, the healthy band ``baseline ± |bound - baseline|`` and the
anomaly step; non-finite points (NaN/inf, sent as null) are marked on the top edge.

Attaching differs per robot: WeCom takes the image itself (an ``image`` message after the
markdown, see :class:`ChartedWeCom`); DingTalk's markdown only links to an image, so
:class:`ChartedDingTalk` adds ``![chart](<public url>/charts/<alert id>.png)`` and the
service serves it from a :class:`ChartStore` (stream_app/alerting_api.py).
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from notifiers.errors import NotifierError
from trainsentry.events import AlertEvent

__all__ = [
    "render_chart",
    "chart_alert",
    "ChartStore",
    "ChartedDingTalk",
    "ChartedWeCom",
    "attach_charts",
    "MAX_CHART_BYTES",
]

logger = logging.getLogger(__name__)

#: Charts stay small: chat clients load them on phones.
MAX_CHART_BYTES = 200 * 1024
_SEVERITY_RANK = {"info": 1, "warning": 2, "critical": 3}


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(float(x)) else None


def render_chart(alert: AlertEvent, *, width_px: int = 800, height_px: int = 400,
                 max_signals: int = 3) -> bytes | None:
    """PNG bytes of the alert's evidence signals, or None when it carries no series."""
    signals = [k for k, pts in alert.series.items() if isinstance(pts, list) and pts][:max_signals]
    if not signals:
        return None
    # The OO API, not pyplot: no global figure state, safe in a worker thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dpi = 100
    fig = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(signals), 1, sharex=True, squeeze=False)[:, 0]
    title = f"{alert.run_id} · {alert.diagnosis} · step {alert.step}"
    fig.suptitle(title if len(title) <= 90 else title[:89] + "…", fontsize=10)
    for ax, key in zip(axes, signals, strict=True):
        points = [p for p in alert.series[key] if isinstance(p, (list, tuple)) and len(p) == 2]
        steps = [int(p[0]) for p in points]
        values = [_num(p[1]) for p in points]
        xs = [s for s, v in zip(steps, values, strict=True) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, color="#1f77b4", linewidth=1.4, marker="." if len(xs) < 30 else None)
        ev = alert.evidence.get(key)
        ev = ev if isinstance(ev, Mapping) else {}
        baseline, bound = _num(ev.get("baseline")), _num(ev.get("bound"))
        if baseline is not None and bound is not None:
            half = abs(bound - baseline)
            ax.axhspan(baseline - half, baseline + half, color="#2ca02c", alpha=0.15,
                       label="healthy band")
            ax.axhline(bound, color="#d62728", linestyle="--", linewidth=0.9, label="bound")
        elif baseline is not None:
            ax.axhline(baseline, color="#2ca02c", linestyle=":", linewidth=0.9, label="baseline")
        ax.axvline(alert.step, color="#d62728", linewidth=1.0, alpha=0.7)
        bad = [s for s, v in zip(steps, values, strict=True) if v is None]
        if bad:
            top = max(ys) if ys else 1.0
            ax.scatter(bad, [top] * len(bad), marker="x", color="#d62728", zorder=3,
                       label="NaN/inf")
        ax.set_ylabel(key if len(key) <= 28 else "…" + key[-27:], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if baseline is not None or bad:
            ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("step", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    data = buf.getvalue()
    if len(data) > MAX_CHART_BYTES:  # a pathological figure; send the alert without it
        logger.warning("chart for alert %s is %d bytes, over %d; not attached", alert.id,
                       len(data), MAX_CHART_BYTES)
        return None
    return data


def chart_alert(alerts: Sequence[AlertEvent]) -> AlertEvent | None:
    """The alert of a message that gets the chart: the most severe firing one with series."""
    candidates = [a for a in alerts if a.status == "firing" and a.series]
    if not candidates:
        return None
    return max(candidates, key=lambda a: (_SEVERITY_RANK.get(a.severity, 0), a.ts))


class ChartStore:
    """An LRU of alerts that a chart link points at, and of the PNGs rendered for them.

    Rendering is lazy: a DingTalk link costs nothing until a phone opens it.
    """

    def __init__(self, *, capacity: int = 512,
                 render: Callable[[AlertEvent], bytes | None] = render_chart) -> None:
        self.capacity = capacity
        self._render = render
        self._alerts: OrderedDict[str, AlertEvent] = OrderedDict()
        self._pngs: OrderedDict[str, bytes] = OrderedDict()

    def put(self, alert: AlertEvent, png: bytes | None = None) -> None:
        self._alerts[alert.id] = alert
        self._alerts.move_to_end(alert.id)
        if png is not None:
            self._pngs[alert.id] = png
        for d in (self._alerts, self._pngs):
            while len(d) > self.capacity:
                d.popitem(last=False)

    def alert(self, alert_id: str) -> AlertEvent | None:
        return self._alerts.get(alert_id)

    async def png(self, alert_id: str, fallback: AlertEvent | None = None) -> bytes | None:
        """The chart of ``alert_id`` (rendered in a thread on first use), or None."""
        cached = self._pngs.get(alert_id)
        if cached is not None:
            return cached
        alert = self._alerts.get(alert_id) or fallback
        if alert is None:
            return None
        png = await asyncio.to_thread(self._render, alert)
        if png is not None:
            self.put(alert, png)
        return png

    def __len__(self) -> int:
        return len(self._alerts)


class ChartedDingTalk:
    """A DingTalk receiver whose markdown links the chart of its most severe alert."""

    def __init__(self, *, inner: Any, base_url: str, store: ChartStore) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.max_batch: int = inner.max_batch
        self.base_url = base_url.rstrip("/")
        self.store = store

    def __repr__(self) -> str:
        return f"ChartedDingTalk({self.inner!r})"

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        payload = self.inner.payload(alerts)
        alert = chart_alert(alerts)
        if alert is not None and payload.get("msgtype") == "markdown":
            self.store.put(alert)
            link = f"{self.base_url}/charts/{alert.id}.png"
            payload["markdown"]["text"] += f"\n\n![{alert.diagnosis} chart]({link})"
        await self.inner.send(payload)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ChartedWeCom:
    """A WeCom receiver that posts the chart as an ``image`` message after the markdown.

    The image is an attachment: if it fails, the alert was still delivered, so the
    failure is logged and counted, never retried as the whole message (that would repeat
    the markdown). Two messages per send: give this lane half the robot's rate limit.
    """

    def __init__(self, *, inner: Any, store: ChartStore) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.max_batch: int = inner.max_batch
        self.store = store
        self.images_sent = 0
        self.images_failed = 0

    def __repr__(self) -> str:
        return f"ChartedWeCom({self.inner!r})"

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        await self.inner.send_alerts(alerts)
        alert = chart_alert(alerts)
        if alert is None:
            return
        try:
            png = await self.store.png(alert.id, fallback=alert)
            if png is None:
                return
            await self.inner.send_image(png)
            self.images_sent += 1
        except NotifierError as exc:
            self.images_failed += 1
            logger.warning("%s: chart of alert %s not sent (the alert itself was): %s",
                           self.name, alert.id, exc)

    async def aclose(self) -> None:
        await self.inner.aclose()


def attach_charts(receivers: Sequence[Any], *, base_url: str,
                  store: ChartStore) -> tuple[list[Any], dict[str, int]]:
    """Wrap DingTalk/WeCom receivers; returns them and the names whose message count per
    send doubles (their rate limit must be halved)."""
    from notifiers.dingtalk import DingTalk
    from notifiers.wecom import WeCom

    out: list[Any] = []
    doubled: dict[str, int] = {}
    for r in receivers:
        if isinstance(r, DingTalk):
            out.append(ChartedDingTalk(inner=r, base_url=base_url, store=store))
        elif isinstance(r, WeCom):
            out.append(ChartedWeCom(inner=r, store=store))
            doubled[r.name] = 2
        else:
            out.append(r)
    return out, doubled
