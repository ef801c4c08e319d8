"""notifiers: diagnosed alerts to DingTalk and WeCom group robots and generic webhooks.

:class:`Deliverer` is what the alerts consumer uses: ``await deliverer.deliver(alerts)``
returns once every alert is acknowledged or has failed for good (then commit the offset).
"""

from __future__ import annotations

from notifiers.delivery import (
    Deliverer,
    DeliveryResult,
    Failure,
    Receiver,
    RetryPolicy,
    SlidingWindowLimiter,
)
from notifiers.dingtalk import DingTalk, sign
from notifiers.errors import (
    ConfigurationError,
    MessageRejected,
    NotifierError,
    Throttled,
    TransientError,
)
from notifiers.receivers import receivers_from_settings
from notifiers.redact import redact_url, scrub
from notifiers.templates import (
    label_name,
    render_markdown,
    render_text,
    render_title,
    render_wecom_markdown,
    truncate_utf8,
)
from notifiers.webhook import Webhook
from notifiers.wecom import WeCom

__all__ = [
    "Deliverer",
    "DeliveryResult",
    "Failure",
    "Receiver",
    "RetryPolicy",
    "SlidingWindowLimiter",
    "DingTalk",
    "WeCom",
    "Webhook",
    "sign",
    "receivers_from_settings",
    "NotifierError",
    "TransientError",
    "Throttled",
    "ConfigurationError",
    "MessageRejected",
    "redact_url",
    "scrub",
    "label_name",
    "render_title",
    "render_markdown",
    "render_text",
    "render_wecom_markdown",
    "truncate_utf8",
]
