"""Keep webhook tokens and signing secrets out of logs, errors, reprs and health output."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["SENSITIVE_PARAMS", "redact_url", "scrub", "install_httpx_log_redaction"]

#: Query parameters whose values are credentials (DingTalk, WeCom, generic webhooks).
SENSITIVE_PARAMS: frozenset[str] = frozenset(
    {"access_token", "key", "sign", "token", "secret", "password", "signature", "api_key"}
)
_MASK = "***"
_PARAM_RE = re.compile(
    r"(?i)\b(" + "|".join(sorted(SENSITIVE_PARAMS)) + r")=([^&\s\"'#<>]+)"
)
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/@\s:]*):([^/@\s]*)@")


def redact_url(url: str) -> str:
    """The URL with credential query values and any userinfo password replaced by ``***``.

    >>> redact_url("https://oapi.dingtalk.com/robot/send?access_token=abc&timestamp=1&sign=x%2B")
    'https://oapi.dingtalk.com/robot/send?access_token=***&timestamp=1&sign=***'
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return scrub(url)
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, _MASK if k.lower() in SENSITIVE_PARAMS else v) for k, v in pairs], safe="*"
        )
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{_MASK}@{host}" if ":" in userinfo else f"{_MASK}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with credential query values, URL passwords and the given secret strings masked."""
    out = _PARAM_RE.sub(lambda m: f"{m.group(1)}={_MASK}", text)
    out = _USERINFO_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}:{_MASK}@", out)
    for secret in secrets:
        if secret and len(secret) >= 4:
            out = out.replace(secret, _MASK)
    return out


class _HttpxRedactingFilter(logging.Filter):
    """httpx logs every request URL at INFO, query string (and so the token) included."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            record.args = tuple(scrub(str(a)) if _looks_like_url(a) else a for a in args)
        if isinstance(record.msg, str):
            record.msg = scrub(record.msg)
        return True


def _looks_like_url(value: object) -> bool:
    return "://" in str(value) or "=" in str(value)


_install_lock = threading.Lock()


def install_httpx_log_redaction() -> None:
    """Attach (once) a filter to the ``httpx`` logger that masks tokens in its request lines.

    A library should not configure logging, but httpx's INFO line ``HTTP Request: POST
    https://…?access_token=…`` would leak a robot token into any application log that
    enables INFO; masking a value is the one change we make, and only to that logger.
    """
    logger = logging.getLogger("httpx")
    with _install_lock:
        if not any(isinstance(f, _HttpxRedactingFilter) for f in logger.filters):
            logger.addFilter(_HttpxRedactingFilter())
