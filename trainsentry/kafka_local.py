"""A local single-node Apache Kafka broker (KRaft, no ZooKeeper) for development and CI.

Why this exists: trainsentry's tests and `.ci/run` need a real broker on a fresh machine
that has only a JDK and Maven, no Docker and no Kafka download site. Maven Central is
reachable, so :func:`fetch_jars` resolves the broker's jars from there into a cache
outside the repository, and :func:`start` runs one combined broker+controller on
127.0.0.1. See docs/kafka.md for versions, file locations and troubleshooting.

Layout (defaults; every path can be passed in):

- jars: ``~/.cache/trainsentry/kafka/<version>/libs`` (the CLI honours ``TRAINSENTRY_KAFKA_HOME``
  in place of ``~/.cache/trainsentry/kafka``)
- data dir: ``~/.cache/trainsentry/kafka-data-<port>`` holding ``server.properties``,
  ``kafka.log`` (the broker's stdout/stderr), ``kafka.pid`` and ``data/`` (the log dirs).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path

from trainsentry.errors import KafkaSetupError

__all__ = [
    "DEFAULT_VERSION",
    "DEFAULT_PORT",
    "add_cli",
    "broker_properties",
    "default_cache_dir",
    "default_data_dir",
    "fetch_jars",
    "is_running",
    "render_properties",
    "start",
    "stop",
]

logger = logging.getLogger(__name__)

#: Newest Apache Kafka release on Maven Central when this was written; kafka-python 3.0.12,
#: aiokafka 0.14.0 and faust-streaming 0.15.3 were checked against it (docs/kafka.md).
DEFAULT_VERSION = "4.4.0"
DEFAULT_PORT = 9092
HOST = "127.0.0.1"

_MARKER = ".complete"
_PID_FILE = "kafka.pid"
_LOG_FILE = "kafka.log"
_PROPS_FILE = "server.properties"
_LOG_TAIL_LINES = 40


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """Where jars are cached: outside the repository, so a checkout stays small and clean."""
    return Path.home() / ".cache" / "trainsentry" / "kafka"


def default_data_dir(port: int) -> Path:
    """One data dir per port, so two brokers on one machine never share state."""
    return Path.home() / ".cache" / "trainsentry" / f"kafka-data-{port}"


def _data_dir(data_dir: str | Path | None, port: int) -> Path:
    return (Path(data_dir) if data_dir else default_data_dir(port)).expanduser().resolve()


def _major(version: str) -> int:
    match = re.match(r"(\d+)\.", version)
    if not match:
        raise KafkaSetupError(f"Kafka version {version!r} is not like 4.4.0; fix --version")
    return int(match.group(1))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive file lock, so concurrent CI steps or test workers don't race on one dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- tools


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise KafkaSetupError(
            "java not found on PATH: the local Kafka broker needs a JDK/JRE 17 or newer "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless)"
        )
    return java


def _java_major(java: str) -> int:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KafkaSetupError(f"could not run `{java} -version`: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise KafkaSetupError(f"could not read the Java version from `{java} -version`")
    first = int(match.group(1))
    # Java 8 and older report "1.8.0_…".
    return int(match.group(2) or 0) if first == 1 else first


def _check_java(version: str) -> str:
    java = _java()
    need = 17 if _major(version) >= 4 else 11
    have = _java_major(java)
    if have < need:
        raise KafkaSetupError(
            f"Kafka {version} needs Java {need}+, but {java} is Java {have}; install a newer "
            f"JDK (apt-get install openjdk-17-jre-headless) and put it first on PATH"
        )
    return java


# --------------------------------------------------------------------------- fetch


def fetch_jars(*, version: str = DEFAULT_VERSION, cache_dir: str | Path | None = None,
               timeout: float = 900.0) -> Path:
    """Download the broker's jars with Maven once; return the folder that holds them.

    Maven resolves ``org.apache.kafka:kafka_2.13:<version>``, its runtime dependencies
    and the logging backend its pom leaves out (log4j2 for Kafka 4, reload4j for Kafka 3)
    through the small pom shipped in ``trainsentry/kafka/pom.xml``. A marker file makes
    later calls free; a half-finished download is never mistaken for a finished one
    because the jars land in a temporary folder that is renamed at the end.
    """
    root = (Path(cache_dir) if cache_dir else default_cache_dir()).expanduser().resolve()
    home = root / version
    libs = home / "libs"
    if (home / _MARKER).is_file() and libs.is_dir():
        return libs
    _major(version)
    with _locked(home / ".lock"):
        if (home / _MARKER).is_file() and libs.is_dir():  # another process finished it
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaSetupError(
                "mvn not found on PATH: the broker's jars are fetched from Maven Central with "
                "Maven (Debian/Ubuntu: apt-get install maven), or put the jars of "
                f"kafka_2.13:{version} in {libs} and create {home / _MARKER}"
            )
        _java()  # Maven itself needs it; say so before Maven does, more obscurely
        staging = Path(tempfile.mkdtemp(prefix="libs.", dir=home))
        started = time.monotonic()
        logger.info("fetching Apache Kafka %s jars from Maven Central into %s", version, libs)
        cmd = [mvn, "-q", "-B", "-f", "POM", "dependency:copy-dependencies",
               f"-Dkafka.version={version}", f"-DoutputDirectory={staging}",
               "-DincludeScope=runtime"]
        if _major(version) < 4:
            cmd.append("-Dkafka.logging=reload4j")
        try:
            with resources.as_file(resources.files("trainsentry") / "kafka" / "pom.xml") as pom:
                cmd[cmd.index("POM")] = str(pom)
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                      cwd=home)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaSetupError(
                f"Maven did not finish fetching Kafka {version} within {timeout:.0f}s; check "
                "that Maven Central (or your ~/.m2/settings.xml mirror) is reachable"
            ) from exc
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
            raise KafkaSetupError(
                f"Maven could not fetch org.apache.kafka:kafka_2.13:{version} (exit "
                f"{done.returncode}). Check the version exists on Maven Central and that "
                f"Maven can reach it (proxy: ~/.m2/settings.xml).\n{tail}"
            )
        if not any(staging.glob(f"kafka_2.13-{version}.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaSetupError(f"Maven ran but kafka_2.13-{version}.jar is missing from its output")
        if libs.exists():
            shutil.rmtree(libs)
        staging.rename(libs)
        (home / _MARKER).write_text(f"kafka_2.13 {version}\n", encoding="utf-8")
        logger.info("fetched Kafka %s jars in %.1fs", version, time.monotonic() - started)
    return libs


# --------------------------------------------------------------------------- config


def broker_properties(*, port: int, controller_port: int, data_dir: str | Path,
                      version: str = DEFAULT_VERSION, node_id: int = 1) -> dict[str, str]:
    """The server.properties of one combined broker+controller bound to 127.0.0.1 only.

    Replication factors and min ISR are 1 because there is one node; the initial rebalance
    delay is 0 so consumer groups (and Faust workers) start at once in tests; a static
    one-voter quorum works the same way on Kafka 3.x and 4.x.
    """
    data = Path(data_dir)
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": f"{node_id}@{HOST}:{controller_port}",
        "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data / "data"),
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        # 50 by default; 10 makes the first consumer group start faster on 2 cores.
        "offsets.topic.num.partitions": "10",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "auto.create.topics.enable": "true",
        "group.initial.rebalance.delay.ms": "0",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "log.retention.hours": "168",
    }
    if _major(version) >= 4:
        # Kafka 4 adds share groups, whose state topic would otherwise want 3 replicas.
        props["share.coordinator.state.topic.replication.factor"] = "1"
        props["share.coordinator.state.topic.min.isr"] = "1"
    return props


def render_properties(props: Mapping[str, str]) -> str:
    """Java properties text; backslashes are escaped because Java reads them as escapes."""
    lines = ["# Written by trainsentry.kafka_local; rewritten on every start."]
    for key, value in props.items():
        lines.append(f"{key}={value.replace(chr(92), chr(92) * 2)}")
    return "\n".join(lines) + "\n"


def _read_properties(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key.strip()] = value.strip()
    return out


_LOG4J2 = """\
# log4j2 for the trainsentry local broker: everything to stdout, which start() sends to kafka.log.
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.stdout.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""

