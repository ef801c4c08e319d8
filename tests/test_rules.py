"""The diagnosis rules: every label on its simulated fault, quiet on its healthy look-alike."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest

from bench.diagnosis import sim_events
from detectors.engine import Engine
from detectors.knowledge import for_run, has_critic, localize
from detectors.offline import detect_events
from detectors.rules import Diagnosis, expected_lr, parse_milestones
from trainsentry.events import AlertEvent, MetricEvent
from trainsentry.simulate import FAULT_LABELS, Scenario, scheduled_lr

ONSET = 60


def scenario(fault: str | None = None, **kw: Any) -> Scenario:
    """A small run: 120 steps of 10 s on 4 ranks, the fault (if any) from step 60."""
    params: dict[str, Any] = dict(run_id=f"t-{fault or 'healthy'}", seed=3, steps=120, ranks=4,
                                  step_time_s=10.0, fault=fault, fault_onset=ONSET)
    params.update(kw)
    return Scenario(**params)


def firing(sc: Scenario) -> list[AlertEvent]:
    return [a for a in detect_events(sim_events(sc))
            if isinstance(a, AlertEvent) and a.status == "firing"]


#: How soon after the onset each label must be named (steps; the hang is timed by the
#: engine's hang limit and alerts at the last completed step, before the onset).
MAX_DELAY = {"training_hang": 0, "gradient_instability": 12}


@pytest.mark.parametrize("label", FAULT_LABELS)
def test_each_fault_is_named_first_and_nothing_fires_before_it(label: str) -> None:
    """The injected fault's label is the first alert, soon after the onset; nothing earlier."""
    alerts = firing(scenario(label))
    assert alerts, f"{label}: nothing fired"
    first = alerts[0]
    assert first.diagnosis == label, [(a.step, a.diagnosis) for a in alerts[:3]]
    if label == "training_hang":
        assert first.step == ONSET - 1  # the last step that completed
    else:
        assert ONSET <= first.step <= ONSET + MAX_DELAY.get(label, 5)


@pytest.mark.parametrize("label", ["memory_leak", "straggler", "lr_drift", "stalled_learning",
                                   "kl_drift", "dataloader_stall", "entropy_collapse"])
def test_faults_are_named_on_other_seeds_and_algorithms(label: str) -> None:
    """Same, on PPO with a noisier run, 8 ranks and another seed."""
    alerts = firing(scenario(label, seed=11, algorithm="ppo", noise=1.8, ranks=8))
    assert alerts and alerts[0].diagnosis == label
    assert ONSET <= alerts[0].step <= ONSET + 5


def test_memory_leak_is_caught_long_before_capacity_on_a_short_run() -> None:
    """A slow leak (120 steps, onset 60, never reaching capacity in the run) warns within a
    few steps, with the climb rate and projected steps to capacity as evidence."""
    alerts = firing(scenario("memory_leak", fault_severity=0.7))
    first = alerts[0]
    assert first.diagnosis == "memory_leak" and first.step <= ONSET + 5
    ev = first.evidence["gpu/memory_used_gb"]
    assert ev["per_step_gb"] > 0 and ev["steps_to_capacity"] > 20 and ev["bound"] == 80.0
    assert first.severity == "warning"


#: label -> a healthy run that looks like it (the hard cases the rules must not fire on).
LOOK_ALIKES: dict[str, dict[str, Any]] = {
    "lr_drift": dict(lr_warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1,
                     lr_milestones=((40, 0.5), (80, 0.25))),
    "stalled_learning": dict(zero_grad_prob=0.3),
    "gradient_instability": dict(grad_spike_prob=0.08),
    "dataloader_stall": dict(test_freq=5, eval_in_step_timer=True),
    "training_hang": dict(test_freq=5, save_freq=5, eval_in_step_timer=True),
    "kl_drift": dict(algorithm="ppo", steps=200),
    "entropy_collapse": dict(steps=150, noise=2.0),
    "memory_leak": dict(noise=2.0, ranks=16),
    "straggler": dict(ranks=8, noise=2.0),
    "numeric_underflow": dict(noise=2.0),
    "comm_degradation": dict(step_time_s=60.0, noise=2.0),
    "nan_loss": dict(algorithm="ppo"),
}


@pytest.mark.parametrize("label", FAULT_LABELS)
def test_healthy_look_alike_raises_nothing(label: str) -> None:
    """The healthy twin that resembles each fault (planned lr steps, zero-gradient steps,
    grad spikes, long validation, slow KL growth, ...) raises no alert at all."""
    alerts = firing(scenario(None, **LOOK_ALIKES[label]))
    assert alerts == [], [(a.step, a.diagnosis, a.summary) for a in alerts]


