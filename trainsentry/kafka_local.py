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
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from trainsentry.config import Secret
from trainsentry.errors import KafkaSetupError

__all__ = [
    "DEFAULT_VERSION",
    "DEFAULT_PORT",
    "SCRAM_MECHANISMS",
    "LocalSecurity",
    "add_cli",
    "broker_properties",
    "ca_file",
    "client_env",
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
_TLS_DIR = "tls"
_INTERNAL = "INTERNAL"
#: Both SCRAM mechanisms are enabled on a SASL listener and the user gets credentials for each.
SCRAM_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
_PASSWORD_VAR = "TRAINSENTRY_KAFKA_SASL_PASSWORD"


@dataclass(frozen=True)
class LocalSecurity:
    """How the client listener of the local broker is secured (default: PLAINTEXT).

    ``tls``: TLS with a certificate for 127.0.0.1 signed by a CA made for this data dir
    (:func:`ca_file`). ``scram_user``/``scram_password``: a SASL/SCRAM login (both
    SCRAM-SHA-512 and SCRAM-SHA-256). Together they make a SASL_SSL listener.
    """

    tls: bool = False
    scram_user: str = ""
    scram_password: Secret = field(default_factory=lambda: Secret(""))

    @property
    def protocol(self) -> str:
        sasl = bool(self.scram_user)
        return {(False, False): "PLAINTEXT", (False, True): "SSL",
                (True, False): "SASL_PLAINTEXT", (True, True): "SASL_SSL"}[(sasl, self.tls)]

    def check(self) -> None:
        if self.scram_user and not self.scram_password:
            raise KafkaSetupError(f"a SCRAM user needs a password; set {_PASSWORD_VAR}")
        if self.scram_password and not self.scram_user:
            raise KafkaSetupError("a SCRAM password was given without a user name (--sasl-scram USER)")
        if any(c in self.scram_user for c in "=,") or not self.scram_user.isprintable():
            raise KafkaSetupError("the SCRAM user name must be printable and hold no '=' or ','")


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
                      version: str = DEFAULT_VERSION, node_id: int = 1,
                      protocol: str = "PLAINTEXT", internal_port: int | None = None,
                      keystore: str | Path | None = None,
                      keystore_password: str = "") -> dict[str, str]:
    """The server.properties of one combined broker+controller bound to 127.0.0.1 only.

    Replication factors and min ISR are 1 because there is one node; the initial rebalance
    delay is 0 so consumer groups (and Faust workers) start at once in tests; a static
    one-voter quorum works the same way on Kafka 3.x and 4.x.

    With a ``protocol`` other than PLAINTEXT the client port gets that listener (SCRAM for
    the SASL ones, the PKCS12 ``keystore`` for the TLS ones), and a PLAINTEXT ``INTERNAL``
    listener on ``internal_port`` (127.0.0.1 only) carries inter-broker traffic, readiness
    probes and the SCRAM user set-up, so the broker needs no credentials of its own.
    """
    data = Path(data_dir)
    if protocol == "PLAINTEXT":
        listeners = {"PLAINTEXT": port}
        inter_broker = "PLAINTEXT"
    else:
        if internal_port is None:
            raise KafkaSetupError(f"a {protocol} listener needs an internal_port")
        if "SSL" in protocol and (keystore is None or not keystore_password):
            raise KafkaSetupError(f"a {protocol} listener needs a keystore and its password")
        listeners = {protocol: port, _INTERNAL: internal_port}
        inter_broker = _INTERNAL
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": f"{node_id}@{HOST}:{controller_port}",
        "listeners": ",".join([*(f"{n}://{HOST}:{p}" for n, p in listeners.items()),
                               f"CONTROLLER://{HOST}:{controller_port}"]),
        "advertised.listeners": ",".join(f"{n}://{HOST}:{p}" for n, p in listeners.items()),
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": inter_broker,
        "listener.security.protocol.map": ",".join(
            ["CONTROLLER:PLAINTEXT", *(f"{n}:{'PLAINTEXT' if n == _INTERNAL else n}"
                                       for n in listeners)]),
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
    if protocol.startswith("SASL"):
        # The server side of SCRAM needs a JAAS entry per mechanism, with no credentials:
        # users live in the cluster metadata (see _upsert_scram_user).
        props["sasl.enabled.mechanisms"] = ",".join(SCRAM_MECHANISMS)
        for mech in SCRAM_MECHANISMS:
            props[f"listener.name.{protocol.lower()}.{mech.lower()}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;")
    if "SSL" in protocol:
        props.update({
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(keystore),
            "ssl.keystore.password": keystore_password,
            "ssl.key.password": keystore_password,
            "ssl.client.auth": "none",
        })
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


