"""Create the contract's Kafka topics, keeping the three metrics topics co-partitioned.

Why: one run's data/compute/resource events must meet in the same partition index
(CONTRACTS.md), which only holds if the three metrics topics have the same partition
count. This module creates what is missing, never alters what exists, and refuses to go on
when existing metrics topics disagree, since that silently splits runs across workers.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

from trainsentry.config import Topics, load_settings
from trainsentry.errors import ConfigError, KafkaSetupError
from trainsentry.kafka_security import describe_failure, diagnose, settings_security

__all__ = ["add_cli", "create_topics", "wait_for_broker"]

logger = logging.getLogger(__name__)

def _admin(bootstrap: str, *, timeout: float, client_config: Mapping[str, Any] | None,
           explain: bool = True) -> Any:
    """A KafkaAdminClient, with kafka-python's errors translated into ours.

    ``explain``: probe the broker to say why it cannot be used (TLS, SASL login, down).
    """
    from kafka import KafkaAdminClient  # imported late: trainers that only publish skip it
    from kafka.errors import KafkaError

    ms = max(1000, int(timeout * 1000))
    config: dict[str, Any] = {"bootstrap_servers": bootstrap, "client_id": "trainsentry-topics",
                              "request_timeout_ms": ms}
    if "bootstrap_timeout_ms" in KafkaAdminClient.DEFAULT_CONFIG:  # kafka-python >= 3
        config["bootstrap_timeout_ms"] = ms
    config.update(client_config or {})
    config["bootstrap_servers"] = bootstrap
    try:
        return KafkaAdminClient(**config)
    except (KafkaError, OSError, ValueError) as exc:
        why = (describe_failure(bootstrap, client_config or {}, exc) if explain
               else f"{type(exc).__name__}: {exc}")
        raise KafkaSetupError(f"cannot use Kafka at {bootstrap}: {why}") from exc


def wait_for_broker(bootstrap: str, timeout: float = 30.0, *,
                    client_config: Mapping[str, Any] | None = None) -> None:
    """Block until a broker at bootstrap answers a metadata request, or raise KafkaSetupError.

    Services start alongside their broker (CI, compose files); waiting here turns a race
    into a short delay instead of a crash. A problem waiting cannot fix (an untrusted TLS
    certificate, a refused SASL login, a protocol the listener does not speak) fails at
    once, with what to change. ``client_config``: kafka-python security settings.
    """
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            admin = _admin(bootstrap, timeout=max(1.0, min(5.0, remaining)),
                           client_config=client_config, explain=False)
            try:
                admin.list_topics()
                return
            finally:
                admin.close()
        except (KafkaSetupError, KafkaError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, KafkaSetupError) and exc.__cause__ else exc
            found = diagnose(bootstrap, client_config or {}, cause)
            if found.permanent or time.monotonic() >= deadline:
                waited = "" if found.permanent else f" within {timeout:.0f}s"
                raise KafkaSetupError(f"no usable Kafka broker at {bootstrap}{waited}: "
                                      f"{found.message}") from exc
        time.sleep(0.5)


def _partition_counts(admin: Any, names: list[str]) -> dict[str, int]:
    """Partition count of each named topic that exists (kafka-python 2.x and 3.x shapes)."""
    existing = set(admin.list_topics())
    wanted = [n for n in names if n in existing]
    if not wanted:
        return {}
    counts: dict[str, int] = {}
    for topic in admin.describe_topics(wanted):
        name = topic.get("name") or topic.get("topic")
        if name in existing and not topic.get("error_code"):
            counts[name] = len(topic.get("partitions") or [])
    return counts


def create_topics(*, bootstrap: str, topics: Topics, partitions: int = 4, replication: int = 1,
                  timeout: float = 30.0,
                  client_config: Mapping[str, Any] | None = None) -> list[str]:
    """Create every missing contract topic; return the names created (existing ones are fine).

    Missing metrics topics take the partition count of the existing ones, so co-partitioning
    holds even when ``partitions`` changed since they were made. ``client_config`` passes
    extra KafkaAdminClient settings (SASL/SSL) through.
    """
    if partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {partitions} (TRAINSENTRY_PARTITIONS)")
    if replication < 1:
        raise ConfigError(f"replication must be >= 1, got {replication}")
    from kafka.admin import NewTopic
    from kafka.errors import (
        InvalidReplicationFactorError,
        KafkaError,
        TopicAlreadyExistsError,
    )

    metrics = [topics.data, topics.compute, topics.resource]
    admin = _admin(bootstrap, timeout=timeout, client_config=client_config)
    try:
        try:
            counts = _partition_counts(admin, topics.all())
        except KafkaError as exc:
            raise KafkaSetupError(f"could not list topics on {bootstrap}: {exc}") from exc
        metric_counts = {n: counts[n] for n in metrics if n in counts}
        if len(set(metric_counts.values())) > 1:
            found = ", ".join(f"{n}={c}" for n, c in metric_counts.items())
            raise ConfigError(
                f"the metrics topics must have the same partition count so one run's events "
                f"meet in one partition index (co-partitioning), but found {found}; add "
                f"partitions to the smaller ones (kafka-topics --alter --partitions N) or "
                f"recreate them"
            )
        metric_partitions = next(iter(metric_counts.values()), partitions)
        if metric_partitions != partitions:
            logger.info("metrics topics already have %d partitions (asked for %d); keeping %d",
                        metric_partitions, partitions, metric_partitions)
        missing = [n for n in topics.all() if n not in counts]
        if not missing:
            return []
        new = [NewTopic(name=n, num_partitions=metric_partitions if n in metrics else partitions,
                        replication_factor=replication) for n in missing]
        try:
            with warnings.catch_warnings():
                # kafka-python 3 deprecates NewTopic for a dict form that 2.x lacks; we
                # support both majors, so NewTopic stays.
                warnings.simplefilter("ignore", DeprecationWarning)
                admin.create_topics(new, timeout_ms=int(timeout * 1000))
        except InvalidReplicationFactorError as exc:
            raise ConfigError(
                f"replication factor {replication} is larger than the number of brokers at "
                f"{bootstrap}; use 1 on a single-node broker (TRAINSENTRY_REPLICATION_FACTOR "
                "for trainsentry serve, --replication for topics create)"
            ) from exc
        except TopicAlreadyExistsError:
            pass  # another worker created them first: exactly what we wanted
        except KafkaError as exc:
            raise KafkaSetupError(f"creating topics on {bootstrap} failed: {exc}") from exc
        # After a race with another creator some of ours may have failed harmlessly; the
        # truth is what the broker shows afterwards.
        deadline = time.monotonic() + timeout
        while True:
            try:
                now = _partition_counts(admin, missing)
            except KafkaError:
                now = {}
            if all(n in now for n in missing):
                break
            if time.monotonic() > deadline:
                absent = [n for n in missing if n not in now]
                raise KafkaSetupError(
                    f"topics {absent} did not appear on {bootstrap} within {timeout:.0f}s; "
                    f"check the broker's log (e.g. replication factor {replication} > brokers)"
                )
            time.sleep(0.2)
        logger.info("created Kafka topics %s", missing)
        return missing
    finally:
        admin.close()


# --------------------------------------------------------------------------- CLI


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``trainsentry topics create``; the sub-parser sets ``func`` to its handler."""
    parser = subparsers.add_parser("topics", help="manage the contract's Kafka topics",
                                   description="Create the contract's Kafka topics "
                                   "(docs/kafka.md).")
    sub = parser.add_subparsers(dest="topics_command", metavar="{create}", required=True)
    create = sub.add_parser("create", help="create any missing contract topic (idempotent)")
    create.add_argument("--bootstrap", default=None,
                        help="bootstrap servers (TRAINSENTRY_KAFKA_BOOTSTRAP or 127.0.0.1:9092)")
    create.add_argument("--prefix", default=None,
                        help="topic prefix (TRAINSENTRY_TOPIC_PREFIX or 'trainsentry.')")
    create.add_argument("--partitions", type=int, default=4, help="partitions per topic (4)")
    create.add_argument("--replication", type=int, default=None,
                        help="replication factor (TRAINSENTRY_REPLICATION_FACTOR or 1; 3 on a "
                        "production cluster)")
    create.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (30)")
    create.set_defaults(func=_cmd_create)


def _cmd_create(args: argparse.Namespace) -> int:
    # The entry point reads the environment (bootstrap, prefix and the TRAINSENTRY_KAFKA_*
    # security settings); the library functions never do.
    settings = load_settings(kafka_bootstrap=args.bootstrap, topic_prefix=args.prefix,
                             replication_factor=args.replication)
    topics = settings.topics
    security = settings_security(settings)
    wait_for_broker(settings.kafka_bootstrap, timeout=args.timeout, client_config=security)
    created = create_topics(bootstrap=settings.kafka_bootstrap, topics=topics,
                            partitions=args.partitions, replication=settings.replication_factor,
                            timeout=args.timeout, client_config=security)
    for name in topics.all():
        print(f"{'created' if name in created else 'exists '} {name}", file=sys.stderr)
    return 0
