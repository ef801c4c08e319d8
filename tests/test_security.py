"""Security properties that need no broker: unsigned, altered or forged control commands
never reach the trainer's callback (hypothesis over mutated commands and signatures)."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producers.control import ControlListener
from trainsentry.events import ControlCommand
from trainsentry.signing import sign_command

SECRET = "security-test-secret"
RUN = "sec/run"


def _signed(**overrides: Any) -> dict[str, Any]:
    cmd = ControlCommand(id="cmd-1", run_id=RUN, action="stop", reason="nan_loss",
                         issued_at=time.time(), alert_ids=["a1"])
    return {**sign_command(cmd, SECRET).to_dict(), **overrides}


def _listener(applied: list[ControlCommand]) -> ControlListener:
    return ControlListener(run_id=RUN, secret=SECRET, on_command=applied.append,
                           consumer_factory=lambda: None)


_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=30), st.lists(st.text(max_size=5), max_size=3))
_fields = st.sampled_from(["v", "id", "run_id", "action", "reason", "alert_ids", "issued_at",
                           "to_step", "sig", "extra"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=_fields, value=_values)
def test_a_command_with_any_field_changed_after_signing_never_reaches_the_callback(
        field: str, value: Any) -> None:
    """Changing, adding or replacing any field of a signed command (including the sig)
    makes the listener reject it; the callback is not called."""
    original = _signed()
    mutated = dict(original)
    mutated[field] = value
    applied: list[ControlCommand] = []
    listener = _listener(applied)
    listener.handle(RUN.encode(), json.dumps(mutated).encode())  # never raises
    if mutated == original:
        return  # the draw happened to change nothing
    assert applied == [], mutated
    assert listener.rejected


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(secret=st.text(min_size=1, max_size=40).filter(lambda s: s != SECRET))
def test_a_command_signed_with_another_secret_is_rejected(secret: str) -> None:
    """Only the shared secret's signatures pass."""
    cmd = ControlCommand(id="cmd-2", run_id=RUN, action="stop", reason="x",
                         issued_at=time.time())
    applied: list[ControlCommand] = []
    listener = _listener(applied)
    listener.handle(RUN.encode(), json.dumps(sign_command(cmd, secret).to_dict()).encode())
    assert applied == []


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_on_the_control_topic_never_reach_the_callback(raw: bytes) -> None:
    """Garbage is rejected (and reported), never applied, never raises."""
    applied: list[ControlCommand] = []
    _listener(applied).handle(RUN.encode(), raw)
    assert applied == []


def test_a_valid_command_is_applied_once_and_its_replay_is_rejected() -> None:
    """The control case: the genuine command passes exactly once."""
    applied: list[ControlCommand] = []
    listener = _listener(applied)
    value = json.dumps(_signed()).encode()
    listener.handle(RUN.encode(), value)
    listener.handle(RUN.encode(), value)
    assert [c.id for c in applied] == ["cmd-1"]
    assert any("replay" in r for r in listener.rejected)


def test_an_old_command_is_rejected_even_with_a_valid_signature() -> None:
    """A correctly signed command outside the age window is not applied."""
    cmd = ControlCommand(id="cmd-3", run_id=RUN, action="stop", reason="x",
                         issued_at=time.time() - 3600)
    applied: list[ControlCommand] = []
    _listener(applied).handle(RUN.encode(), json.dumps(sign_command(cmd, SECRET).to_dict()).encode())
    assert applied == []


def test_a_non_ascii_signature_is_rejected_without_raising() -> None:
    """A forged sig with non-ASCII characters is reported as a rejection, not an exception
    that restarts the listener's consumer."""
    applied: list[ControlCommand] = []
    listener = _listener(applied)
    listener.handle(RUN.encode(), json.dumps(_signed(sig="\u00e9" * 64)).encode())
    assert applied == [] and listener.rejected


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(sig=st.one_of(st.text(max_size=80), st.text(alphabet="0123456789abcdefABCDEF",
                                                   min_size=64, max_size=64)))
def test_any_forged_signature_string_is_rejected_without_raising(sig: str) -> None:
    """Any sig but the genuine one (any length, any characters, hex of the right length)
    is rejected and reported; the callback is not called and nothing escapes handle()."""
    genuine = _signed()
    applied: list[ControlCommand] = []
    listener = _listener(applied)
    listener.handle(RUN.encode(), json.dumps({**genuine, "sig": sig}).encode())
    if sig.lower() == genuine["sig"]:
        return
    assert applied == [] and listener.rejected
