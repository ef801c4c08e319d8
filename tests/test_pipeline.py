"""The stream app's pure pipeline: dead letters with reasons, signed commands."""

from __future__ import annotations

import json

import pytest

from detectors.engine import Engine
from stream_app.pipeline import Pipeline, dump_state, load_state
from trainsentry.config import Secret, Topics
from trainsentry.errors import EventError
from trainsentry.events import AlertEvent, ControlCommand
from trainsentry.signing import verify_command

TOPICS = Topics("trainsentry.")


def _pipeline(secret: str = "k", **kw: object) -> Pipeline:
    return Pipeline(engine=Engine(), topics=TOPICS, control_secret=Secret(secret),
                    clock=lambda: 100.0, **kw)  # type: ignore[arg-type]


GOOD = {"v": 1, "run_id": "r", "step": 1, "ts": 1.0, "layer": "data", "metrics": {"x": 1.0}}


@pytest.mark.parametrize("value, reason", [
    (b"\xff\xfe not utf8", "UTF-8 JSON"),
    (b'{"v": 1}', "missing required field"),
    (json.dumps({**GOOD, "step": "one"}).encode(), "step"),
    (json.dumps({**GOOD, "metrics": {"x": "x" * 1_000_000}}).encode(), "limit"),
    (json.dumps({**GOOD, "layer": "compute"}).encode(), "own topic"),
])
def test_malformed_records_raise_with_a_reason(value: bytes, reason: str) -> None:
    """Each kind of malformed record is refused with a reason that says what is wrong."""
    with pytest.raises(EventError, match=reason):
        _pipeline().decode(TOPICS.data, b"r", value)


def test_key_must_match_run_id() -> None:
    """A record keyed by another run would land in the wrong partition: refused."""
    with pytest.raises(EventError, match="key"):
        _pipeline().decode(TOPICS.data, b"other", json.dumps(GOOD).encode())


def test_deadletter_record_keeps_key_value_and_reason_headers() -> None:
    """The dead letter carries the original key and value, and the reason in headers."""
    rec = _pipeline().deadletter(TOPICS.data, 2, 17, b"r", b"{bad", "not JSON")
    headers = dict(rec.headers)
    assert rec.topic == TOPICS.deadletter and rec.key == b"r" and rec.value == b"{bad"
    assert headers["reason"] == b"not JSON" and headers["original_offset"] == b"17"


def test_commands_are_signed_and_state_round_trips() -> None:
    """Commands leave the pipeline signed with the control secret; RunState pickles."""
    p = Pipeline(engine=Engine(), topics=TOPICS, control_secret=Secret("sekrit"), clock=lambda: 100.0)
    cmd = ControlCommand(id="c", run_id="r", action="stop", reason="x", issued_at=5.0)
    outcome = p.encode("r", [cmd])
    (rec,) = outcome.records
    assert rec.topic == TOPICS.control and rec.key == b"r"
    verified = verify_command(json.loads(rec.value), "sekrit", run_id="r", now=100.0)
    assert verified.issued_at == 100.0  # re-dated by the service clock before signing
    state = p.engine.new_state("r")
    p.handle(state, p.decode(TOPICS.data, b"r", json.dumps(GOOD).encode()))
    assert load_state(dump_state(state)).pending.keys() == state.pending.keys()


def test_no_secret_means_no_command_is_published() -> None:
    """Without a control secret the command is withheld (and logged), never sent unsigned."""
    p = Pipeline(engine=Engine(), topics=TOPICS, control_secret=Secret(""))
    cmd = ControlCommand(id="c", run_id="r", action="stop", reason="x", issued_at=1.0)
    assert p.encode("r", [cmd]).records == []


def _notice(**command: object) -> AlertEvent:
    return AlertEvent(id="n", fingerprint="f", run_id="r", status="firing", severity="critical",
                      diagnosis="nan_loss", step=52, ts=1.0, summary="nan_loss: breaker",
                      summary_zh="nan_loss：熔断", evidence={}, actions=[],
                      command={"id": "c", "action": "stop", "to_step": None, **command})


@pytest.mark.parametrize("secret", ["k", ""])
def test_a_breaker_notice_says_whether_its_command_was_sent(secret: str) -> None:
    """With a control secret the notice is marked sent; without, it says so and what to do."""
    cmd = ControlCommand(id="c", run_id="r", action="stop", reason="x", issued_at=1.0)
    outcome = _pipeline(secret).encode("r", [cmd, _notice()])
    alerts = [json.loads(r.value) for r in outcome.records if r.topic == TOPICS.alerts]
    assert len(alerts) == 1 and alerts[0]["command"]["sent"] is bool(secret)
    assert outcome.outputs[1].command["sent"] is bool(secret)  # what the dashboard records
    if secret:
        assert alerts[0]["summary"] == "nan_loss: breaker"
    else:
        assert "NOT SENT: TRAINSENTRY_CONTROL_SECRET is not set" in alerts[0]["summary"]
        assert "未下发" in alerts[0]["summary_zh"]
        assert [r.topic for r in outcome.records] == [TOPICS.alerts]


@pytest.mark.parametrize("limit, published", [(3600.0, False), (0.0, True), (7200.0, True)])
def test_no_command_for_data_older_than_the_limit(limit: float, published: bool) -> None:
    """A breaker tripped on data an hour and a half old (a replay under a new app id, a long
    backlog) publishes no command; its notice says why and what to do. 0 turns the limit off."""
    from notifiers.templates import command_text

    cmd = ControlCommand(id="c", run_id="r", action="stop", reason="x", issued_at=100.0 - 5400)
    outcome = _pipeline("k", command_max_data_age_s=limit).encode("r", [cmd, _notice()])
    assert any(r.topic == TOPICS.control for r in outcome.records) is published
    notice = outcome.outputs[1]
    assert notice.command["sent"] is published
    if not published:
        assert notice.command["stale_s"] == 5400 and "90 min old" in notice.summary
        assert "90 分钟前" in (notice.summary_zh or "")
        assert "was NOT sent" in command_text(notice, "en") and "90 min old" in command_text(notice, "en")
