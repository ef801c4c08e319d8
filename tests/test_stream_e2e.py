"""End to end on the real broker: trainer events in, diagnosed chat alerts and a signed command out."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer

from bench._common import read_topic
from producers import MetricsProducer
from tests.chat_servers import FakeDingTalk, FakeWeCom
from tests.service_proc import ServiceProcess, publish_scenario
from trainsentry.config import Topics
from trainsentry.signing import verify_command
from trainsentry.simulate import Scenario, generate

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SECRET = "e2e-control-secret"


async def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _control_commands(bootstrap: str, topics: Topics, run_id: str) -> list[dict]:
    consumer = KafkaConsumer(topics.control, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=3000)
    out = [json.loads(r.value) for r in consumer if r.key == run_id.encode()]
    consumer.close()
    return out


async def test_faulty_run_yields_signed_chat_alerts_and_a_verified_stop_command(
        kafka_bootstrap: str, topic_prefix: str, free_port: int,
        dingtalk_server: FakeDingTalk, wecom_server: FakeWeCom) -> None:
    """A NaN-loss run published through MetricsProducer: DingTalk (signed) and WeCom get a
    message naming run and diagnosis, and the control topic carries a verifiable stop."""
    topics = Topics(topic_prefix)
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         control_secret=SECRET, extra_env={
                             "TRAINSENTRY_DINGTALK_URL": dingtalk_server.url,
                             "TRAINSENTRY_DINGTALK_SECRET": dingtalk_server.secret or "",
                             "TRAINSENTRY_WECOM_URL": wecom_server.url}).start()
    try:
        await asyncio.to_thread(svc.wait_ready)
        run_id = "e2e/grpo-nan"
        # save_freq beyond the run: no checkpoint, so the breaker's action is a plain stop.
        events = generate(Scenario(run_id=run_id, steps=50, fault="nan_loss", fault_onset=35,
                                   ranks=2, save_freq=1000, seed=3, start_ts=time.time() - 3000))
        with MetricsProducer(run_id=run_id, bootstrap=kafka_bootstrap, topic_prefix=topic_prefix) as p:
            publish_scenario(p, events)
        await _wait(lambda: any(run_id in m.text and "nan_loss" in m.text for m in dingtalk_server.messages),
                    60, "the DingTalk message")
        await _wait(lambda: any(run_id in m.text and "nan_loss" in m.text for m in wecom_server.messages),
                    30, "the WeCom message")
        assert all(s.errcode in (0, None) or s.errcode == 130101 for s in dingtalk_server.requests), \
            "DingTalk rejected a request (bad signature or shape)"
        commands: list[dict] = []
        deadline = time.monotonic() + 30
        while not commands and time.monotonic() < deadline:
            commands = await asyncio.to_thread(_control_commands, kafka_bootstrap, topics, run_id)
        assert len(commands) == 1, commands
        cmd = verify_command(commands[0], SECRET, run_id=run_id, now=time.time())
        assert cmd.action == "stop" and "nan_loss" in cmd.reason
        assert cmd.alert_ids
    finally:
        elapsed = await asyncio.to_thread(svc.stop)
    assert elapsed < 15


async def test_malformed_records_go_to_deadletter_and_good_ones_are_still_processed(
        kafka_bootstrap: str, topic_prefix: str, free_port: int) -> None:
    """Bad JSON, missing fields, wrong types and a 1 MB value land in the dead-letter topic
    with reasons; a good run sent after them is still diagnosed."""
    topics = Topics(topic_prefix)
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         control_secret=SECRET).start()
    try:
        await asyncio.to_thread(svc.wait_ready)
        raw = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=4 * 1024 * 1024)
        good = {"v": 1, "run_id": "dl/run", "step": 0, "ts": time.time(), "layer": "data",
                "metrics": {"timing_s/gen": 3.0}}
        bad = [b"{not json", json.dumps({"v": 1, "run_id": "dl/run"}).encode(),
               json.dumps({**good, "step": "seven"}).encode(),
               json.dumps({**good, "metrics": {"timing_s/gen": "x" * 1_000_000}}).encode()]
        for value in bad:
            raw.send(topics.data, key=b"dl/run", value=value)
        raw.flush()
        run_id = "dl/after-garbage"
        events = generate(Scenario(run_id=run_id, steps=45, fault="nan_loss", fault_onset=35, ranks=1,
                                   save_freq=1000, seed=4, start_ts=time.time() - 3000))
        with MetricsProducer(run_id=run_id, bootstrap=kafka_bootstrap, topic_prefix=topic_prefix) as p:
            publish_scenario(p, events)
        raw.close()

        def alerts() -> list[dict]:
            return [json.loads(r.value) for r in read_topic(kafka_bootstrap, topics.alerts,
                                                            timeout_ms=2000)]

        found: list[dict] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(a["run_id"] == run_id for a in found):
            found = await asyncio.to_thread(alerts)
        assert any(a["run_id"] == run_id and a["diagnosis"] == "nan_loss" for a in found)
        c = KafkaConsumer(topics.deadletter, bootstrap_servers=kafka_bootstrap,
                          auto_offset_reset="earliest", consumer_timeout_ms=3000)
        dead = list(c)
        c.close()
        assert len(dead) == 4
        reasons = [dict(r.headers)["reason"].decode() for r in dead]
        assert any("JSON" in r for r in reasons) and any("missing" in r for r in reasons)
        assert any("step" in r for r in reasons) and any("limit" in r for r in reasons)
        assert all(r.key == b"dl/run" for r in dead)
    finally:
        await asyncio.to_thread(svc.stop)