_LOG4J1 = """\
# log4j (reload4j) for the trainsentry local broker: everything to stdout (kafka.log).
log4j.rootLogger={level}, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
"""


def _log_config(data: Path, version: str, *, level: str) -> list[str]:
    """Write the logging config for the version's backend; return the JVM flag that loads it."""
    if _major(version) >= 4:
        path = data / f"log4j2-{level.lower()}.properties"
        path.write_text(_LOG4J2.format(level=level), encoding="utf-8")
        return [f"-Dlog4j2.configurationFile={path}"]
    path = data / f"log4j-{level.lower()}.properties"
    path.write_text(_LOG4J1.format(level=level), encoding="utf-8")
    return [f"-Dlog4j.configuration=file:{path}"]


def _cluster_id() -> str:
    """A Kafka Uuid string (base64url of 16 bytes); Kafka refuses ids that start with '-'."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode("ascii")
        if not text.startswith("-"):
            return text


# --------------------------------------------------------------------------- processes


def _read_pid(data: Path) -> int | None:
    try:
        return int((data / _PID_FILE).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def _is_our_broker(pid: int, data: Path) -> bool:
    """True if pid is alive and is the java we launched for this data dir (pids get reused)."""
    if not _alive(pid):
        return False
    cmdline_file = Path(f"/proc/{pid}/cmdline")
    if not cmdline_file.parent.is_dir():
        return True  # no /proc (macOS): a live pid from our pid file is the best we know
    try:
        cmdline = cmdline_file.read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "kafka.Kafka" in cmdline and str(data / _PROPS_FILE) in cmdline


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _answers(address: str, *, timeout: float = 5.0) -> bool:
    """True if a broker at address answers a cluster-metadata request with a live broker."""
    host, _, port = address.rpartition(":")
    if not _port_in_use(int(port)):
        return False
    from kafka import KafkaAdminClient  # imported late: the CLI should start fast
    from kafka.errors import KafkaError

    ms = int(timeout * 1000)
    try:
        admin = KafkaAdminClient(bootstrap_servers=address, client_id="trainsentry-kafka-local",
                                 request_timeout_ms=ms, bootstrap_timeout_ms=ms)
    except (KafkaError, OSError):
        return False
    try:
        brokers = admin.describe_cluster().get("brokers") or []
        return any(not b.get("is_fenced", False) for b in brokers)
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def _log_tail(data: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = (data / _LOG_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no kafka.log)"
    return "\n".join(text.splitlines()[-lines:])


def is_running(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None) -> bool:
    """Whether the broker we started for this data dir is alive (no network round trip)."""
    data = _data_dir(data_dir, port)
    pid = _read_pid(data)
    return pid is not None and _is_our_broker(pid, data)


def start(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
          version: str = DEFAULT_VERSION, cache_dir: str | Path | None = None,
          timeout: float = 90.0, heap: str = "512m") -> str:
    """Start (or find running) the local broker; return ``"127.0.0.1:<port>"`` once it serves.

    Idempotent: if the broker we started for this data dir is up and answers, its address
    comes back at once. A data dir that does not exist yet is created and formatted; an
    existing one keeps its topics and offsets across restarts.
    """
    address = f"{HOST}:{port}"
    data = _data_dir(data_dir, port)
    data.mkdir(parents=True, exist_ok=True)
    with _locked(data / ".lock"):
        pid = _read_pid(data)
        if pid is not None and _is_our_broker(pid, data):
            _wait_until_serving(address, data, pid=pid, proc=None, timeout=timeout)
            return address
        (data / _PID_FILE).unlink(missing_ok=True)
        if _port_in_use(port):
            raise KafkaSetupError(
                f"port {port} on {HOST} is already in use by a process trainsentry did not start "
                f"for {data}; stop it, or choose another port with --port"
            )
        java = _check_java(version)
        libs = fetch_jars(version=version, cache_dir=cache_dir)
        props_path = data / _PROPS_FILE
        controller_port = _controller_port(props_path, port)
        props = broker_properties(port=port, controller_port=controller_port, data_dir=data,
                                  version=version)
        props_path.write_text(render_properties(props), encoding="utf-8")
        classpath = f"{libs}{os.sep}*"
        _format_storage(java, classpath, data, props_path, version)

        log = data / _LOG_FILE
        if log.exists():
            log.replace(data / f"{_LOG_FILE}.1")  # keep the previous run for troubleshooting
        cmd = [java, f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
               "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
               *_log_config(data, version, level="INFO"),
               "-cp", classpath, "kafka.Kafka", str(props_path)]
        started = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=data,
                                    start_new_session=True, close_fds=True)
        (data / _PID_FILE).write_text(f"{proc.pid}\n", encoding="utf-8")
        _wait_until_serving(address, data, pid=proc.pid, proc=proc, timeout=timeout)
        logger.info("Kafka %s serving on %s (pid %d) after %.1fs", version, address, proc.pid,
                    time.monotonic() - started)
        return address


def _controller_port(props_path: Path, port: int) -> int:
    """Reuse the previous controller port when it is free, so a restarted node finds its quorum."""
    voters = _read_properties(props_path).get("controller.quorum.voters", "")
    match = re.search(r":(\d+)$", voters)
    if match:
        previous = int(match.group(1))
        if previous != port and not _port_in_use(previous):
            return previous
    while True:
        candidate = _free_port()
        if candidate != port:
            return candidate


def _format_storage(java: str, classpath: str, data: Path, props_path: Path,
                    version: str) -> None:
    """Format the KRaft log dir once; --ignore-formatted keeps an existing cluster's data."""
    meta = _read_properties(data / "data" / "meta.properties")
    cluster_id = meta.get("cluster.id") or _cluster_id()
    cmd = [java, "-Xmx256m", *_log_config(data, version, level="WARN"), "-cp", classpath,
           "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
           "--config", str(props_path), "--ignore-formatted"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=data)
    except subprocess.TimeoutExpired as exc:
        raise KafkaSetupError("formatting the KRaft storage took over 120s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise KafkaSetupError(
            f"formatting KRaft storage in {data / 'data'} failed (exit {done.returncode}); if the "
            f"data dir is from another Kafka version or cluster, delete it and retry.\n{tail}"
        )


