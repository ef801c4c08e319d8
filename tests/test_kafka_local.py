"""The local Kafka broker (trainsentry.kafka_local) and topic creation (trainsentry.topics).

Tests marked ``kafka`` share ONE broker that this module starts itself, on a free port
and in a data dir that does not exist yet, and stop at the end: a start costs seconds on
a 2-core machine. The last test stops it and checks the pid is gone.
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainsentry import kafka_local
from trainsentry.config import Topics
from trainsentry.errors import ConfigError, KafkaSetupError
from trainsentry.topics import add_cli as add_topics_cli
from trainsentry.topics import create_topics, wait_for_broker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- no broker


def test_broker_properties_bind_only_loopback() -> None:
    """Every listener is on 127.0.0.1, clients are told 127.0.0.1:port."""
    props = kafka_local.broker_properties(port=19092, controller_port=19093, data_dir="/d")
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["process.roles"] == "broker,controller"
    assert props["log.dirs"] == str(Path("/d") / "data")


def test_broker_properties_use_single_node_replication() -> None:
    """Internal topics need one replica, or a one-node broker cannot host consumer groups."""
    props = kafka_local.broker_properties(port=1, controller_port=2, data_dir="/d")
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "transaction.state.log.min.isr", "min.insync.replicas",
                "share.coordinator.state.topic.replication.factor"):
        assert props[key] == "1", key
    assert props["auto.create.topics.enable"] == "true"
    assert props["group.initial.rebalance.delay.ms"] == "0"


def test_broker_properties_for_kafka3_leave_out_kafka4_settings() -> None:
    """Kafka 3.x has no share groups, so their settings are not written for it."""
    props = kafka_local.broker_properties(port=1, controller_port=2, data_dir="/d",
                                          version="3.9.1")
    assert not any(k.startswith("share.") for k in props)


def test_render_properties_round_trips_and_escapes_backslashes() -> None:
    """Java reads backslashes as escapes, so they are doubled; keys and values survive."""
    text = kafka_local.render_properties({"a.b": "1", "log.dirs": "C:\\x"})
    assert "a.b=1\n" in text
    assert "log.dirs=C:\\\\x\n" in text
    assert text.startswith("#")


def test_cluster_id_is_a_kafka_uuid() -> None:
    """The id is base64url of 16 bytes, 22 chars, never starting with '-'."""
    for _ in range(200):
        cid = kafka_local._cluster_id()
        assert len(cid) == 22 and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_bad_version_is_a_setup_error() -> None:
    """A version that is not x.y.z is refused with a hint before anything runs."""
    with pytest.raises(KafkaSetupError, match="--version"):
        kafka_local.broker_properties(port=1, controller_port=2, data_dir="/d", version="latest")


def test_fetch_jars_skips_maven_when_marker_exists(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished cache is used as is, even with no mvn on PATH."""
    (tmp_path / "9.9.9" / "libs").mkdir(parents=True)
    (tmp_path / "9.9.9" / ".complete").write_text("done")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert kafka_local.fetch_jars(version="9.9.9", cache_dir=tmp_path) == (
        tmp_path / "9.9.9" / "libs").resolve()


