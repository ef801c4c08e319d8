"""HMAC-SHA256 signing of control commands (contract: canonical JSON without ``sig``)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainsentry.errors import SignatureError
from trainsentry.events import ControlCommand

__all__ = ["canonical_json", "sign_body", "sign_command", "verify_command", "DEFAULT_MAX_AGE_S"]

#: A command older than this (or dated this far in the future) is refused.
DEFAULT_MAX_AGE_S = 300.0
_SIG_HEX_LEN = 2 * hashlib.sha256().digest_size
_HEX = frozenset("0123456789abcdefABCDEF")


def _is_hex(text: str) -> bool:
    return all(c in _HEX for c in text)


def canonical_json(body: Mapping[str, Any]) -> bytes:
    """The exact bytes the signature covers."""
    return json.dumps(dict(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sign_body(body: Mapping[str, Any], secret: str) -> str:
    """Lowercase hex HMAC-SHA256 of the canonical JSON of ``body`` (which must not hold ``sig``)."""
    if not secret:
        raise SignatureError("the control secret is empty; set TRAINSENTRY_CONTROL_SECRET")
    if "sig" in body:
        raise SignatureError("sign the command body without its 'sig' field")
    return hmac.new(secret.encode(), canonical_json(body), hashlib.sha256).hexdigest()


def sign_command(command: ControlCommand, secret: str) -> ControlCommand:
    """The same command with ``sig`` filled in."""
    return replace(command, sig=sign_body(command.body(), secret))


def verify_command(raw: Mapping[str, Any], secret: str, *, run_id: str | None, now: float,
                   max_age_s: float = DEFAULT_MAX_AGE_S) -> ControlCommand:
    """Check a received command: signature over exactly what was sent, run_id, age.

    Verifies the signature over the record as received (minus ``sig``), so a field added
    by a forger is caught even if our dataclass would drop it. Raises SignatureError with
    the reason; returns the decoded command when everything checks out.
    """
    body = {k: v for k, v in raw.items() if k != "sig"}
    sig = raw.get("sig")
    if not isinstance(sig, str) or not sig:
        raise SignatureError("command has no signature")
    # compare_digest raises TypeError on a str with non-ASCII characters, so a forged sig
    # must be refused as a SignatureError before it gets there (and compared as bytes).
    if len(sig) != _SIG_HEX_LEN or not _is_hex(sig):
        raise SignatureError("signature is not 64 hex digits (HMAC-SHA256)")
    expected = sign_body(body, secret)
    if not hmac.compare_digest(expected.encode("ascii"), sig.lower().encode("ascii")):
        raise SignatureError("signature does not match (wrong secret or altered command)")
    command = ControlCommand.from_dict(raw)
    if run_id is not None and command.run_id != run_id:
        raise SignatureError(f"command is for run {command.run_id!r}, not this run {run_id!r}")
    age = now - command.issued_at
    if age > max_age_s:
        raise SignatureError(f"command is {age:.0f}s old, over the {max_age_s:.0f}s age window")
    if age < -max_age_s:
        raise SignatureError(f"command is dated {-age:.0f}s in the future; check the clocks")
    return command
