"""The signal catalog: how each known signal is watched, with user overrides.

A :class:`SignalPolicy` says which direction is bad, the baseline window and band width,
warm-up, and the smallest effect worth reporting. Defaults come from DOMAIN.md (latency
W=100 k=3, KL W=30 k=2, empty-response ratio W=20 k=4) and sensible values for verl's
keys; a user YAML (``signals:`` section, see docs/configuration.md) overrides any field
per key or per role, and unknown keys get the generic policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from producers.layers import signal_info
from trainsentry.errors import ConfigError

__all__ = ["SignalPolicy", "Catalog", "DEFAULT_BY_ROLE", "GENERIC", "load_catalog"]


@dataclass(frozen=True)
class SignalPolicy:
    """How one signal is watched."""

    direction: str = "both"  #: which way is bad: "up", "down" or "both"
    window: int = 50  #: baseline window (values)
    k: float = 3.0  #: band half-width in std units
    warmup: int = 0  #: values before any verdict (0 = window // 2, the baseline's rule)
    min_abs_effect: float = 0.0  #: |value - baseline| must exceed this to count
    min_rel_effect: float = 0.2  #: ... and this fraction of |baseline|
    nonnegative: bool = True  #: clip the lower bound at 0
    detectors: tuple[str, ...] = ("adaptive",)
    watch: bool = True  #: False: keep the values for rules, raise no anomaly of its own

    def effective_warmup(self) -> int:
        return self.warmup or max(1, self.window // 2)

    def validate(self, name: str) -> SignalPolicy:
        if self.direction not in ("up", "down", "both"):
            raise ConfigError(f"signal {name!r}: direction must be up, down or both")
        if self.window < 2 or self.k <= 0:
            raise ConfigError(f"signal {name!r}: window must be >= 2 and k > 0")
        return self


GENERIC = SignalPolicy(direction="both", window=50, k=4.0, min_rel_effect=0.5, watch=False)

#: Role → policy. Roles come from producers.layers (verl keys and aliases share them).
DEFAULT_BY_ROLE: dict[str, SignalPolicy] = {
    "latency": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.5),
    "kl": SignalPolicy(direction="up", window=30, k=2.0, warmup=10, min_abs_effect=0.02,
                       min_rel_effect=0.5),
    "policy_kl": SignalPolicy(direction="up", window=30, k=3.0, warmup=10, min_rel_effect=1.0,
                              watch=False),
    "empty_ratio": SignalPolicy(direction="up", window=20, k=4.0, warmup=10, min_abs_effect=0.03),
    "response_length": SignalPolicy(direction="down", window=50, k=3.0, warmup=10,
                                    min_rel_effect=0.3),
    "entropy": SignalPolicy(direction="down", window=30, k=3.0, warmup=5, min_rel_effect=0.3),
    "forward_time": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.5),
    "comm_time": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_abs_effect=0.2,
                              min_rel_effect=0.5),
    "update_time": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.5),
    "step_time": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.5),
    "loss": SignalPolicy(direction="both", window=50, k=5.0, warmup=10, min_rel_effect=1.0,
                         nonnegative=False, watch=False),
    "grad_norm": SignalPolicy(direction="up", window=50, k=4.0, warmup=10, min_rel_effect=1.0,
                              watch=False),
    "lr": SignalPolicy(direction="both", window=20, k=3.0, warmup=5, watch=False),
    "gpu_util": SignalPolicy(direction="down", window=100, k=3.0, warmup=10, min_abs_effect=15.0),
    "gpu_mem": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.05,
                            watch=False),
    "actor_mem": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_rel_effect=0.05,
                              watch=False),
    "io_wait": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, min_abs_effect=5.0,
                            watch=False),
    "cpu_load": SignalPolicy(direction="up", window=100, k=3.0, warmup=10, watch=False),
    "throughput": SignalPolicy(direction="down", window=100, k=3.0, warmup=10, min_rel_effect=0.3,
                               watch=False),
    "score": SignalPolicy(direction="down", window=50, k=3.0, warmup=10, nonnegative=False,
                          watch=False),
    # Judged peer-relative by the straggler rule; its own band only feeds the evidence.
    "rank_step_time": SignalPolicy(direction="up", window=100, k=3.0, warmup=10,
                                   min_rel_effect=0.5, watch=False),
}


class Catalog:
    """Looks up the policy of a key: user key override > user role override > role default > generic."""

    def __init__(self, *, by_key: Mapping[str, Mapping[str, Any]] | None = None,
                 by_role: Mapping[str, Mapping[str, Any]] | None = None,
                 generic: Mapping[str, Any] | None = None) -> None:
        self.by_key = {k: dict(v) for k, v in (by_key or {}).items()}
        self.by_role = {k: dict(v) for k, v in (by_role or {}).items()}
        self.generic = dict(generic or {})
        self._cache: dict[str, SignalPolicy] = {}
        for name, over in [*self.by_key.items(), *self.by_role.items(), ("generic", self.generic)]:
            _apply(GENERIC, over, name)  # validate early: a typo fails at start-up, not at 3 a.m.

    def policy(self, key: str) -> SignalPolicy:
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        role = signal_info(key).role
        base = DEFAULT_BY_ROLE.get(role, GENERIC) if role else GENERIC
        if base is GENERIC and self.generic:
            base = _apply(GENERIC, self.generic, "generic")
        if role and role in self.by_role:
            base = _apply(base, self.by_role[role], role)
        if key in self.by_key:
            base = _apply(base, self.by_key[key], key)
        self._cache[key] = base
        return base

    def __getstate__(self) -> dict[str, Any]:
        return {"by_key": self.by_key, "by_role": self.by_role, "generic": self.generic}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


_FIELDS = {f.name for f in fields(SignalPolicy)}


def _apply(base: SignalPolicy, over: Mapping[str, Any], name: str) -> SignalPolicy:
    unknown = set(over) - _FIELDS
    if unknown:
        raise ConfigError(f"signal {name!r}: unknown policy field(s) {sorted(unknown)}; "
                          f"valid: {sorted(_FIELDS)}")
    values = dict(over)
    if "detectors" in values:
        values["detectors"] = tuple(values["detectors"])
    try:
        return replace(base, **values).validate(name)
    except TypeError as exc:
        raise ConfigError(f"signal {name!r}: {exc}") from exc


def load_catalog(path: str | Path | None) -> Catalog:
    """A catalog from a YAML/JSON file's ``signals:`` section (``roles:`` and ``generic:`` too)."""
    if not path:
        return Catalog()
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"detector config {p} is a directory; give its YAML/JSON file "
                          "(--config or TRAINSENTRY_DETECTOR_CONFIG)")
    if not p.is_file():
        raise ConfigError(f"detector config {p} does not exist; fix --config "
                          "(or TRAINSENTRY_DETECTOR_CONFIG)")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            import json

            raw = json.loads(text)
    except Exception as exc:
        raise ConfigError(f"detector config {p} could not be parsed: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"detector config {p} must be a mapping with a 'signals:' section")
    return Catalog(by_key=raw.get("signals") or {}, by_role=raw.get("roles") or {},
                   generic=raw.get("generic") or {})