def _wait_until_serving(address: str, data: Path, *, pid: int,
                        proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        exited = proc.poll() is not None if proc is not None else not _is_our_broker(pid, data)
        if exited:
            (data / _PID_FILE).unlink(missing_ok=True)
            code = f" with exit code {proc.returncode}" if proc is not None else ""
            raise KafkaSetupError(
                f"the Kafka broker for {data} exited{code} before serving on {address}; "
                f"last lines of {data / _LOG_FILE}:\n{_log_tail(data)}"
            )
        if _answers(address, timeout=3.0):
            return
        if time.monotonic() > deadline:
            if proc is not None:  # ours and useless: don't leave it running
                _terminate(pid, timeout=10.0)
                (data / _PID_FILE).unlink(missing_ok=True)
            raise KafkaSetupError(
                f"the Kafka broker did not accept clients on {address} within {timeout:.0f}s "
                f"(a slow machine may need a longer --timeout); last lines of "
                f"{data / _LOG_FILE}:\n{_log_tail(data)}"
            )
        time.sleep(0.3)


def _terminate(pid: int, *, timeout: float) -> None:
    """SIGTERM (Kafka shuts down cleanly on it), then SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    logger.warning("Kafka broker pid %d ignored SIGTERM for %.0fs; sending SIGKILL", pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.is_dir():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
         timeout: float = 30.0) -> bool:
    """Stop the broker started for this data dir; return whether one was running.

    Only the pid in the data dir's pid file is signalled, and only if that pid still is our
    java process, so a stale pid file can never kill an unrelated process.
    """
    data = _data_dir(data_dir, port)
    pid = _read_pid(data)
    if pid is None:
        return False
    with _locked(data / ".lock"):
        running = _is_our_broker(pid, data)
        if running:
            _terminate(pid, timeout=timeout)
        (data / _PID_FILE).unlink(missing_ok=True)
    return running


# --------------------------------------------------------------------------- CLI


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``trainsentry kafka start|stop|status``; each sub-parser sets ``func`` to its handler."""
    kafka = subparsers.add_parser("kafka", help="run a local single-node Kafka broker",
                                  description="Start/stop a local single-node Apache Kafka "
                                  "broker on 127.0.0.1 (docs/kafka.md).")
    sub = kafka.add_subparsers(dest="kafka_command", metavar="{start,stop,status}", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--port", type=int, default=DEFAULT_PORT, help="client port (9092)")
        p.add_argument("--data-dir", default=None,
                       help="broker state, log and pid file (~/.cache/trainsentry/kafka-data-PORT)")

    p_start = sub.add_parser("start", help="start the broker (idempotent); prints its address")
    common(p_start)
    p_start.add_argument("--version", dest="kafka_version", default=DEFAULT_VERSION,
                         help=f"Apache Kafka version from Maven Central ({DEFAULT_VERSION})")
    p_start.add_argument("--timeout", type=float, default=90.0,
                         help="seconds to wait for the broker to accept clients (90)")
    p_start.set_defaults(func=_cmd_start)

    p_stop = sub.add_parser("stop", help="stop the broker started for that port/data dir")
    common(p_stop)
    p_stop.add_argument("--timeout", type=float, default=30.0,
                        help="seconds before SIGTERM becomes SIGKILL (30)")
    p_stop.set_defaults(func=_cmd_stop)

    p_status = sub.add_parser("status", help="say whether the broker runs and answers")
    common(p_status)
    p_status.set_defaults(func=_cmd_status)


def _cache_dir_from_env(env: Mapping[str, str] | None = None) -> Path | None:
    """The entry point's reading of TRAINSENTRY_KAFKA_HOME (libraries never read the env)."""
    env = os.environ if env is None else env
    value = env.get("TRAINSENTRY_KAFKA_HOME", "")
    return Path(value) if value else None


def _cmd_start(args: argparse.Namespace) -> int:
    # KafkaSetupError propagates: the CLI's main prints it to stderr and exits non-zero.
    address = start(port=args.port, data_dir=args.data_dir, version=args.kafka_version,
                    cache_dir=_cache_dir_from_env(), timeout=args.timeout)
    print(address)  # the contract: exactly the bootstrap address on stdout
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    stopped = stop(port=args.port, data_dir=args.data_dir, timeout=args.timeout)
    _complain(f"kafka stop: {'stopped' if stopped else 'no broker was running'} "
              f"({_data_dir(args.data_dir, args.port)})")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    data = _data_dir(args.data_dir, args.port)
    address = f"{HOST}:{args.port}"
    if not is_running(port=args.port, data_dir=data):
        print(f"not running ({data})")
        return 1
    serving = _answers(address)
    print(f"{'running' if serving else 'starting or unhealthy'} {address} pid {_read_pid(data)} "
          f"({data})")
    return 0 if serving else 1


def _complain(message: str) -> None:
    """CLI diagnostics go to stderr so stdout stays machine-readable."""
    print(message, file=sys.stderr)
