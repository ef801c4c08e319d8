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


# ------------------------------------------------------------------------------ stalled recovery

@pytest.mark.parametrize("value, ok", [("0", True), ("60", True), ("30", False), ("-1", False)])
def test_recovery_stall_limit_is_off_or_at_least_a_minute(value: str, ok: bool) -> None:
    env = {"TRAINSENTRY_RECOVERY_STALL_S": value}
    if ok:
        assert load_settings(env=env).recovery_stall_s == int(value)
    else:
        with pytest.raises(ConfigError, match="TRAINSENTRY_RECOVERY_STALL_S"):
            load_settings(env=env)
    assert load_settings(env={}).recovery_stall_s == 600


def test_the_watch_reads_the_real_faust_recovery_of_a_built_app() -> None:
    """recovery_progress reads faust-streaming's own Recovery (attribute names checked
    against the pinned version), on the app `trainsentry serve` builds."""
    from stream_app.app import build_app
    from stream_app.offsets import RecoveryWatch, recovery_progress

    app = build_app(load_settings(env={"TRAINSENTRY_KAFKA_BOOTSTRAP": "127.0.0.1:1"}))
    assert recovery_progress(app) == 0
    from faust.types import TP

    recovery = app.tables.recovery
    recovery.active_offsets[TP("t-run_state-changelog", 0)] = 41
    recovery.standby_offsets[TP("t-run_state-changelog", 1)] = 1
    assert recovery_progress(app) == 42
    watch = RecoveryWatch(60.0)
    assert watch.observe(0.0, recovering=True, progress=recovery_progress(app)) is None
    assert watch.observe(61.0, recovering=False, progress=42) is None  # recovered: reset
    assert watch.observe(62.0, recovering=True, progress=42) is None
    assert watch.observe(122.0, recovering=True, progress=42) == 60.0
    assert RecoveryWatch(0.0).observe(1e9, recovering=True, progress=0) is None  # off


def test_a_stalled_worker_stops_itself_with_its_own_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to itself (the clean shutdown path), exit code 70 for run_service, and a
    forced exit if the clean shutdown hangs."""
    import os
    import signal
    import threading
    from types import SimpleNamespace

    from stream_app.app import RECOVERY_STALL_EXIT, ServiceState, stop_stalled_worker
    from stream_app.service import _stall_exit

    forced = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        forced.set()

    monkeypatch.setattr(os, "_exit", fake_exit)
    sent: list[tuple[int, int]] = []
    svc = ServiceState()
    stop_stalled_worker(svc, 612.0, 600, kill=lambda pid, sig: sent.append((pid, sig)),
                        force_after_s=0.05)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert forced.wait(5) and codes == [RECOVERY_STALL_EXIT] == [70]
    assert _stall_exit(SimpleNamespace(trainsentry=svc)) == 70
    assert _stall_exit(SimpleNamespace(trainsentry=ServiceState())) == 0


def test_an_empty_topic_prefix_is_kept_verbatim() -> None:
    """TRAINSENTRY_TOPIC_PREFIX= gives unprefixed topics (the contract prepends the prefix
    verbatim); other empty variables still mean unset."""
    s = load_settings(env={"TRAINSENTRY_TOPIC_PREFIX": "", "TRAINSENTRY_LANGUAGE": ""})
    assert s.topic_prefix == "" and s.topics.data == "metrics.data"
    assert s.language == "zh"
    assert load_settings(env={}).topics.data == "trainsentry.metrics.data"


def test_replication_factor_and_command_data_age_are_validated() -> None:
    """TRAINSENTRY_REPLICATION_FACTOR (default 1) and TRAINSENTRY_COMMAND_MAX_DATA_AGE_S
    (default 1 h, 0 = no limit, else >= 60 s) name the variable when refused."""
    default = load_settings(env={})
    assert default.replication_factor == 1 and default.command_max_data_age_s == 3600
    assert load_settings(env={"TRAINSENTRY_REPLICATION_FACTOR": "3"}).replication_factor == 3
    assert load_settings(env={"TRAINSENTRY_COMMAND_MAX_DATA_AGE_S": "0"}).command_max_data_age_s == 0
    with pytest.raises(ConfigError, match="TRAINSENTRY_REPLICATION_FACTOR"):
        load_settings(env={"TRAINSENTRY_REPLICATION_FACTOR": "0"})
    with pytest.raises(ConfigError, match="TRAINSENTRY_COMMAND_MAX_DATA_AGE_S"):
        load_settings(env={"TRAINSENTRY_COMMAND_MAX_DATA_AGE_S": "30"})
