"""Cross-layer diagnosis rules over one joined step of a run.

Each rule reads a :class:`StepContext` (the step's values by key and by role, the
findings of the signal monitors, short per-role histories and per-rank values) and
returns a :class:`Diagnosis` or None. Rules are pure functions of the context plus the
per-run state they own: ``streaks`` counters and ``rule:*`` histories in ``history``,
both persisted (pickled) with the run's state, so a restarted worker resumes mid-streak.

The rules follow DOMAIN.md's operators' table and predictive signs; docs/diagnosis.md
gives every condition and threshold. Two principles:

- *Absolute checks where a healthy baseline may not exist* (a run dead from step 1,
  a NaN, an lr off its configured schedule); adaptive ones everywhere else.
- *The healthy look-alikes stay quiet*: planned lr steps, long validation steps, single
  zero-gradient GRPO steps, single grad-norm spikes, slowly growing KL, entropy falling
  while reward rises.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from detectors.monitor import Finding, _round
from producers.layers import signal_info

__all__ = ["StepContext", "Diagnosis", "RULES", "diagnose", "expected_lr", "parse_milestones",
           "peer_outlier", "PeerOutlier", "SPECIFICITY", "LR_MILESTONES_KEY"]

#: Higher wins when several diagnoses explain the same signals (shared evidence keys).
SPECIFICITY: dict[str, int] = {
    "nan_loss": 100, "training_hang": 95, "stalled_learning": 90, "numeric_underflow": 85,
    "straggler": 82, "dataloader_stall": 80, "comm_degradation": 75, "memory_leak": 70,
    "entropy_collapse": 65, "kl_drift": 60, "lr_drift": 55, "gradient_instability": 50,
    "unknown": 0,
}

#: trainsentry's own config extension: planned lr steps, ``"step:factor,..."`` (the
#: schedule times ``factor`` from ``step`` on). verl has no such key; a trainer (or the
#: simulator) that changes lr on purpose puts it in ``run_started``'s config.
LR_MILESTONES_KEY = "actor_rollout_ref.actor.optim.lr_milestones"


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
    history: MutableMapping[str, deque[float]]  # role -> recent values (this step last)
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

    def series(self, name: str, maxlen: int = 64) -> deque[float]:
        """A rule-owned history (kept in the run state next to the role histories)."""
        key = f"rule:{name}"
        h = self.history.get(key)
        if h is None:
            h = self.history[key] = deque(maxlen=maxlen)
        return h


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
    #: The summary in Chinese, with the same figures (chat messages in zh show it).
    summary_zh: str | None = None

    @property
    def specificity(self) -> int:
        return SPECIFICITY.get(self.label, 0)


def _ev(value: float, baseline: float | None, bound: float | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"value": _round(value)}
    out["baseline"] = None if baseline is None else _round(baseline)
    out["bound"] = None if bound is None else _round(bound)
    out.update({k: (_round(v) if isinstance(v, float) else v) for k, v in extra.items()})
    return out


def _finding_ev(ctx: StepContext, role: str) -> dict[str, dict[str, Any]]:
    f = ctx.role_findings.get(role)
    if f is not None:
        return {f.key: f.evidence()}
    return {}


def _role_ev(ctx: StepContext, role: str, key: str, **extra: Any) -> dict[str, dict[str, Any]]:
    """Evidence for a role's value against its monitor's band (bound on the value's side)."""
    value = ctx.roles.get(role)
    if value is None:
        return {}
    f = ctx.role_findings.get(role)
    if f is not None:
        key = f.key
    base = ctx.baselines.get(role)
    if base is None:
        return {key: _ev(value, None, None, **extra)}
    mean, lower, upper = base
    return {key: _ev(value, mean, upper if value >= mean else lower, **extra)}


def _ratio(ctx: StepContext, role: str) -> float | None:
    """The role's value over its baseline mean (None without a warm baseline)."""
    value, base = ctx.roles.get(role), ctx.baselines.get(role)
    if value is None or base is None or base[0] <= 0:
        return None
    return value / base[0]


# --------------------------------------------------------------------------- nan_loss
def rule_nan_loss(ctx: StepContext) -> Diagnosis | None:
    """Any non-finite loss or gradient norm (DOMAIN critical condition): at once, critical."""
    bad = [k for k in ctx.nonfinite if "loss" in k or "grad_norm" in k]
    n = ctx.bump("nan_loss", bool(bad))
    if not bad:
        return None
    ev = {}
    for k in bad:
        last = ctx.series(f"finite:{k}", 1)
        ev[k] = _ev(ctx.values.get(k, math.nan), last[-1] if last else None, None,
                    bound_kind="finite")
    return Diagnosis("nan_loss", "critical", 1.0,
                     f"{', '.join(bad)} non-finite at step {ctx.step} ({n} step(s) in a row); "
                     "verl skips the optimizer step on a NaN gradient, so the run may look alive",
                     ev, critical_reason="non-finite loss or gradient norm",
                     summary_zh=f"{', '.join(bad)} 在第 {ctx.step} 步出现非有限值（NaN/Inf，已连续 "
                     f"{n} 步）；梯度为 NaN 时 verl 会跳过优化器更新，训练看起来可能仍在正常运行")


def _remember_finite(ctx: StepContext) -> None:
    for k, v in ctx.values.items():
        if ("loss" in k or "grad_norm" in k) and math.isfinite(v):
            ctx.series(f"finite:{k}", 1).append(v)


# --------------------------------------------------------------------------- stalled_learning
#: Consecutive steps needed, by how many of (uniform reward, responses capped, zero
#: gradient/advantage) hold: all three are conclusive fast; fewer need more patience.
STALL_STEPS_ALL = 2
STALL_STEPS_CAPPED = 3
STALL_STEPS_UNIFORM_ZERO = 8
STALL_STEPS_CAPPED_ONLY = 10
STALL_CRITICAL_STEPS = 20


def rule_stalled_learning(ctx: StepContext) -> Diagnosis | None:
    """No learning signal, step after step (absolute checks: a run dead from step 1 has no baseline).

    Healthy look-alike: single GRPO steps where every group is uniform (grad exactly 0)
    while learning goes on; they break the streak, and a streak of uniform-and-zero
    without capped responses needs 8 steps.
    """
    grad = ctx.values.get("actor/grad_norm")
    smin, smax = ctx.role("score_min"), ctx.role("score_max")
    amax, amin = ctx.role("adv_max"), ctx.role("adv_min")
    clip = ctx.role("clip_ratio")
    uniform = smin is not None and smax is not None and abs(smax - smin) < 1e-9
    capped = clip is not None and clip >= 0.95
    zero_grad = grad is not None and math.isfinite(grad) and abs(grad) < 1e-8
    tiny_adv = (amax is not None and amin is not None and max(abs(amax), abs(amin)) < 0.1)
    zero = zero_grad or tiny_adv
    count = int(uniform) + int(capped) + int(zero)
    n = ctx.bump("stalled", count >= 2)
    n_cap = ctx.bump("stalled_capped", capped)
    if count == 3:
        need = STALL_STEPS_ALL
    elif count == 2:
        need = STALL_STEPS_CAPPED if capped else STALL_STEPS_UNIFORM_ZERO
    else:
        need = STALL_STEPS_CAPPED_ONLY
    streak = n if count >= 2 else n_cap
    if streak < need:
        return None
    ev: dict[str, dict[str, Any]] = {}
    if grad is not None:
        base = ctx.baselines.get("grad_norm")
        ev["actor/grad_norm"] = _ev(grad, base[0] if base else None, 0.0, steps=streak)
    if smin is not None and smax is not None:
        ev["critic/score/max-min"] = _ev(smax - smin, None, 0.0, min=smin, max=smax)
    if clip is not None:
        ev["response_length/clip_ratio"] = _ev(clip, None, 0.95)
    if amax is not None and amin is not None:
        ev["critic/advantages/max|min|"] = _ev(max(abs(amax), abs(amin)), None, 0.1)
    why, why_zh = [], []
    if uniform:
        why.append(f"every reward = {smax:.3g}")
        why_zh.append(f"所有奖励都等于 {smax:.3g}")
    if capped:
        why.append(f"{clip:.0%} of responses cut at the length cap")
        why_zh.append(f"{clip:.0%} 的回复被长度上限截断")
    if zero_grad:
        why.append("gradient norm exactly 0")
        why_zh.append("梯度范数恰好为 0")
    elif tiny_adv:
        why.append("advantages ~0")
        why_zh.append("优势值接近 0")
    critical = streak >= STALL_CRITICAL_STEPS
    return Diagnosis("stalled_learning", "critical" if critical else "warning",
                     min(1.0, 0.55 + 0.1 * count + streak / 100),
                     f"no learning signal for {streak} steps: {', '.join(why)}", ev,
                     critical_reason=(f"no learning signal for {STALL_CRITICAL_STEPS}+ steps"
                                      if critical else None),
                     summary_zh=f"已连续 {streak} 步没有学习信号：{'，'.join(why_zh)}")


# --------------------------------------------------------------------------- numeric_underflow
def rule_numeric_underflow(ctx: StepContext) -> Diagnosis | None:
    """Empty-response ratio anomalous and > 10% while response length collapses (operators' table)."""
    empty = ctx.role("empty_ratio")
    f_empty = ctx.role_findings.get("empty_ratio")
    length_drop = "response_length" in ctx.role_findings
    if empty is None or f_empty is None or empty <= 0.10 or not length_drop:
        return None
    critical = empty > 0.15
    # The bound a reader needs is the one this rule applied (the band's alone is ~0 on a
    # run that never had empty responses): the band or the 10 % / 15 % floor, the larger.
    ratio_ev = f_empty.evidence()
    ratio_ev["bound"] = _round(max(f_empty.bound, 0.15 if critical else 0.10))
    ev = {f_empty.key: ratio_ev, **_finding_ev(ctx, "response_length")}
    return Diagnosis("numeric_underflow", "critical" if critical else "warning", 0.9,
                     f"empty-response ratio {empty:.0%} while response length collapses "
                     "(logits underflow after softmax?)", ev,
                     critical_reason="empty-response ratio anomalous and above 15%" if critical else None,
                     summary_zh=f"空回复比例 {empty:.0%}，同时回复长度骤降（softmax 之后 logits 下溢？）")


# --------------------------------------------------------------------------- straggler
#: A rank is a straggler when its own step time is this many times the peers' median...
STRAGGLER_RATIO = 1.2
#: ...and this many robust standard deviations of the peers above it.
STRAGGLER_Z = 6.0
STRAGGLER_STEPS = 2


@dataclass(frozen=True)
class PeerOutlier:
    """The slowest rank (and every rank as slow as a straggler) against its peers."""

    rank: int
    value: float
    reference: float  #: the peers' median: the faster half of the ranks
    z: float  #: robust standard deviations of the peers above the reference
    slow_ranks: tuple[int, ...]  #: every outlying rank, slowest first


def peer_outlier(per_rank: Mapping[int, float]) -> PeerOutlier | None:
    """The slow rank(s), judged against the faster half of the ranks.

    The reference is the median of the faster half and the spread its MAD (floored at
    3% of the median), so up to half the ranks can be slow without hiding, it works
    from 2 ranks (the other one is the reference), and the whole run slowing down moves
    the reference with it.
    """
    if len(per_rank) < 2:
        return None
    ordered = sorted(per_rank.items(), key=lambda kv: (kv[1], kv[0]))
    peers = [v for _r, v in ordered[: (len(ordered) + 1) // 2]]
    ref = statistics.median(peers)
    if ref <= 0:
        return None
    scale = max(1.4826 * statistics.median(abs(v - ref) for v in peers), 0.03 * ref)
    slow = [(r, v) for r, v in reversed(ordered)
            if v >= STRAGGLER_RATIO * ref and (v - ref) / scale >= STRAGGLER_Z]
    if not slow:
        return None
    rank, value = slow[0]
    return PeerOutlier(rank, value, ref, (value - ref) / scale, tuple(r for r, _v in slow))


def _rank_times(ctx: StepContext) -> dict[int, float]:
    return {r: v["timing_s/rank_step"] for r, v in ctx.ranks.items()
            if math.isfinite(v.get("timing_s/rank_step", math.nan))}


def rule_straggler(ctx: StepContext) -> Diagnosis | None:
    """One rank's own step time far above its peers' (``timing_s/rank_step``), 2 steps running."""
    out = peer_outlier(_rank_times(ctx))
    prev = ctx.streaks.get("straggler_rank", -1)
    if out is None:
        ctx.streaks["straggler"] = 0
        ctx.streaks["straggler_rank"] = -1
        return None
    rank, slow, med = out.rank, out.value, out.reference
    n = ctx.streaks.get("straggler", 0) + 1 if prev == rank else 1
    ctx.streaks["straggler"] = n
    ctx.streaks["straggler_rank"] = rank
    if n < STRAGGLER_STEPS:
        return None
    host = ctx.hosts.get(rank)
    where = f"rank {rank}" + (f" on {host}" if host else "")
    where_zh = f"rank {rank}" + (f"（{host}）" if host else "")
    if len(out.slow_ranks) > 1:
        hosts = {ctx.hosts.get(r) for r in out.slow_ranks}
        others = ", ".join(str(r) for r in out.slow_ranks[1:])
        whole_host = len(hosts) == 1 and bool(host)
        where += (f" (with ranks {others}: the whole host looks slow)"
                  if whole_host else f" (ranks {others} are slow too)")
        where_zh += (f"（连同 rank {others}：整台主机都偏慢）" if whole_host
                     else f"（rank {others} 也偏慢）")
    ev = {f"timing_s/rank_step[rank={rank}]": _ev(slow, med, STRAGGLER_RATIO * med, host=host,
                                                  peer_z=out.z, ranks=len(ctx.ranks),
                                                  slow_ranks=list(out.slow_ranks))}
    peer_util = [v["gpu/utilization_pct"] for r, v in ctx.ranks.items()
                 if r != rank and "gpu/utilization_pct" in v]
    own_util = ctx.ranks.get(rank, {}).get("gpu/utilization_pct")
    extra = extra_zh = ""
    if peer_util and own_util is not None:
        pu = statistics.median(peer_util)
        ev[f"gpu/utilization_pct[rank={rank}]"] = _ev(own_util, pu, None)
        if own_util > pu + 10:
            extra = f"; its GPU is busy ({own_util:.0f}%) while the peers wait ({pu:.0f}%)"
            extra_zh = f"；它的 GPU 很忙（{own_util:.0f}%），其他 rank 在等待（{pu:.0f}%）"
    temp = ctx.ranks.get(rank, {}).get("gpu/temperature_c")
    if temp is not None and temp >= 85:
        extra += f"; GPU at {temp:.0f} °C (thermal throttling?)"
        extra_zh += f"；GPU 温度 {temp:.0f} °C（是否过热降频？）"
    return Diagnosis("straggler", "warning", min(1.0, 0.7 + 0.05 * n),
                     f"{where} takes {slow:.3g}s per step, {slow / med:.1f}x the peers' median "
                     f"{med:.3g}s, for {n} steps{extra}", ev, host=host, rank=rank,
                     summary_zh=f"{where_zh} 每步耗时 {slow:.3g}s，是其他 rank 中位数 {med:.3g}s 的 "
                     f"{slow / med:.1f} 倍，已持续 {n} 步{extra_zh}")


# --------------------------------------------------------------------------- dataloader_stall
#: Forward time above this multiple of its baseline means the model itself is slower.
FORWARD_UP_RATIO = 1.2


def rule_dataloader_stall(ctx: StepContext) -> Diagnosis | None:
    """Latency up + GPU util down + forward time *not* up: the input pipeline starves the GPUs.

    Not when one rank is a peer-relative outlier (a straggler also idles its peers) and
    not when forward time rose (then it is the model, not the data).
    """
    f_lat = ctx.role_findings.get("latency") or ctx.role_findings.get("step_time")
    util = ctx.role("gpu_util")
    if f_lat is None or util is None:
        ctx.bump("stall", False)
        return None
    util_base = ctx.baselines.get("gpu_util")
    util_low = "gpu_util" in ctx.role_findings or util < 30.0
    fwd_ratio = _ratio(ctx, "forward_time")
    forward_up = "forward_time" in ctx.role_findings or (fwd_ratio is not None
                                                         and fwd_ratio > FORWARD_UP_RATIO)
    straggling = peer_outlier(_rank_times(ctx)) is not None
    holds = util_low and not forward_up and not straggling
    n = ctx.bump("stall", holds)
    if not holds:
        return None
    ev = {f_lat.key: f_lat.evidence()}
    ev["gpu/utilization_pct"] = _ev(util, util_base[0] if util_base else None,
                                    util_base[1] if util_base else 30.0)
    fwd = ctx.role("forward_time")
    if fwd is not None:
        fb = ctx.baselines.get("forward_time")
        ev["forward_time (old_log_prob+ref+values)"] = _ev(
            fwd, fb[0] if fb else None, fb[0] * FORWARD_UP_RATIO if fb else None, flat=True)
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
        "the input pipeline or disk I/O starves the GPUs", ev,
        critical_reason="rollout latency anomalous and above 5 s" if critical else None,
        summary_zh=f"GPU 利用率仅 {util:.0f}%，{f_lat.key} 是基线的 {ratio:.1f} 倍，前向时间持平："
        "输入管线或磁盘 I/O 跟不上，GPU 在空等")


# --------------------------------------------------------------------------- comm_degradation
def rule_comm_degradation(ctx: StepContext) -> Diagnosis | None:
    """Weight-sync / all-reduce time anomalous, above 0.5 s and >= 1.5x its baseline.

    Two steps running (a single sync hiccup is not a degradation) unless 3x or more.
    """
    f = ctx.role_findings.get("comm_time")
    comm = ctx.role("comm_time")
    ratio = f.value / f.baseline if f is not None and f.baseline > 0 else math.inf
    holds = f is not None and comm is not None and comm > 0.5 and ratio >= 1.5
    n = ctx.bump("comm", holds)
    if f is None or not holds or (n < 2 and ratio < 3.0):
        return None
    share = share_zh = ""
    step = ctx.role("step_time")
    if step and step > 0 and comm is not None:
        share = f" ({comm / step:.0%} of the step)"
        share_zh = f"（占每步时间的 {comm / step:.0%}）"
    return Diagnosis("comm_degradation", "warning", min(1.0, 0.6 + 0.1 * n),
                     f"{f.key} {f.value:.3g}s, {ratio:.1f}x its baseline {f.baseline:.3g}s{share}: "
                     "NCCL / network", {f.key: f.evidence()},
                     summary_zh=f"{f.key} 为 {f.value:.3g}s，是基线 {f.baseline:.3g}s 的 {ratio:.1f} 倍"
                     f"{share_zh}：NCCL / 网络问题")


# --------------------------------------------------------------------------- memory_leak
#: Windows (steps) over which a monotone climb is tested, shortest first.
LEAK_WINDOWS = (6, 10, 16, 24)
LEAK_T = 8.0  #: slope t-statistic
LEAK_UP_SHARE = 0.8  #: share of step-to-step differences that must be increases
LEAK_MIN_RISE_FRAC = 0.004  #: the climb over the window, as a share of capacity...
LEAK_NOISE_MULT = 6.0  #: ...and in units of the gauge's step-to-step noise
LEAK_MIN_BEFORE = 9  #: values before the window, to estimate that noise


def _capacity(ctx: StepContext) -> float:
    total = ctx.role("gpu_mem_total")
    return total if total and total > 0 else 80.0


def _slope(ys: list[float]) -> float:
    """Least-squares slope per step."""
    w = len(ys)
    xm, ym = (w - 1) / 2, sum(ys) / w
    sxx = sum((i - xm) ** 2 for i in range(w))
    return sum((i - xm) * (v - ym) for i, v in enumerate(ys)) / sxx


def _climb(ys: list[float], cap: float) -> tuple[int, float, float] | None:
    """(window, slope per step, t) of the shortest window with a significant monotone climb.

    The climb must also beat the series' own step-to-step noise, estimated robustly from
    the values before the window: a flat but noisy gauge can drift up for a few steps.
    """
    for w in LEAK_WINDOWS:
        if len(ys) < w + LEAK_MIN_BEFORE:
            break
        y = ys[-w:]
        # Cheapest test first: a monotone climb needs most differences to be increases.
        ups = sum(1 for a, c in zip(y, y[1:], strict=False) if c > a)
        if ups < LEAK_UP_SHARE * (w - 1):
            continue
        xm = (w - 1) / 2
        sxx = sum((i - xm) ** 2 for i in range(w))
        ym = sum(y) / w
        b = _slope(y)
        if b <= 0:
            continue
        resid = [v - (ym + b * (i - xm)) for i, v in enumerate(y)]
        s2 = sum(r * r for r in resid) / (w - 2)
        t = b / math.sqrt(s2 / sxx) if s2 > 0 else math.inf
        before = ys[:-w]
        diffs = [abs(c - a) for a, c in zip(before, before[1:], strict=False)]
        noise = 1.4826 * statistics.median(diffs) / math.sqrt(2)
        rise = b * (w - 1)
        if (t >= LEAK_T
                and rise >= max(LEAK_MIN_RISE_FRAC * cap, LEAK_NOISE_MULT * noise)):
            return w, b, t
    return None


def rule_memory_leak(ctx: StepContext) -> Diagnosis | None:
    """GPU memory climbing step after step: a significant, monotone linear climb, with the
    projected steps to capacity (warns long before the 95% line)."""
    cap = _capacity(ctx)
    climbs: dict[str, tuple[int, float, float]] = {}
    series: dict[str, list[float]] = {}
    for role in ("gpu_mem", "actor_mem"):
        value = ctx.role(role)
        if value is None:
            continue
        hist = ctx.series(f"mem:{role}", 48)
        hist.append(value)
        series[role] = list(hist)
        found = _climb(series[role], cap)
        if found is not None:
            climbs[role] = found
    n = ctx.bump("leak", bool(climbs))
    if not climbs:
        return None
    keys = {"gpu_mem": "gpu/memory_used_gb", "actor_mem": "actor/perf/max_memory_allocated_gb"}
    ev: dict[str, dict[str, Any]] = {}
    for role, (w, b, t) in climbs.items():
        ys = series[role]
        ev[keys[role]] = _ev(ys[-1], ys[-w], cap, per_step_gb=b, window_steps=w,
                             slope_t=min(t, 1e6))
    # Capacity is judged on what the device holds (the sampler's view) when there is one.
    role = "gpu_mem" if "gpu_mem" in series else "actor_mem"
    used = series[role][-1]
    w, slope, _t = climbs.get(role) or next(iter(climbs.values()))
    if role not in climbs:  # the device gauge is noisier: its own slope over the same window
        ys = series[role][-w:]
        slope = max(_slope(ys), slope * 0.5) if len(ys) >= 3 else slope
        ev[keys[role]] = _ev(used, ys[0], cap, per_step_gb=slope, window_steps=len(ys))
    steps_left = max(0.0, (cap - used) / slope)
    ev[keys[role]]["steps_to_capacity"] = _round(steps_left)
    critical = used >= 0.95 * cap or steps_left <= 10
    return Diagnosis("memory_leak", "critical" if critical else "warning",
                     min(1.0, 0.7 + 0.03 * n),
                     f"GPU memory climbing {slope:.3g} GB/step for {w}+ steps ({used:.1f}/{cap:.0f} GB): "
                     f"~{steps_left:.0f} steps to capacity", ev,
                     critical_reason=("GPU memory above 95% of capacity or out of memory within 10 steps"
                                      if critical else None),
                     summary_zh=f"GPU 显存每步增长 {slope:.3g} GB，已持续 {w}+ 步（{used:.1f}/{cap:.0f} "
                     f"GB）：约 {steps_left:.0f} 步后耗尽")


# --------------------------------------------------------------------------- entropy_collapse
ENTROPY_RATIO = 0.5  #: entropy below this share of its recent median...
ENTROPY_RATIO_PREV = 0.6  #: ...and the step before below this one
ENTROPY_CRITICAL_RATIO = 0.35


def rule_entropy_collapse(ctx: StepContext) -> Diagnosis | None:
    """Entropy falls to under half its recent median within a few steps, two steps running.

    The baseline is the median of the 3rd..14th latest values, so a collapse does not
    hide in its own baseline and single noisy dips do not fire. A steady fall over the
    run (normal while reward and validation rise) is far slower than this.
    """
    ent = ctx.role("entropy")
    hist = ctx.series("entropy", 16)
    ratios = ctx.series("entropy_ratio", 2)
    score = ctx.series("score_for_entropy", 8)
    s = ctx.role("score")
    if s is not None:
        score.append(s)
    if ent is None:
        return None
    hist.append(ent)
    values = list(hist)
    if len(values) < 5:
        ratios.append(1.0)
        return None
    base = statistics.median(values[-14:-3])
    ratio = ent / base if base > 0 else 1.0
    prev = ratios[-1] if ratios else 1.0
    ratios.append(ratio)
    holds = ratio < ENTROPY_RATIO and prev < ENTROPY_RATIO_PREV and base - ent > 0.01
    n = ctx.bump("entropy", holds)
    if not holds:
        return None
    ev = {"actor/entropy": _ev(ent, base, ENTROPY_RATIO * base, ratio=ratio)}
    extra, extra_zh = [], []
    if len(score) >= 4 and score[-1] > score[0]:
        extra.append("reward still rising (possible reward hacking)")
        extra_zh.append("奖励仍在上升（可能是 reward hacking）")
    kl_hist = ctx.history.get("kl")
    f_kl = ctx.role_findings.get("kl")
    if f_kl is not None and kl_hist and len(kl_hist) >= 4 and kl_hist[-1] > kl_hist[-4]:
        # KL running away with it: the same evidence makes a kl_drift of this step secondary.
        extra.append("KL rising past its band")
        extra_zh.append("KL 上升并超出健康区间")
        ev[f_kl.key] = f_kl.evidence()
    critical = ratio < ENTROPY_CRITICAL_RATIO
    return Diagnosis("entropy_collapse", "critical" if critical else "warning",
                     min(1.0, 0.7 + 0.1 * len(extra) + 0.05 * n),
                     f"policy entropy fell to {ent:.3g}, {ratio:.0%} of its recent median {base:.3g}"
                     + (f"; {', '.join(extra)}" if extra else ""), ev,
                     critical_reason="entropy collapsed below 35% of its recent level" if critical else None,
                     summary_zh=f"策略熵降至 {ent:.3g}，仅为近期中位数 {base:.3g} 的 {ratio:.0%}"
                     + (f"；{'，'.join(extra_zh)}" if extra_zh else ""))


# --------------------------------------------------------------------------- kl_drift
KL_ABS = 0.3  #: DOMAIN predictive sign: KL above 0.3
KL_CRITICAL = 0.8  #: DOMAIN critical condition: KL anomalous and above 0.8
KL_RATE = 0.02  #: KL gained per step over the last 3, all rising...
KL_RATE_MIN = 0.1  #: ...once KL is at least this


def rule_kl_drift(ctx: StepContext) -> Diagnosis | None:
    """KL anomalous against its band and rising one-sidedly: above 0.3, or gaining more than
    0.02 per step for 3 steps running (above 0.1). Slow healthy growth (a few 1e-3 per
    step, saturating) never reaches either."""
    f = ctx.role_findings.get("kl")
    kl = ctx.role("kl")
    hist = ctx.history.get("kl")
    if kl is None or not hist or len(hist) < 4:
        ctx.bump("kl", False)
        return None
    h = list(hist)
    diffs = [b - a for a, b in zip(h[-4:], h[-3:], strict=False)]
    rate = (h[-1] - h[-4]) / 3
    rising = h[-1] > h[-4]
    fast = all(d > 0 for d in diffs) and rate >= KL_RATE and kl >= KL_RATE_MIN
    # Once established, the drift holds while KL stays high and rising even after the
    # band has adapted to it (the monitor learns a level shift after window/4 steps).
    established = ctx.streaks.get("kl", 0) >= 2
    holds = (f is not None or established) and rising and (kl > KL_ABS or fast)
    n = ctx.bump("kl", holds)
    if not holds or n < 2:
        return None
    if f is not None:
        key, base, bound = f.key, f.baseline, f.bound
    else:
        key = next((k for k in ctx.values if signal_info(k).role == "kl"
                    and ctx.values[k] == kl), "kl")
        b = ctx.baselines.get("kl")
        base, bound = (b[0], b[2]) if b else (h[-4], KL_ABS)
    critical = kl > KL_CRITICAL
    return Diagnosis("kl_drift", "critical" if critical else "warning", min(1.0, 0.6 + 0.1 * n),
                     f"{key} {kl:.3g} and rising for {n} steps ({rate:+.3g}/step; "
                     f"baseline {base:.3g})",
                     {key: _ev(kl, base, bound, per_step=rate, abs_bound=KL_ABS)},
                     critical_reason="KL anomalous and above 0.8" if critical else None,
                     summary_zh=f"{key} 为 {kl:.3g}，已连续 {n} 步上升（每步 {rate:+.3g}；基线 "
                     f"{base:.3g}）")


# --------------------------------------------------------------------------- gradient_instability
GRAD_WINDOW = 6  #: recent non-zero steps judged
GRAD_Z = 3.5  #: robust z of log(grad_norm) that counts as an outlier
GRAD_MIN_BASE = 24  #: baseline values before any verdict
GRAD_MIN_SIGMA = 0.1  #: floor of the baseline's log spread (10%): short samples understate it


def rule_gradient_instability(ctx: StepContext) -> Diagnosis | None:
    """The gradient norm's spread jumps far above its history.

    In log space, with the spread of the earlier steps (robust: MAD, floored at 10%) as
    the yardstick: of the last 6 non-zero steps, 3+ lie more than 3.5 spreads beyond
    both the baseline median and the recent median, at least one of them below. Measuring
    from both makes a level shift (grad norm halving after a collapse) no instability, and
    requiring a low outlier keeps healthy spikes (they only go up) quiet. The DOMAIN sign (std of
    the last 3 > 2x the historical mean) is reported as evidence. Zero-gradient steps
    (uniform GRPO groups) are skipped.
    """
    g = ctx.values.get("actor/grad_norm")
    hist = ctx.series("log_grad", 96)
    raw = ctx.series("grad", 3)
    if g is None or not math.isfinite(g) or g <= 0:
        return None
    hist.append(math.log(g))
    raw.append(g)
    values = list(hist)
    if len(values) < GRAD_MIN_BASE + GRAD_WINDOW:
        return None
    base, recent = values[:-GRAD_WINDOW], values[-GRAD_WINDOW:]
    med = statistics.median(base)
    sigma = max(1.4826 * statistics.median(abs(v - med) for v in base), GRAD_MIN_SIGMA)
    centre = statistics.median(recent)
    low_ref, high_ref = min(centre, med), max(centre, med)
    n_up = sum(1 for v in recent if v > high_ref + GRAD_Z * sigma)
    n_down = sum(1 for v in recent if v < low_ref - GRAD_Z * sigma)
    holds = n_down >= 1 and n_up + n_down >= 3
    n = ctx.bump("grad", holds)
    if not holds:
        return None
    mean_hist = statistics.fmean(math.exp(v) for v in base)
    spread = statistics.pstdev(raw) if len(raw) >= 2 else 0.0
    return Diagnosis("gradient_instability", "warning", min(1.0, 0.6 + 0.05 * (n_up + n_down)),
                     f"actor/grad_norm erratic: {n_up + n_down} of the last {GRAD_WINDOW} steps "
                     f"more than {math.exp(GRAD_Z * sigma):.2g}x off its usual {math.exp(med):.3g} "
                     f"({n_down} below); std of the last 3 {spread:.3g} vs "
                     f"historical mean {mean_hist:.3g}",
                     {"actor/grad_norm": _ev(g, math.exp(med), math.exp(high_ref + GRAD_Z * sigma),
                                             lower_bound=math.exp(low_ref - GRAD_Z * sigma),
                                             std_last3=spread, historical_mean=mean_hist,
                                             outliers_up=n_up, outliers_down=n_down, steps=n)},
                     summary_zh=f"actor/grad_norm 剧烈波动：最近 {GRAD_WINDOW} 步中有 {n_up + n_down} 步"
                     f"偏离常值 {math.exp(med):.3g} 超过 {math.exp(GRAD_Z * sigma):.2g} 倍（其中 {n_down} "
                     f"步偏低）；最近 3 步标准差 {spread:.3g}，历史均值 {mean_hist:.3g}")


# --------------------------------------------------------------------------- lr_drift
def parse_milestones(raw: Any) -> list[tuple[int, float]]:
    """``"40:0.5,80:0.25"`` (or a list of pairs) → sorted ``[(40, 0.5), (80, 0.25)]``."""
    out: list[tuple[int, float]] = []
    if raw is None or raw == "":
        return out
    items: list[Any]
    if isinstance(raw, str):
        items = [p.split(":", 1) for p in raw.split(",") if ":" in p]
    elif isinstance(raw, (list, tuple)):
        items = [p for p in raw if isinstance(p, (list, tuple)) and len(p) == 2]
    else:
        return out
    for at, factor in items:
        try:
            out.append((int(float(at)), float(factor)))
        except (TypeError, ValueError):
            continue
    return sorted(out)


def expected_lr(config: Mapping[str, Any], step: int) -> float | None:
    """verl's configured actor lr at ``step`` (constant or cosine, linear warmup, planned
    milestones from :data:`LR_MILESTONES_KEY`).

    verl logs the lr before stepping the scheduler, so step N shows scheduler index N-1
    (with warmup, step 1 logs 0).
    """
    def get(*names: str) -> Any:
        for name in names:
            if name in config and config[name] is not None:
                return config[name]
        return None

    base = get("actor_rollout_ref.actor.optim.lr")
    if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
        return None
    total = get("actor_rollout_ref.actor.optim.total_training_steps", "trainer.total_training_steps")
    warmup = get("actor_rollout_ref.actor.optim.lr_warmup_steps")
    ratio = get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    style = get("actor_rollout_ref.actor.optim.lr_scheduler_type",
                "actor_rollout_ref.actor.optim.warmup_style") or "constant"
    min_ratio = float(get("actor_rollout_ref.actor.optim.min_lr_ratio") or 0.0)
    cycles = float(get("actor_rollout_ref.actor.optim.num_cycles") or 0.5)
    if not isinstance(warmup, (int, float)) or warmup < 0:
        warmup = int(float(ratio or 0.0) * float(total or 0))
    i = max(0, step - 1)
    if i < warmup:
        lr = float(base) * i / max(1.0, float(warmup))
    elif style == "cosine" and isinstance(total, (int, float)) and total > warmup:
        progress = min(1.0, (i - warmup) / max(1.0, float(total) - warmup))
        coef = 0.5 * (1 + math.cos(math.pi * 2.0 * cycles * progress))
        lr = float(base) * (min_ratio + (1 - min_ratio) * coef)
    else:
        lr = float(base)
    factor = 1.0
    for at, f in parse_milestones(config.get(LR_MILESTONES_KEY)):
        if step >= at:
            factor = f
    return lr * factor


LR_TOLERANCE = 0.10  #: DOMAIN: more than 10% off the configured schedule
LR_FLOOR = 0.01  #: absolute slack, as a share of the peak lr (warmup start, cosine tail)
LR_STEPS = 2


def rule_lr_drift(ctx: StepContext) -> Diagnosis | None:
    """actor/lr more than 10% off the configured schedule for 2 steps (off-by-one tolerant)."""
    lr = ctx.values.get("actor/lr")
    if lr is None or not math.isfinite(lr):
        return None
    peak = ctx.config.get("actor_rollout_ref.actor.optim.lr")
    candidates = [e for e in (expected_lr(ctx.config, s) for s in (ctx.step, ctx.step - 1,
                                                                    ctx.step + 1)) if e is not None]
    if not candidates or not isinstance(peak, (int, float)):
        return None
    best = min(candidates, key=lambda e: abs(lr - e))
    slack = LR_TOLERANCE * best + LR_FLOOR * float(peak)
    holds = abs(lr - best) > slack
    n = ctx.bump("lr", holds)
    if n < LR_STEPS:
        return None
    off = abs(lr - best) / best if best > 0 else math.inf
    bound = best + slack if lr > best else best - slack
    return Diagnosis("lr_drift", "warning", min(1.0, 0.7 + 0.05 * n),
                     f"actor/lr {lr:.3g} is {off:.0%} {'above' if lr > best else 'below'} the "
                     f"configured schedule ({best:.3g}) for {n} steps",
                     {"actor/lr": _ev(lr, best, bound, steps=n)},
                     summary_zh=f"actor/lr 为 {lr:.3g}，{'高于' if lr > best else '低于'}配置的学习率计划"
                     f"（{best:.3g}）{off:.0%}，已持续 {n} 步")


# --------------------------------------------------------------------------- unknown
#: Roles whose slow trends are normal learning dynamics, judged by their own rules only.
_TREND_ROLES = {"kl", "policy_kl", "entropy", "response_length"}
UNKNOWN_SUSTAIN = 5


def rule_unknown(ctx: StepContext) -> Diagnosis | None:
    """Anomalous, but no pattern fits: the critical latency condition, or a watched signal
    far outside its band for 5+ steps. Any specific diagnosis of the step absorbs it."""
    latency = ctx.role("latency")
    length = ctx.role("response_length")
    per_token = ctx.series("latency_per_len", 32)
    explained = False
    if latency is not None and length is not None and length > 0:
        ratio_now = latency / length
        if len(per_token) >= 5:
            # Generation slower because responses are longer (e.g. all at the length cap)
            # is not "stuck": judge latency per response length.
            explained = ratio_now < 1.5 * statistics.median(per_token)
        if "latency" not in ctx.role_findings:
            per_token.append(ratio_now)
    stuck = (latency is not None and latency > 5.0 and "latency" in ctx.role_findings
             and not explained)
    n_lat = ctx.bump("unknown_latency", stuck)
    if stuck and n_lat >= 2:
        f = ctx.role_findings["latency"]
        fwd = _ratio(ctx, "forward_time")
        slower = fwd is not None and fwd > FORWARD_UP_RATIO
        hint = f"; forward time is up too ({fwd:.1f}x): the model itself is slower" if slower else ""
        hint_zh = f"；前向时间也在上升（{fwd:.1f} 倍）：模型本身变慢了" if slower else ""
        return Diagnosis("unknown", "critical", 0.5,
                         f"{f.key} {f.value:.3g}s, {f.value / max(f.baseline, 1e-9):.1f}x its baseline "
                         f"for {n_lat} steps and no known pattern explains it (not the input "
                         f"pipeline, a straggler or longer responses): generation may be stuck{hint}",
                         {f.key: f.evidence()},
                         critical_reason="rollout latency anomalous and above 5 s",
                         summary_zh=f"{f.key} 为 {f.value:.3g}s，是基线的 "
                         f"{f.value / max(f.baseline, 1e-9):.1f} 倍，已持续 {n_lat} 步，且没有已知模式"
                         f"能解释（不是输入管线、慢节点或回复变长）：生成可能卡住了{hint_zh}")
    sustained = []
    strong = set()
    for key, f in ctx.findings.items():
        role = signal_info(key).role
        if f.score < 2.0 or role in _TREND_ROLES or (explained and role == "latency"):
            continue
        strong.add(key)
        n = ctx.streaks.get(f"u:{key}", 0) + 1
        ctx.streaks[f"u:{key}"] = n
        if n >= UNKNOWN_SUSTAIN:
            sustained.append(f)
    for key in [k for k in ctx.streaks if k.startswith("u:") and k[2:] not in strong]:
        del ctx.streaks[key]
    if not sustained:
        return None
    sustained.sort(key=lambda f: -f.score)
    return Diagnosis("unknown", "warning", 0.3,
                     f"{len(sustained)} signal(s) outside their healthy band for "
                     f"{UNKNOWN_SUSTAIN}+ steps: " + ", ".join(f.key for f in sustained[:3]),
                     {f.key: f.evidence() for f in sustained[:5]},
                     summary_zh=f"{len(sustained)} 个信号已连续 {UNKNOWN_SUSTAIN}+ 步超出健康区间："
                     + ", ".join(f.key for f in sustained[:3]))


def _bookkeeping(ctx: StepContext) -> Diagnosis | None:
    """Not a rule: state the rules read on later steps."""
    _remember_finite(ctx)
    return None


RULES: tuple[Callable[[StepContext], Diagnosis | None], ...] = (
    rule_nan_loss, rule_stalled_learning, rule_numeric_underflow, rule_straggler,
    rule_dataloader_stall, rule_comm_degradation, rule_memory_leak, rule_entropy_collapse,
    rule_kl_drift, rule_lr_drift, rule_gradient_instability, rule_unknown, _bookkeeping,
)


def diagnose(ctx: StepContext) -> list[Diagnosis]:
    """All diagnoses of a step, most specific first; the engine files the ones that share
    an evidence signal with a more specific diagnosis (and every ``unknown`` next to a
    specific one) as that diagnosis's secondary labels."""
    out = [d for rule in RULES if (d := rule(ctx)) is not None]
    out.sort(key=lambda d: (-d.specificity, d.label))
    return out
