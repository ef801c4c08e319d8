"""``trainsentry serve``: create topics, build the app and the notifier, run one Faust worker."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from typing import Any

from detectors.catalog import load_catalog
from stream_app.app import build_app, engine_config_for
from trainsentry.config import Settings

__all__ = ["run_service", "build_notifier", "install_event_loop"]

log = logging.getLogger(__name__)


def build_notifier(settings: Settings) -> object | None:
    """The chat deliverer for the configured receivers, or None when none is configured."""
    from notifiers.factory import notifier_from_settings

    return notifier_from_settings(settings)


def install_event_loop(choice: str) -> str:
    """Use uvloop for the worker's event loops when asked to, or by default when it is
    installed (``auto``); returns the loop in use, ``uvloop`` or ``asyncio``.

    Faust's per-record path is asyncio tasks and futures; uvloop runs them faster (+16 %
    records/s through the service on average here, docs/performance.md). Call before the app's
    loop exists: every loop created afterwards (the main one, the consumer thread's) is
    then a uvloop one.
    """
    import asyncio

    from trainsentry.errors import ConfigError

    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError("TRAINSENTRY_EVENT_LOOP=uvloop but uvloop is not installed: "
                              "pip install 'trainsentry[service]' (or uvloop), or set it to "
                              "auto or asyncio") from exc
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def run_service(settings: Settings, *, workdir: str | None = None) -> int:
    """Run one worker until SIGTERM/SIGINT; returns the exit code."""
    from faust.worker import Worker

    from trainsentry.kafka_security import check_security, settings_security
    from trainsentry.topics import create_topics, wait_for_broker

    log.info("trainsentry serve starting with %s", settings.redacted())
    if not settings.control_secret:
        log.warning("TRAINSENTRY_CONTROL_SECRET is not set: the circuit breaker will alert but "
                    "publish no stop/rollback commands")
    # Check the Kafka security settings once (ConfigError names the variable to fix) and
    # normalise them, so the admin client here, Faust and the alerting consumer agree.
    protocol, mechanism = check_security(
        protocol=settings.kafka_security_protocol, mechanism=settings.kafka_sasl_mechanism,
        username=settings.kafka_sasl_username, password=settings.kafka_sasl_password,
        cafile=settings.kafka_ssl_cafile)
    settings = replace(settings, kafka_security_protocol=protocol, kafka_sasl_mechanism=mechanism)
    security = settings_security(settings)
    wait_for_broker(settings.kafka_bootstrap, timeout=60, client_config=security)
    create_topics(bootstrap=settings.kafka_bootstrap, topics=settings.topics,
                  partitions=settings.partitions, replication=settings.replication_factor,
                  client_config=security)
    if not settings.data_dir:
        settings = replace(settings, data_dir=workdir or tempfile.mkdtemp(prefix="trainsentry-worker-"))
    engine_config = engine_config_for(settings, load_catalog(settings.detector_config or None))
    loop = install_event_loop(settings.event_loop)
    log.info("event loop: %s (TRAINSENTRY_EVENT_LOOP=%s)", loop, settings.event_loop)
    notifier = build_notifier(settings)
    app = build_app(settings, engine_config=engine_config, notifier=notifier)
    worker = Worker(app, loglevel=logging.getLevelName(logging.getLogger().level).lower(),
                    redirect_stdouts=False, override_logging=False, quiet=True)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        return _stall_exit(app) or int(exc.code or 0)
    return _stall_exit(app)


def _stall_exit(app: Any) -> int:
    """The exit code the worker chose for itself (a stalled table recovery), else 0."""
    return int(app.trainsentry.extra.get("exit_code", 0) or 0)
