"""Real local HTTP servers that behave like the DingTalk and WeCom group-robot APIs.

They are the test oracle for :mod:`notifiers`, so they share no code with it: the
DingTalk signature is recomputed here from the documented recipe. Both bind 127.0.0.1 on
a free port, check the token/key, the message shape and the per-robot rate limit
(20 messages per ``window_s``), answer with the real errcodes, record every request and
every accepted message, and can be told to fail (HTTP 500, go down, answer slowly).

Use them as fixtures: ``from tests.chat_servers import dingtalk_server, wecom_server``
(or the factories ``dingtalk_server_factory`` / ``wecom_server_factory``), or add
``pytest_plugins = ["tests.chat_servers"]`` to ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from trainsentry.events import AlertEvent

__all__ = [
    "FakeDingTalk",
    "FakeWeCom",
    "Accepted",
    "Seen",
    "dingtalk_server_factory",
    "wecom_server_factory",
    "dingtalk_server",
    "wecom_server",
    "make_alert",
]


def make_alert(**overrides: Any) -> AlertEvent:
    """A realistic firing critical ``dataloader_stall`` alert; override any field."""
    fields: dict[str, Any] = {
        "id": "a-0001", "fingerprint": "fp-dls-exp3", "run_id": "grpo-qwen7b/exp3",
        "status": "firing", "severity": "critical", "diagnosis": "dataloader_stall",
        "step": 431, "ts": 1764528123.0,
        "summary": "rollout latency 12.3 s while GPU utilisation fell to 21%",
        "evidence": {"timing_s/gen": {"value": 12.3, "baseline": 3.1, "bound": 6.0},
                     "gpu/utilization_pct": {"value": 21.0, "baseline": 88.0, "bound": 40.0}},
        "actions": ["check the dataset mount", "raise the number of loader workers",
                    "use memory-mapped datasets"],
        "checks": ["iostat -x 1 (await, %util)", "nvidia-smi dmon -s u"],
        "secondary": ["straggler"], "confidence": 0.82,
    }
    fields.update(overrides)
    return AlertEvent(**fields)


@dataclass(frozen=True)
class Accepted:
    """A message the robot accepted (errcode 0) and would show in the chat."""

    msgtype: str
    payload: dict[str, Any]
    at: float  # time.monotonic() when it was accepted

    @property
    def text(self) -> str:
        """Everything a person would read, for searching."""
        if self.msgtype == "image":
            return ""
        return "\n".join(_strings(self.payload.get(self.msgtype, {})))


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


@dataclass(frozen=True)
class Seen:
    """Every request that reached the server, and what it answered."""

    path: str
    query: dict[str, str]
    status: int
    errcode: int | None
    errmsg: str
    at: float


@dataclass
class _Failure:
    status: int
    until: float | None = None  # monotonic deadline, or None: count-based
    remaining: int = 0


class _RobotServer:
    """What DingTalk and WeCom have in common: a site, a rate limit and failure modes."""

    path = "/"
    throttle_code = 0
    throttle_msg = ""

    def __init__(self, *, limit: int = 20, window_s: float = 60.0, penalty_s: float = 0.0) -> None:
        self.limit = limit
        self.window_s = window_s
        #: DingTalk throttles a robot for 10 minutes after it exceeds the limit.
        self.penalty_s = penalty_s
        self.messages: list[Accepted] = []
        self.requests: list[Seen] = []
        self.delay_s = 0.0
        self._failures: deque[_Failure] = deque()
        self._throttled_until: dict[str, float] = {}
        self._accepted_at: dict[str, deque[float]] = {}
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.down = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post(self.path, self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        with socket.socket() as s:  # find a free port, then bind it with reuse_address
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        await self._bring_up()

    async def _bring_up(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await self._site.start()
        self.down = False

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def go_down(self) -> None:
        """Stop listening: clients get 'connection refused' until :meth:`come_up`."""
        if self._site is not None and not self.down:
            await self._site.stop()
            self.down = True

    async def come_up(self) -> None:
        if self.down:
            await self._bring_up()

    async def down_for(self, seconds: float) -> asyncio.Task[None]:
        """Go down now and come back up after ``seconds`` (returns the task doing that)."""
        await self.go_down()

        async def later() -> None:
            await asyncio.sleep(seconds)
            await self.come_up()
        return asyncio.get_running_loop().create_task(later())

    def fail_next(self, n: int, *, status: int = 500) -> None:
        """Answer the next ``n`` requests with HTTP ``status`` (nothing recorded as accepted)."""
        self._failures.append(_Failure(status=status, remaining=n))

    def fail_for(self, seconds: float, *, status: int = 500) -> None:
        """Answer every request with HTTP ``status`` for the next ``seconds``."""
        self._failures.append(_Failure(status=status, until=time.monotonic() + seconds))

    def heal(self) -> None:
        """Forget every injected failure: answer normally from now on."""
        self._failures.clear()

    # -- inspection ------------------------------------------------------------------------
    def errcodes(self) -> Counter[int | None]:
        return Counter(r.errcode for r in self.requests)

    def statuses(self) -> Counter[int]:
        return Counter(r.status for r in self.requests)

    def all_text(self) -> str:
        return "\n".join(m.text for m in self.messages)

    def max_in_window(self, window_s: float | None = None) -> int:
        """The most accepted messages in any window of ``window_s`` (default: the server's)."""
        w = self.window_s if window_s is None else window_s
        times = sorted(m.at for m in self.messages)
        best = 0
        j = 0
        for i, t in enumerate(times):
            while times[j] <= t - w:
                j += 1
            best = max(best, i - j + 1)
        return best

    # -- request handling ------------------------------------------------------------------
    def _answer(self, request: web.Request, errcode: int, errmsg: str,
                status: int = 200) -> web.Response:
        self.requests.append(Seen(request.path, dict(request.query), status, errcode, errmsg,
                                  time.monotonic()))
        return web.json_response({"errcode": errcode, "errmsg": errmsg}, status=status)

    def _injected_failure(self) -> int | None:
        now = time.monotonic()
        while self._failures:
            f = self._failures[0]
            if f.until is not None:
                if now < f.until:
                    return f.status
                self._failures.popleft()
                continue
            if f.remaining > 0:
                f.remaining -= 1
                if f.remaining == 0:
                    self._failures.popleft()
                return f.status
            self._failures.popleft()
        return None

    def _rate_ok(self, robot: str) -> bool:
        now = time.monotonic()
        if self._throttled_until.get(robot, 0.0) > now:
            return False
        times = self._accepted_at.setdefault(robot, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            if self.penalty_s:
                self._throttled_until[robot] = now + self.penalty_s
            return False
        return True

    def _accept(self, robot: str, msgtype: str, payload: dict[str, Any]) -> None:
        now = time.monotonic()
        self._accepted_at.setdefault(robot, deque()).append(now)
        self.messages.append(Accepted(msgtype, payload, now))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        status = self._injected_failure()
        if status is not None:
            self.requests.append(Seen(request.path, dict(request.query), status, None,
                                      "injected failure", time.monotonic()))
            return web.Response(status=status, text="injected failure")
        raw = await request.read()
        return await self._check(request, raw)

    async def _check(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        raise NotImplementedError

    @staticmethod
    def _json(raw: bytes) -> dict[str, Any] | None:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None
        return obj if isinstance(obj, dict) else None


def _is_str(x: Any) -> bool:
    return isinstance(x, str) and x != ""


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, str) for i in x)


class FakeDingTalk(_RobotServer):
    """``POST /robot/send?access_token=…[&timestamp=…&sign=…]`` like oapi.dingtalk.com."""

    path = "/robot/send"

    def __init__(self, *, token: str = "dt-token-0123456789abcdef",
                 secret: str | None = "SECdt-secret-0123456789abcdef0123456789",
                 keywords: tuple[str, ...] = (), **kw: Any) -> None:
        super().__init__(**kw)
        self.token = token
        self.secret = secret
        self.keywords = keywords

    @property
    def url(self) -> str:
        """The webhook as the robot's settings page shows it (no timestamp/sign yet)."""
        return f"http://{self.host}:{self.port}{self.path}?access_token={self.token}"

    def _sign_ok(self, timestamp: str, sign: str) -> bool:
        assert self.secret is not None
        mac = hmac.new(self.secret.encode("utf-8"), f"{timestamp}\n{self.secret}".encode(),
                       hashlib.sha256).digest()
        # aiohttp already URL-decoded the query: compare with the plain base64.
        return hmac.compare_digest(base64.b64encode(mac).decode("ascii"), sign)

    async def _check(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        q = request.query
        if q.get("access_token") != self.token:
            return self._answer(request, 300001, "token is not exist")
        if self.secret:
            ts, sign = q.get("timestamp", ""), q.get("sign", "")
            if not ts.isdigit() or abs(int(ts) - time.time() * 1000) > 3600 * 1000:
                return self._answer(request, 310000, "invalid timestamp")
            if not self._sign_ok(ts, sign):
                return self._answer(request, 310000, "sign not match")
        if request.content_type != "application/json":
            return self._answer(request, 43004, "无效的HTTP HEADER Content-Type")
        body = self._json(raw)
        if body is None:
            return self._answer(request, 40035, "缺少参数 json")
        problem = self._shape_problem(body)
        if problem:
            return self._answer(request, 40035, f"缺少参数 {problem}")
        if self.keywords and not any(k in json.dumps(body, ensure_ascii=False)
                                     for k in self.keywords):
            return self._answer(request, 310000, "keywords not in content")
        if not self._rate_ok(self.token):
            return self._answer(request, 130101, "send too fast, exceed 20 times per minute")
        self._accept(self.token, body["msgtype"], body)
        return self._answer(request, 0, "ok")

    @staticmethod
    def _shape_problem(body: dict[str, Any]) -> str | None:
        msgtype = body.get("msgtype")
        part = body.get(msgtype) if isinstance(msgtype, str) else None
        if not isinstance(part, dict):
            return "msgtype"
        if msgtype == "text":
            if not _is_str(part.get("content")):
                return "text.content"
        elif msgtype == "markdown":
            if not (_is_str(part.get("title")) and _is_str(part.get("text"))):
                return "markdown.title/text"
        elif msgtype == "actionCard":
            if not (_is_str(part.get("title")) and _is_str(part.get("text"))):
                return "actionCard.title/text"
            single = _is_str(part.get("singleTitle")) and _is_str(part.get("singleURL"))
            btns = part.get("btns")
            multi = isinstance(btns, list) and btns and all(
                isinstance(b, dict) and _is_str(b.get("title")) and _is_str(b.get("actionURL"))
                for b in btns)
            if not (single or multi):
                return "actionCard.singleTitle/singleURL or btns"
        elif msgtype == "link":
            if not all(_is_str(part.get(k)) for k in ("title", "text", "messageUrl")):
                return "link"
        else:
            return "msgtype"
        at = body.get("at")
        if at is not None:
            if not isinstance(at, dict):
                return "at"
            if "atMobiles" in at and not _str_list(at["atMobiles"]):
                return "at.atMobiles"
            if "atUserIds" in at and not _str_list(at["atUserIds"]):
                return "at.atUserIds"
            if "isAtAll" in at and not isinstance(at["isAtAll"], bool):
                return "at.isAtAll"
        return None


class FakeWeCom(_RobotServer):
    """``POST /cgi-bin/webhook/send?key=…`` like qyapi.weixin.qq.com."""

    path = "/cgi-bin/webhook/send"

    def __init__(self, *, key: str = "wc-key-0123456789abcdef-0123", **kw: Any) -> None:
        super().__init__(**kw)
        self.key = key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}?key={self.key}"

    async def _check(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        if request.query.get("key") != self.key:
            return self._answer(request, 93000, "invalid webhook url")
        body = self._json(raw)
        if body is None:
            return self._answer(request, 40058, "invalid json")
        msgtype = body.get("msgtype")
        part = body.get(msgtype) if isinstance(msgtype, str) else None
        if msgtype not in ("text", "markdown", "markdown_v2", "image", "news", "file",
                           "template_card") or not isinstance(part, dict):
            return self._answer(request, 40008, "invalid message type")
        problem = self._shape_problem(msgtype, part)
        if problem is not None:
            return self._answer(request, *problem)
        if not self._rate_ok(self.key):
            return self._answer(request, 45009, "api freq out of limit")
        self._accept(self.key, msgtype, body)
        return self._answer(request, 0, "ok")

    @staticmethod
    def _shape_problem(msgtype: str, part: dict[str, Any]) -> tuple[int, str] | None:
        if msgtype == "text":
            content = part.get("content")
            if not _is_str(content):
                return 44004, "empty content"
            if len(content.encode()) > 2048:
                return 40058, "content exceed max length 2048"
            for k in ("mentioned_list", "mentioned_mobile_list"):
                if k in part and not _str_list(part[k]):
                    return 40058, f"invalid {k}"
        elif msgtype in ("markdown", "markdown_v2"):
            content = part.get("content")
            if not _is_str(content):
                return 44004, "empty content"
            if len(content.encode("utf-8")) > 4096:
                return 40058, f"{msgtype}.content exceed max length 4096"
        elif msgtype == "image":
            b64, md5 = part.get("base64"), part.get("md5")
            if not (_is_str(b64) and _is_str(md5)):
                return 40058, "image.base64 and image.md5 are required"
            try:
                data = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                return 40058, "invalid base64"
            if len(data) > 2 * 1024 * 1024:
                return 40009, "invalid image size"
            if hashlib.md5(data).hexdigest() != md5.lower():
                return 301019, "media md5 not match"
        elif msgtype == "template_card":
            if part.get("card_type") not in ("text_notice", "news_notice"):
                return 40058, "invalid card_type"
            main = part.get("main_title")
            if not (isinstance(main, dict) and (_is_str(main.get("title")) or _is_str(main.get("desc")))):
                return 40058, "main_title is required"
            action = part.get("card_action")
            if not (isinstance(action, dict) and action.get("type") in (1, 2)):
                return 40058, "card_action is required"
            if action.get("type") == 1 and not _is_str(action.get("url")):
                return 40058, "card_action.url is required"
            rows = part.get("horizontal_content_list", [])
            if not isinstance(rows, list) or len(rows) > 6 or not all(
                    isinstance(r, dict) and _is_str(r.get("keyname")) for r in rows):
                return 40058, "invalid horizontal_content_list"
        return None


# -- fixtures (factories first: STYLE rule 12) ----------------------------------------------

@pytest.fixture
async def dingtalk_server_factory() -> AsyncIterator[Callable[..., Awaitable[FakeDingTalk]]]:
    """``await make(token=…, secret=…, limit=20, window_s=60.0, keywords=())``: a started server."""
    servers: list[FakeDingTalk] = []

    async def make(**kw: Any) -> FakeDingTalk:
        server = FakeDingTalk(**kw)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def wecom_server_factory() -> AsyncIterator[Callable[..., Awaitable[FakeWeCom]]]:
    """``await make(key=…, limit=20, window_s=60.0)``: a started server."""
    servers: list[FakeWeCom] = []

    async def make(**kw: Any) -> FakeWeCom:
        server = FakeWeCom(**kw)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def dingtalk_server(
        dingtalk_server_factory: Callable[..., Awaitable[FakeDingTalk]]) -> FakeDingTalk:
    """A DingTalk robot with 加签 on, 20 messages a minute."""
    return await dingtalk_server_factory()


@pytest.fixture
async def wecom_server(wecom_server_factory: Callable[..., Awaitable[FakeWeCom]]) -> FakeWeCom:
    """A WeCom robot, 20 messages a minute."""
    return await wecom_server_factory()

