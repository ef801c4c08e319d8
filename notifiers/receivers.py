"""Build the configured receivers from :class:`~trainsentry.config.Settings`."""

from __future__ import annotations

import httpx

from notifiers.delivery import Receiver
from notifiers.dingtalk import DingTalk
from notifiers.webhook import Webhook
from notifiers.wecom import WeCom
from trainsentry.config import Settings

__all__ = ["receivers_from_settings"]


def receivers_from_settings(settings: Settings, *, client: httpx.AsyncClient | None = None,
                            dashboard_url: str | None = None) -> list[Receiver]:
    """One receiver per configured webhook (DingTalk, WeCom, generic); none configured: ``[]``."""
    out: list[Receiver] = []
    if settings.dingtalk_url:
        out.append(DingTalk(url=settings.dingtalk_url, secret=settings.dingtalk_secret or None,
                            client=client, language=settings.language,
                            dashboard_url=dashboard_url))
    if settings.wecom_url:
        out.append(WeCom(url=settings.wecom_url, client=client, language=settings.language,
                         dashboard_url=dashboard_url))
    if settings.webhook_url:
        out.append(Webhook(url=settings.webhook_url, client=client))
    return out
