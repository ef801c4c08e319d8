"""Settings: one frozen object, read from a config file and the environment by the entry point.

Libraries never read the environment; the CLI calls :func:`load_settings` once and passes
the result down. Environment variables win over the config file (contract).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from trainsentry.errors import ConfigError

__all__ = ["Secret", "Settings", "Topics", "load_settings", "ENV_VARS"]


class Secret:
    """A string that never shows itself in repr, str, logs or tracebacks."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('**********')" if self._value else "Secret('')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Secret, (self._value,))


@dataclass(frozen=True)
class Topics:
    """The contract's topic names under one prefix."""

    prefix: str = "trainsentry."

    @property
    def data(self) -> str:
        return f"{self.prefix}metrics.data"

    @property
    def compute(self) -> str:
        return f"{self.prefix}metrics.compute"

    @property
    def resource(self) -> str:
        return f"{self.prefix}metrics.resource"

    @property
    def runs(self) -> str:
        return f"{self.prefix}runs"

    @property
    def alerts(self) -> str:
        return f"{self.prefix}alerts"

    @property
    def control(self) -> str:
        return f"{self.prefix}control"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}deadletter"

    def metrics(self, layer: str) -> str:
        return f"{self.prefix}metrics.{layer}"

    def all(self) -> list[str]:
        return [self.data, self.compute, self.resource, self.runs, self.alerts, self.control,
                self.deadletter]


@dataclass(frozen=True)
class Settings:
    """Everything the service and the producers need; secrets are :class:`Secret`."""

    kafka_bootstrap: str = "127.0.0.1:9092"
    topic_prefix: str = "trainsentry."
    partitions: int = 4
    #: Replication factor of every topic the service creates (contract topics, its table
    #: changelogs, silences, alert history): 3 on a production cluster, 1 on one broker.
    replication_factor: int = 1
    dingtalk_url: Secret = field(default_factory=lambda: Secret(""))
    dingtalk_secret: Secret = field(default_factory=lambda: Secret(""))
    wecom_url: Secret = field(default_factory=lambda: Secret(""))
    webhook_url: Secret = field(default_factory=lambda: Secret(""))
    control_secret: Secret = field(default_factory=lambda: Secret(""))
    web_port: int = 6066
    web_host: str = "127.0.0.1"
    language: str = "zh"
    app_id: str = "trainsentry"
    data_dir: str = ""
    breaker_threshold: int = 3
    detector_config: str = ""
    finished_run_retention_s: int = 86400  #: keep a finished run's state this long (dashboard)
    idle_run_retention_s: int = 7 * 86400  #: drop an unfinished run's state after this silence
    event_loop: str = "auto"  #: auto (uvloop when installed), uvloop, asyncio
    recovery_stall_s: int = 600  #: restart the worker after a table recovery this long stuck (0: never)
    #: The breaker publishes no stop / rollback for data older than this (a replay under a
    #: new app id, a long backlog): the notice says so instead (0: no limit).
    command_max_data_age_s: int = 3600
    # Kafka security (SASL/SSL clusters); empty = PLAINTEXT.
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = ""
    kafka_sasl_username: str = ""
    kafka_sasl_password: Secret = field(default_factory=lambda: Secret(""))
    kafka_ssl_cafile: str = ""
    # Alerting (docs/alerting.md).
    public_url: str = ""  #: base of chart links in chat; default http://<web_host>:<web_port>
    alert_for_s: int = 60  #: a warning holds this long (or alert_for_steps) before it is sent
    alert_for_steps: int = 10
    alert_repeat_interval_s: int = 0  #: least seconds between repeats of one problem
    alert_escalate_after: int = 2  #: repeats before the on-call list is @-mentioned (0: never)
    alert_book_retention_s: int = 86400  #: drop a run's quiet alert book after this long
    alert_charts: bool = True
    oncall_mobiles: str = ""  #: DingTalk at_mobiles, comma-separated
    oncall_wecom_users: str = ""  #: WeCom mentioned_list userids, comma-separated
    notify_rate_limit: int = 20  #: messages per robot per notify_window_s
    notify_window_s: int = 60

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict fit for a log line: secrets show only whether they are set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = ("<set>" if value else "<unset>") if isinstance(value, Secret) else value
        return out


