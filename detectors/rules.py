"""Cross-layer diagnosis rules over one joined step of a run.

Each rule reads a :class:`StepContext` (the step's values by key and by role, the
findings of the signal monitors, short per-role histories and per-rank values) and
returns a :class:`Diagnosis` or None. Rules are pure functions of the context plus the
per-run ``streaks`` counters they own (persisted with the run's state). docs/diagnosis.md
describes each rule.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from detectors.monitor import Finding, _round

__all__ = ["StepContext", "Diagnosis", "RULES", "diagnose", "expected_lr", "SPECIFICITY"]

#: Higher wins when several diagnoses explain the same signals.
SPECIFICITY: dict[str, int] = {
    "nan_loss": 100, "training_hang": 95, "stalled_learning": 90, "numeric_underflow": 85,
    "dataloader_stall": 80, "straggler": 78, "comm_degradation": 75, "memory_leak": 70,
    "entropy_collapse": 65, "kl_drift": 60, "lr_drift": 55, "gradient_instability": 50,
    "unknown": 0,
}


@dataclass
class StepContext:
    """Everything a rule may read about one step."""

    run_id: str
    step: int
    ts: float
    values: dict[str, float]
    roles: dict[str, float]
    findings: dict[str, Finding]
    role_findings: dict[str, Finding]
    baselines: dict[str, tuple[float, float, float]]  # role -> (mean, lower, upper)
    history: Mapping[str, deque[float]]  # role -> recent values (this step last)
    ranks: dict[int, dict[str, float]]
    hosts: dict[int, str]
    config: Mapping[str, Any]
    streaks: dict[str, int]
    nonfinite: list[str] = field(default_factory=list)

    def role(self, name: str) -> float | None:
        return self.roles.get(name)

    def bump(self, name: str, holds: bool) -> int:
        """Count consecutive steps for which ``holds`` is true; returns the count."""
        n = self.streaks.get(name, 0) + 1 if holds else 0
        self.streaks[name] = n
        return n


@dataclass
class Diagnosis:
    label: str
    severity: str
    confidence: float
    summary: str
    evidence: dict[str, dict[str, Any]]
    critical_reason: str | None = None
    host: str | None = None
    rank: int | None = None

    @property
    def specificity(self) -> int:
        return SPECIFICITY.get(self.label, 0)


def _ev(value: float, baseline: float | None, bound: float | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"value": _round(value)}
    out["baseline"] = None if baseline is None else _round(baseline)
    out["bound"] = None if bound is None else _round(bound)
    out.update(extra)
    return out


def _finding_ev(ctx: StepContext, role: str) -> dict[str, dict[str, Any]]:
    f = ctx.role_findings.get(role)
    if f is not None:
        return {f.key: f.evidence()}
    return {}


def _role_ev(ctx: StepContext, role: str, key_hint: str) -> dict[str, dict[str, Any]]:
    value = ctx.roles.get(role)
    if value is None:
        return {}
    base = ctx.baselines.get(role)
    f = ctx.role_findings.get(role)
    key = f.key if f else key_hint
    if base is None:
        return {key: _ev(value, None, None)}
    mean, lower, upper = base
    return {key: _ev(value, mean, upper if value >= mean else lower)}


# --------------------------------------------------------------------------- rules
def rule_nan_loss(ctx: StepContext) -> Diagnosis | None:
    bad = [k for k in ctx.nonfinite if "loss" in k or "grad_norm" in k]
    if not bad:
        ctx.bump("nan_loss", False)
        return None
    n = ctx.bump("nan_loss", True)
    ev = {k: _ev(ctx.values.get(k, math.nan), None, None, finite_steps_before=None) for k in bad}
    for k in ev:
        ev[k].pop("finite_steps_before")
    return Diagnosis("nan_loss", "critical", 1.0,
                     f"{', '.join(bad)} non-finite at step {ctx.step} ({n} step(s) in a row)",
                     ev, critical_reason="non-finite loss or gradient norm")


def rule_stalled_learning(ctx: StepContext) -> Diagnosis | None:
    grad = ctx.role("grad_norm")
    loss = ctx.values.get("actor/pg_loss")
    smin, smax = ctx.role("score_min"), ctx.role("score_max")
    clip = ctx.role("clip_ratio")
    zero_grad = grad is not None and abs(grad) < 1e-9
    zero_loss = loss is None or abs(loss) < 1e-9
    uniform = smin is not None and smax is not None and abs(smax - smin) < 1e-9
    capped = clip is not None and clip >= 0.95
    dead = zero_grad and zero_loss and (uniform or capped)
    n = ctx.bump("stalled", dead)
    if n < 5:
        return None
    ev: dict[str, dict[str, Any]] = {}
    if grad is not None:
        ev["actor/grad_norm"] = _ev(grad, None, 0.0, steps=n)
    if uniform and smin is not None and smax is not None:
        ev["critic/score/min..max"] = _ev(smax - smin, None, 0.0, min=_round(smin), max=_round(smax))
    if capped and clip is not None:
        ev["response_length/clip_ratio"] = _ev(clip, None, 0.95)
    why = "rewards identical across the batch" if uniform else "responses cut at the length cap"
    return Diagnosis("stalled_learning", "critical" if n >= 20 else "warning", min(1.0, 0.6 + n / 50),
                     f"no learning signal for {n} steps: gradient exactly 0, {why}", ev,
                     critical_reason="no learning signal for 20+ steps" if n >= 20 else None)


def rule_numeric_underflow(ctx: StepContext) -> Diagnosis | None:
    empty = ctx.role("empty_ratio")
    f_empty = ctx.role_findings.get("empty_ratio")
    length_drop = "response_length" in ctx.role_findings
    holds = empty is not None and f_empty is not None and empty > 0.10 and length_drop
    if not holds or empty is None:
        return None
    ev = {**_finding_ev(ctx, "empty_ratio"), **_finding_ev(ctx, "response_length")}
    critical = empty > 0.15
    return Diagnosis("numeric_underflow", "critical" if critical else "warning", 0.9,
                     f"empty-response ratio {empty:.0%} while response length collapses", ev,
                     critical_reason="empty-response ratio anomalous and above 15%" if critical else None)


def rule_dataloader_stall(ctx: StepContext) -> Diagnosis | None:
    f_lat = ctx.role_findings.get("latency") or ctx.role_findings.get("step_time")
    util = ctx.role("gpu_util")
    if f_lat is None:
        ctx.bump("stall", False)
        return None
    util_base = ctx.baselines.get("gpu_util")
    util_low = util is not None and ("gpu_util" in ctx.role_findings or util < 30.0)
    forward_up = "forward_time" in ctx.role_findings
    holds = util_low and not forward_up
    n = ctx.bump("stall", holds)
    if not holds or util is None:
        return None
    ev = {f_lat.key: f_lat.evidence()}
    ev["gpu/utilization_pct"] = _ev(util, util_base[0] if util_base else None,
                                    util_base[1] if util_base else 30.0)
    fwd = ctx.role("forward_time")
    if fwd is not None:
        fb = ctx.baselines.get("forward_time")
        ev["forward_time (old_log_prob+ref+values)"] = _ev(fwd, fb[0] if fb else None,
                                                          fb[2] if fb else None, flat=True)
    io = ctx.role("io_wait")
    if io is not None:
        ib = ctx.baselines.get("io_wait")
        ev["system/disk_io_wait_ms"] = _ev(io, ib[0] if ib else None, ib[2] if ib else None)
    latency = ctx.role("latency")
    critical = latency is not None and latency > 5.0 and "latency" in ctx.role_findings
    ratio = f_lat.value / f_lat.baseline if f_lat.baseline > 0 else math.inf
    return Diagnosis(
        "dataloader_stall", "critical" if critical else "warning", min(1.0, 0.7 + 0.1 * n),
        f"GPUs idle at {util:.0f}%, {f_lat.key} {ratio:.1f}x its baseline, forward time flat: "
        "the input pipeline starves the GPUs", ev,
        critical_reason="rollout latency anomalous and above 5 s" if critical else None)


def rule_comm_degradation(ctx: StepContext) -> Diagnosis | None:
    f = ctx.role_findings.get("comm_time")
    comm = ctx.role("comm_time")
    holds = f is not None and comm is not None and comm > 0.5
    n = ctx.bump("comm", holds)
    if not holds or f is None:
        return None
    ratio = f.value / f.baseline if f.baseline > 0 else math.inf
    return Diagnosis("comm_degradation", "warning", min(1.0, 0.6 + 0.1 * n),
                     f"{f.key} {f.value:.3g}s, {ratio:.1f}x its baseline (> 0.5 s): NCCL / network",
                     {f.key: f.evidence()})


def _capacity(ctx: StepContext) -> float:
    total = ctx.role("gpu_mem_total")
    return total if total and total > 0 else 80.0


def rule_memory_leak(ctx: StepContext) -> Diagnosis | None:
    hist = ctx.history.get("gpu_mem") or ctx.history.get("actor_mem")
    key = "gpu/memory_used_gb" if ctx.history.get("gpu_mem") else "actor/perf/max_memory_allocated_gb"
    if not hist or len(hist) < 8:
        return None
    recent = list(hist)[-8:]
    cap = _capacity(ctx)
    rises = sum(1 for a, b in zip(recent, recent[1:], strict=False) if b > a)
    rise = recent[-1] - recent[0]
    climbing = rises >= 6 and rise > 0.03 * cap
    n = ctx.bump("leak", climbing)
    if not climbing:
        return None
    used = recent[-1]
    per_step = rise / (len(recent) - 1)
    steps_left = (cap - used) / per_step if per_step > 0 else math.inf
    critical = used > 0.95 * cap
    ev = {key: _ev(used, recent[0], cap, per_step_gb=_round(per_step),
                   steps_to_capacity=_round(steps_left))}
    return Diagnosis("memory_leak", "critical" if critical else "warning", min(1.0, 0.6 + 0.05 * n),
                     f"GPU memory up {rise:.1f} GB in 8 steps ({used:.1f}/{cap:.0f} GB), "
                     f"~{steps_left:.0f} steps to capacity", ev,
                     critical_reason="GPU memory above 95% of capacity" if critical else None)


def rule_entropy_collapse(ctx: StepContext) -> Diagnosis | None:
    hist = ctx.history.get("entropy")
    if not hist or len(hist) < 4:
        return None
    values = list(hist)
    current = values[-1]
    peak = max(values[-12:])
    holds = peak > 0 and current < 0.35 * peak and (peak - current) > 0.05
    n = ctx.bump("entropy", holds)
    if not holds or n < 2:
        return None
    ev = {"actor/entropy": _ev(current, peak, 0.35 * peak)}
    reward_hist = ctx.history.get("score")
    extra = ""
    if reward_hist and len(reward_hist) >= 4 and reward_hist[-1] > reward_hist[-4]:
        extra = ", reward still rising (possible reward hacking)"
    return Diagnosis("entropy_collapse", "critical", min(1.0, 0.7 + 0.1 * n),
                     f"policy entropy fell to {current:.3g}, {current / peak:.0%} of its recent "
                     f"{peak:.3g}{extra}", ev, critical_reason="entropy collapsed")


def rule_kl_drift(ctx: StepContext) -> Diagnosis | None:
    f = ctx.role_findings.get("kl")
    kl = ctx.role("kl")
    hist = ctx.history.get("kl")
    rising = bool(hist) and len(hist) >= 4 and hist[-1] > hist[-4]
    # DOMAIN.md: KL rising one-sidedly past its healthy range; below 0.3 slow growth is normal.
    holds = f is not None and kl is not None and rising and kl > 0.3
    n = ctx.bump("kl", holds)
    if not holds or f is None or kl is None or n < 2:
        return None
    critical = kl > 0.8
    return Diagnosis("kl_drift", "critical" if critical else "warning", min(1.0, 0.6 + 0.1 * n),
                     f"{f.key} {kl:.3g} and rising for {n} steps (baseline {f.baseline:.3g})",
                     {f.key: f.evidence()},
                     critical_reason="KL anomalous and above 0.8" if critical else None)


def rule_gradient_instability(ctx: StepContext) -> Diagnosis | None:
    hist = ctx.history.get("grad_norm")
    base = ctx.baselines.get("grad_norm")
    f = ctx.role_findings.get("grad_norm")
    ctx.streaks["grad_anoms"] = (ctx.streaks.get("grad_anoms", 0) << 1 | (1 if f else 0)) & 0b11111
    if not hist or len(hist) < 3 or base is None:
        return None
    last3 = list(hist)[-3:]
    spread = statistics.pstdev(last3)
    anomalous_recent = bin(ctx.streaks["grad_anoms"]).count("1")
    holds = spread > 2 * base[0] and anomalous_recent >= 3
    if not holds:
        return None
    return Diagnosis("gradient_instability", "warning", 0.8,
                     f"actor/grad_norm std over the last 3 steps {spread:.3g} > 2x its mean "
                     f"{base[0]:.3g}; {anomalous_recent} of the last 5 steps anomalous",
                     {"actor/grad_norm": _ev(last3[-1], base[0], base[2], std_last3=_round(spread))})


def expected_lr(config: Mapping[str, Any], step: int) -> float | None:
    """verl's configured actor lr at ``step`` (constant or cosine, with linear warmup)."""
    def get(*names: str) -> Any:
        for name in names:
            if name in config and config[name] is not None:
                return config[name]
        return None

    base = get("actor_rollout_ref.actor.optim.lr")
    if not isinstance(base, (int, float)) or base <= 0:
        return None
    total = get("actor_rollout_ref.actor.optim.total_training_steps", "trainer.total_training_steps")
    warmup = get("actor_rollout_ref.actor.optim.lr_warmup_steps")
    ratio = get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    style = get("actor_rollout_ref.actor.optim.lr_scheduler_type",
                "actor_rollout_ref.actor.optim.warmup_style") or "constant"
    min_ratio = get("actor_rollout_ref.actor.optim.min_lr_ratio") or 0.0
    if not isinstance(warmup, (int, float)) or warmup < 0:
        warmup = int(float(ratio or 0.0) * float(total or 0))
    if step < warmup:
        return float(base) * step / max(1.0, float(warmup))
    if style == "cosine" and isinstance(total, (int, float)) and total > warmup:
        progress = min(1.0, (step - warmup) / (float(total) - warmup))
        return float(base) * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return float(base)