# --------------------------------------------------------------------------- TLS


def ca_file(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None) -> Path:
    """The PEM CA certificate clients trust for a ``--tls`` broker (TRAINSENTRY_KAFKA_SSL_CAFILE)."""
    return _data_dir(data_dir, port) / _TLS_DIR / "ca.pem"


#: keytool runs seven times on the first --tls start; a small heap, the serial GC and the
#: C1 compiler only make each short-lived JVM start a little faster (12 s -> 10 s in all
#: on a busy 2-core machine).
_KEYTOOL_JVM = ("-J-Xmx64m", "-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1")


def _keytool(java: str) -> str:
    beside = Path(java).resolve().parent / "keytool"
    found = str(beside) if beside.is_file() else shutil.which("keytool")
    if found is None:
        raise KafkaSetupError("keytool not found next to java or on PATH: it comes with every "
                              "JDK/JRE 17 and makes the local broker's TLS certificate")
    return found


def _ensure_tls(java: str, data: Path) -> tuple[Path, str]:
    """A CA and a broker keystore for 127.0.0.1, made once per data dir with keytool.

    Kept across restarts so clients' CA file stays valid. Made in a temporary folder and
    renamed, so a half-made set is never used. Returns (keystore, keystore password).
    """
    tls = data / _TLS_DIR
    pw_file = tls / "keystore.password"
    if (tls / _MARKER).is_file():
        return tls / "broker.p12", pw_file.read_text(encoding="utf-8").strip()
    keytool = _keytool(java)
    staging = Path(tempfile.mkdtemp(prefix="tls.", dir=data))  # mode 0700
    password = secrets.token_hex(24)
    (staging / pw_file.name).write_text(password + "\n", encoding="utf-8")
    os.chmod(staging / pw_file.name, 0o600)
    # :file keeps the keystore password off every command line.
    store = ["-storetype", "PKCS12", "-storepass:file", str(staging / pw_file.name)]
    ca, broker = str(staging / "ca.p12"), str(staging / "broker.p12")
    steps = [
        ["-genkeypair", "-alias", "ca", "-keyalg", "RSA", "-keysize", "2048", "-validity",
         "3650", "-dname", "CN=trainsentry local Kafka CA", "-ext", "bc:c",
         "-ext", "KU=keyCertSign,cRLSign", "-keystore", ca, *store],
        ["-exportcert", "-rfc", "-alias", "ca", "-keystore", ca, *store,
         "-file", str(staging / "ca.pem")],
        ["-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048", "-validity",
         "3650", "-dname", f"CN={HOST}", "-keystore", broker, *store],
        ["-certreq", "-alias", "broker", "-keystore", broker, *store,
         "-file", str(staging / "broker.csr")],
        ["-gencert", "-rfc", "-alias", "ca", "-keystore", ca, *store, "-validity", "3650",
         "-infile", str(staging / "broker.csr"), "-outfile", str(staging / "broker.pem"),
         "-ext", f"SAN=ip:{HOST},dns:localhost", "-ext", "KU=digitalSignature,keyEncipherment",
         "-ext", "EKU=serverAuth"],
        ["-importcert", "-noprompt", "-alias", "ca", "-file", str(staging / "ca.pem"),
         "-keystore", broker, *store],
        ["-importcert", "-noprompt", "-alias", "broker", "-file", str(staging / "broker.pem"),
         "-keystore", broker, *store],
    ]
    for args in steps:
        try:
            done = subprocess.run([keytool, *_KEYTOOL_JVM, *args], capture_output=True, text=True,
                                  timeout=120, cwd=staging)
        except (OSError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaSetupError(f"keytool {args[0]} did not finish ({exc})") from exc
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaSetupError(f"keytool {args[0]} failed (exit {done.returncode}) making the "
                                  f"local broker's TLS certificate:\n{(done.stdout + done.stderr).strip()}")
    for name in ("ca.p12", "broker.csr"):  # the CA key is needed no more: nothing else is signed
        (staging / name).unlink(missing_ok=True)
    os.chmod(staging / "ca.pem", 0o644)  # clients read it; the key and password stay 0600
    os.chmod(staging / "broker.p12", 0o600)
    os.chmod(staging, 0o755)
    (staging / _MARKER).write_text("keytool\n", encoding="utf-8")
    if tls.exists():
        shutil.rmtree(tls)
    staging.rename(tls)
    logger.info("made a CA and a TLS certificate for %s in %s", HOST, tls)
    return tls / "broker.p12", password


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


def _answers(address: str, *, timeout: float = 5.0,
             client_config: Mapping[str, Any] | None = None) -> bool:
    """True if a broker at address answers a cluster-metadata request with a live broker."""
    host, _, port = address.rpartition(":")
    if not _port_in_use(int(port)):
        return False
    from kafka import KafkaAdminClient  # imported late: the CLI should start fast
    from kafka.errors import KafkaError

    ms = int(timeout * 1000)
    try:
        admin = KafkaAdminClient(bootstrap_servers=address, client_id="trainsentry-kafka-local",
                                 request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                                 **(client_config or {}))
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


def _probe_address(data: Path, port: int) -> str:
    """Where readiness is checked: the INTERNAL PLAINTEXT listener of a secured broker."""
    listeners = _read_properties(data / _PROPS_FILE).get("listeners", "")
    match = re.search(rf"{_INTERNAL}://([^,]+)", listeners)
    return match.group(1) if match else f"{HOST}:{port}"


def _running_protocol(data: Path) -> str:
    listeners = _read_properties(data / _PROPS_FILE).get("advertised.listeners", "")
    first = listeners.split(",")[0]
    return first.split("://")[0] if "://" in first else "PLAINTEXT"


def client_env(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
               security: LocalSecurity | None = None) -> dict[str, str]:
    """The TRAINSENTRY_KAFKA_* variables clients need for this broker, without the password."""
    security = security or LocalSecurity()
    env = {"TRAINSENTRY_KAFKA_BOOTSTRAP": f"{HOST}:{port}",
           "TRAINSENTRY_KAFKA_SECURITY_PROTOCOL": security.protocol}
    if security.scram_user:
        env["TRAINSENTRY_KAFKA_SASL_MECHANISM"] = SCRAM_MECHANISMS[0]
        env["TRAINSENTRY_KAFKA_SASL_USERNAME"] = security.scram_user
    if security.tls:
        env["TRAINSENTRY_KAFKA_SSL_CAFILE"] = str(ca_file(port=port, data_dir=data_dir))
    return env


def _client_security(security: LocalSecurity, data: Path) -> dict[str, Any]:
    from trainsentry.kafka_security import kafka_python_security

    return kafka_python_security(
        protocol=security.protocol, mechanism=SCRAM_MECHANISMS[0] if security.scram_user else "",
        username=security.scram_user, password=security.scram_password,
        cafile=str(data / _TLS_DIR / "ca.pem") if security.tls else "")


def _upsert_scram_user(internal: str, security: LocalSecurity, *, timeout: float) -> None:
    """Create or update the SCRAM user (both mechanisms) through the INTERNAL listener.

    Done through the admin API rather than ``kafka-storage format --add-scram`` so the
    password never appears on a command line and a changed password takes effect on the
    next start of an existing data dir.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        from kafka.admin import UserScramCredentialUpsertion
    except ImportError as exc:  # kafka-python 2.x has no SCRAM admin API
        raise KafkaSetupError("a SCRAM user needs kafka-python >= 3 (pip install -U "
                              "'kafka-python>=3')") from exc

    ms = int(timeout * 1000)
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=internal, client_id="trainsentry-kafka-local",
                                     request_timeout_ms=ms, bootstrap_timeout_ms=ms)
            try:
                result: dict[str, Any] = {}
                for mech in SCRAM_MECHANISMS:  # one user's credential per request
                    result.update(admin.alter_user_scram_credentials([
                        UserScramCredentialUpsertion(security.scram_user, mech,
                                                     security.scram_password.get())]))
            finally:
                admin.close()
        except (KafkaError, OSError) as exc:
            if time.monotonic() > deadline:
                raise KafkaSetupError(f"could not create the SCRAM user through the internal "
                                      f"listener {internal}: {exc!r}") from exc
            time.sleep(0.5)
            continue
        problems = {user: err for user, err in result.items() if err}
        if problems:
            raise KafkaSetupError(f"the broker refused the SCRAM user {security.scram_user!r}: "
                                  f"{problems.get(security.scram_user, problems)}")
        return


def _wait_for_login(address: str, data: Path, security: LocalSecurity, *,
                    timeout: float) -> None:
    """Until a client using ``security`` gets metadata on the client port (SCRAM propagates
    through the metadata log, so the first attempts may be refused)."""
    config = _client_security(security, data)
    deadline = time.monotonic() + timeout
    while not _answers(address, timeout=3.0, client_config=config):
        if time.monotonic() > deadline:
            from trainsentry.kafka_security import describe_failure

            raise KafkaSetupError(
                f"the broker runs, but a {security.protocol} client cannot use {address}: "
                f"{describe_failure(address, config)}; see {data / _LOG_FILE}")
        time.sleep(0.5)


def is_running(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None) -> bool:
    """Whether the broker we started for this data dir is alive (no network round trip)."""
    data = _data_dir(data_dir, port)
    pid = _read_pid(data)
    return pid is not None and _is_our_broker(pid, data)


def start(*, port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
          version: str = DEFAULT_VERSION, cache_dir: str | Path | None = None,
          timeout: float = 90.0, heap: str = "512m",
          security: LocalSecurity | None = None) -> str:
    """Start (or find running) the local broker; return ``"127.0.0.1:<port>"`` once it serves.

    Idempotent: if the broker we started for this data dir is up and answers, its address
    comes back at once. A data dir that does not exist yet is created and formatted; an
    existing one keeps its topics and offsets across restarts. ``security`` secures the
    client port (TLS, SASL/SCRAM or both; docs/kafka.md); ``start`` then returns only once
    a client with those settings is served.
    """
    security = security or LocalSecurity()
    security.check()
    address = f"{HOST}:{port}"
    data = _data_dir(data_dir, port)
    data.mkdir(parents=True, exist_ok=True)
    with _locked(data / ".lock"):
        pid = _read_pid(data)
        if pid is not None and _is_our_broker(pid, data):
            running = _running_protocol(data)
            if running != security.protocol:
                raise KafkaSetupError(
                    f"the broker for {data} already runs with a {running} listener on port "
                    f"{port}, not {security.protocol}; stop it first (trainsentry kafka stop "
                    f"--port {port} --data-dir {data})")
            _wait_until_serving(_probe_address(data, port), data, pid=pid, proc=None,
                                timeout=timeout)
            _secure(address, data, security, timeout=timeout)
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
        previous = _read_properties(props_path)
        controller_port = _reuse_port(previous.get("controller.quorum.voters", ""), port)
        extra: dict[str, Any] = {}
        if security.protocol != "PLAINTEXT":
            internal = re.search(rf"{_INTERNAL}://([^,]+)", previous.get("listeners", ""))
            extra["internal_port"] = _reuse_port(internal.group(1) if internal else "", port,
                                                 controller_port)
        if security.tls:
            extra["keystore"], extra["keystore_password"] = _ensure_tls(java, data)
        props = broker_properties(port=port, controller_port=controller_port, data_dir=data,
                                  version=version, protocol=security.protocol, **extra)
        props_path.unlink(missing_ok=True)
        # 0600: it may hold the keystore password.
        fd = os.open(props_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(render_properties(props))
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
        _wait_until_serving(_probe_address(data, port), data, pid=proc.pid, proc=proc,
                            timeout=timeout)
        try:
            _secure(address, data, security, timeout=max(10.0, timeout - (time.monotonic() - started)))
        except KafkaSetupError:
            _terminate(proc.pid, timeout=10.0)  # ours and unusable: don't leave it running
            (data / _PID_FILE).unlink(missing_ok=True)
            raise
        logger.info("Kafka %s serving %s on %s (pid %d) after %.1fs", version, security.protocol,
                    address, proc.pid, time.monotonic() - started)
        return address


def _secure(address: str, data: Path, security: LocalSecurity, *, timeout: float) -> None:
    """Set up the SCRAM user and wait until a secured client is served (no-op for PLAINTEXT)."""
    if security.protocol == "PLAINTEXT":
        return
    if security.scram_user:
        _upsert_scram_user(_probe_address(data, int(address.rpartition(":")[2])), security,
                           timeout=timeout)
    _wait_for_login(address, data, security, timeout=timeout)


def _reuse_port(previous: str, *taken: int) -> int:
    """The port at the end of ``previous`` (``1@127.0.0.1:P`` or ``127.0.0.1:P``) when it is
    free, so a restarted node finds its quorum; else a new free port not in ``taken``."""
    match = re.search(r":(\d+)$", previous)
    if match:
        candidate = int(match.group(1))
        if candidate not in taken and not _port_in_use(candidate):
            return candidate
    while True:
        candidate = _free_port()
        if candidate not in taken:
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
    p_start.add_argument("--tls", action="store_true",
                         help="TLS on the client port, with a CA made for this data dir "
                         "(DATA_DIR/tls/ca.pem: point TRAINSENTRY_KAFKA_SSL_CAFILE at it)")
    p_start.add_argument("--sasl-scram", metavar="USER", default="",
                         help=f"require a SASL/SCRAM login (SCRAM-SHA-512 and -256) as USER; the "
                         f"password is read from {_PASSWORD_VAR}, never from the command line")
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


def _security_from_args(args: argparse.Namespace,
                        env: Mapping[str, str] | None = None) -> LocalSecurity:
    """The entry point's reading of --tls, --sasl-scram and the password variable."""
    env = os.environ if env is None else env
    user = args.sasl_scram or ""
    if ":" in user:
        # Never echo the value: it may be USER:PASSWORD.
        raise KafkaSetupError(f"--sasl-scram takes only the user name; put the password in "
                              f"{_PASSWORD_VAR} so it stays out of ps and shell history")
    password = env.get(_PASSWORD_VAR, "") if user else ""
    if user and not password:
        raise KafkaSetupError(f"--sasl-scram {user} needs the password in {_PASSWORD_VAR}")
    return LocalSecurity(tls=bool(args.tls), scram_user=user, scram_password=Secret(password))


def _cmd_start(args: argparse.Namespace) -> int:
    # KafkaSetupError propagates: the CLI's main prints it to stderr and exits non-zero.
    security = _security_from_args(args)
    address = start(port=args.port, data_dir=args.data_dir, version=args.kafka_version,
                    cache_dir=_cache_dir_from_env(), timeout=args.timeout, security=security)
    print(address)  # the contract: exactly the bootstrap address on stdout
    if security.protocol != "PLAINTEXT":
        env = client_env(port=args.port, data_dir=args.data_dir, security=security)
        lines = [f"export {k}={v}" for k, v in env.items()]
        if security.scram_user:
            lines.append(f"export {_PASSWORD_VAR}=...  # the password you started it with")
        _complain(f"kafka start: {security.protocol} on {address}; clients need:\n  "
                  + "\n  ".join(lines))
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
        if _answers(address, timeout=2.0):
            _complain(f"kafka status: but a broker answers on {address}: it was started with "
                      "another --data-dir (pass that one to status / stop)")
        return 1
    serving = _answers(_probe_address(data, args.port))  # INTERNAL listener if secured
    protocol = _running_protocol(data)
    shown = "" if protocol == "PLAINTEXT" else f" {protocol}"
    print(f"{'running' if serving else 'starting or unhealthy'} {address}{shown} "
          f"pid {_read_pid(data)} ({data})")
    return 0 if serving else 1


def _complain(message: str) -> None:
    """CLI diagnostics go to stderr so stdout stays machine-readable."""
    print(message, file=sys.stderr)
