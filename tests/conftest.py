"""Shared fixtures. Tests marked ``kafka`` use the real local broker.

The broker is the one at ``TRAINSENTRY_KAFKA_BOOTSTRAP`` (``.ci/run`` and ``make test``
start it); when nothing answers there, the session starts its own with
``trainsentry.kafka_local`` and stops it at the end. Each test gets its own topic prefix,
so tests never see each other's records.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

#: The fake DingTalk / WeCom servers' fixtures, for every test module.
pytest_plugins = ["tests.chat_servers"]


def _reachable(bootstrap: str) -> bool:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap address of a real Apache Kafka broker."""
    bootstrap = os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    if _reachable(bootstrap):
        yield bootstrap
        return
    from trainsentry import kafka_local

    port = _free_port()
    data_dir = tempfile.mkdtemp(prefix="trainsentry-test-kafka-")
    address = kafka_local.start(port=port, data_dir=data_dir)
    try:
        yield address
    finally:
        kafka_local.stop(port=port, data_dir=data_dir)


@pytest.fixture
def topic_prefix() -> str:
    """A fresh topic prefix per test (contract: the prefix is prepended verbatim)."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def free_port() -> int:
    return _free_port()