def rule_lr_drift(ctx: StepContext) -> Diagnosis | None:
    lr = ctx.role("lr")
    if lr is None:
        return None
    candidates = [e for e in (expected_lr(ctx.config, ctx.step), expected_lr(ctx.config, ctx.step - 1),
                              expected_lr(ctx.config, ctx.step + 1)) if e is not None]
    if not candidates:
        return None
    best = min(candidates, key=lambda e: abs(lr - e))
    off = abs(lr - best) / best if best > 0 else (math.inf if lr > 0 else 0.0)
    holds = off > 0.10
    n = ctx.bump("lr", holds)
    if n < 3:
        return None
    return Diagnosis("lr_drift", "warning", min(1.0, 0.6 + 0.1 * n),
                     f"actor/lr {lr:.3g} is {off:.0%} off the configured schedule ({best:.3g}) "
                     f"for {n} steps", {"actor/lr": _ev(lr, best, best * 1.1 if lr > best else best * 0.9)})


def rule_straggler(ctx: StepContext) -> Diagnosis | None:
    per_rank = {r: v["timing_s/rank_step"] for r, v in ctx.ranks.items()
                if math.isfinite(v.get("timing_s/rank_step", math.nan))}
    if len(per_rank) < 3:
        ctx.streaks.pop("straggler_rank", None)
        return None
    values = sorted(per_rank.values())
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    slow_rank, slow = max(per_rank.items(), key=lambda kv: kv[1])
    scale = max(1.4826 * mad, 0.03 * med, 1e-6)
    holds = slow > 1.5 * med and (slow - med) / scale > 5
    prev = ctx.streaks.get("straggler_rank")
    if holds and prev == slow_rank:
        n = ctx.bump("straggler", True)
    else:
        ctx.streaks["straggler"] = 1 if holds else 0
        n = ctx.streaks["straggler"]
    ctx.streaks["straggler_rank"] = slow_rank if holds else -1
    if n < 3:
        return None
    host = ctx.hosts.get(slow_rank)
    where = f"rank {slow_rank}" + (f" on {host}" if host else "")
    return Diagnosis("straggler", "warning", min(1.0, 0.6 + 0.1 * n),
                     f"{where} takes {slow:.3g}s per step, {slow / med:.1f}x the peers' median "
                     f"{med:.3g}s, for {n} steps",
                     {f"timing_s/rank_step[rank={slow_rank}]": _ev(slow, med, 1.5 * med, host=host)},
                     host=host, rank=slow_rank)


