"""Kafka over SASL/SCRAM + TLS, end to end, and no secret anywhere the service shows things.

One SASL_SSL broker for the module (``kafka_local.start(security=...)``: a CA made with
keytool, SCRAM-SHA-512/256 user, PLAINTEXT only on an internal listener). One run of the
real ``trainsentry serve`` against it, with every secret set (SASL password, DingTalk
token and 加签 secret, WeCom key, control secret), drives a NaN-loss run to the fake chat
robots; the tests then check what it produced and grep everything it showed for the
secrets. Tests without the marks need no broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from producers import ControlListener, KafkaOptions, MetricsProducer, make_sender
from producers.kafka import client_options
from tests.chat_servers import FakeDingTalk, FakeWeCom
from tests.service_proc import ServiceProcess, publish_scenario
from trainsentry import kafka_local
from trainsentry.config import Secret, Topics
from trainsentry.errors import ConfigError, KafkaSetupError
from trainsentry.events import ControlCommand
from trainsentry.kafka_security import check_security
from trainsentry.signing import sign_command
from trainsentry.simulate import Scenario, generate
from trainsentry.topics import create_topics, wait_for_broker

USER = "ts-alice"
PASSWORD = "scramPW-7f3a9c1e-do-not-leak"
WRONG_PASSWORD = "wrongPW-0b1c2d3e-do-not-leak"
CONTROL_SECRET = "ctlSECRET-5e6f7a8b-do-not-leak"
DT_TOKEN = "dtTOKEN-1a2b3c4d5e6f-do-not-leak"
DT_SECRET = "SECdtsign-9f8e7d6c5b4a-do-not-leak"
WC_KEY = "wcKEY-abcdef012345-do-not-leak"
SECRETS = (PASSWORD, WRONG_PASSWORD, CONTROL_SECRET, DT_TOKEN, DT_SECRET, WC_KEY)

slow_kafka = [pytest.mark.kafka, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leaks(blob: str | bytes, extra: tuple[str, ...] = ()) -> list[str]:
    """Which secrets (or their first 12 characters) occur in blob; names only, never values."""
    text = blob.decode("utf-8", errors="replace") if isinstance(blob, bytes) else blob
    found = []
    for i, secret in enumerate((*SECRETS, *extra)):
        if secret in text or secret[:12] in text:
            found.append(f"secret #{i} ({secret[:4]}…)")
    return found


# --------------------------------------------------------------------------- broker


@dataclass(frozen=True)
class SaslBroker:
    bootstrap: str
    cafile: str
    data_dir: str

    def options(self, **over: Any) -> KafkaOptions:
        base: dict[str, Any] = dict(bootstrap=self.bootstrap, security_protocol="SASL_SSL",
                                    sasl_mechanism="SCRAM-SHA-512", sasl_username=USER,
                                    sasl_password=Secret(PASSWORD), ssl_cafile=self.cafile)
        return KafkaOptions(**{**base, **over})

    def env(self, **over: str) -> dict[str, str]:
        return {"TRAINSENTRY_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "TRAINSENTRY_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                "TRAINSENTRY_KAFKA_SASL_USERNAME": USER,
                "TRAINSENTRY_KAFKA_SASL_PASSWORD": PASSWORD,
                "TRAINSENTRY_KAFKA_SSL_CAFILE": self.cafile, **over}


@pytest.fixture(scope="session")
def sasl_broker() -> Iterator[SaslBroker]:
    """A local broker whose only client listener is SASL_SSL with SCRAM; stopped at the end."""
    port = _free_port()
    data_dir = tempfile.mkdtemp(prefix="trainsentry-test-sasl-kafka-")
    security = kafka_local.LocalSecurity(tls=True, scram_user=USER, scram_password=Secret(PASSWORD))
    address = kafka_local.start(port=port, data_dir=data_dir, security=security, timeout=120)
    try:
        yield SaslBroker(address, str(kafka_local.ca_file(port=port, data_dir=data_dir)), data_dir)
    finally:
        kafka_local.stop(port=port, data_dir=data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def _records(broker: SaslBroker, topic: str, *, timeout_ms: int = 3000) -> list[Any]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, **client_options(broker.options()),
                             auto_offset_reset="earliest", consumer_timeout_ms=timeout_ms)
    try:
        return list(consumer)
    finally:
        consumer.close()


# --------------------------------------------------------------------------- no broker


def test_broker_properties_for_sasl_ssl_keep_plaintext_internal_only() -> None:
    """The client port is SASL_SSL with SCRAM; PLAINTEXT exists only on internal loopback ports."""
    props = kafka_local.broker_properties(port=1, controller_port=2, data_dir="/d",
                                          protocol="SASL_SSL", internal_port=3,
                                          keystore="/d/tls/broker.p12", keystore_password="k")
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:1,INTERNAL://127.0.0.1:3"
    assert props["listener.security.protocol.map"] == \
        "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT"
    assert props["inter.broker.listener.name"] == "INTERNAL"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512,SCRAM-SHA-256"
    assert "ScramLoginModule" in props["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
    assert props["ssl.keystore.type"] == "PKCS12"
    assert all(address.startswith("127.0.0.1:") for address in
               (p.split("://")[1] for p in props["listeners"].split(",")))


def test_kafka_start_cli_takes_the_password_only_from_the_environment() -> None:
    """`--sasl-scram USER:PASSWORD` is refused without echoing it; a missing password is named."""
    parser = argparse.ArgumentParser()
    kafka_local.add_cli(parser.add_subparsers())
    args = parser.parse_args(["kafka", "start", "--tls", "--sasl-scram", f"{USER}:{PASSWORD}"])
    with pytest.raises(KafkaSetupError) as err:
        kafka_local._security_from_args(args, env={})
    assert "TRAINSENTRY_KAFKA_SASL_PASSWORD" in str(err.value) and not _leaks(str(err.value))
    args = parser.parse_args(["kafka", "start", "--sasl-scram", USER])
    with pytest.raises(KafkaSetupError, match="TRAINSENTRY_KAFKA_SASL_PASSWORD"):
        kafka_local._security_from_args(args, env={})
    security = kafka_local._security_from_args(
        args, env={"TRAINSENTRY_KAFKA_SASL_PASSWORD": PASSWORD})
    assert security.protocol == "SASL_PLAINTEXT" and security.scram_password.get() == PASSWORD
    assert not _leaks(repr(security))


@pytest.mark.parametrize("settings, names", [
    (dict(protocol="SASL-SSL"), "TRAINSENTRY_KAFKA_SECURITY_PROTOCOL"),
    (dict(protocol="SASL_SSL", mechanism="SCRAM-SHA-1", username=USER, password=PASSWORD),
     "TRAINSENTRY_KAFKA_SASL_MECHANISM"),
    (dict(protocol="SASL_SSL", mechanism="SCRAM-SHA-512", password=PASSWORD),
     "TRAINSENTRY_KAFKA_SASL_USERNAME"),
    (dict(protocol="SASL_PLAINTEXT", mechanism="SCRAM-SHA-512", username=USER),
     "TRAINSENTRY_KAFKA_SASL_PASSWORD"),
    (dict(protocol="SSL", cafile="/nonexistent/ca.pem"), "TRAINSENTRY_KAFKA_SSL_CAFILE"),
])
def test_bad_security_settings_name_the_variable_to_fix(settings: dict[str, str],
                                                        names: str) -> None:
    """Each inconsistent setting is a ConfigError naming its variable, before any network I/O."""
    with pytest.raises(ConfigError, match=names) as err:
        check_security(**settings)
    assert not _leaks(str(err.value))


def test_security_settings_are_normalised() -> None:
    """Case and `_`/`-` in the protocol and mechanism do not matter; PLAIN is the SASL default."""
    assert check_security(protocol="sasl_ssl", mechanism="scram_sha_256", username="u",
                          password="p") == ("SASL_SSL", "SCRAM-SHA-256")
    assert check_security(protocol="sasl_plaintext", username="u", password="p") == \
        ("SASL_PLAINTEXT", "PLAIN")
    assert check_security(protocol="") == ("PLAINTEXT", "")


# --------------------------------------------------------------------------- broker


@pytest.mark.kafka
@pytest.mark.slow
def test_producer_and_control_listener_work_over_sasl_ssl(sasl_broker: SaslBroker) -> None:
    """MetricsProducer publishes with SCRAM-SHA-512 over TLS, and a ControlListener on the same
    broker receives a signed command sent with SCRAM-SHA-256."""
    topics = Topics(f"sec{os.getpid()}.")
    security = client_options(sasl_broker.options())
    security.pop("bootstrap_servers")
    wait_for_broker(sasl_broker.bootstrap, timeout=30, client_config=security)
    create_topics(bootstrap=sasl_broker.bootstrap, topics=topics, partitions=1,
                  client_config=security)
    with MetricsProducer(run_id="sec/run", bootstrap=sasl_broker.options(),
                         topic_prefix=topics.prefix) as producer:
        for step in range(3):
            producer.log({"actor/pg_loss": 0.1 * step, "timing_s/gen": 3.0}, step=step)
    data = _records(sasl_broker, topics.data)
    assert [json.loads(r.value)["step"] for r in data] == [0, 1, 2]

    applied: list[ControlCommand] = []
    with ControlListener(run_id="sec/run", secret=CONTROL_SECRET, on_command=applied.append,
                         bootstrap=sasl_broker.options(), topic_prefix=topics.prefix) as listener:
        assert listener.wait_ready(30)
        send = make_sender(sasl_broker.options(sasl_mechanism="SCRAM-SHA-256"), topics.prefix)
        command = ControlCommand(id="sec-cmd-1", run_id="sec/run", action="stop",
                                 reason="nan_loss", issued_at=time.time())
        send("control", sign_command(command, CONTROL_SECRET).to_dict())
        send.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 20
        while not applied and time.monotonic() < deadline:
            time.sleep(0.2)
    assert [c.id for c in applied] == ["sec-cmd-1"]


@pytest.mark.kafka
@pytest.mark.slow
def test_a_wrong_password_fails_fast_and_says_what_to_fix(sasl_broker: SaslBroker) -> None:
    """A refused SCRAM login is not mistaken for a down broker: it fails at once, names the
    variables to check, and does not contain the password."""
    options = sasl_broker.options(sasl_password=Secret(WRONG_PASSWORD))
    security = client_options(options)
    security.pop("bootstrap_servers")
    started = time.monotonic()
    with pytest.raises(KafkaSetupError) as err:
        wait_for_broker(sasl_broker.bootstrap, timeout=60, client_config=security)
    assert time.monotonic() - started < 20, "a refused login must not wait out the timeout"
    message = str(err.value)
    assert "refused the SASL SCRAM-SHA-512 login" in message
    assert "TRAINSENTRY_KAFKA_SASL_PASSWORD" in message and USER in message
    with pytest.raises(KafkaSetupError) as err2:
        make_sender(options, "x.", timeout_s=3)
    for text in (message, repr(err.value), str(err2.value), repr(err2.value)):
        assert not _leaks(text), text


@pytest.mark.kafka
@pytest.mark.slow
def test_a_missing_ca_file_fails_and_says_what_to_fix(sasl_broker: SaslBroker) -> None:
    """Without the CA, the TLS failure names TRAINSENTRY_KAFKA_SSL_CAFILE; a CA path that does
    not exist is a ConfigError before any connection."""
    with pytest.raises(KafkaSetupError) as err:
        make_sender(sasl_broker.options(ssl_cafile=""), "x.", timeout_s=3)
    message = str(err.value)
    assert "not trusted" in message and "TRAINSENTRY_KAFKA_SSL_CAFILE" in message
    assert not _leaks(message)
    with pytest.raises(ConfigError, match="TRAINSENTRY_KAFKA_SSL_CAFILE=/nonexistent/ca.pem"):
        make_sender(sasl_broker.options(ssl_cafile="/nonexistent/ca.pem"), "x.")


@pytest.mark.kafka
@pytest.mark.slow
def test_serve_with_a_wrong_password_exits_with_what_to_fix(sasl_broker: SaslBroker) -> None:
    """`trainsentry serve` with a refused login exits non-zero within seconds, says which
    variables to check, and its whole output holds no secret."""
    env = {**os.environ, "TRAINSENTRY_KAFKA_BOOTSTRAP": sasl_broker.bootstrap,
           "TRAINSENTRY_WEB_PORT": str(_free_port()), "TRAINSENTRY_CONTROL_SECRET": CONTROL_SECRET,
           **sasl_broker.env(TRAINSENTRY_KAFKA_SASL_PASSWORD=WRONG_PASSWORD)}
    done = subprocess.run([sys.executable, "-m", "trainsentry.cli", "serve"], env=env,
                          capture_output=True, text=True, timeout=90)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "TRAINSENTRY_KAFKA_SASL_PASSWORD" in output, output[-2000:]
    assert not _leaks(output)


# --------------------------------------------------------------------------- the service


class _Robots:
    """The fake DingTalk and WeCom robots on an event loop of their own thread, so a sync
    module-scoped fixture can keep them up while the service runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dingtalk = FakeDingTalk(token=DT_TOKEN, secret=DT_SECRET)
        self.wecom = FakeWeCom(key=WC_KEY)
        for robot in (self.dingtalk, self.wecom):
            asyncio.run_coroutine_threadsafe(robot.start(), self.loop).result(10)

    def close(self) -> None:
        for robot in (self.dingtalk, self.wecom):
            asyncio.run_coroutine_threadsafe(robot.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class ServedRun:
    """What one service run over SASL_SSL produced and showed."""

    run_id: str
    log: str = ""
    http: dict[str, bytes] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    commands: list[bytes] = field(default_factory=list)
    chat: list[str] = field(default_factory=list)
    signs: list[str] = field(default_factory=list)
    stop_s: float = 0.0


def _get(port: int, path: str) -> bytes:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return bytes(r.read())
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} ".encode() + exc.read()


