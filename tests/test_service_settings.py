"""Service settings that shape the worker: run and alert-book retention, the event loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

from stream_app.service import install_event_loop
from trainsentry.config import load_settings
from trainsentry.errors import ConfigError


@pytest.mark.parametrize("var, value, fragment", [
    ("TRAINSENTRY_FINISHED_RUN_RETENTION_S", "-1", "TRAINSENTRY_FINISHED_RUN_RETENTION_S"),
    ("TRAINSENTRY_IDLE_RUN_RETENTION_S", "600", "could drop a run before its hang"),
    ("TRAINSENTRY_IDLE_RUN_RETENTION_S", "a week", "must be an integer"),
    ("TRAINSENTRY_EVENT_LOOP", "trio", "auto, uvloop or asyncio"),
    ("TRAINSENTRY_ALERT_BOOK_RETENTION_S", "0", "TRAINSENTRY_ALERT_BOOK_RETENTION_S"),
])
def test_bad_values_name_the_variable_to_fix(var: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_settings(env={var: value})


def test_alert_book_retention_reaches_the_lifecycle() -> None:
    from stream_app.alerting_api import lifecycle_config

    assert lifecycle_config(load_settings(env={})).book_retention_s == 86400.0
    short = load_settings(env={"TRAINSENTRY_ALERT_BOOK_RETENTION_S": "5"})
    assert lifecycle_config(short).book_retention_s == 5.0


def test_defaults_and_accepted_values() -> None:
    default = load_settings(env={})
    assert (default.finished_run_retention_s, default.idle_run_retention_s,
            default.event_loop) == (86400, 7 * 86400, "auto")
    ok = load_settings(env={"TRAINSENTRY_FINISHED_RUN_RETENTION_S": "0",
                            "TRAINSENTRY_IDLE_RUN_RETENTION_S": "3600",
                            "TRAINSENTRY_EVENT_LOOP": "asyncio"})
    assert (ok.finished_run_retention_s, ok.idle_run_retention_s, ok.event_loop) == (0, 3600,
                                                                                     "asyncio")


@pytest.fixture
def policy() -> Iterator[None]:
    """Restore the event loop policy the test changes."""
    saved = asyncio.get_event_loop_policy()
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(saved)


def _loop_module() -> str:
    loop = asyncio.new_event_loop()
    try:
        return type(loop).__module__.split(".")[0]
    finally:
        loop.close()


def test_auto_and_uvloop_run_uvloop_when_installed(policy: None) -> None:
    pytest.importorskip("uvloop")  # a service extra: installed by `make setup`
    assert install_event_loop("auto") == "uvloop"
    assert _loop_module() == "uvloop"
    assert install_event_loop("asyncio") == "asyncio"  # leaves the policy alone
    asyncio.set_event_loop_policy(None)
    assert install_event_loop("uvloop") == "uvloop" and _loop_module() == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_says_what_to_install(
        policy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    asyncio.set_event_loop_policy(None)
    assert install_event_loop("auto") == "asyncio"
    assert _loop_module() == "asyncio"
    with pytest.raises(ConfigError, match=r"pip install 'trainsentry\[service\]'"):
        install_event_loop("uvloop")