def test_evidence_has_value_baseline_and_bound_and_alerts_carry_knowledge() -> None:
    """Every signal in the evidence has value, baseline and bound; checks and actions come
    from the knowledge base; confidence is in (0, 1]."""
    for label in FAULT_LABELS:
        sc = scenario(label)
        for a in firing(sc):
            assert a.evidence, label
            for key, ev in a.evidence.items():
                assert {"value", "baseline", "bound"} <= set(ev), (label, key, ev)
            know = for_run(a.diagnosis, {"algorithm.adv_estimator": "gae" if sc.algorithm == "ppo" else "grpo"})
            assert a.checks == list(know.checks) and a.actions == list(know.actions)
            assert a.confidence is not None and 0 < a.confidence <= 1
            assert a.severity in ("warning", "critical")


def test_critical_conditions_from_the_domain_are_critical() -> None:
    """nan_loss at once; kl_drift once KL passes 0.8; stalled_learning after 20 steps."""
    assert firing(scenario("nan_loss"))[0].severity == "critical"
    kl = firing(scenario("kl_drift", fault_severity=2.0))
    assert any(a.diagnosis == "kl_drift" and a.severity == "critical" for a in kl)
    stalled = firing(scenario("stalled_learning"))
    assert stalled[0].severity == "warning"
    assert any(a.severity == "critical" and a.step == ONSET + 19 for a in stalled)


def test_dead_from_the_start_run_is_caught_without_a_baseline() -> None:
    """stalled_learning from step 1: absolute checks name it within 3 steps."""
    alerts = firing(scenario("stalled_learning", fault_onset=1))
    assert alerts[0].diagnosis == "stalled_learning" and alerts[0].step <= 3


def test_unspecific_signals_of_a_fault_become_secondary_labels() -> None:
    """The dataloader stall's latency also meets the 'generation stuck' condition: it is
    reported once, as dataloader_stall with unknown as secondary."""
    alerts = firing(scenario("dataloader_stall"))
    assert {a.diagnosis for a in alerts} == {"dataloader_stall"}
    assert any("unknown" in a.secondary for a in alerts)


def test_the_more_specific_diagnosis_owns_shared_evidence() -> None:
    """Two diagnoses on the same signal: the more specific fires, the other is secondary."""
    engine = Engine()
    state = engine.new_state("r")
    ev = {"actor/kl_loss": {"value": 0.9, "baseline": 0.1, "bound": 0.2}}
    out = engine._lifecycle(state, 10, 100.0, [
        Diagnosis("entropy_collapse", "critical", 0.9, "entropy fell", {
            "actor/entropy": {"value": 0.05, "baseline": 0.4, "bound": 0.2}, **ev}),
        Diagnosis("kl_drift", "critical", 0.8, "kl up", ev),
        Diagnosis("lr_drift", "warning", 0.8, "lr off", {"actor/lr": {"value": 1, "baseline": 2,
                                                                      "bound": 1.8}}),
    ])
    alerts = {a.diagnosis: a for a in out if isinstance(a, AlertEvent)}
    assert set(alerts) == {"entropy_collapse", "lr_drift"}
    assert alerts["entropy_collapse"].secondary == ["kl_drift"]


def test_planned_lr_milestones_follow_the_simulator_schedule() -> None:
    """expected_lr reads trainsentry's lr_milestones key and matches what verl logs."""
    sc = scenario(None, lr_warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1,
                  lr_milestones=((40, 0.5), (80, 0.25)))
    cfg = sc.verl_config()
    assert parse_milestones(cfg["actor_rollout_ref.actor.optim.lr_milestones"]) == [(40, 0.5), (80, 0.25)]
    for step in range(1, sc.steps + 1):
        want = scheduled_lr(sc, step)
        got = expected_lr(cfg, step)
        assert got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), step


def _data_steps(n: int, metrics: Callable[[int], dict[str, float]]) -> list[Any]:
    """Everything the engine puts out for ``n`` data-layer steps of 20 s, then a flush."""
    engine = Engine()
    state = engine.new_state("r")
    out: list[Any] = []
    for s in range(n):
        out += engine.process(state, MetricEvent(run_id="r", step=s, ts=1000.0 + 20 * s,
                                                 layer="data", metrics=metrics(s)))
    return out + engine.flush(state)


def test_unknown_needs_two_steps_and_yields_to_a_longer_response_explanation() -> None:
    """Generation slower only because responses got longer is not 'stuck'."""
    def metrics(s: int) -> dict[str, float]:
        gen, length = (12.0, 2000.0) if s >= 60 else (3.0 * (1 + 0.02 * (s % 3)), 500.0)
        return {"timing_s/gen": gen, "response_length/mean": length}

    out = _data_steps(80, metrics)
    assert [a for a in out if isinstance(a, AlertEvent)] == []


#: English words a Chinese summary may keep: names of systems, units and signals.
_ZH_KEEP = {"rank", "GPU", "NCCL", "verl", "KL", "softmax", "logits", "NaN", "Inf", "GB",
            "reward", "hacking", "p95", "I/O", "s", "C",  # s: seconds, C: °C
            "checkpoint", "trainsentry", "supervise"}
