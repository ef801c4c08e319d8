"""trainsentry: a watchdog for LLM RL post-training runs.

The core package holds what every part shares: the contract's event types
(:mod:`trainsentry.events`), settings (:mod:`trainsentry.config`), control-command
signing (:mod:`trainsentry.signing`), topic names and the local Kafka broker.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