#: Environment variable → Settings field. The first block is the contract's.
ENV_VARS: dict[str, str] = {
    "TRAINSENTRY_KAFKA_BOOTSTRAP": "kafka_bootstrap",
    "TRAINSENTRY_TOPIC_PREFIX": "topic_prefix",
    "TRAINSENTRY_DINGTALK_URL": "dingtalk_url",
    "TRAINSENTRY_DINGTALK_SECRET": "dingtalk_secret",
    "TRAINSENTRY_WECOM_URL": "wecom_url",
    "TRAINSENTRY_CONTROL_SECRET": "control_secret",
    "TRAINSENTRY_WEB_PORT": "web_port",
    # Our own additions (docs/configuration.md).
    "TRAINSENTRY_WEBHOOK_URL": "webhook_url",
    "TRAINSENTRY_WEB_HOST": "web_host",
    "TRAINSENTRY_PARTITIONS": "partitions",
    "TRAINSENTRY_REPLICATION_FACTOR": "replication_factor",
    "TRAINSENTRY_COMMAND_MAX_DATA_AGE_S": "command_max_data_age_s",
    "TRAINSENTRY_LANGUAGE": "language",
    "TRAINSENTRY_APP_ID": "app_id",
    "TRAINSENTRY_DATA_DIR": "data_dir",
    "TRAINSENTRY_BREAKER_THRESHOLD": "breaker_threshold",
    "TRAINSENTRY_DETECTOR_CONFIG": "detector_config",
    "TRAINSENTRY_FINISHED_RUN_RETENTION_S": "finished_run_retention_s",
    "TRAINSENTRY_IDLE_RUN_RETENTION_S": "idle_run_retention_s",
    "TRAINSENTRY_RECOVERY_STALL_S": "recovery_stall_s",
    "TRAINSENTRY_EVENT_LOOP": "event_loop",
    "TRAINSENTRY_KAFKA_SECURITY_PROTOCOL": "kafka_security_protocol",
    "TRAINSENTRY_KAFKA_SASL_MECHANISM": "kafka_sasl_mechanism",
    "TRAINSENTRY_KAFKA_SASL_USERNAME": "kafka_sasl_username",
    "TRAINSENTRY_KAFKA_SASL_PASSWORD": "kafka_sasl_password",
    "TRAINSENTRY_KAFKA_SSL_CAFILE": "kafka_ssl_cafile",
    "TRAINSENTRY_PUBLIC_URL": "public_url",
    "TRAINSENTRY_ALERT_FOR_S": "alert_for_s",
    "TRAINSENTRY_ALERT_FOR_STEPS": "alert_for_steps",
    "TRAINSENTRY_ALERT_REPEAT_INTERVAL_S": "alert_repeat_interval_s",
    "TRAINSENTRY_ALERT_ESCALATE_AFTER": "alert_escalate_after",
    "TRAINSENTRY_ALERT_BOOK_RETENTION_S": "alert_book_retention_s",
    "TRAINSENTRY_ALERT_CHARTS": "alert_charts",
    "TRAINSENTRY_ONCALL_MOBILES": "oncall_mobiles",
    "TRAINSENTRY_ONCALL_WECOM_USERS": "oncall_wecom_users",
    "TRAINSENTRY_NOTIFY_RATE_LIMIT": "notify_rate_limit",
    "TRAINSENTRY_NOTIFY_WINDOW_S": "notify_window_s",
}

_FIELD_TYPES = {f.name: f for f in fields(Settings)}


