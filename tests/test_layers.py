"""The documented key → layer mapping (docs/events.md)."""

from __future__ import annotations

import pytest

from producers.layers import layer_of, signal_info, split_metrics


@pytest.mark.parametrize("key, layer", [
    ("timing_s/gen", "data"), ("rollout/latency_ms", "data"), ("actor/entropy", "data"),
    ("actor/kl_loss", "data"), ("reward/kl_divergence", "data"), ("critic/score/mean", "data"),
    ("response_length/clip_ratio", "data"), ("rollout/empty_response_ratio", "data"),
    ("val-core/openai/gsm8k/reward/mean@1", "data"),
    ("actor/pg_loss", "compute"), ("actor/grad_norm", "compute"), ("actor/lr", "compute"),
    ("timing_s/update_weights", "compute"), ("actor/reduce_grad_ms", "compute"),
    ("timing_s/some_new_phase", "compute"), ("critic/vf_loss", "compute"),
    ("gpu/utilization_pct", "resource"), ("system/disk_io_wait_ms", "resource"),
    ("actor/perf/max_memory_allocated_gb", "resource"), ("perf/max_memory_allocated_gb", "resource"),
    ("memory/actor_peak_gb", "resource"), ("perf/mfu/actor", "resource"),
    ("something/unheard_of", "compute"),
])
def test_layer_of_known_and_prefixed_keys(key: str, layer: str) -> None:
    """verl keys, aliases and prefixes land on the documented layer."""
    assert layer_of(key) == layer


def test_aliases_share_roles_with_unit_conversion() -> None:
    """rollout/latency_ms is timing_s/gen's role in seconds."""
    assert signal_info("rollout/latency_ms").role == signal_info("timing_s/gen").role == "latency"
    assert signal_info("rollout/latency_ms").scale == 0.001
    assert signal_info("memory/actor_peak_gb").role == signal_info("actor/perf/max_memory_allocated_gb").role


def test_split_metrics_partitions_every_key_once() -> None:
    """Every key appears in exactly one layer; empty layers are left out."""
    metrics = {"timing_s/gen": 3.0, "actor/pg_loss": 0.1, "gpu/utilization_pct": 90.0,
               "actor/entropy": 0.4}
    layers = split_metrics(metrics)
    assert layers == {"data": {"timing_s/gen": 3.0, "actor/entropy": 0.4},
                      "compute": {"actor/pg_loss": 0.1}, "resource": {"gpu/utilization_pct": 90.0}}
    assert split_metrics({"actor/lr": 1e-6}) == {"compute": {"actor/lr": 1e-6}}
