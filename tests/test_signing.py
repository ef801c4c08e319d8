"""Control-command signing: the contract's canonical JSON HMAC, and verification."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainsentry.errors import SignatureError
from trainsentry.events import ControlCommand
from trainsentry.signing import sign_command, verify_command

SECRET = "s3cret-key"


def _cmd(**over: object) -> ControlCommand:
    base = dict(id="c1", run_id="grpo/exp3", action="rollback", reason="3 consecutive critical alerts",
                issued_at=1000.0, alert_ids=["a1"], to_step=400)
    base.update(over)
    return ControlCommand(**base)  # type: ignore[arg-type]


def test_signature_matches_the_contracts_recipe() -> None:
    """sig == hex HMAC-SHA256 over json.dumps(body, sort_keys, compact, ensure_ascii=False)."""
    cmd = sign_command(_cmd(reason="回滚: nan_loss"), SECRET)
    body = {k: v for k, v in cmd.to_dict().items() if k != "sig"}
    expected = hmac.new(SECRET.encode(), json.dumps(body, sort_keys=True, separators=(",", ":"),
                                                    ensure_ascii=False).encode(),
                        hashlib.sha256).hexdigest()
    assert cmd.sig == expected


def test_valid_command_verifies() -> None:
    """A freshly signed command for this run passes."""
    raw = sign_command(_cmd(), SECRET).to_dict()
    assert verify_command(raw, SECRET, run_id="grpo/exp3", now=1010.0).to_step == 400


@pytest.mark.parametrize("tamper, reason", [
    (lambda d: d.update(to_step=10), "signature"),
    (lambda d: d.update(extra="x"), "signature"),
    (lambda d: d.pop("sig"), "no signature"),
])
def test_tampered_commands_are_rejected(tamper, reason) -> None:  # type: ignore[no-untyped-def]
    """Changing or adding any field breaks the signature."""
    raw = sign_command(_cmd(), SECRET).to_dict()
    tamper(raw)
    with pytest.raises(SignatureError, match=reason):
        verify_command(raw, SECRET, run_id="grpo/exp3", now=1010.0)


def test_wrong_secret_other_run_and_expired_are_rejected() -> None:
    """Wrong key, another run's command and an old command are each refused."""
    raw = sign_command(_cmd(), SECRET).to_dict()
    with pytest.raises(SignatureError, match="signature"):
        verify_command(raw, "other", run_id="grpo/exp3", now=1010.0)
    with pytest.raises(SignatureError, match="not this run"):
        verify_command(raw, SECRET, run_id="grpo/exp4", now=1010.0)
    with pytest.raises(SignatureError, match="old"):
        verify_command(raw, SECRET, run_id="grpo/exp3", now=1000.0 + 3600)


@given(st.text(min_size=1, max_size=20), st.integers(min_value=0, max_value=10**6),
       st.text(max_size=30))
def test_any_single_field_change_invalidates(run_id: str, step: int, reason: str) -> None:
    """Property: a command signed for one body never verifies for a different to_step."""
    cmd = sign_command(_cmd(run_id=run_id, to_step=step, reason=reason), SECRET)
    forged = {**cmd.to_dict(), "to_step": step + 1}
    with pytest.raises(SignatureError):
        verify_command(forged, SECRET, run_id=run_id, now=1000.0)