def _coerce(name: str, raw: Any, source: str) -> Any:
    default = getattr(Settings(), name)
    if isinstance(default, Secret):
        return raw if isinstance(raw, Secret) else Secret(str(raw))
    if isinstance(default, bool):
        return str(raw).lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        try:
            return int(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {name} must be an integer, got {raw!r}") from exc
    return str(raw)


_ENV_OF = {field_name: var for var, field_name in ENV_VARS.items()}


def _validate(s: Settings) -> Settings:
    if s.language not in ("zh", "en"):
        raise ConfigError(f"language must be 'zh' or 'en', got {s.language!r} (TRAINSENTRY_LANGUAGE)")
    if not 0 < s.web_port < 65536:
        raise ConfigError(f"web_port must be 1..65535, got {s.web_port} (TRAINSENTRY_WEB_PORT)")
    if s.partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {s.partitions} (TRAINSENTRY_PARTITIONS)")
    if s.replication_factor < 1:
        raise ConfigError(f"replication_factor must be >= 1, got {s.replication_factor} "
                          "(TRAINSENTRY_REPLICATION_FACTOR; 3 on a production cluster)")
    if s.breaker_threshold < 1:
        raise ConfigError("breaker_threshold must be >= 1 (TRAINSENTRY_BREAKER_THRESHOLD)")
    if s.event_loop not in ("auto", "uvloop", "asyncio"):
        raise ConfigError(f"event_loop must be auto, uvloop or asyncio, got {s.event_loop!r} "
                          "(TRAINSENTRY_EVENT_LOOP)")
    # Durations in seconds: (field, least value, 0 also allowed, why the bound).
    for name, least, zero_ok, why in (
            ("finished_run_retention_s", 0, False, ""),
            ("idle_run_retention_s", 3600, False,
             ": a shorter one could drop a run before its hang is reported"),
            ("recovery_stall_s", 60, True, " (0: never restart)"),
            ("command_max_data_age_s", 60, True, " (0: no limit)"),
            ("alert_book_retention_s", 1, False, "; keep it at an hour or more in production")):
        value = getattr(s, name)
        if value < least and not (zero_ok and value == 0):
            raise ConfigError(f"{name} must be {'0 or ' if zero_ok else ''}>= {least} seconds, "
                              f"got {value} ({_ENV_OF[name]}){why}")
    if not s.kafka_bootstrap:
        raise ConfigError("kafka_bootstrap is empty; set TRAINSENTRY_KAFKA_BOOTSTRAP=host:port")
    return s


def load_settings(config_file: str | Path | None = None,
                  env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from defaults < config file (YAML or JSON) < environment < explicit overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file or env.get("TRAINSENTRY_CONFIG")
    if path:
        values.update(_read_file(Path(path)))
    for var, name in ENV_VARS.items():
        # An empty value means unset, except the topic prefix, which the contract prepends
        # verbatim: TRAINSENTRY_TOPIC_PREFIX= gives unprefixed topics (metrics.data ...).
        if var in env and (env[var] != "" or var == "TRAINSENTRY_TOPIC_PREFIX"):
            values[name] = _coerce(name, env[var], var)
    for name, raw in overrides.items():
        if raw is not None:
            values[name] = _coerce(name, raw, "argument")
    return _validate(replace(Settings(), **values))


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; fix --config or TRAINSENTRY_CONFIG")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # in the [service] extra

            raw = yaml.safe_load(text) or {}
        else:
            import json

            raw = json.loads(text)
    except Exception as exc:  # parse errors from either library
        raise ConfigError(f"config file {path} could not be parsed: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting: value")
    section = raw.get("service", raw)
    out = {}
    for key, value in section.items():
        if key not in _FIELD_TYPES:
            if key in ("detectors", "signals", "remediation", "alerting"):
                continue  # other sections of the same file, read by their own loaders
            raise ConfigError(f"config file {path}: unknown setting {key!r}; see docs/configuration.md")
        out[key] = _coerce(key, value, str(path))
    return out
