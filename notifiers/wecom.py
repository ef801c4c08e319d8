"""WeCom (企业微信) group robot: markdown, markdown_v2, template_card, text and image payloads.

The webhook is ``https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=…``. The robot
answers ``{"errcode": 0, "errmsg": "ok"}`` or an errcode (see ``docs/notifiers.md``);
markdown content is limited to 4096 UTF-8 bytes and images to 2 MB before base64.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Literal

import httpx

from notifiers._http import DEFAULT_TIMEOUT_S, post_json, raise_for_http_status
from notifiers.errors import ConfigurationError, MessageRejected, Throttled, TransientError
from notifiers.redact import redact_url, scrub
from notifiers.templates import (
    WECOM_MARKDOWN_MAX_BYTES,
    label_name,
    pages,
    render_markdown,
    render_text,
    render_title,
    render_wecom_markdown,
    severity_name,
    summary_text,
)
from trainsentry.config import Secret
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = [
    "WeCom",
    "image_payload",
    "WECOM_IMAGE_MAX_BYTES",
    "WECOM_TEXT_MAX_BYTES",
    "THROTTLE_ERRCODES",
    "CONFIG_ERRCODES",
]

logger = logging.getLogger(__name__)

#: Image payloads: at most 2 MB before base64 (JPG or PNG).
WECOM_IMAGE_MAX_BYTES = 2 * 1024 * 1024
#: ``text`` content: at most 2048 bytes.
WECOM_TEXT_MAX_BYTES = 2048
#: 45009: "api freq out of limit" (20 messages a minute per robot).
THROTTLE_ERRCODES: frozenset[int] = frozenset({45009})
#: 93000: invalid webhook key; 40008: invalid message type (the robot does not take it);
#: 93004/93008: robot disabled or not in the group.
CONFIG_ERRCODES: frozenset[int] = frozenset({93000, 40008, 93004, 93008})
TRANSIENT_ERRCODES: frozenset[int] = frozenset({-1})

MsgType = Literal["markdown", "markdown_v2", "template_card", "text"]


def image_payload(image: bytes) -> dict[str, Any]:
    """An ``image`` payload: base64 of the bytes and the md5 of the raw bytes (≤ 2 MB)."""
    if len(image) > WECOM_IMAGE_MAX_BYTES:
        raise MessageRejected(f"image is {len(image)} bytes; WeCom takes at most "
                              f"{WECOM_IMAGE_MAX_BYTES} bytes before base64")
    return {"msgtype": "image",
            "image": {"base64": base64.b64encode(image).decode("ascii"),
                      "md5": hashlib.md5(image).hexdigest()}}  # noqa: S324 - WeCom's checksum


def _secret(value: str | Secret) -> Secret:
    return value if isinstance(value, Secret) else Secret(value)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class WeCom:
    """A WeCom group robot. No network I/O until the first :meth:`send`.

    ``mentioned_list`` (userids, or ``"@all"``) is mentioned on critical firing alerts:
    as ``<@userid>`` in markdown and as ``mentioned_list`` in text messages.
    """

    def __init__(self, *, url: str | Secret, client: httpx.AsyncClient | None = None,
                 language: str = "zh", mentioned_list: Sequence[str] = (),
                 mentioned_mobile_list: Sequence[str] = (), msgtype: MsgType = "markdown",
                 dashboard_url: str | None = None, name: str = "wecom",
                 timeout: float = DEFAULT_TIMEOUT_S, max_batch: int = 20) -> None:
        self._url = _secret(url)
        if not self._url.get().startswith(("http://", "https://")):
            raise ConfigError(f"{name}: the WeCom webhook must be an http(s) URL with ?key=… "
                              "(TRAINSENTRY_WECOM_URL)")
        if language not in ("zh", "en"):
            raise ConfigError(f"{name}: language must be 'zh' or 'en', got {language!r}")
        if msgtype not in ("markdown", "markdown_v2", "template_card", "text"):
            raise ConfigError(f"{name}: msgtype must be markdown, markdown_v2, template_card or text")
        if msgtype == "template_card" and not dashboard_url:
            raise ConfigError(f"{name}: a template_card needs dashboard_url for its click action")
        self.name = name
        self.language = language
        self.mentioned_list = tuple(mentioned_list)
        self.mentioned_mobile_list = tuple(mentioned_mobile_list)
        self.msgtype: MsgType = msgtype
        self.dashboard_url = dashboard_url
        self.timeout = timeout
        self.max_batch = max_batch
        self._client = client
        self._owns_client = client is None

    def __repr__(self) -> str:
        return (f"WeCom(name={self.name!r}, url={redact_url(self._url.get())!r}, "
                f"msgtype={self.msgtype!r}, language={self.language!r})")

    @property
    def redacted_url(self) -> str:
        return redact_url(self._url.get())

    # -- payloads --------------------------------------------------------------------------
    def _mentions(self, alerts: Sequence[AlertEvent]) -> list[str]:
        return list(self.mentioned_list) if pages(alerts) else []

    def markdown_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``markdown`` msgtype, at most 4096 bytes, cut at a character with a "more" line."""
        mentions = [m for m in self._mentions(alerts) if m != "@all"]  # markdown has no @all
        content = render_wecom_markdown(alerts, language=self.language, link=self.dashboard_url,
                                        mentions=mentions)
        return {"msgtype": "markdown", "markdown": {"content": content}}

    def markdown_v2_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``markdown_v2`` msgtype (standard markdown, no colour tags), at most 4096 bytes."""
        content = render_markdown(alerts, language=self.language, link=self.dashboard_url,
                                  max_bytes=WECOM_MARKDOWN_MAX_BYTES).text
        return {"msgtype": "markdown_v2", "markdown_v2": {"content": content}}

    def text_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``text`` msgtype (≤ 2048 bytes) with ``mentioned_list`` on critical alerts."""
        content = render_text(alerts, language=self.language, link=self.dashboard_url,
                              max_bytes=WECOM_TEXT_MAX_BYTES).text
        text: dict[str, Any] = {"content": content}
        mentions = self._mentions(alerts)
        if mentions:
            text["mentioned_list"] = mentions
        if mentions and self.mentioned_mobile_list:
            text["mentioned_mobile_list"] = list(self.mentioned_mobile_list)
        return {"msgtype": "text", "text": text}

    def template_card_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``template_card`` of ``card_type`` ``text_notice``: the headline fields of the alert(s)."""
        if not self.dashboard_url:
            raise ConfigError(f"{self.name}: a template_card needs dashboard_url for its click action")
        lang = self.language
        top = max(alerts, key=lambda a: (a.status == "firing",
                                         ("info", "warning", "critical").index(a.severity)
                                         if a.severity in ("info", "warning", "critical") else 0))
        title = render_title(alerts, language=lang)
        desc = f"{top.diagnosis} · {label_name(top.diagnosis, lang)}"
        rows = [
            {"keyname": "run_id", "value": _cut(top.run_id, 60)},
            {"keyname": "label", "value": top.diagnosis},
            {"keyname": "step" if lang == "en" else "步数", "value": str(top.step)},
            {"keyname": "severity" if lang == "en" else "级别", "value": severity_name(top, lang)},
        ]
        if len(alerts) > 1:
            runs = ", ".join(dict.fromkeys(a.run_id for a in alerts))
            rows.append({"keyname": "runs" if lang == "en" else "运行", "value": _cut(runs, 60)})
        card: dict[str, Any] = {
            "card_type": "text_notice",
            "source": {"desc": "trainsentry"},
            "main_title": {"title": _cut(title, 60), "desc": _cut(desc, 60)},
            "emphasis_content": {"title": str(len(alerts)),
                                 "desc": "alerts" if lang == "en" else "条告警"},
            "sub_title_text": _cut(summary_text(top, lang) if top.summary else desc, 200),
            "horizontal_content_list": rows[:6],
            "card_action": {"type": 1, "url": self.dashboard_url},
            "jump_list": [{"type": 1, "url": self.dashboard_url,
                           "title": "Dashboard" if lang == "en" else "看板"}],
        }
        return {"msgtype": "template_card", "template_card": card}

    def payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """The payload :meth:`send_alerts` sends, per ``msgtype``."""
        build = {"markdown": self.markdown_payload, "markdown_v2": self.markdown_v2_payload,
                 "template_card": self.template_card_payload, "text": self.text_payload}
        return build[self.msgtype](alerts)

    # -- sending ---------------------------------------------------------------------------
    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def send(self, payload: dict[str, Any]) -> None:
        """POST one payload; return when the robot answered errcode 0 (raises our errors)."""
        url = self._url.get()
        secrets = tuple(s for s in (_key(url),) if s)
        resp = await post_json(self._get_client(), url, payload, receiver=self.name,
                               timeout=self.timeout, secrets=secrets)
        raise_for_http_status(resp, receiver=self.name, url=url)
        body = resp.body
        if not isinstance(body, dict) or "errcode" not in body:
            raise TransientError(f"{self.name}: HTTP {resp.status} without a WeCom errcode from "
                                 f"{self.redacted_url}", receiver=self.name)
        code = body.get("errcode")
        if code == 0:
            return
        text = f"{self.name}: WeCom errcode {code}: {scrub(str(body.get('errmsg', ''))[:200], secrets)}"
        if code in THROTTLE_ERRCODES:
            raise Throttled(text, receiver=self.name, errcode=code)
        if code in CONFIG_ERRCODES:
            hint = " (check the key in TRAINSENTRY_WECOM_URL)" if code == 93000 else ""
            raise ConfigurationError(text + hint, receiver=self.name, errcode=code)
        if code in TRANSIENT_ERRCODES:
            raise TransientError(text, receiver=self.name, errcode=code)
        raise MessageRejected(text, receiver=self.name,
                              errcode=code if isinstance(code, int) else None)

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        """One message for ``alerts`` (one alert, or a digest of several)."""
        await self.send(self.payload(alerts))

    async def send_image(self, image: bytes) -> None:
        """Post a PNG/JPG (e.g. a chart of the evidence), at most 2 MB."""
        await self.send(image_payload(image))

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> WeCom:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _key(url: str) -> str:
    marker = "key="
    if marker not in url:
        return ""
    return url.split(marker, 1)[1].split("&", 1)[0]
