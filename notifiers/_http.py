"""One POST helper shared by the notifiers: httpx errors become ours, with URLs redacted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from notifiers.errors import ConfigurationError, MessageRejected, Throttled, TransientError
from notifiers.redact import install_httpx_log_redaction, redact_url, scrub

__all__ = ["Response", "post_json", "DEFAULT_TIMEOUT_S", "raise_for_http_status", "retry_after"]

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Response:
    """What the notifiers need from an HTTP answer."""

    status: int
    body: Any  # decoded JSON, or None when the body is not JSON
    text: str
    headers: dict[str, str]


async def post_json(client: httpx.AsyncClient, url: str, payload: Any, *, receiver: str,
                    timeout: float, secrets: tuple[str, ...] = (),
                    headers: dict[str, str] | None = None) -> Response:
    """POST ``payload`` as UTF-8 JSON; transport failures raise :class:`TransientError`.

    httpx's own messages may carry the URL (and with it the token), so the original
    exception is not chained (``from None``); its class name and scrubbed text are kept.
    """
    install_httpx_log_redaction()
    content = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    all_headers = {**(headers or {}), "Content-Type": "application/json; charset=utf-8"}
    try:
        resp = await client.post(url, content=content, headers=all_headers, timeout=timeout)
    except httpx.TimeoutException as exc:
        err = TransientError(
            f"{receiver}: timed out after {timeout:g}s posting to {redact_url(url)} "
            f"({type(exc).__name__})", receiver=receiver)
    except httpx.HTTPError as exc:  # connect/read/write/protocol errors
        detail = scrub(str(exc), secrets)[:200]
        err = TransientError(
            f"{receiver}: could not reach {redact_url(url)} ({type(exc).__name__}: {detail})",
            receiver=receiver)
    else:
        text = resp.text
        try:
            body: Any = json.loads(text) if text else None
        except ValueError:
            body = None
        return Response(resp.status_code, body, text, dict(resp.headers))
    raise err from None


def retry_after(headers: dict[str, str]) -> float | None:
    """Seconds from a ``Retry-After`` header given in seconds (dates are ignored)."""
    raw = headers.get("retry-after") or headers.get("Retry-After")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def raise_for_http_status(resp: Response, *, receiver: str, url: str) -> None:
    """Map a non-2xx HTTP status onto retry (429, 408, 5xx) or no retry (other 4xx)."""
    status = resp.status
    if 200 <= status < 300:
        return
    where = redact_url(url)
    snippet = scrub(resp.text[:200])
    if status == 429:
        raise Throttled(f"{receiver}: HTTP 429 from {where}", receiver=receiver,
                        retry_after=retry_after(resp.headers))
    if status == 408 or status >= 500:
        raise TransientError(f"{receiver}: HTTP {status} from {where}: {snippet}",
                             receiver=receiver)
    if status in (401, 403, 404, 405):
        raise ConfigurationError(
            f"{receiver}: HTTP {status} from {where}: {snippet} (check the webhook URL and its token)",
            receiver=receiver)
    raise MessageRejected(f"{receiver}: HTTP {status} from {where}: {snippet}", receiver=receiver)