def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def served_run(sasl_broker: SaslBroker) -> Iterator[ServedRun]:
    """`trainsentry serve` on the SASL_SSL broker with every secret set, fed a NaN-loss run."""
    prefix = f"svc{os.getpid()}."
    topics = Topics(prefix)
    robots = _Robots()
    web_port = _free_port()
    svc = ServiceProcess(bootstrap=sasl_broker.bootstrap, prefix=prefix, web_port=web_port,
                         control_secret=CONTROL_SECRET, extra_env={
                             **sasl_broker.env(),
                             "TRAINSENTRY_DINGTALK_URL": robots.dingtalk.url,
                             "TRAINSENTRY_DINGTALK_SECRET": DT_SECRET,
                             "TRAINSENTRY_WECOM_URL": robots.wecom.url})
    result = ServedRun(run_id="sec/grpo-nan")
    try:
        svc.start()
        svc.wait_ready(timeout=120)
        events = generate(Scenario(run_id=result.run_id, steps=45, fault="nan_loss",
                                   fault_onset=35, ranks=1, save_freq=1000, seed=5,
                                   start_ts=time.time() - 3000))
        with MetricsProducer(run_id=result.run_id, bootstrap=sasl_broker.options(),
                             topic_prefix=prefix) as producer:
            publish_scenario(producer, events)

        def chatted() -> bool:
            return all(any(result.run_id in m.text and "nan_loss" in m.text
                           for m in robot.messages)
                       for robot in (robots.dingtalk, robots.wecom))

        _until(chatted, 60, "the DingTalk and WeCom messages")
        result.alerts = [json.loads(r.value) for r in _records(sasl_broker, topics.alerts)]
        result.commands = [r.value for r in _records(sasl_broker, topics.control)]
        alert_id = urllib.request.quote(next((a["id"] for a in result.alerts), "none"), safe="")
        run = urllib.request.quote(result.run_id, safe="")
        for path in ("/healthz", "/readyz", "/metrics", "/api/runs", "/api/stats",
                     f"/api/runs/{run}/signals", f"/api/runs/{run}/signals?all=1",
                     f"/api/runs/{run}/timeline", f"/api/runs/{run}/history", "/api/history",
                     "/api/alerting", "/api/silences", f"/charts/{alert_id}.png", "/",
                     f"/runs/{run}", "/api/runs/no-such-run/signals", "/no-such-page"):
            result.http[path] = _get(web_port, path)
        result.chat = [json.dumps(m.payload, ensure_ascii=False)
                       for robot in (robots.dingtalk, robots.wecom) for m in robot.messages]
        result.signs = [s.query["sign"] for s in robots.dingtalk.requests if s.query.get("sign")]
    finally:
        try:
            if svc.proc is not None:
                result.stop_s = svc.stop()
        finally:
            svc.kill()
            robots.close()
            result.log = svc.log()
            shutil.rmtree(svc.workdir, ignore_errors=True)
    yield result


