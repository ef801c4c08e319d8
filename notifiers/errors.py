"""Notifier errors: what the delivery loop needs to know to retry, give up or stop.

Every error text is safe to log: URLs in it are redacted (see :mod:`notifiers.redact`).
"""

from __future__ import annotations

from trainsentry.errors import NotifierError

__all__ = [
    "NotifierError",
    "TransientError",
    "Throttled",
    "ConfigurationError",
    "MessageRejected",
]


class _ReceiverError(NotifierError):
    """A notifier error that knows which receiver raised it and the server's errcode."""

    def __init__(self, message: str, *, receiver: str = "", errcode: int | None = None) -> None:
        super().__init__(message)
        self.receiver = receiver
        self.errcode = errcode


class TransientError(_ReceiverError):
    """Timeout, connection error, 5xx: the same message may succeed later, so retry."""


class Throttled(TransientError):
    """The robot's rate limit (HTTP 429, DingTalk 130101/410100, WeCom 45009): retry later."""

    def __init__(self, message: str, *, receiver: str = "", errcode: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message, receiver=receiver, errcode=errcode)
        self.retry_after = retry_after


class ConfigurationError(_ReceiverError):
    """Bad token, key or signature, IP not whitelisted: no retry helps until someone fixes it."""


class MessageRejected(_ReceiverError):
    """The server refused this one message (bad shape, too long): retrying it cannot help."""
