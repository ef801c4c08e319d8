"""One engine, two front ends: the stream app on the real broker and `trainsentry detect`
produce the same alerts for the same recorded run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from producers import make_sender
from tests.service_proc import ServiceProcess
from trainsentry.config import Topics
from trainsentry.simulate import Scenario, event_kind, generate, write_jsonl

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _key(alert: dict) -> tuple:
    return (alert["step"], alert["diagnosis"], alert["status"], alert["severity"],
            alert["fingerprint"], alert["id"])


@pytest.mark.parametrize("fault", ["dataloader_stall", "memory_leak"])
def test_stream_and_detect_give_identical_alerts(kafka_bootstrap: str, topic_prefix: str,
                                                 free_port: int, tmp_path: Path, fault: str) -> None:
    """Same run through Kafka + Faust and through the offline CLI: identical alert lists."""
    run_id = f"equal/{fault}"
    events = generate(Scenario(run_id=run_id, steps=90, fault=fault, fault_onset=60, ranks=3,
                               seed=21, save_freq=25, test_freq=30))
    path = tmp_path / "run.jsonl"
    write_jsonl(events, str(path))
    offline = subprocess.run([sys.executable, "-m", "trainsentry.cli", "detect", str(path)],
                             capture_output=True, text=True, timeout=120, check=True)
    expected = sorted(_key(json.loads(line)) for line in offline.stdout.splitlines() if line.strip())
    assert any(k[1] == fault for k in expected), expected

    topics = Topics(topic_prefix)
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port).start()
    try:
        svc.wait_ready()
        send = make_sender(kafka_bootstrap, topic_prefix)
        for ev in events:
            send(event_kind(ev), ev)
        send.close()  # type: ignore[attr-defined]
        got: list[tuple] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            consumer = KafkaConsumer(topics.alerts, bootstrap_servers=kafka_bootstrap,
                                     auto_offset_reset="earliest", consumer_timeout_ms=2000)
            got = sorted(_key(json.loads(r.value)) for r in consumer)
            consumer.close()
            if len(got) >= len(expected) and any(k[2] == "resolved" for k in got):
                break
            time.sleep(1.0)
        assert got == expected
    finally:
        svc.stop()
