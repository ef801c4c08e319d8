"""The thin Kafka side of the producer library: client settings and a raw event sender.

kafka-python is imported lazily, so importing :mod:`producers` costs nothing and a trainer
can build a producer without a broker (STYLE.md rule 6).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainsentry.config import Secret, Settings, Topics
from trainsentry.errors import ConfigError, KafkaSetupError
from trainsentry.kafka_security import describe_failure, kafka_python_security

__all__ = ["KafkaOptions", "client_options", "connect_error", "producer_options", "make_sender",
           "security_options", "topic_for"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KafkaOptions:
    """Where the broker is and how to authenticate (PLAINTEXT by default)."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: Secret = Secret("")
    ssl_cafile: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> KafkaOptions:
        return cls(
            bootstrap=settings.kafka_bootstrap,
            security_protocol=settings.kafka_security_protocol,
            sasl_mechanism=settings.kafka_sasl_mechanism,
            sasl_username=settings.kafka_sasl_username,
            sasl_password=settings.kafka_sasl_password,
            ssl_cafile=settings.kafka_ssl_cafile,
        )


def security_options(opts: KafkaOptions) -> dict[str, Any]:
    """kafka-python's security keyword arguments; raises ConfigError naming what to fix."""
    return kafka_python_security(protocol=opts.security_protocol, mechanism=opts.sasl_mechanism,
                                 username=opts.sasl_username, password=opts.sasl_password,
                                 cafile=opts.ssl_cafile)


def client_options(opts: KafkaOptions) -> dict[str, Any]:
    """kafka-python keyword arguments shared by producers, consumers and admin clients."""
    return {
        "bootstrap_servers": [s.strip() for s in opts.bootstrap.split(",") if s.strip()],
        **security_options(opts),
    }


def connect_error(opts: KafkaOptions, exc: BaseException) -> KafkaSetupError:
    """A KafkaSetupError saying why the broker cannot be used and what to fix (no password)."""
    if isinstance(exc, ConfigError):
        return KafkaSetupError(str(exc))
    return KafkaSetupError(f"cannot use Kafka at {opts.bootstrap}: "
                           f"{describe_failure(opts.bootstrap, security_options(opts), exc)}")


def producer_options(opts: KafkaOptions) -> dict[str, Any]:
    """Durable producer settings: acks=all and idempotence, so a broker restart loses nothing."""
    return {
        **client_options(opts),
        "acks": "all",
        "enable_idempotence": True,
        "retries": 2**31 - 1,
        "linger_ms": 5,
        "max_in_flight_requests_per_connection": 5,
        "request_timeout_ms": 15_000,
        "delivery_timeout_ms": 600_000,
        "reconnect_backoff_max_ms": 2_000,
    }


def topic_for(kind: str, topics: Topics) -> str:
    """The topic an event goes to: ``data``/``compute``/``resource``/``run``/``alert``/``control``."""
    if kind in ("data", "compute", "resource"):
        return topics.metrics(kind)
    mapping = {"run": topics.runs, "alert": topics.alerts, "control": topics.control,
               "deadletter": topics.deadletter}
    try:
        return mapping[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}") from None


def make_sender(bootstrap: str | KafkaOptions, prefix: str = "trainsentry.", *,
                timeout_s: float = 30.0) -> Callable[..., None]:
    """A blocking ``send(kind, event_dict)`` for tools (the simulator, tests).

    Training code uses :class:`producers.MetricsProducer` instead, which never blocks.
    ``send.close()`` flushes. Keys are the run_id as plain UTF-8 bytes (contract).
    """
    from trainsentry.events import dumps

    opts = bootstrap if isinstance(bootstrap, KafkaOptions) else KafkaOptions(bootstrap=bootstrap)
    topics = Topics(prefix)
    options = producer_options(opts)  # ConfigError for bad security settings, before any I/O
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    ms = int(timeout_s * 1000)
    if "bootstrap_timeout_ms" in KafkaProducer.DEFAULT_CONFIG:  # kafka-python >= 3 bootstraps
        options["bootstrap_timeout_ms"] = ms  # in the constructor, 30 s by default
    try:
        producer = KafkaProducer(**options, max_block_ms=ms)
    except Exception as exc:  # NoBrokersAvailable, a refused login or TLS handshake, ...
        raise connect_error(opts, exc) from exc

    def send(kind: str, event: Mapping[str, Any]) -> None:
        key = str(event.get("run_id", "")).encode()
        try:
            producer.send(topic_for(kind, topics), key=key, value=dumps(event))
        except KafkaError as exc:
            raise KafkaSetupError(f"could not send to Kafka at {opts.bootstrap}: {exc}") from exc

    def close() -> None:
        producer.flush(timeout=timeout_s)
        producer.close(timeout=timeout_s)

    send.close = close  # type: ignore[attr-defined]
    send.flush = lambda: producer.flush(timeout=timeout_s)  # type: ignore[attr-defined]
    return send
