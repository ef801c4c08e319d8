"""Which layer each metric belongs to, and what role it plays in diagnosis.

verl emits one flat dict per step. trainsentry splits it into three layers (data flow,
compute flow, resources; see docs/events.md) and gives the signals it knows a *role*
(``latency``, ``kl``, ``gpu_util``, ...) that the diagnosis rules reason about, so verl's
own keys and the operators' aliases (``rollout/latency_ms``...) meet in one vocabulary.

Lookup order: exact key, then the longest matching prefix, then the default layer
``compute``. Units: ``scale`` converts the key's unit to the role's canonical unit
(seconds for times, GB for memory, ratio 0..1 for ratios).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SignalInfo", "KNOWN_SIGNALS", "PREFIX_LAYERS", "signal_info", "layer_of",
           "split_metrics", "DEFAULT_LAYER"]

DEFAULT_LAYER = "compute"


@dataclass(frozen=True, slots=True)
class SignalInfo:
    """A signal's layer, its diagnostic role (or None), and the factor to the role's unit."""

    layer: str
    role: str | None = None
    scale: float = 1.0


def _s(layer: str, role: str | None = None, scale: float = 1.0) -> SignalInfo:
    return SignalInfo(layer, role, scale)


#: verl's real keys (0.4–0.9 spellings) and the operators' aliases from DOMAIN.md.
KNOWN_SIGNALS: dict[str, SignalInfo] = {
    # --- data flow: the run's pulse -------------------------------------------------
    "timing_s/gen": _s("data", "latency"),
    "timing/gen": _s("data", "latency"),  # verl <= 0.3
    "rollout/latency_ms": _s("data", "latency", 0.001),  # alias
    "response_length/mean": _s("data", "response_length"),
    "response_length/max": _s("data"),
    "response_length/min": _s("data"),
    "response_length/clip_ratio": _s("data", "clip_ratio"),
    "response/aborted_ratio": _s("data", "empty_ratio"),
    "rollout/empty_response_ratio": _s("data", "empty_ratio"),  # alias
    "prompt_length/mean": _s("data"),
    "prompt_length/clip_ratio": _s("data"),
    "actor/ppo_kl": _s("data", "policy_kl"),
    "actor/kl_loss": _s("data", "kl"),
    "actor/reward_kl_penalty": _s("data", "kl"),
    "critic/kl": _s("data", "kl"),  # verl <= 0.3
    "reward/kl_divergence": _s("data", "kl"),  # alias
    "actor/kl_coef": _s("data"),
    "actor/reward_kl_penalty_coeff": _s("data"),
    "actor/entropy": _s("data", "entropy"),
    "actor/entropy_loss": _s("data", "entropy"),  # verl <= 0.3
    "critic/score/mean": _s("data", "score"),
    "critic/score/max": _s("data", "score_max"),
    "critic/score/min": _s("data", "score_min"),
    "critic/score/std": _s("data", "score_std"),
    "reward/critic_score_std": _s("data", "score_std"),  # alias
    "critic/rewards/mean": _s("data", "reward"),
    "critic/rewards/max": _s("data"),
    "critic/rewards/min": _s("data"),
    "critic/advantages/mean": _s("data"),
    "critic/advantages/max": _s("data", "adv_max"),
    "critic/advantages/min": _s("data", "adv_min"),
    "critic/returns/mean": _s("data"),
    "critic/values/mean": _s("data"),
    # --- compute flow: where time goes ------------------------------------------------
    "timing_s/old_log_prob": _s("compute", "forward_time"),
    "timing_s/ref": _s("compute", "forward_time"),
    "timing_s/values": _s("compute", "forward_time"),
    "timing/old_log_prob": _s("compute", "forward_time"),
    "timing/ref": _s("compute", "forward_time"),
    "timing/values": _s("compute", "forward_time"),
    "actor/forward_latency_ms": _s("compute", "forward_time", 0.001),  # alias
    "critic/forward_latency_ms": _s("compute", "forward_time", 0.001),  # alias
    "timing_s/update_weights": _s("compute", "comm_time"),
    "timing_s/sync_weights": _s("compute", "comm_time"),
    "actor/reduce_grad_ms": _s("compute", "comm_time", 0.001),  # alias
    "timing_s/update_actor": _s("compute", "update_time"),
    "timing_s/update_critic": _s("compute", "update_time"),
    "timing/update_actor": _s("compute", "update_time"),
    "timing_s/step": _s("compute", "step_time"),
    "timing/step": _s("compute", "step_time"),
    "timing_s/reward": _s("compute"),
    "timing_s/adv": _s("compute"),
    "timing_s/testing": _s("compute", "validation_time"),
    "timing_s/save_checkpoint": _s("compute", "checkpoint_time"),
    "actor/pg_loss": _s("compute", "loss"),
    "actor/pg_clipfrac": _s("compute"),
    "actor/pg_clipfrac_lower": _s("compute"),
    "actor/grad_norm": _s("compute", "grad_norm"),
    "actor/lr": _s("compute", "lr"),
    "critic/vf_loss": _s("compute", "loss"),
    "critic/vf_clipfrac": _s("compute"),
    "critic/grad_norm": _s("compute", "grad_norm"),
    "critic/lr": _s("compute", "critic_lr"),
    "critic/vpred_mean": _s("compute"),
    # --- resources: the physical world ------------------------------------------------
    "gpu/utilization_pct": _s("resource", "gpu_util"),
    "gpu/memory_used_gb": _s("resource", "gpu_mem"),
    "gpu/memory_total_gb": _s("resource", "gpu_mem_total"),
    "gpu/temperature_c": _s("resource"),
    "gpu/power_w": _s("resource"),
    "system/cpu_load_avg": _s("resource", "cpu_load"),
    "system/disk_io_wait_ms": _s("resource", "io_wait"),
    "actor/perf/max_memory_allocated_gb": _s("resource", "actor_mem"),
    "actor/perf/max_memory_reserved_gb": _s("resource", "actor_mem_reserved"),
    "perf/max_memory_allocated_gb": _s("resource", "actor_mem"),  # verl <= 0.7
    "perf/max_memory_reserved_gb": _s("resource", "actor_mem_reserved"),
    "memory/actor_peak_gb": _s("resource", "actor_mem"),  # alias
    "perf/cpu_memory_used_gb": _s("resource"),
    "perf/throughput": _s("resource", "throughput"),
    "perf/mfu/actor": _s("resource", "mfu"),
    "perf/total_num_tokens": _s("resource"),
    "perf/time_per_step": _s("compute", "step_time"),
    # A rank's own busy time in the step (the sampler's per-rank view; not a verl key).
    # Peers compare it to find a straggler, so it rides in the per-rank resource record.
    "timing_s/rank_step": _s("resource", "rank_step_time"),
}

#: Prefix → layer for keys not listed above (longest prefix wins).
PREFIX_LAYERS: dict[str, str] = {
    "timing_s/": "compute",
    "timing/": "compute",
    "timing_per_token_ms/": "compute",
    "actor/perf/": "resource",
    "perf/": "resource",
    "gpu/": "resource",
    "system/": "resource",
    "memory/": "resource",
    "host/": "resource",
    "network/": "resource",
    "rollout/": "data",
    "reward/": "data",
    "response_length/": "data",
    "response/": "data",
    "prompt_length/": "data",
    "critic/score/": "data",
    "critic/rewards/": "data",
    "critic/advantages/": "data",
    "critic/returns/": "data",
    "critic/values/": "data",
    "val-core/": "data",
    "val-aux/": "data",
    "val/": "data",
    "actor/": "compute",
    "critic/": "compute",
    "training/": "compute",
}

_PREFIXES_LONGEST_FIRST = sorted(PREFIX_LAYERS, key=len, reverse=True)


def signal_info(key: str) -> SignalInfo:
    """What trainsentry knows of a metric key (a generic compute signal when nothing)."""
    info = KNOWN_SIGNALS.get(key)
    if info is not None:
        return info
    for prefix in _PREFIXES_LONGEST_FIRST:
        if key.startswith(prefix):
            return SignalInfo(PREFIX_LAYERS[prefix])
    return SignalInfo(DEFAULT_LAYER)


def layer_of(key: str) -> str:
    """The layer (``data``, ``compute`` or ``resource``) a metric key is published on."""
    return signal_info(key).layer


def split_metrics(metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Split one step's flat metrics dict into ``{layer: {key: value}}`` (empty layers left out)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        out.setdefault(layer_of(key), {})[key] = value
    return out