def test_fetch_jars_without_mvn_says_how_to_fix(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No Maven on PATH gives an error that names the package to install."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KafkaSetupError, match="apt-get install maven"):
        kafka_local.fetch_jars(version="9.9.9", cache_dir=tmp_path)


def test_stop_without_pid_file_returns_false(tmp_path: Path) -> None:
    """Stopping a broker that never ran is not an error."""
    assert kafka_local.stop(port=_free_port(), data_dir=tmp_path / "nothing") is False


def test_stale_pid_file_never_kills_an_unrelated_process(tmp_path: Path) -> None:
    """A pid file naming a live non-Kafka process (here: ourselves) is ignored and removed."""
    (tmp_path / "kafka.pid").write_text(str(os.getpid()))
    assert kafka_local.is_running(port=1, data_dir=tmp_path) is False
    assert kafka_local.stop(port=1, data_dir=tmp_path) is False
    assert not (tmp_path / "kafka.pid").exists()


def test_start_refuses_a_port_held_by_another_process(tmp_path: Path) -> None:
    """A foreign listener on the port is reported, not mistaken for our broker."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(KafkaSetupError, match="already in use"):
            kafka_local.start(port=port, data_dir=tmp_path / "d", timeout=5)


def test_cli_adds_kafka_and_topics_commands() -> None:
    """add_cli wires `kafka start|stop|status` and `topics create` to handlers."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    kafka_local.add_cli(sub)
    add_topics_cli(sub)
    args = parser.parse_args(["kafka", "start", "--port", "19999", "--data-dir", "/x",
                              "--version", "3.9.1"])
    assert (args.port, args.data_dir, args.kafka_version) == (19999, "/x", "3.9.1")
    assert callable(args.func)
    assert callable(parser.parse_args(["kafka", "stop"]).func)
    assert callable(parser.parse_args(["kafka", "status"]).func)
    args = parser.parse_args(["topics", "create", "--partitions", "6"])
    assert args.partitions == 6 and callable(args.func)


def test_wait_for_broker_times_out_with_a_hint() -> None:
    """Nothing listening gives a KafkaSetupError that says how to start a broker."""
    with pytest.raises(KafkaSetupError, match="trainsentry kafka start"):
        wait_for_broker(f"127.0.0.1:{_free_port()}", timeout=1.0)


def test_create_topics_rejects_zero_partitions() -> None:
    """Invalid counts fail before any network I/O."""
    with pytest.raises(ConfigError, match="partitions"):
        create_topics(bootstrap="127.0.0.1:1", topics=Topics(), partitions=0)


# --------------------------------------------------------------------------- real broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One broker for the module, in a data dir that does not exist yet."""
    port = _free_port()
    data_dir = tmp_path_factory.mktemp("kafka") / "not-yet" / "data"
    assert not data_dir.exists()
    started = time.monotonic()
    address = kafka_local.start(port=port, data_dir=data_dir, timeout=180)
    info = {"address": address, "port": port, "data_dir": data_dir,
            "start_s": time.monotonic() - started}
    try:
        yield info
    finally:
        kafka_local.stop(port=port, data_dir=data_dir)


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."



def _partitions(address: str, names: list[str]) -> dict[str, int]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=address)
    try:
        out = {}
        for t in admin.describe_topics(names):
            out[t.get("name") or t.get("topic")] = len(t["partitions"])
        return out
    finally:
        admin.close()


def _wait_visible(admin: Any, names: list[str]) -> None:
    """New topics reach the broker's metadata a moment after CreateTopics returns (KRaft)."""
    deadline = time.monotonic() + 20
    while not set(names) <= set(admin.list_topics()):
        assert time.monotonic() < deadline, f"{names} never appeared"
        time.sleep(0.1)


@pytest.mark.kafka
@pytest.mark.slow
def test_start_returns_loopback_address_that_accepts_clients(broker: dict[str, Any]) -> None:
    """start returns 127.0.0.1:PORT once a metadata request succeeds."""
    assert broker["address"] == f"127.0.0.1:{broker['port']}"
    assert kafka_local._answers(broker["address"])
    assert kafka_local.is_running(port=broker["port"], data_dir=broker["data_dir"])
    assert (broker["data_dir"] / "kafka.log").stat().st_size > 0


