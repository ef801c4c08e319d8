"""The project's small error hierarchy: third-party errors are translated at the boundary."""

from __future__ import annotations

__all__ = [
    "TrainsentryError",
    "ConfigError",
    "EventError",
    "SignatureError",
    "KafkaSetupError",
    "NotifierError",
]


class TrainsentryError(Exception):
    """Base of every error trainsentry raises on purpose."""


class ConfigError(TrainsentryError):
    """A setting is missing or invalid; the message names the setting and how to fix it."""


class EventError(TrainsentryError):
    """A record does not follow the event contract (see docs/events.md)."""


class SignatureError(TrainsentryError):
    """A control command's signature, run_id or age does not check out."""


class KafkaSetupError(TrainsentryError):
    """The local broker could not be fetched, started or reached."""


class NotifierError(TrainsentryError):
    """A chat webhook rejected a message or could not be reached."""