_NUMBER = re.compile(r"(?<![A-Za-z0-9-])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")


def _zh_checked(a: AlertEvent) -> None:
    zh, en = a.summary_zh, a.summary
    assert zh, f"{a.diagnosis}: no Chinese summary for {en!r}"
    if a.command:  # a breaker notice names its command by id in both
        assert a.command["id"] in zh and a.command["id"] in en
        zh, en = zh.replace(a.command["id"], ""), en.replace(a.command["id"], "")
    assert zh.startswith(f"{a.diagnosis}："), zh
    assert re.search(r"[\u4e00-\u9fff]", zh), zh
    # The same figures as the English summary, none lost or changed.
    assert sorted(_NUMBER.findall(en)) == sorted(_NUMBER.findall(zh)), (en, zh)
    # No English sentence left: only signal keys (with / or _) and the names above.
    body = _NUMBER.sub(" ", zh.split("：", 1)[1])
    words = [w for w in re.findall(r"[A-Za-z][A-Za-z0-9_/.\[\]=|-]*", body)
             if "/" not in w and "_" not in w and w not in _ZH_KEEP | {a.host}]
    assert words == [], (words, zh)


@pytest.mark.parametrize("label", FAULT_LABELS)
def test_every_firing_alert_has_a_chinese_summary_with_the_same_figures(label: str) -> None:
    alerts = firing(scenario(label)) + firing(scenario(label, seed=11, algorithm="ppo",
                                                       noise=1.8, ranks=8))
    assert any(a.diagnosis == label for a in alerts)
    for a in alerts:
        _zh_checked(a)


def test_the_latency_unknown_has_a_chinese_summary_with_its_hint() -> None:
    """The latency ``unknown`` with the forward-time hint, and whatever else fires."""
    def metrics(s: int) -> dict[str, float]:
        stuck = s >= 60
        return {"timing_s/gen": 30.0 if stuck else 3.0 * (1 + 0.02 * (s % 3)),
                "response_length/mean": 500.0,
                "timing_s/old_log_prob": 4.0 if stuck else 1.0 + 0.01 * (s % 3)}

    out = _data_steps(90, metrics)
    alerts = [a for a in out if isinstance(a, AlertEvent) and a.status == "firing"]
    assert any(a.diagnosis == "unknown" and "前向时间也在上升" in (a.summary_zh or "")
               for a in alerts), [(a.diagnosis, a.summary) for a in alerts]
    for a in alerts:
        _zh_checked(a)


def test_a_run_without_a_critic_is_never_told_to_tune_one() -> None:
    """kl_drift on GRPO (no critic in verl unless critic.enable) names no critic step, in
    either language; on PPO (gae) the critic steps stay."""
    grpo = firing(scenario("kl_drift"))
    ppo = firing(scenario("kl_drift", algorithm="ppo"))
    assert grpo and ppo
    for a in grpo:
        texts = a.actions + a.checks
        assert not any("critic" in t for t in texts), texts
        assert not any("critic" in t for t in localize(texts, "zh"))
        assert "lower the learning rate" in a.actions
    assert any("critic" in t for a in ppo for t in a.actions)
    assert has_critic({"algorithm.adv_estimator": "grpo", "critic.enable": True})
    assert not has_critic({"algorithm.adv_estimator": "GRPO"}) and has_critic({})


def test_numeric_underflow_evidence_shows_the_threshold_it_crossed() -> None:
    """The empty-response ratio's bound is the rule's 10 % / 15 % floor when the band's own
    bound is lower (a run that never had empty responses has a band of ~0)."""
    alerts = firing(scenario("numeric_underflow"))
    assert alerts
    for a in alerts:
        if a.diagnosis != "numeric_underflow":
            continue
        (key,) = [k for k in a.evidence if "aborted" in k or "empty" in k]
        floor = 0.15 if a.severity == "critical" else 0.10
        assert a.evidence[key]["bound"] >= floor, a.evidence
        assert a.evidence[key]["value"] > a.evidence[key]["bound"]


def test_every_breaker_notice_says_what_is_wrong_first() -> None:
    """On every label's simulated fault that trips the breaker, the notice's summary starts
    with the problem (also when the breaker trips on a step the rule did not fire again)."""
    notices = [a for label in FAULT_LABELS
               for a in detect_events(sim_events(scenario(label)))
               if isinstance(a, AlertEvent) and a.command and "outcome" not in a.command]
    assert len({a.diagnosis for a in notices}) >= 3
    for a in notices:
        body = a.summary.split(": ", 1)[1]
        assert not body.startswith("circuit breaker"), a.summary
        assert not (a.summary_zh or "").split("：", 1)[1].startswith("连续"), a.summary_zh
