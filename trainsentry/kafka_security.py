"""Kafka connection security shared by every client: check the settings, build client
options, and turn a failed connection into a message that says what to fix.

Why one module: the producer, the control listener, ``trainsentry serve`` (admin client,
Faust/aiokafka) and ``trainsentry kafka start`` must agree on what
``TRAINSENTRY_KAFKA_SECURITY_PROTOCOL`` and friends mean, and a wrong password or a missing
CA file must read the same everywhere. Nothing here reads the environment, and no function
puts the SASL password into a message or log line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
import ssl
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainsentry.config import Secret, Settings
from trainsentry.errors import ConfigError

__all__ = [
    "MECHANISMS",
    "PROTOCOLS",
    "Diagnosis",
    "check_security",
    "describe_failure",
    "diagnose",
    "kafka_python_security",
    "settings_security",
    "ssl_context",
]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

_PROTOCOL_VAR = "TRAINSENTRY_KAFKA_SECURITY_PROTOCOL"
_MECHANISM_VAR = "TRAINSENTRY_KAFKA_SASL_MECHANISM"
_USER_VAR = "TRAINSENTRY_KAFKA_SASL_USERNAME"
_PASSWORD_VAR = "TRAINSENTRY_KAFKA_SASL_PASSWORD"
_CAFILE_VAR = "TRAINSENTRY_KAFKA_SSL_CAFILE"
_LOCAL_CA_HINT = "`trainsentry kafka start --tls` writes it to DATA_DIR/tls/ca.pem"


def _norm(value: str) -> str:
    return value.strip().upper().replace("_", "-") if value else ""


def check_security(*, protocol: str, mechanism: str = "", username: str = "",
                   password: Secret | str = "", cafile: str = "") -> tuple[str, str]:
    """Validate the settings; return the normalised ``(protocol, mechanism)``.

    Raises ConfigError naming the variable to fix. ``mechanism`` defaults to ``PLAIN`` for
    the SASL protocols (Kafka's own default) and is ``""`` otherwise.
    """
    proto = (protocol or "PLAINTEXT").strip().upper()
    if proto not in PROTOCOLS:
        raise ConfigError(f"{_PROTOCOL_VAR} must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    mech = ""
    if proto.startswith("SASL"):
        mech = _norm(mechanism) or "PLAIN"
        if mech not in MECHANISMS:
            raise ConfigError(f"{_MECHANISM_VAR} must be one of {', '.join(MECHANISMS)}, "
                              f"got {mechanism!r}")
        secret = password.get() if isinstance(password, Secret) else password
        if not username:
            raise ConfigError(f"{_PROTOCOL_VAR}={proto} needs a user name; set {_USER_VAR}")
        if not secret:
            raise ConfigError(f"{_PROTOCOL_VAR}={proto} needs a password; set {_PASSWORD_VAR}")
    if cafile and proto in ("SSL", "SASL_SSL"):
        try:
            with open(cafile, "rb") as handle:
                head = handle.read(4096)
        except OSError as exc:
            raise ConfigError(f"{_CAFILE_VAR}={cafile} cannot be read ({exc.strerror}); point it "
                              f"at the PEM file of the CA that signed the broker's certificate "
                              f"({_LOCAL_CA_HINT})") from None
        if b"-----BEGIN CERTIFICATE-----" not in head:
            raise ConfigError(f"{_CAFILE_VAR}={cafile} is not a PEM certificate file; point it "
                              f"at the CA's PEM file ({_LOCAL_CA_HINT})")
    return proto, mech


def kafka_python_security(*, protocol: str, mechanism: str = "", username: str = "",
                          password: Secret | str = "", cafile: str = "") -> dict[str, Any]:
    """kafka-python keyword arguments for the security settings (checked first)."""
    proto, mech = check_security(protocol=protocol, mechanism=mechanism, username=username,
                                 password=password, cafile=cafile)
    out: dict[str, Any] = {"security_protocol": proto}
    if mech:
        out["sasl_mechanism"] = mech
        out["sasl_plain_username"] = username
        out["sasl_plain_password"] = password.get() if isinstance(password, Secret) else password
    if proto in ("SSL", "SASL_SSL") and cafile:
        out["ssl_cafile"] = cafile
    return out


def settings_security(settings: Settings) -> dict[str, Any]:
    """:func:`kafka_python_security` for a :class:`~trainsentry.config.Settings`."""
    return kafka_python_security(protocol=settings.kafka_security_protocol,
                                 mechanism=settings.kafka_sasl_mechanism,
                                 username=settings.kafka_sasl_username,
                                 password=settings.kafka_sasl_password,
                                 cafile=settings.kafka_ssl_cafile)


def ssl_context(cafile: str = "") -> ssl.SSLContext:
    """A verifying client TLS context (hostname checked); the CA file, else the system CAs."""
    try:
        return ssl.create_default_context(cafile=cafile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{_CAFILE_VAR}={cafile} is not a usable CA file ({exc}); "
                          f"{_LOCAL_CA_HINT}") from None


@dataclass(frozen=True)
class Diagnosis:
    """Why a client cannot use the broker. ``permanent``: retrying cannot help (an untrusted
    certificate, a refused login, a protocol that does not match the listener)."""

    message: str
    permanent: bool


def describe_failure(bootstrap: str, config: Mapping[str, Any], exc: BaseException | None = None,
                     *, timeout: float = 3.0) -> str:
    """Why clients cannot use the broker, and what to change; never contains the password."""
    return diagnose(bootstrap, config, exc, timeout=timeout).message


def diagnose(bootstrap: str, config: Mapping[str, Any], exc: BaseException | None = None,
             *, timeout: float = 3.0) -> Diagnosis:
    """Probe the first bootstrap server to name the cause of a failed connection.

    kafka-python retries a refused TLS handshake or SASL login until its timeout and then
    reports only "unable to bootstrap", so this checks each layer itself: TCP, the TLS
    handshake with the configured CA, and a SASL handshake and login (PLAIN or SCRAM) with
    the configured credentials. ``config`` is the kafka-python security dict
    (:func:`kafka_python_security`). ``exc`` is the client's error, shown by type only.
    """
    proto = str(config.get("security_protocol") or "PLAINTEXT").upper()
    first = next((s.strip() for s in bootstrap.split(",") if s.strip()), bootstrap)
    host, _, port_text = first.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return Diagnosis(f"bootstrap server {first!r} is not host:port; fix "
                         "TRAINSENTRY_KAFKA_BOOTSTRAP", True)
    host = host.strip("[]") or "127.0.0.1"
    try:
        sock: socket.socket = socket.create_connection((host, port), timeout=timeout)
    except OSError as err:
        return Diagnosis(f"nothing accepts connections at {host}:{port} ({err.strerror or err}); "
                         "start a broker (`trainsentry kafka start`) or fix "
                         "TRAINSENTRY_KAFKA_BOOTSTRAP", False)
    try:
        if proto in ("SSL", "SASL_SSL"):
            sock, problem = _tls(sock, host, port, str(config.get("ssl_cafile") or ""))
            if problem:
                return Diagnosis(problem, True)
        elif _speaks_tls(host, port, timeout):
            return Diagnosis(f"{host}:{port} is a TLS listener but {_PROTOCOL_VAR} is {proto}; "
                             f"set it to SASL_SSL (with SASL) or SSL, and {_CAFILE_VAR}", True)
        problem = _sasl_problem(sock, config, f"{host}:{port}", proto)
        if problem:
            return Diagnosis(problem, True)
    except (OSError, ValueError, struct.error):
        pass  # the probe itself could not finish: fall through to the generic answer
    finally:
        sock.close()
    what = type(exc).__name__ if exc is not None else "no answer"
    login = " and this login" if proto.startswith("SASL") else ""
    return Diagnosis(f"the broker at {bootstrap} accepts {proto} connections{login}, but the "
                     f"client got no metadata ({what}); the broker may still be starting: check "
                     f"its log, and that TRAINSENTRY_KAFKA_BOOTSTRAP names its advertised "
                     f"listener", False)


def _tls(sock: socket.socket, host: str, port: int,
         cafile: str) -> tuple[socket.socket, str | None]:
    try:
        context = ssl_context(cafile)
    except ConfigError as exc:
        return sock, str(exc)
    try:
        return context.wrap_socket(sock, server_hostname=host), None
    except ssl.SSLCertVerificationError as err:
        which = (f"the CA in {_CAFILE_VAR}={cafile} did not sign it" if cafile else
                 f"{_CAFILE_VAR} is not set and no system CA signed it")
        return sock, (f"the TLS certificate of {host}:{port} is not trusted "
                      f"({err.verify_message}): {which}; set {_CAFILE_VAR} to the PEM file of "
                      f"the CA that signed the broker's certificate ({_LOCAL_CA_HINT})")
    except (ssl.SSLError, OSError) as err:
        return sock, (f"TLS handshake with {host}:{port} failed "
                      f"({getattr(err, 'reason', None) or type(err).__name__}): it is probably not "
                      f"a TLS listener; {_PROTOCOL_VAR}=SSL and SASL_SSL need one, PLAINTEXT "
                      f"and SASL_PLAINTEXT do not")


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether host:port completes a TLS handshake (certificate not checked: only a probe)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                probe.wrap_socket(raw, server_hostname=host):
            return True
    except (ssl.SSLError, OSError):
        return False


# --------------------------------------------------------------------------- SASL probe
# Just enough of the Kafka wire protocol for one SaslHandshake (v1) and SaslAuthenticate
# (v0) exchange, so a refused login is told apart from a down broker without relying on a
# client library's internals.

_SASL_HANDSHAKE, _SASL_AUTHENTICATE = 17, 36
_ILLEGAL_SASL_STATE, _UNSUPPORTED_MECHANISM = 34, 33


class _Wire:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._correlation = 0

    def call(self, api_key: int, version: int, body: bytes) -> bytes:
        self._correlation += 1
        client = b"trainsentry-probe"
        header = struct.pack(">hhih", api_key, version, self._correlation, len(client)) + client
        frame = header + body
        self._sock.sendall(struct.pack(">i", len(frame)) + frame)
        size = struct.unpack(">i", self._read(4))[0]
        if not 4 <= size <= 1 << 20:
            raise ValueError("unexpected response size")
        reply = self._read(size)
        if struct.unpack(">i", reply[:4])[0] != self._correlation:
            raise ValueError("unexpected correlation id")
        return reply[4:]

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                raise OSError("connection closed by the broker")
            out += chunk
        return out


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


def _read_string(buf: bytes, at: int) -> tuple[str | None, int]:
    n = struct.unpack(">h", buf[at:at + 2])[0]
    if n < 0:
        return None, at + 2
    return buf[at + 2:at + 2 + n].decode(errors="replace"), at + 2 + n


def _sasl_problem(sock: socket.socket, config: Mapping[str, Any], where: str,
                  proto: str) -> str | None:
    """A message when the listener's SASL set-up does not match ours, else None."""
    wire = _Wire(sock)
    sasl = proto.startswith("SASL")
    mech = str(config.get("sasl_mechanism") or "PLAIN")
    reply = wire.call(_SASL_HANDSHAKE, 1, _string(mech))
    error = struct.unpack(">h", reply[:2])[0]
    count = struct.unpack(">i", reply[2:6])[0]
    at, enabled = 6, []
    for _ in range(max(0, count)):
        name, at = _read_string(reply, at)
        enabled.append(name or "")
    if not sasl:
        if error in (0, _UNSUPPORTED_MECHANISM) and enabled:
            return (f"{where} requires a SASL login ({', '.join(enabled)}) but "
                    f"{_PROTOCOL_VAR} is {proto}; set it to "
                    f"{'SASL_SSL' if proto == 'SSL' else 'SASL_PLAINTEXT (SASL_SSL if it is TLS)'} "
                    f"with {_MECHANISM_VAR}, {_USER_VAR} and {_PASSWORD_VAR}")
        return None
    if error == _ILLEGAL_SASL_STATE or (error and not enabled):
        return (f"{where} is not a SASL listener but {_PROTOCOL_VAR} is {proto}; set it to "
                f"{'SSL' if proto == 'SASL_SSL' else 'PLAINTEXT'} (and unset the SASL settings), "
                f"or point TRAINSENTRY_KAFKA_BOOTSTRAP at the broker's SASL listener")
    if error == _UNSUPPORTED_MECHANISM or error:
        return (f"{where} does not accept SASL mechanism {mech} (it accepts "
                f"{', '.join(enabled) or 'none'}); set {_MECHANISM_VAR} to one of those")
    user = str(config.get("sasl_plain_username") or "")
    password = str(config.get("sasl_plain_password") or "")
    refused = _login(wire, mech, user, password)
    if refused is None:
        return None
    return (f"{where} refused the SASL {mech} login of user {user!r} ({refused}); check "
            f"{_USER_VAR} and {_PASSWORD_VAR} (and {_MECHANISM_VAR}: a SCRAM user exists per "
            f"mechanism)")


def _authenticate(wire: _Wire, token: bytes) -> tuple[int, str, bytes]:
    reply = wire.call(_SASL_AUTHENTICATE, 0, struct.pack(">i", len(token)) + token)
    error = struct.unpack(">h", reply[:2])[0]
    message, at = _read_string(reply, 2)
    n = struct.unpack(">i", reply[at:at + 4])[0]
    return error, message or "", reply[at + 4:at + 4 + max(0, n)]


def _login(wire: _Wire, mech: str, user: str, password: str) -> str | None:
    """Run the login; return the broker's reason when it is refused, else None."""
    if mech == "PLAIN":
        error, message, _ = _authenticate(wire, f"\0{user}\0{password}".encode())
        return (message or f"error {error}") if error else None
    digest = "sha512" if mech.endswith("512") else "sha256"
    name = user.replace("=", "=3D").replace(",", "=2C")
    nonce = base64.b64encode(os.urandom(18)).decode()
    first_bare = f"n={name},r={nonce}"
    error, message, server_first = _authenticate(wire, f"n,,{first_bare}".encode())
    if error:
        return message or f"error {error}"
    fields = dict(part.split("=", 1) for part in server_first.decode().split(",") if "=" in part)
    salted = hashlib.pbkdf2_hmac(digest, password.encode(), base64.b64decode(fields["s"]),
                                 int(fields["i"]))
    client_key = hmac.new(salted, b"Client Key", digest).digest()
    stored = hashlib.new(digest, client_key).digest()
    final_bare = f"c=biws,r={fields['r']}"
    auth = f"{first_bare},{server_first.decode()},{final_bare}".encode()
    signature = hmac.new(stored, auth, digest).digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature, strict=True)))
    error, message, _ = _authenticate(wire, f"{final_bare},p={proof.decode()}".encode())
    return (message or f"error {error}") if error else None