@pytest.mark.kafka
@pytest.mark.slow
def test_serve_over_sasl_ssl_diagnoses_a_faulty_run(served_run: ServedRun) -> None:
    """Over SASL_SSL the service consumes the run, publishes a nan_loss alert and a signed
    command, tells both robots, and still stops cleanly on SIGTERM."""
    assert any(a["run_id"] == served_run.run_id and a["diagnosis"] == "nan_loss"
               for a in served_run.alerts), served_run.log[-3000:]
    assert served_run.commands, "the breaker published a control command"
    assert served_run.stop_s < 15
    assert b'"ready":true' in served_run.http["/readyz"]


@pytest.mark.kafka
@pytest.mark.slow
def test_no_secret_in_the_service_log(served_run: ServedRun) -> None:
    """The service's whole stdout/stderr holds none of the secrets (nor a DingTalk sign)."""
    assert served_run.signs, "the DingTalk robot saw signed requests"
    assert "kafka_sasl_password': '<set>'" in served_run.log
    assert not _leaks(served_run.log, tuple(served_run.signs))


@pytest.mark.kafka
@pytest.mark.slow
def test_no_secret_in_any_http_endpoint(served_run: ServedRun) -> None:
    """/healthz, /readyz, /metrics, every /api view, the chart, the dashboard and error pages
    show no secret."""
    assert len(served_run.http[f"/runs/{urllib.request.quote(served_run.run_id, safe='')}"]) > 0
    for path, body in served_run.http.items():
        assert not _leaks(body, tuple(served_run.signs)), path


@pytest.mark.kafka
@pytest.mark.slow
def test_no_secret_in_alert_records_commands_or_chat_messages(served_run: ServedRun) -> None:
    """The alerts and control topics and every chat message hold no secret."""
    assert served_run.chat
    blobs = [json.dumps(a) for a in served_run.alerts] + served_run.commands + served_run.chat
    for blob in blobs:
        assert not _leaks(blob, tuple(served_run.signs))


def test_the_leak_check_finds_a_secret_and_its_prefix() -> None:
    """Guards the leak checks above: a whole secret or its first 12 characters is found."""
    assert _leaks(f"x{PASSWORD}y") and _leaks(f"token={DT_TOKEN[:12]}")
    assert not _leaks("access_token=***&sign=***")
