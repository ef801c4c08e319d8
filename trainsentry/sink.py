"""A local chat sink for demos: one HTTP server that plays both DingTalk and WeCom robots.

It listens on 127.0.0.1, takes DingTalk-style posts at ``/dingtalk/robot/send?access_token=…``
(checking 加签 when given the secret) and WeCom-style posts at
``/wecom/webhook/send?key=…``, answers like the real APIs, prints what the chat would
show, and keeps every accepted message in memory. Standard library only, so the demo
needs nothing installed; it runs in a thread, so sync code can start and stop it::

    sink = ChatSink(dingtalk_secret="SECdemo")
    sink.start()
    env = sink.env()   # TRAINSENTRY_DINGTALK_URL / _SECRET / TRAINSENTRY_WECOM_URL
    ...
    sink.stop()

``python -m trainsentry.sink --port 8089`` runs it in the foreground and prints the settings.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

__all__ = ["ChatSink", "ChatMessage", "main"]

DINGTALK_PATH = "/dingtalk/robot/send"
WECOM_PATH = "/wecom/webhook/send"
_MAX_BODY = 8 * 1024 * 1024


@dataclass(frozen=True)
class ChatMessage:
    """One message a robot accepted: where it went and what a person would read."""

    channel: str  # "dingtalk" or "wecom"
    msgtype: str
    title: str
    text: str
    payload: dict[str, Any] = field(repr=False)
    received_at: float = 0.0


class ChatSink:
    """Fake DingTalk + WeCom robots on one local port. Network only on :meth:`start`."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 dingtalk_secret: str | None = None, access_token: str = "sink-dingtalk-token",
                 wecom_key: str = "sink-wecom-key", out: TextIO | None = None,
                 echo: bool = True) -> None:
        self.host = host
        self.port = port
        self.dingtalk_secret = dingtalk_secret
        self.access_token = access_token
        self.wecom_key = wecom_key
        self.echo = echo
        self._out = out
        self._messages: list[ChatMessage] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ChatSink:
        """Bind and serve in a daemon thread; returns self (``.urls`` are valid after this)."""
        if self._server is not None:
            return self
        sink = self

        class Handler(_Handler):
            owner = sink

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="trainsentry-chat-sink", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ChatSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what callers use ------------------------------------------------------------------
    @property
    def urls(self) -> dict[str, str]:
        """``{"dingtalk": …, "wecom": …}``: the webhooks for TRAINSENTRY_DINGTALK_URL / _WECOM_URL."""
        base = f"http://{self.host}:{self.port}"
        return {"dingtalk": f"{base}{DINGTALK_PATH}?access_token={self.access_token}",
                "wecom": f"{base}{WECOM_PATH}?key={self.wecom_key}"}

    def env(self) -> dict[str, str]:
        """The environment variables that point trainsentry at this sink."""
        out = {"TRAINSENTRY_DINGTALK_URL": self.urls["dingtalk"],
               "TRAINSENTRY_WECOM_URL": self.urls["wecom"]}
        if self.dingtalk_secret:
            out["TRAINSENTRY_DINGTALK_SECRET"] = self.dingtalk_secret
        return out

    @property
    def messages(self) -> list[ChatMessage]:
        """A copy of every accepted message, oldest first."""
        with self._lock:
            return list(self._messages)

    def wait_for(self, count: int, timeout: float = 10.0) -> bool:
        """Block until at least ``count`` messages arrived; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self._messages) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(left)
        return True

    # -- handling (called from server threads) ----------------------------------------------
    def _dingtalk(self, query: dict[str, str], body: Any) -> tuple[int, str]:
        if query.get("access_token") != self.access_token:
            return 300001, "token is not exist"
        if self.dingtalk_secret:
            ts, sign = query.get("timestamp", ""), query.get("sign", "")
            if not ts.isdigit() or abs(int(ts) - time.time() * 1000) > 3600 * 1000:
                return 310000, "invalid timestamp"
            mac = hmac.new(self.dingtalk_secret.encode(), f"{ts}\n{self.dingtalk_secret}".encode(),
                           hashlib.sha256).digest()
            if not hmac.compare_digest(base64.b64encode(mac).decode(), sign):
                return 310000, "sign not match"
        if not isinstance(body, dict):
            return 40035, "缺少参数 json"
        msgtype = body.get("msgtype")
        part = body.get(msgtype) if isinstance(msgtype, str) else None
        if not isinstance(part, dict):
            return 40035, "缺少参数 msgtype"
        if msgtype == "text" and isinstance(part.get("content"), str):
            title, text = "", part["content"]
        elif msgtype in ("markdown", "actionCard") and isinstance(part.get("text"), str):
            title, text = str(part.get("title", "")), part["text"]
        else:
            return 40035, f"缺少参数 {msgtype}"
        self._record(ChatMessage("dingtalk", msgtype, title, text, body, time.time()))
        return 0, "ok"

    def _wecom(self, query: dict[str, str], body: Any) -> tuple[int, str]:
        if query.get("key") != self.wecom_key:
            return 93000, "invalid webhook url"
        if not isinstance(body, dict):
            return 40058, "invalid json"
        msgtype = body.get("msgtype")
        part = body.get(msgtype) if isinstance(msgtype, str) else None
        if not isinstance(part, dict):
            return 40008, "invalid message type"
        if msgtype in ("markdown", "markdown_v2", "text"):
            content = part.get("content")
            if not isinstance(content, str) or not content:
                return 44004, "empty content"
            limit = 2048 if msgtype == "text" else 4096
            if len(content.encode()) > limit:
                return 40058, f"{msgtype}.content exceed max length {limit}"
            title, text = "", content
        elif msgtype == "template_card":
            main = part.get("main_title") or {}
            title = str(main.get("title", ""))
            rows = [f"{r.get('keyname')}: {r.get('value')}" for r in
                    part.get("horizontal_content_list", []) if isinstance(r, dict)]
            text = "\n".join([str(main.get("desc", "")), str(part.get("sub_title_text", "")),
                              *rows])
        elif msgtype == "image":
            try:
                data = base64.b64decode(str(part.get("base64", "")), validate=True)
            except ValueError:
                return 40058, "invalid base64"
            if hashlib.md5(data).hexdigest() != str(part.get("md5", "")).lower():  # noqa: S324
                return 301019, "media md5 not match"
            title, text = "", f"[image, {len(data)} bytes]"
        else:
            return 40008, "invalid message type"
        self._record(ChatMessage("wecom", msgtype, title, text, body, time.time()))
        return 0, "ok"

    def _record(self, msg: ChatMessage) -> None:
        with self._arrived:
            self._messages.append(msg)
            self._arrived.notify_all()
        if self.echo:
            self._print(msg)

    def _print(self, msg: ChatMessage) -> None:
        out = self._out or sys.stdout
        when = time.strftime("%H:%M:%S", time.localtime(msg.received_at))
        name = {"dingtalk": "DingTalk 钉钉", "wecom": "WeCom 企业微信"}[msg.channel]
        lines = [f"╭─ {name} · {msg.msgtype} · {when}"]
        if msg.title:
            lines.append(f"│ {_readable(msg.title)}")
            lines.append("├" + "─" * 40)
        lines += [f"│ {line}" for line in _readable(msg.text).split("\n") if line.strip()]
        lines.append("╰" + "─" * 40)
        with self._lock:  # one box at a time when several robots post at once
            out.write("\n".join(lines) + "\n")
            out.flush()


_FONT = re.compile(r"</?font[^>]*>")


def _readable(text: str) -> str:
    """Markdown as a terminal shows it best: no bold stars or colour tags."""
    return _FONT.sub("", text).replace("**", "")


class _Handler(BaseHTTPRequestHandler):
    owner: ChatSink
    server_version = "trainsentry-chat-sink"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        """Silence the default access log (it would print tokens from the query)."""

    def _reply(self, code: int, msg: str, status: int = 200) -> None:
        data = json.dumps({"errcode": code, "errmsg": msg}, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self._reply(40058, "body too large", 413)
            return
        raw = self.rfile.read(length)
        try:
            body: Any = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        if parts.path == DINGTALK_PATH:
            self._reply(*self.owner._dingtalk(query, body))
        elif parts.path == WECOM_PATH:
            self._reply(*self.owner._wecom(query, body))
        else:
            self._reply(404, f"no robot at {parts.path}", 404)

    def do_GET(self) -> None:  # noqa: N802
        """``GET /messages``: what arrived so far, as JSON (for scripts and the demo)."""
        if urlsplit(self.path).path != "/messages":
            self._reply(404, "try GET /messages", 404)
            return
        data = json.dumps([{"channel": m.channel, "msgtype": m.msgtype, "title": m.title,
                            "text": m.text, "received_at": m.received_at}
                           for m in self.owner.messages], ensure_ascii=False).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str] | None = None) -> int:
    """Run the sink in the foreground until Ctrl-C; print the settings that point at it."""
    parser = argparse.ArgumentParser(prog="python -m trainsentry.sink",
                                     description="Local DingTalk + WeCom robot that prints messages.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dingtalk-secret", default=None, help="check 加签 with this secret")
    args = parser.parse_args(argv)
    sink = ChatSink(host=args.host, port=args.port, dingtalk_secret=args.dingtalk_secret)
    sink.start()
    for key, value in sink.env().items():
        sys.stdout.write(f"export {key}='{value}'\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        sink.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
