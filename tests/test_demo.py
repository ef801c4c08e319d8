"""The README's first command works: `trainsentry demo` end to end on the real broker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_demo_shows_a_diagnosed_chat_alert_and_a_verified_command(kafka_bootstrap: str,
                                                                   free_port: int) -> None:
    """The demo's chat sink prints a message naming the run and `nan_loss`, and the
    trainer side prints the rollback command it verified; exit code 0."""
    port = kafka_bootstrap.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "trainsentry.cli", "demo", "--port", port,
                           "--web-port", str(free_port), "--steps", "70"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "demo/grpo-qwen7b-nan_loss" in out and "`nan_loss`" in out
    assert "DingTalk" in out and "WeCom" in out
    assert "signature verified" in out and '"action": "rollback"' in out
    assert "using the Kafka broker already at" in out  # it did not start a second broker
