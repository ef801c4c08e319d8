"""DingTalk custom robot (自定义机器人): 加签 signing, payloads, and reading its answers.

The webhook is ``https://oapi.dingtalk.com/robot/send?access_token=…``; with 加签 on, each
request appends ``&timestamp=<ms>&sign=<URL-encoded base64 HMAC-SHA256>``. The robot
answers HTTP 200 with ``{"errcode": 0, "errmsg": "ok"}`` or an errcode (see ``docs/notifiers.md``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal
from urllib.parse import quote_plus

import httpx

from notifiers._http import DEFAULT_TIMEOUT_S, post_json, raise_for_http_status
from notifiers.errors import ConfigurationError, MessageRejected, Throttled, TransientError
from notifiers.redact import redact_url, scrub
from notifiers.templates import pages, render_markdown, render_text
from trainsentry.config import Secret
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = [
    "DingTalk",
    "sign",
    "signed_url",
    "DINGTALK_MAX_BYTES",
    "THROTTLE_ERRCODES",
    "CONFIG_ERRCODES",
    "TRANSIENT_ERRCODES",
]

logger = logging.getLogger(__name__)

#: DingTalk refuses message bodies much over 20 000 bytes; we stay under it.
DINGTALK_MAX_BYTES = 20000
#: 130101: "send too fast, exceed 20 times per minute"; 410100: flow-control throttle.
THROTTLE_ERRCODES: frozenset[int] = frozenset({130101, 410100})
#: 310000: signature / keyword / IP whitelist mismatch; 300001, 300005: bad or unknown token;
#: 400013, 400014: robot disabled or removed from the group.
CONFIG_ERRCODES: frozenset[int] = frozenset({310000, 300001, 300005, 400013, 400014})
#: -1: "system busy".
TRANSIENT_ERRCODES: frozenset[int] = frozenset({-1})

MsgType = Literal["markdown", "text", "actionCard"]


def sign(secret: str, timestamp_ms: int) -> str:
    """加签: URL-encoded base64 of HMAC-SHA256 keyed by ``secret`` over ``"{timestamp}\\n{secret}"``.

    >>> sign("this is secret", 1577262236757)
    'hmPWwU%2B7lVdm3ZZz0r9tSfx0L4Q26jWOZr9%2BGs6EZQM%3D'
    """
    string_to_sign = f"{timestamp_ms}\n{secret}".encode()
    digest = hmac.new(secret.encode(), string_to_sign, hashlib.sha256).digest()
    return quote_plus(base64.b64encode(digest).decode("ascii"))


def signed_url(url: str, secret: str | None, timestamp_ms: int) -> str:
    """The webhook with ``&timestamp=…&sign=…`` appended (``url`` unchanged without a secret)."""
    if not secret:
        return url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}timestamp={timestamp_ms}&sign={sign(secret, timestamp_ms)}"


def _secret(value: str | Secret | None) -> Secret:
    if value is None:
        return Secret("")
    return value if isinstance(value, Secret) else Secret(value)


class DingTalk:
    """A DingTalk group robot. No network I/O until the first :meth:`send`.

    ``at_mobiles`` are @-mentioned on critical firing alerts, and ``@all`` too when
    ``at_all_on_critical``. ``msgtype`` picks what :meth:`send_alerts` sends; ``actionCard``
    needs ``dashboard_url`` for its button and falls back to markdown without one.
    """

    def __init__(self, *, url: str | Secret, secret: str | Secret | None = None,
                 client: httpx.AsyncClient | None = None, language: str = "zh",
                 at_mobiles: Sequence[str] = (), at_all_on_critical: bool = False,
                 msgtype: MsgType = "markdown", dashboard_url: str | None = None,
                 name: str = "dingtalk", timeout: float = DEFAULT_TIMEOUT_S,
                 max_batch: int = 20, clock: Callable[[], float] = time.time) -> None:
        self._url = _secret(url)
        self._secret = _secret(secret)
        raw = self._url.get()
        if not raw.startswith(("http://", "https://")):
            raise ConfigError(f"{name}: the DingTalk webhook must be an http(s) URL with "
                              "?access_token=… (TRAINSENTRY_DINGTALK_URL)")
        if language not in ("zh", "en"):
            raise ConfigError(f"{name}: language must be 'zh' or 'en', got {language!r}")
        if msgtype not in ("markdown", "text", "actionCard"):
            raise ConfigError(f"{name}: msgtype must be markdown, text or actionCard")
        self.name = name
        self.language = language
        self.at_mobiles = tuple(at_mobiles)
        self.at_all_on_critical = at_all_on_critical
        self.msgtype: MsgType = msgtype
        self.dashboard_url = dashboard_url
        self.timeout = timeout
        self.max_batch = max_batch
        self._client = client
        self._owns_client = client is None
        self._clock = clock

    def __repr__(self) -> str:
        return (f"DingTalk(name={self.name!r}, url={redact_url(self._url.get())!r}, "
                f"signed={bool(self._secret)}, msgtype={self.msgtype!r}, language={self.language!r})")

    @property
    def redacted_url(self) -> str:
        return redact_url(self._url.get())

    # -- payloads --------------------------------------------------------------------------
    def _at(self, alerts: Sequence[AlertEvent]) -> tuple[dict[str, Any], str]:
        if not pages(alerts):
            return {"atMobiles": [], "isAtAll": False}, ""
        mobiles = list(self.at_mobiles)
        # The robot only highlights a mention that also appears in the text as @mobile.
        footer = " ".join(f"@{m}" for m in mobiles)
        return {"atMobiles": mobiles, "isAtAll": self.at_all_on_critical}, footer

    def text_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``text`` msgtype: plain text, for clients that render markdown poorly."""
        at, footer = self._at(alerts)
        rendered = render_text(alerts, language=self.language, link=self.dashboard_url,
                               footer=footer, max_bytes=DINGTALK_MAX_BYTES)
        return {"msgtype": "text", "text": {"content": rendered.text}, "at": at}

    def markdown_payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """``markdown`` msgtype: title (the notification preview) and the body."""
        at, footer = self._at(alerts)
        # DingTalk's markdown needs a blank line to break a paragraph; doubling the
        # newlines doubles their bytes, so render for half the limit.
        rendered = render_markdown(alerts, language=self.language, link=self.dashboard_url,
                                   footer=footer, max_bytes=DINGTALK_MAX_BYTES // 2)
        return {"msgtype": "markdown",
                "markdown": {"title": rendered.title, "text": _paragraphs(rendered.text)},
                "at": at}

    def action_card_payload(self, alerts: Sequence[AlertEvent], *,
                            url: str | None = None) -> dict[str, Any]:
        """``actionCard`` msgtype with one button to ``url`` (default: the dashboard)."""
        target = url or self.dashboard_url
        if not target:
            raise ConfigError(f"{self.name}: an actionCard needs a button URL (dashboard_url)")
        rendered = render_markdown(alerts, language=self.language,
                                   max_bytes=DINGTALK_MAX_BYTES // 2)
        button = "打开看板" if self.language == "zh" else "Open dashboard"
        return {"msgtype": "actionCard",
                "actionCard": {"title": rendered.title, "text": _paragraphs(rendered.text),
                               "btnOrientation": "0", "singleTitle": button,
                               "singleURL": target}}

    def payload(self, alerts: Sequence[AlertEvent]) -> dict[str, Any]:
        """The payload :meth:`send_alerts` sends, per ``msgtype``."""
        if self.msgtype == "text":
            return self.text_payload(alerts)
        if self.msgtype == "actionCard" and self.dashboard_url:
            return self.action_card_payload(alerts)
        return self.markdown_payload(alerts)

    # -- sending ---------------------------------------------------------------------------
    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def send(self, payload: dict[str, Any]) -> None:
        """POST one payload, signed now; return when the robot answered errcode 0.

        Raises :class:`Throttled`, :class:`TransientError`, :class:`ConfigurationError` or
        :class:`MessageRejected`; their text never holds the token or the secret.
        """
        ts_ms = int(round(self._clock() * 1000))
        url = signed_url(self._url.get(), self._secret.get() or None, ts_ms)
        secrets = tuple(s for s in (self._secret.get(), _token(self._url.get())) if s)
        resp = await post_json(self._get_client(), url, payload, receiver=self.name,
                               timeout=self.timeout, secrets=secrets)
        raise_for_http_status(resp, receiver=self.name, url=url)
        body = resp.body
        if not isinstance(body, dict) or "errcode" not in body:
            raise TransientError(f"{self.name}: HTTP {resp.status} without a DingTalk errcode "
                                 f"from {self.redacted_url}", receiver=self.name)
        _raise_for_errcode(body, receiver=self.name, secrets=secrets)

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        """One message for ``alerts`` (one alert, or a digest of several)."""
        await self.send(self.payload(alerts))

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> DingTalk:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _paragraphs(text: str) -> str:
    """Blank lines between paragraphs for DingTalk's markdown; list items stay together."""
    out: list[str] = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        out.append(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        if nxt is not None and not (_is_item(line) and _is_item(nxt)):
            out.append("")
    return "\n".join(out)


def _is_item(line: str) -> bool:
    head = line.lstrip()[:4]
    return head.startswith("- ") or (head[:1].isdigit() and ". " in head)


def _token(url: str) -> str:
    marker = "access_token="
    if marker not in url:
        return ""
    return url.split(marker, 1)[1].split("&", 1)[0]


def _raise_for_errcode(body: dict[str, Any], *, receiver: str, secrets: tuple[str, ...]) -> None:
    code = body.get("errcode")
    if code == 0:
        return
    msg = scrub(str(body.get("errmsg", ""))[:200], secrets)
    text = f"{receiver}: DingTalk errcode {code}: {msg}"
    if code in THROTTLE_ERRCODES:
        raise Throttled(text, receiver=receiver, errcode=code)
    if code in CONFIG_ERRCODES:
        hint = {310000: " (check TRAINSENTRY_DINGTALK_SECRET, the robot's keywords and IP whitelist)",
                300001: " (check the access_token in TRAINSENTRY_DINGTALK_URL)",
                300005: " (check the access_token in TRAINSENTRY_DINGTALK_URL)"}.get(code, "")
        raise ConfigurationError(text + hint, receiver=receiver, errcode=code)
    if code in TRANSIENT_ERRCODES:
        raise TransientError(text, receiver=receiver, errcode=code)
    raise MessageRejected(text, receiver=receiver, errcode=code if isinstance(code, int) else None)