@pytest.mark.kafka
@pytest.mark.slow
def test_status_names_the_broker_of_another_data_dir(broker: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """status on the right data dir says running; on another one it says not running (exit
    1) and that a broker answers on the port, started with another --data-dir."""
    from trainsentry.cli import main

    port = str(broker["port"])
    assert main(["kafka", "status", "--port", port, "--data-dir", str(broker["data_dir"])]) == 0
    assert capsys.readouterr().out.startswith(f"running 127.0.0.1:{port}")
    assert main(["kafka", "status", "--port", port, "--data-dir", str(tmp_path / "other")]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("not running") and "another --data-dir" in err


@pytest.mark.kafka
@pytest.mark.slow
def test_start_is_idempotent(broker: dict[str, Any]) -> None:
    """A second start finds the running broker: same address, same pid, no restart."""
    pid = (broker["data_dir"] / "kafka.pid").read_text()
    t0 = time.monotonic()
    again = kafka_local.start(port=broker["port"], data_dir=broker["data_dir"])
    assert again == broker["address"]
    assert (broker["data_dir"] / "kafka.pid").read_text() == pid
    assert time.monotonic() - t0 < 10


@pytest.mark.kafka
@pytest.mark.slow
def test_create_topics_creates_all_contract_topics(broker: dict[str, Any]) -> None:
    """Every contract topic is created with the requested partition count."""
    topics = Topics(_prefix())
    created = create_topics(bootstrap=broker["address"], topics=topics, partitions=3)
    assert sorted(created) == sorted(topics.all())
    assert set(_partitions(broker["address"], topics.all()).values()) == {3}


@pytest.mark.kafka
@pytest.mark.slow
def test_create_topics_is_idempotent(broker: dict[str, Any]) -> None:
    """A second call creates nothing and does not fail."""
    topics = Topics(_prefix())
    create_topics(bootstrap=broker["address"], topics=topics, partitions=2)
    assert create_topics(bootstrap=broker["address"], topics=topics, partitions=2) == []


@pytest.mark.kafka
@pytest.mark.slow
def test_missing_metrics_topic_follows_existing_partition_count(broker: dict[str, Any]) -> None:
    """Co-partitioning: a missing metrics topic copies the existing ones' count."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    topics = Topics(_prefix())
    admin = KafkaAdminClient(bootstrap_servers=broker["address"])
    admin.create_topics([NewTopic(topics.data, 5, 1)])
    _wait_visible(admin, [topics.data])
    admin.close()
    create_topics(bootstrap=broker["address"], topics=topics, partitions=2)
    counts = _partitions(broker["address"], topics.all())
    assert counts[topics.compute] == counts[topics.resource] == 5
    assert counts[topics.alerts] == 2


@pytest.mark.kafka
@pytest.mark.slow
def test_mismatched_metrics_partitions_raise_config_error(broker: dict[str, Any]) -> None:
    """Existing metrics topics with different counts are refused with an explanation."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    topics = Topics(_prefix())
    admin = KafkaAdminClient(bootstrap_servers=broker["address"])
    admin.create_topics([NewTopic(topics.data, 2, 1), NewTopic(topics.compute, 3, 1)])
    _wait_visible(admin, [topics.data, topics.compute])
    admin.close()
    with pytest.raises(ConfigError, match="co-partitioning"):
        create_topics(bootstrap=broker["address"], topics=topics, partitions=2)


@pytest.mark.kafka
@pytest.mark.slow
def test_replication_above_broker_count_is_a_config_error(broker: dict[str, Any]) -> None:
    """Asking for 3 replicas on one node says to use replication 1."""
    with pytest.raises((ConfigError, KafkaSetupError), match="replication"):
        create_topics(bootstrap=broker["address"], topics=Topics(_prefix()), replication=3,
                      timeout=10)


@pytest.mark.kafka
@pytest.mark.slow
def test_kafka_python_produces_consumes_and_commits(broker: dict[str, Any]) -> None:
    """kafka-python: produce, consume in a group, commit, read the committed offsets back."""
    from kafka import KafkaConsumer, KafkaProducer

    topic, group = f"{_prefix()}kp", f"g-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=broker["address"])
    for i in range(10):
        producer.send(topic, key=b"run", value=b"%d" % i)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(topic, bootstrap_servers=broker["address"], group_id=group,
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=20000)
    values = []
    for message in consumer:
        values.append(message.value)
        if len(values) == 10:
            break
    consumer.commit()
    committed = sum(consumer.committed(tp) or 0 for tp in consumer.assignment())
    consumer.close()
    assert values == [b"%d" % i for i in range(10)]
    assert committed == 10


@pytest.mark.kafka
@pytest.mark.slow
async def test_aiokafka_produces_consumes_and_commits(broker: dict[str, Any]) -> None:
    """aiokafka (faust's transport): produce, consume in a group, commit."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic, group = f"{_prefix()}aio", f"g-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=broker["address"])
    await producer.start()
    for i in range(5):
        await producer.send_and_wait(topic, b"%d" % i, key=b"run")
    await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker["address"], group_id=group,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        got = []
        async with asyncio.timeout(30):
            async for message in consumer:
                got.append(message.value)
                if len(got) == 5:
                    break
        await consumer.commit()
        assert await consumer.committed(TopicPartition(topic, 0)) == 5
    finally:
        await consumer.stop()


_FAUST_APP = """
import os
import faust

tag = os.environ["FTAG"]
app = faust.App(f"fa-{tag}", broker="kafka://" + os.environ["FB"], store="memory://",
                web_enabled=False, topic_partitions=2, topic_replication_factor=1,
                datadir=os.environ["FDATA"])
source = app.topic(f"ft-{tag}", value_serializer="raw", partitions=2)
counts = app.Table(f"counts-{tag}", default=int, partitions=2)
expect = int(os.environ["FEXPECT"])

@app.agent(source)
async def count(stream):
    async for event in stream.events():
        counts[event.key.decode()] += 1

@app.task
async def produce():
    for i in range(6):
        await source.send(key=b"k%d" % (i % 2), value=b"v%d" % i)

@app.timer(0.5)
async def check():
    if counts["k0"] + counts["k1"] >= expect:
        print("FAUST_OK", dict(counts.items()), flush=True)
        await app.stop()  # leaves the group, so the next worker need not wait out our session
        os._exit(0)

if __name__ == "__main__":
    app.main()
"""


@pytest.mark.kafka
@pytest.mark.slow
def test_faust_table_with_changelog_survives_restart(broker: dict[str, Any],
                                                     tmp_path: Path) -> None:
    """faust-streaming: an agent fills a Table; a restarted worker restores it from the changelog."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    tag = uuid.uuid4().hex[:8]
    admin = KafkaAdminClient(bootstrap_servers=broker["address"])
    admin.create_topics([NewTopic(f"ft-{tag}", 2, 1)])  # as `serve` does: topics exist first
    admin.close()
    app = tmp_path / "faustapp.py"
    app.write_text(textwrap.dedent(_FAUST_APP))
    for expect in (6, 12):  # the second run only reaches 12 if it restored the first's 6
        env = {**os.environ, "FB": broker["address"], "FTAG": tag, "FEXPECT": str(expect),
               "FDATA": str(tmp_path / f"data-{expect}")}
        done = subprocess.run([sys.executable, str(app), "worker", "-l", "warn",
                               "--without-web"], capture_output=True, text=True, timeout=150,
                              env=env, cwd=tmp_path)
        assert "FAUST_OK" in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


@pytest.mark.kafka
@pytest.mark.slow
def test_stop_stops_the_broker_and_removes_the_pid_file(broker: dict[str, Any]) -> None:
    """stop (last test here) ends the process; a second stop finds nothing to do."""
    pid = int((broker["data_dir"] / "kafka.pid").read_text())
    assert kafka_local.stop(port=broker["port"], data_dir=broker["data_dir"]) is True
    assert not (broker["data_dir"] / "kafka.pid").exists()
    assert not kafka_local._alive(pid)
    assert not kafka_local.is_running(port=broker["port"], data_dir=broker["data_dir"])
    assert kafka_local.stop(port=broker["port"], data_dir=broker["data_dir"]) is False


@pytest.mark.kafka
def test_serve_with_a_replication_factor_above_the_brokers_says_what_to_fix(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """TRAINSENTRY_REPLICATION_FACTOR reaches topic creation: 2 on the single-node broker
    stops `trainsentry serve` at start with exit 2 and the variable to fix."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TRAINSENTRY_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "TRAINSENTRY_TOPIC_PREFIX": topic_prefix, "TRAINSENTRY_WEB_PORT": str(port),
           "TRAINSENTRY_REPLICATION_FACTOR": "2", "TRAINSENTRY_APP_ID": f"rf-{topic_prefix}"}
    done = subprocess.run([sys.executable, "-m", "trainsentry.cli", "serve"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "TRAINSENTRY_REPLICATION_FACTOR" in done.stderr and "replication factor 2" in done.stderr