def rule_unknown(ctx: StepContext) -> Diagnosis | None:
    """Critical conditions no specific rule explained, and sustained anomalies of watched signals."""
    latency = ctx.role("latency")
    if latency is not None and latency > 5.0 and "latency" in ctx.role_findings:
        f = ctx.role_findings["latency"]
        return Diagnosis("unknown", "critical", 0.5,
                         f"{f.key} {f.value:.3g}s, {f.value / max(f.baseline, 1e-9):.1f}x its baseline, "
                         "with no input-pipeline or compute pattern: generation may be stuck",
                         {f.key: f.evidence()},
                         critical_reason="rollout latency anomalous and above 5 s")
    sustained = []
    for key, f in ctx.findings.items():
        if f.score < 2.0:
            continue
        n = ctx.streaks.get(f"u:{key}", 0) + 1
        ctx.streaks[f"u:{key}"] = n
        if n >= 5:
            sustained.append(f)
    strong = {k for k, f in ctx.findings.items() if f.score >= 2.0}
    for key in [k for k in ctx.streaks if k.startswith("u:") and k[2:] not in strong]:
        del ctx.streaks[key]
    if not sustained:
        return None
    sustained.sort(key=lambda f: -f.score)
    return Diagnosis("unknown", "warning", 0.3,
                     f"{len(sustained)} signal(s) outside their healthy band for 5+ steps: "
                     + ", ".join(f.key for f in sustained[:3]),
                     {f.key: f.evidence() for f in sustained[:5]})


RULES: tuple[Callable[[StepContext], Diagnosis | None], ...] = (
    rule_nan_loss, rule_stalled_learning, rule_numeric_underflow, rule_dataloader_stall,
    rule_straggler, rule_comm_degradation, rule_memory_leak, rule_entropy_collapse, rule_kl_drift,
    rule_lr_drift, rule_gradient_instability, rule_unknown,
)


def diagnose(ctx: StepContext) -> list[Diagnosis]:
    """All diagnoses of a step, most specific first; ones explained by a more specific
    diagnosis (sharing an evidence signal) are dropped from the list and returned as
    that diagnosis's secondary labels by the engine."""
    out = [d for rule in RULES if (d := rule(ctx)) is not None]
    out.sort(key=lambda d: (-d.specificity, d.label))
    return out
