"""The service's notifier: a Deliverer over the receivers configured in Settings."""

from __future__ import annotations

from notifiers.delivery import Deliverer
from notifiers.receivers import receivers_from_settings
from trainsentry.config import Settings

__all__ = ["notifier_from_settings"]


def notifier_from_settings(settings: Settings, *, dashboard_url: str | None = None) -> Deliverer | None:
    """A Deliverer for every configured webhook, or None when no chat is configured."""
    receivers = receivers_from_settings(settings, dashboard_url=dashboard_url)
    if not receivers:
        return None
    return Deliverer(receivers=receivers)
