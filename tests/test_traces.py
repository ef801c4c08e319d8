"""Real verl traces through ``trainsentry detect``: the problems are caught, the healthy stay quiet."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.traces import replay

TRACES = Path(__file__).resolve().parents[2] / "shared" / "eval" / "verl-traces"

pytestmark = pytest.mark.skipif(not TRACES.is_dir(),
                                reason=f"real traces not found at {TRACES} (shared/ beside the clone)")


@pytest.mark.parametrize("name", ["pr5469_grpo_qwen3_06b_gsm8k_dead",
                                  "pr5545_grpo_qwen3_30b_moe_npu_dead"])
def test_dead_runs_are_stalled_learning_within_a_few_steps(name: str) -> None:
    """Runs dead from step 1 (capped, constant reward, zero gradient): stalled_learning by step 5,
    critical later, and the breaker asks to stop the run."""
    r = replay(TRACES / f"{name}.jsonl")
    assert r.first is not None and r.first.diagnosis == "stalled_learning"
    assert r.first.step <= 5
    assert {a.diagnosis for a in r.opened} == {"stalled_learning"}
    assert [c.action for c in r.commands] == ["stop"]


def test_game2048_collapse_is_entropy_collapse_first() -> None:
    """Entropy 0.51 → 0.09 by step 6: entropy_collapse, critical, before anything else."""
    r = replay(TRACES / "pr5687_grpo_qwen2_7b_game2048_collapse.jsonl")
    assert r.first is not None and r.first.diagnosis == "entropy_collapse"
    assert r.first.step <= 7 and r.first.severity == "critical"
    assert r.first.evidence["actor/entropy"]["value"] < r.first.evidence["actor/entropy"]["bound"]


@pytest.mark.parametrize("name", ["monte_ppo_qwen3_06b_gsm8k", "pr5687_grpo_qwen2_7b_gsm8k_math",
                                  "pr5469_grpo_qwen3_30b_a3b_titan", "verl_nb_ppo_qwen05b_gsm8k"])
def test_healthy_runs_raise_no_alert(name: str) -> None:
    """Warm-up step, entropy falling 8x with reward up, 33 zero-gradient steps, slowly growing
    KL and single grad-norm spikes: no alert at all."""
    r = replay(TRACES / f"{name}.jsonl")
    assert r.opened == [], [(a.step, a.diagnosis, a.summary) for a in r.opened]
    assert r.commands == []
