"""Event contract: decoding validates, encoding writes non-finite values as strings."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainsentry.errors import EventError
from trainsentry.events import (
    AlertEvent,
    ControlCommand,
    MetricEvent,
    RunEvent,
    decode_event,
    decode_record,
    dumps,
)

GOOD = {"v": 1, "run_id": "grpo-qwen7b/exp3", "attempt": 0, "step": 120, "ts": 1764528000.25,
        "layer": "data", "host": "node-3", "rank": 0,
        "metrics": {"critic/score/mean": 0.41, "response_length/mean": 812.0,
                    "actor/grad_norm": "nan"}}


def test_contract_example_decodes_with_nan_string() -> None:
    """The CONTRACTS.md example decodes, and "nan" becomes float NaN."""
    ev = MetricEvent.from_dict(GOOD)
    assert ev.run_id == "grpo-qwen7b/exp3" and ev.step == 120 and ev.rank == 0
    assert math.isnan(ev.metrics["actor/grad_norm"])
    assert ev.metrics["critic/score/mean"] == 0.41


def test_encoding_writes_nonfinite_as_contract_strings() -> None:
    """NaN/inf/-inf are written as "nan"/"inf"/"-inf", never as bare NaN tokens."""
    ev = MetricEvent(run_id="r", step=1, ts=1.0, layer="compute",
                     metrics={"a": math.nan, "b": math.inf, "c": -math.inf, "d": 2.5})
    wire = json.loads(dumps(ev))
    assert wire["metrics"] == {"a": "nan", "b": "inf", "c": "-inf", "d": 2.5}
    assert MetricEvent.from_dict(wire).metrics["d"] == 2.5


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("run_id"), "run_id"),
    (lambda d: d.update(step="12"), "step"),
    (lambda d: d.update(layer="gpu"), "layer"),
    (lambda d: d.update(metrics={"x": "high"}), "x"),
    (lambda d: d.update(metrics={"x": True}), "boolean"),
    (lambda d: d.update(v=2), "version"),
    (lambda d: d.update(ts="now"), "ts"),
    (lambda d: d.update(step=-1), "step"),
])
def test_invalid_metric_events_are_refused_with_the_reason(mutate, message) -> None:  # type: ignore[no-untyped-def]
    """Each contract violation raises EventError naming what is wrong."""
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    with pytest.raises(EventError, match=message):
        MetricEvent.from_dict(bad)


def test_oversized_and_non_json_records_are_refused() -> None:
    """decode_record refuses 1 MB values, bad JSON and non-objects."""
    with pytest.raises(EventError, match="limit"):
        decode_record(b"{" + b" " * 1_000_000 + b"}", "metric")
    with pytest.raises(EventError, match="JSON"):
        decode_record(b"{not json", "metric")
    with pytest.raises(EventError, match="object"):
        decode_record(b"[1,2]", "metric")
    with pytest.raises(EventError, match="tombstone"):
        decode_record(None, "metric")


def test_run_event_round_trip_keeps_extra_fields() -> None:
    """RunEvent keeps type-specific fields (config, path, exit_code) through a round trip."""
    raw = {"v": 1, "run_id": "r", "attempt": 1, "ts": 5.0, "type": "checkpoint_saved", "step": 40,
           "path": "/ckpt/global_step_40"}
    ev = decode_event(raw)
    assert isinstance(ev, RunEvent) and ev.step == 40
    assert json.loads(dumps(ev)) == raw
    with pytest.raises(EventError, match="step"):
        RunEvent.from_dict({"v": 1, "run_id": "r", "ts": 1.0, "type": "heartbeat"})


def test_alert_and_command_round_trip() -> None:
    """AlertEvent and ControlCommand survive encode/decode unchanged."""
    alert = AlertEvent(id="a1", fingerprint="f", run_id="r", status="firing", severity="critical",
                       diagnosis="nan_loss", step=3, ts=1.0, summary="s",
                       evidence={"actor/pg_loss": {"value": "nan", "baseline": 0.1, "bound": None}},
                       actions=["roll back"])
    assert AlertEvent.from_dict(json.loads(dumps(alert))) == alert
    cmd = ControlCommand(id="c", run_id="r", action="rollback", reason="x", issued_at=2.0,
                         alert_ids=["a1"], to_step=40, sig="ab")
    assert ControlCommand.from_dict(json.loads(dumps(cmd))) == cmd
    with pytest.raises(EventError, match="to_step"):
        ControlCommand.from_dict({**cmd.body(), "to_step": None})


@given(st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=5)
                    | st.integers(), lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12))
def test_decoding_arbitrary_json_raises_only_event_error(obj: object) -> None:
    """Any JSON value either decodes or raises EventError (never another exception)."""
    payload = json.dumps(obj).encode()
    with contextlib.suppress(EventError):
        decode_record(payload, "metric")
