"""Simulated verl runs: realistic PPO/GRPO metrics, optionally with one injected fault.

A :class:`Scenario` describes a run (algorithm, length, step time, ranks, lr schedule,
validation and checkpoint cadence) and at most one fault from the diagnosis vocabulary.
:func:`generate` turns it into the contract's event dicts (per-step MetricEvents split
by layer with :func:`producers.layers.split_metrics`, per-rank resource events,
heartbeats, checkpoints, run start/finish), deterministic from the scenario's seed.
Magnitudes, noise and trends are copied from real verl traces (see docs/simulator.md).

Every random draw of step ``t`` comes from its own generator seeded with
``(seed, t, stream)``, so a faulty scenario and the same scenario without the fault
are identical before the onset: benchmarks can compare them step by step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from producers.layers import split_metrics
from trainsentry.errors import TrainsentryError
from trainsentry.events import MetricEvent, RunEvent, dumps, encode_metric_value

__all__ = [
    "FAULT_LABELS",
    "SCENARIO_LABELS",
    "Scenario",
    "scheduled_lr",
    "generate",
    "generate_file_logger_lines",
    "random_scenario",
    "write_jsonl",
    "publish",
    "event_kind",
    "add_cli",
    "cmd_simulate",
]

#: The faults the simulator can inject: the diagnosis vocabulary less ``unknown``.
FAULT_LABELS: tuple[str, ...] = (
    "dataloader_stall",
    "kl_drift",
    "numeric_underflow",
    "comm_degradation",
    "memory_leak",
    "nan_loss",
    "training_hang",
    "straggler",
    "gradient_instability",
    "lr_drift",
    "entropy_collapse",
    "stalled_learning",
)
#: What a scenario can be: ``healthy`` or one fault.
SCENARIO_LABELS: tuple[str, ...] = ("healthy", *FAULT_LABELS)

#: Steps a fault takes to reach full strength after its onset.
RAMP_STEPS = 4
#: A memory leak ends in an OOM crash once a rank passes this share of capacity.
OOM_FRACTION = 0.985
#: The validation set's key in verl's ``val-core/<data source>/acc/mean@1`` metrics.
VAL_SOURCE = "openai/gsm8k"

_STREAM_RUN, _STREAM_STEP, _STREAM_FAULT, _STREAM_HANG = 0, 1, 2, 3
_PHASES_GRPO = {"gen": 0.36, "reward": 0.003, "old_log_prob": 0.10, "ref": 0.11,
                "adv": 0.004, "update_actor": 0.33, "update_weights": 0.05}
_PHASES_PPO = {"gen": 0.20, "reward": 0.003, "old_log_prob": 0.05, "ref": 0.05,
               "values": 0.08, "adv": 0.002, "update_critic": 0.28, "update_actor": 0.28,
               "update_weights": 0.05}
_OVERHEAD = 0.01  # share of the step outside the named phases (logging, bookkeeping)
#: Phases that run on the GPUs; a straggling rank slows all of them (synchronous training).
_GPU_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")


@dataclass(frozen=True)
class Scenario:
    """One simulated run: its shape, its schedule and at most one injected fault."""

    run_id: str = "sim-run"
    seed: int = 0
    steps: int = 200
    algorithm: Literal["grpo", "ppo"] = "grpo"
    step_time_s: float = 20.0
    noise: float = 1.0
    ranks: int = 8
    gpus_per_host: int = 8
    gpu_memory_total_gb: float = 80.0
    # learning-rate schedule (verl's actor optim config)
    lr: float = 1e-6
    lr_warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    #: Planned lr changes: ``(step, factor)``, the schedule times ``factor`` from ``step`` on.
    lr_milestones: tuple[tuple[int, float], ...] = ()
    test_freq: int = 10
    save_freq: int = 20
    val_before_train: bool = True
    #: verl <= 0.5 times validation and checkpoint saving inside ``timing_s/step``.
    eval_in_step_timer: bool = True
    ckpt_dir: str = ""
    max_response_length: int = 1024
    #: GRPO: chance that a step has every group uniform (zero gradient), a healthy hard case.
    zero_grad_prob: float = 0.0
    #: Chance of a healthy single-step ``actor/grad_norm`` spike.
    grad_spike_prob: float = 0.01
    fault: str | None = None
    fault_onset: int | None = None
    fault_severity: float = 1.0
    fault_rank: int | None = None
    start_ts: float = 1764528000.0
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.fault == "healthy":
            object.__setattr__(self, "fault", None)
        if self.fault is not None and self.fault not in FAULT_LABELS:
            raise ValueError(f"unknown fault {self.fault!r}; valid: {', '.join(SCENARIO_LABELS)}")
        if self.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"algorithm must be 'grpo' or 'ppo', got {self.algorithm!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.steps < 1 or self.ranks < 1 or self.gpus_per_host < 1:
            raise ValueError("steps, ranks and gpus_per_host must be >= 1")
        if self.seed < 0:
            raise ValueError("seed must be >= 0")
        if not (self.step_time_s > 0 and self.noise >= 0 and self.fault_severity > 0):
            raise ValueError("step_time_s and fault_severity must be > 0, noise >= 0")
        if self.fault_onset is None:
            object.__setattr__(self, "fault_onset", max(1, self.steps // 2))
        assert self.fault_onset is not None
        if self.fault is None:  # the onset means nothing for a healthy run; keep it in range
            object.__setattr__(self, "fault_onset", min(max(1, self.fault_onset), self.steps))
        if not 1 <= self.fault_onset <= self.steps:
            raise ValueError(f"fault_onset must be in 1..{self.steps}, got {self.fault_onset}")
        if self.fault == "straggler" and self.ranks < 2:
            raise ValueError("a straggler needs ranks >= 2")
        if self.fault_rank is None:
            object.__setattr__(self, "fault_rank", self.ranks - 1)
        assert self.fault_rank is not None
        if not 0 <= self.fault_rank < self.ranks:
            raise ValueError(f"fault_rank must be in 0..{self.ranks - 1}")
        if not self.ckpt_dir:
            object.__setattr__(self, "ckpt_dir", f"/checkpoints/{self.run_id}")

    @property
    def label(self) -> str:
        """The scenario's ground truth: the fault, or ``healthy``."""
        return self.fault or "healthy"

    @property
    def onset(self) -> int:
        """The fault's first step (``fault_onset`` after defaults are applied)."""
        assert self.fault_onset is not None
        return self.fault_onset

    @property
    def hosts(self) -> int:
        """Number of nodes: ``ceil(ranks / gpus_per_host)``."""
        return -(-self.ranks // self.gpus_per_host)

    def host_of(self, rank: int) -> str:
        """The node a rank runs on (``node-0``, ``node-1``, ...)."""
        return f"node-{rank // self.gpus_per_host}"

    def is_test_step(self, step: int) -> bool:
        """verl validates every ``test_freq`` steps and after the last one."""
        return self.test_freq > 0 and (step % self.test_freq == 0 or step == self.steps)

    def is_save_step(self, step: int) -> bool:
        """verl saves every ``save_freq`` steps and after the last one."""
        return self.save_freq > 0 and (step % self.save_freq == 0 or step == self.steps)

    def verl_config(self) -> dict[str, Any]:
        """The flat, verl-style config carried by ``run_started`` (no hint of the fault)."""
        grpo = self.algorithm == "grpo"
        cfg: dict[str, Any] = {
            "algorithm.adv_estimator": "grpo" if grpo else "gae",
            "algorithm.use_kl_in_reward": not grpo,
            "actor_rollout_ref.actor.optim.lr": self.lr,
            "actor_rollout_ref.actor.optim.lr_warmup_steps": self.lr_warmup_steps,
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
            "actor_rollout_ref.actor.optim.warmup_style": self.lr_schedule,
            "actor_rollout_ref.actor.optim.lr_scheduler_type": self.lr_schedule,
            "actor_rollout_ref.actor.optim.min_lr_ratio": self.min_lr_ratio,
            "actor_rollout_ref.actor.optim.num_cycles": 0.5,
            "actor_rollout_ref.actor.use_kl_loss": grpo,
            "actor_rollout_ref.actor.kl_loss_coef": 0.001,
            "actor_rollout_ref.rollout.n": 5 if grpo else 1,
            "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
            "data.train_batch_size": 128 if grpo else 256,
            "data.max_prompt_length": 512,
            "data.max_response_length": self.max_response_length,
            "trainer.total_training_steps": self.steps,
            "trainer.save_freq": self.save_freq,
            "trainer.test_freq": self.test_freq,
            "trainer.val_before_train": self.val_before_train,
            "trainer.n_gpus_per_node": min(self.ranks, self.gpus_per_host),
            "trainer.nnodes": self.hosts,
            "trainer.default_local_dir": self.ckpt_dir,
            "trainer.experiment_name": self.run_id,
            "trainer.project_name": "trainsentry-sim",
            "n_gpus": self.ranks,
        }
        if not grpo:
            cfg["critic.optim.lr"] = 1e-5
            cfg["algorithm.kl_ctrl.kl_coef"] = 0.001
        if self.lr_milestones:
            # Not a verl key: trainsentry's spelling of planned lr steps ("step:factor,...").
            cfg["actor_rollout_ref.actor.optim.lr_milestones"] = ",".join(
                f"{s}:{f:g}" for s, f in sorted(self.lr_milestones))
        return cfg


def scheduled_lr(scenario: Scenario, step: int) -> float:
    """The actor lr verl logs at ``step`` under the scenario's schedule (no fault).

    verl reads the lr before stepping the scheduler, so step N uses scheduler index N-1:
    with warmup the first step logs 0.
    """
    i = max(0, step - 1)
    base, warm = scenario.lr, scenario.lr_warmup_steps
    if i < warm:
        lr = base * i / max(1, warm)
    elif scenario.lr_schedule == "cosine":
        progress = (i - warm) / max(1, scenario.steps - warm)
        coef = 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress))
        lr = base * (scenario.min_lr_ratio + (1.0 - scenario.min_lr_ratio) * coef)
    else:
        lr = base
    factor = 1.0
    for at, f in sorted(scenario.lr_milestones):
        if step >= at:
            factor = f
    return lr * factor


# --------------------------------------------------------------------------- internals


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, stream])


@dataclass(frozen=True)
class _Params:
    """A run's personality, drawn once from the seed."""

    entropy0: float
    entropy_end: float
    score0: float
    score_gain: float
    learn_speed: float
    kl_end: float
    resp_len0: float
    clip0: float
    prompt_len: float
    grad_norm0: float
    critic_grad0: float
    vf_loss0: float
    init_s: float
    testing_frac: float
    save_frac: float
    gpu_util0: float
    mem_frac: float
    actor_mem: float
    mfu0: float
    temp0: float
    io_wait0: float
    val_offset: float
    group_n: int
    batch: int
    rank_util_off: np.ndarray
    rank_mem_off: np.ndarray
    rank_temp_off: np.ndarray
    host_cpu: np.ndarray
    hang_spin: bool
    lr_drift_up: bool
    stalled_score: float
    leak_spread: np.ndarray


def _draw_params(sc: Scenario) -> _Params:
    r = _rng(sc.seed, 0, _STREAM_RUN)
    grpo = sc.algorithm == "grpo"
    cap = sc.max_response_length
    return _Params(
        entropy0=float(r.uniform(0.25, 0.6)),
        entropy_end=float(r.uniform(0.15, 0.5)),
        score0=float(r.uniform(0.05, 0.5)),
        score_gain=float(r.uniform(0.15, 0.4)),
        learn_speed=float(r.uniform(2.0, 5.0)),
        kl_end=float(r.uniform(0.03, 0.2)),
        resp_len0=float(r.uniform(0.2, 0.55) * cap),
        clip0=float(r.uniform(0.005, 0.05)),
        prompt_len=float(r.uniform(60.0, 160.0)),
        grad_norm0=float(r.uniform(0.12, 0.45) if grpo else r.uniform(1.2, 3.0)),
        critic_grad0=float(r.uniform(20.0, 120.0)),
        vf_loss0=float(r.uniform(0.5, 3.0)),
        init_s=float(r.uniform(30.0, 120.0)),
        testing_frac=float(r.uniform(0.4, 1.2)),
        save_frac=float(r.uniform(0.15, 0.45)),
        gpu_util0=float(r.uniform(72.0, 92.0)),
        mem_frac=float(r.uniform(0.6, 0.85)),
        actor_mem=float(r.uniform(0.3, 0.55) * sc.gpu_memory_total_gb),
        mfu0=float(r.uniform(0.15, 0.4)),
        temp0=float(r.uniform(55.0, 70.0)),
        io_wait0=float(r.uniform(0.5, 3.0)),
        val_offset=float(r.uniform(-0.1, 0.05)),
        group_n=5 if grpo else 1,
        batch=128 if grpo else 256,
        rank_util_off=r.normal(0.0, 2.0, sc.ranks),
        rank_mem_off=r.normal(0.0, 0.4, sc.ranks),
        rank_temp_off=r.normal(0.0, 2.0, sc.ranks),
        host_cpu=r.uniform(6.0, 30.0, sc.hosts),
        hang_spin=bool(r.random() < 0.5),
        lr_drift_up=bool(r.random() < 0.5),
        stalled_score=float(r.choice([0.0, -1.0])),
        leak_spread=r.uniform(0.9, 1.1, sc.ranks),
    )


@dataclass
class _Step:
    """One step's latent state: healthy values first, then the fault edits them."""

    entropy: float
    score: float
    score_max: float
    score_min: float
    kl: float
    ppo_kl: float
    resp_len: float
    resp_max: float
    resp_min: float
    clip_ratio: float
    aborted: float
    prompt_len: float
    pg_loss: float
    pg_clipfrac: float
    grad_norm: float
    adv_mean: float
    adv_max: float
    adv_min: float
    returns: float
    vf_loss: float
    critic_grad: float
    lr: float
    phases: dict[str, float]
    overhead: float
    testing: float | None
    save: float | None
    val_acc: float
    actor_mem: float
    mfu_scale: float
    util: np.ndarray
    mem: np.ndarray
    temp: np.ndarray
    rank_noise: np.ndarray
    io_rank: np.ndarray
    cpu_host: np.ndarray
    io_host: np.ndarray
    rank_step: np.ndarray | None = None
    nan_metrics: dict[str, float] = field(default_factory=dict)
    oom: bool = False


class _Simulator:
    """Builds one scenario's events; the only mutable state is the event list."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.p = _draw_params(sc)
        self.events: list[MetricEvent | RunEvent] = []
        self._base_phases = _PHASES_GRPO if sc.algorithm == "grpo" else _PHASES_PPO
        scale = (1.0 - _OVERHEAD) / sum(self._base_phases.values())
        self._phase_s = {k: v * scale * sc.step_time_s for k, v in self._base_phases.items()}

    # -- healthy dynamics -------------------------------------------------------------
    def _score_trend(self, t: int) -> float:
        p, sc = self.p, self.sc
        return p.score0 + p.score_gain * (1.0 - math.exp(-p.learn_speed * t / sc.steps))

    def _kl_trend(self, t: int) -> float:
        return self.p.kl_end * (1.0 - math.exp(-3.0 * t / self.sc.steps)) + 1e-4

    def _healthy(self, t: int) -> _Step:
        sc, p = self.sc, self.p
        r = _rng(sc.seed, t, _STREAM_STEP)
        nz = sc.noise
        frac = t / sc.steps

        def ln(sigma: float) -> float:
            """Multiplicative log-normal noise, scaled by the scenario's noise."""
            return float(np.exp(r.normal(0.0, sigma * nz)))

        grpo = sc.algorithm == "grpo"
        cap = float(sc.max_response_length)

        samples = p.batch * p.group_n
        s_mean = self._score_trend(t)
        s_std = math.sqrt(max(s_mean * (1 - s_mean), 1e-4) / samples) + 0.015
        score = float(np.clip(s_mean + r.normal(0.0, s_std * nz), 0.0, 1.0))

        resp = min(cap, p.resp_len0 * (1.0 - 0.15 * frac) * ln(0.03))
        clip = float(np.clip(p.clip0 * math.exp(-2.0 * frac) * ln(0.2), 0.0, 1.0))
        resp_max = cap if clip > 0.0008 else min(cap, resp * 2.5)

        grad = p.grad_norm0 * (1.0 + 0.3 * frac) * ln(0.12)
        if r.random() < sc.grad_spike_prob:
            grad *= float(r.uniform(3.0, 12.0))
        adv_edge = (p.group_n - 1) / math.sqrt(p.group_n) if grpo else 0.0
        adv_max = adv_edge - 1e-5 if grpo else float(r.uniform(3.0, 9.0))
        adv_min = -adv_edge + 1e-5 if grpo else -float(r.uniform(3.0, 8.0))
        adv_mean = float(r.normal(-0.02, 0.02)) if grpo else float(r.normal(0.0, 1e-8))
        pg_loss = float(r.normal(0.005, 0.004 * nz) if grpo else r.normal(-0.02, 0.05 * nz))
        clipfrac = (3e-4 if grpo else 2e-3) * ln(0.35)
        ppo_kl = float(r.normal(6e-5, 8e-5 * nz))
        zero_grad = grpo and r.random() < sc.zero_grad_prob
        if zero_grad:  # every group uniform: no advantage, no gradient (healthy)
            adv_mean = adv_max = adv_min = pg_loss = clipfrac = ppo_kl = grad = 0.0

        length_ratio = resp / p.resp_len0
        phases: dict[str, float] = {}
        warm = float(r.uniform(1.5, 2.0)) if t == 1 else 1.0  # first step: warm-up
        for name, base in self._phase_s.items():
            sigma = 0.06 if name == "gen" else 0.04
            scale = length_ratio if name in ("gen", "update_actor", "old_log_prob", "ref") else 1.0
            phases[name] = base * scale * ln(sigma) * (warm if name in _GPU_PHASES else 1.0)
        testing = (sc.step_time_s * p.testing_frac * ln(0.05)) if sc.is_test_step(t) else None
        save = (sc.step_time_s * p.save_frac * ln(0.1)) if sc.is_save_step(t) else None

        n, h = sc.ranks, sc.hosts
        util = np.clip(p.gpu_util0 + p.rank_util_off + r.normal(0.0, 2.5 * nz, n), 0.0, 100.0)
        mem_total = sc.gpu_memory_total_gb
        mem = p.mem_frac * mem_total + p.rank_mem_off + r.normal(0.0, 0.1 * nz, n)
        temp = p.temp0 + p.rank_temp_off + r.normal(0.0, 1.0, n)
        rank_noise = 1.0 + r.normal(0.0, 0.01 * nz, n)
        io_rank = np.exp(r.normal(0.0, 0.05 * nz, n))
        cpu_host = p.host_cpu * np.exp(r.normal(0.0, 0.08 * nz, h))
        io_host = p.io_wait0 * np.exp(r.normal(0.0, 0.25 * nz, h))

        return _Step(
            entropy=p.entropy0 * p.entropy_end ** frac * ln(0.03),
            score=score, score_max=1.0 if score > 0 else 0.0,
            score_min=0.0 if score < 1 else 1.0,
            kl=self._kl_trend(t) * ln(0.04), ppo_kl=ppo_kl,
            resp_len=resp, resp_max=resp_max, resp_min=float(round(r.uniform(5.0, 40.0))),
            clip_ratio=clip, aborted=0.0, prompt_len=p.prompt_len * ln(0.02),
            pg_loss=pg_loss, pg_clipfrac=clipfrac, grad_norm=grad,
            adv_mean=adv_mean, adv_max=adv_max, adv_min=adv_min,
            returns=float(s_mean * 0.88 + r.normal(0.0, 0.02)),
            vf_loss=p.vf_loss0 * (0.2 + 0.8 * math.exp(-5.0 * frac)) * ln(0.1),
            critic_grad=p.critic_grad0 * (0.1 + 0.9 * math.exp(-4.0 * frac)) * ln(0.35),
            lr=scheduled_lr(sc, t),
            phases=phases, overhead=_OVERHEAD * sc.step_time_s * ln(0.1),
            testing=testing, save=save,
            val_acc=float(np.clip(s_mean + p.val_offset + r.normal(0.0, 0.01), 0.0, 1.0)),
            actor_mem=p.actor_mem + float(r.normal(0.0, 0.002)),
            mfu_scale=ln(0.02),
            util=util, mem=mem, temp=temp, rank_noise=rank_noise, io_rank=io_rank,
            cpu_host=cpu_host, io_host=io_host,
        )

    # -- faults -----------------------------------------------------------------------
    def _ramp(self, t: int) -> float:
        if self.sc.fault is None or t < self.sc.onset:
            return 0.0
        return min(1.0, (t - self.sc.onset + 1) / RAMP_STEPS)

    def _apply_fault(self, st: _Step, t: int, kl_at_onset: float, ent_at_onset: float) -> None:
        sc, p = self.sc, self.p
        ramp = self._ramp(t)
        if ramp == 0.0:
            return
        s, k = sc.fault_severity, t - sc.onset
        fr = _rng(sc.seed, t, _STREAM_FAULT)
        cap = float(sc.max_response_length)
        fault = sc.fault
        if fault == "dataloader_stall":
            # Input starved: rollout waits on data; forward passes are untouched.
            st.phases["gen"] *= (1.0 + 6.0 * s * ramp) * float(np.exp(fr.normal(0.0, 0.1 * ramp)))
            target = float(np.clip(25.0 / s, 8.0, 30.0))
            st.util = np.clip(st.util * (1 - ramp) + ramp * (target + fr.normal(0, 3.0, sc.ranks)),
                              0.0, 100.0)
            st.io_host = st.io_host * (1.0 + 25.0 * s * ramp)
            st.cpu_host = st.cpu_host * (1.0 + 0.5 * ramp)  # D-state loader workers count in load
        elif fault == "kl_drift":
            st.kl += 0.045 * s * (k + 1) ** 1.2 * float(np.exp(fr.normal(0.0, 0.03)))
            st.ppo_kl = abs(st.ppo_kl) * (1.0 + 3.0 * ramp) + 1e-4 * ramp
            st.pg_clipfrac *= 1.0 + 2.0 * ramp
            st.score = max(0.0, st.score - 0.05 * s * ramp)
        elif fault == "numeric_underflow":
            st.aborted = ramp * min(0.6, 0.12 + 0.1 * s + 0.005 * s * k) + abs(fr.normal(0, 0.01))
            st.resp_len *= 1.0 - min(0.9, 0.55 + 0.25 * s) * ramp
            st.resp_min = 0.0
            st.clip_ratio *= 1.0 - ramp
            st.score *= 1.0 - st.aborted
            st.val_acc *= 1.0 - 0.7 * ramp
        elif fault == "comm_degradation":
            st.phases["update_weights"] = (st.phases["update_weights"] * (1.0 + 4.0 * s * ramp)
                                           + 0.6 * s * ramp)
            st.phases["update_actor"] *= 1.0 + 0.3 * s * ramp
            st.util = st.util * (1.0 - 0.2 * min(1.0, s) * ramp)
        elif fault == "memory_leak":
            head = OOM_FRACTION * sc.gpu_memory_total_gb - p.mem_frac * sc.gpu_memory_total_gb
            leak = head / max(12.0, 60.0 / s) * (k + 1)
            st.mem = st.mem + leak * p.leak_spread
            st.actor_mem += 0.9 * leak
            st.oom = bool(np.max(st.mem) >= OOM_FRACTION * sc.gpu_memory_total_gb)
        elif fault == "nan_loss":
            if k == 0 or fr.random() < min(1.0, 0.5 * s):
                st.nan_metrics["actor/grad_norm"] = math.inf if (k and fr.random() < 0.2) else math.nan
                if k == 0 or fr.random() < 0.7:
                    st.nan_metrics["actor/pg_loss"] = math.nan
                if sc.algorithm == "ppo" and fr.random() < 0.3:
                    st.nan_metrics["critic/vf_loss"] = math.nan
        elif fault == "straggler":
            slow = 1.0 + 1.5 * s * ramp
            base_train = sum(st.phases.values()) + st.overhead
            for name in _GPU_PHASES:
                if name in st.phases:
                    st.phases[name] *= slow
            train = sum(st.phases.values()) + st.overhead
            # Peers finish their own work on time, then wait in the collective (util falls);
            # the straggler (a throttling GPU) is busy the whole step and runs hot.
            st.rank_step = base_train * st.rank_noise
            st.rank_step[sc.fault_rank] = train * st.rank_noise[sc.fault_rank]
            busy = base_train / train
            st.util = st.util * busy
            st.util[sc.fault_rank] = min(100.0, p.gpu_util0 + 6.0 + float(fr.normal(0, 1.5)))
            st.temp[sc.fault_rank] += ramp * max(0.0, 88.0 - p.temp0)
        elif fault == "gradient_instability":
            sigma = 0.12 * sc.noise + 1.1 * s * ramp
            st.grad_norm *= float(np.exp(fr.normal(0.0, sigma)))
            if fr.random() < 0.3 * s * ramp:
                st.grad_norm *= float(fr.uniform(5.0, 25.0))
            st.pg_clipfrac *= 1.0 + 5.0 * ramp
            st.pg_loss += float(fr.normal(0.0, 0.03 * s * ramp))
        elif fault == "lr_drift":
            off = 0.5 * s * ramp
            st.lr *= (1.0 + off) if p.lr_drift_up else 1.0 / (1.0 + off)
        elif fault == "entropy_collapse":
            st.entropy = st.entropy * 0.2 ** (s * ramp) * 0.98 ** k
            st.score = min(0.99, st.score + min(0.25, 0.15 * s) * ramp)
            st.kl += 0.006 * s * (k + 1) ** 1.5
            st.resp_len *= 1.0 - 0.4 * ramp
            st.clip_ratio *= 1.0 - ramp
            st.grad_norm *= 1.0 - 0.5 * ramp
            st.val_acc = max(0.0, st.val_acc - 0.15 * s * ramp)
        elif fault == "stalled_learning":
            # Nothing to learn from: every sample scores the same, often at the length cap.
            c = p.stalled_score
            st.score = st.score_max = st.score_min = c
            st.adv_mean = st.adv_max = st.adv_min = 0.0
            st.clip_ratio = float(1.0 - min(0.02, abs(fr.normal(0.0, 0.003))))
            st.resp_len = cap * st.clip_ratio + (1 - st.clip_ratio) * 0.6 * cap
            st.resp_max = cap
            st.resp_min = cap if st.clip_ratio == 1.0 else 0.6 * cap
            st.phases["gen"] *= cap / max(1.0, self.p.resp_len0)
            st.kl = kl_at_onset
            st.entropy = ent_at_onset * float(np.exp(fr.normal(0.0, 0.01)))
            st.val_acc = 0.0 if c == 0.0 else 0.01
            if sc.algorithm == "grpo":
                st.returns = 0.0
                st.pg_loss = st.grad_norm = st.pg_clipfrac = st.ppo_kl = 0.0
            else:  # GAE still gives tiny advantages from the critic's noise
                st.adv_max, st.adv_min = float(fr.uniform(0.01, 0.05)), -float(fr.uniform(0.01, 0.05))
                st.returns = c
                st.pg_loss *= 0.02
                st.grad_norm *= 0.03
                st.pg_clipfrac = 0.0

    # -- emission ---------------------------------------------------------------------
    def _metric(self, step: int, ts: float, layer: str, metrics: dict[str, float],
                host: str | None = None, rank: int | None = None) -> None:
        self.events.append(MetricEvent(run_id=self.sc.run_id, step=step, ts=ts, layer=layer,
                                       metrics=metrics, attempt=self.sc.attempt, host=host,
                                       rank=rank))

    def _run_event(self, etype: str, ts: float, step: int | None = None, **extra: Any) -> None:
        self.events.append(RunEvent(run_id=self.sc.run_id, type=etype, ts=ts,
                                    attempt=self.sc.attempt, step=step, fields=dict(extra)))

    def _val_metrics(self, acc: float) -> dict[str, float]:
        return {f"val-core/{VAL_SOURCE}/acc/mean@1": acc,
                f"val-aux/{VAL_SOURCE}/reward/mean@1": acc}

    def _driver_metrics(self, t: int, st: _Step) -> tuple[dict[str, float], float, float]:
        """verl's per-step dict, the train time (no eval/save) and the wall time of the step."""
        sc, p = self.sc, self.p
        grpo = sc.algorithm == "grpo"
        train = sum(st.phases.values()) + st.overhead
        extra = (st.testing or 0.0) + (st.save or 0.0)
        step_time = train + extra if sc.eval_in_step_timer else train
        tokens = p.batch * p.group_n * (st.prompt_len + st.resp_len)
        m: dict[str, float] = {
            "actor/entropy": st.entropy,
            "actor/pg_loss": st.pg_loss,
            "actor/pg_clipfrac": st.pg_clipfrac,
            "actor/ppo_kl": st.ppo_kl,
            "actor/grad_norm": st.grad_norm,
            "actor/lr": st.lr,
        }
        if grpo:
            m["actor/kl_loss"] = st.kl
            m["actor/kl_coef"] = 0.001
        else:
            m["actor/reward_kl_penalty"] = st.kl
            m["actor/reward_kl_penalty_coeff"] = 0.001
            m["critic/vf_loss"] = st.vf_loss
            m["critic/grad_norm"] = st.critic_grad
            m["critic/lr"] = 1e-5
            m["critic/values/mean"] = st.returns * 1.05
        m.update({
            "actor/perf/max_memory_allocated_gb": st.actor_mem,
            "actor/perf/max_memory_reserved_gb": st.actor_mem * 1.3,
            "perf/mfu/actor": p.mfu0 * st.mfu_scale * self._phase_s["update_actor"]
            / st.phases["update_actor"],
            "perf/total_num_tokens": float(round(tokens)),
            "perf/throughput": tokens / step_time / sc.ranks,
            "training/global_step": float(t),
            "training/epoch": 0.0,
            "critic/score/mean": st.score,
            "critic/score/max": st.score_max,
            "critic/score/min": st.score_min,
            "critic/rewards/mean": st.score - (0.0 if grpo else 0.001 * st.kl),
            "critic/advantages/mean": st.adv_mean,
            "critic/advantages/max": st.adv_max,
            "critic/advantages/min": st.adv_min,
        })
        if not grpo:
            m["critic/returns/mean"] = st.returns
        m.update({
            "response_length/mean": st.resp_len,
            "response_length/max": st.resp_max,
            "response_length/min": st.resp_min,
            "response_length/clip_ratio": st.clip_ratio,
            "response/aborted_ratio": st.aborted,
            "prompt_length/mean": st.prompt_len,
        })
        for name, secs in st.phases.items():
            m[f"timing_s/{name}"] = secs
        m["timing_s/step"] = step_time
        if st.testing is not None:
            m["timing_s/testing"] = st.testing
            m.update(self._val_metrics(st.val_acc))
        if st.save is not None:
            m["timing_s/save_checkpoint"] = st.save
        m.update(st.nan_metrics)
        return m, train, train + extra

    def _rank_events(self, step: int, ts: float, st: _Step, rank_step: np.ndarray | None,
                     jitter: np.ndarray) -> None:
        sc = self.sc
        for i in range(sc.ranks):
            h = i // sc.gpus_per_host
            metrics = {
                "gpu/utilization_pct": round(float(st.util[i]), 2),
                "gpu/memory_used_gb": round(float(min(st.mem[i], sc.gpu_memory_total_gb)), 3),
                "gpu/memory_total_gb": sc.gpu_memory_total_gb,
                "gpu/temperature_c": round(float(st.temp[i]), 1),
                "system/cpu_load_avg": round(float(st.cpu_host[h]), 2),
                "system/disk_io_wait_ms": round(float(st.io_host[h] * st.io_rank[i]), 3),
            }
            if rank_step is not None:
                metrics["timing_s/rank_step"] = float(rank_step[i])
            host = sc.host_of(i)
            # The sampler event carries every per-rank signal, so it goes on the resource
            # layer as one record (timing_s/rank_step included; see docs/simulator.md).
            self._metric(step, ts + float(jitter[i]), "resource", metrics, host=host, rank=i)
            self._run_event("heartbeat", ts + float(jitter[i]) + 0.01, step=step, host=host,
                            rank=i)

    def run(self) -> list[MetricEvent | RunEvent]:
        sc, p = self.sc, self.p
        ts = sc.start_ts
        self._run_event("run_started", ts, config=sc.verl_config())
        ts += p.init_s
        if sc.val_before_train and sc.test_freq > 0:
            r0 = _rng(sc.seed, 0, _STREAM_STEP)
            ts += sc.step_time_s * p.testing_frac * float(np.exp(r0.normal(0.0, 0.05)))
            acc0 = self._score_trend(0) + p.val_offset
            if sc.fault == "stalled_learning" and sc.onset == 1:
                acc0 = 0.0 if p.stalled_score == 0.0 else 0.01
            for layer, ms in split_metrics(self._val_metrics(float(np.clip(acc0, 0, 1)))).items():
                self._metric(0, ts, layer, ms)
        kl_at_onset = ent_at_onset = 0.0
        for t in range(1, sc.steps + 1):
            if sc.fault == "training_hang" and t >= sc.onset:
                self._hang(t, ts)
                return self.events
            st = self._healthy(t)
            if t == sc.onset:  # the values a stalled policy freezes at
                kl_at_onset = 0.0 if t == 1 else self._kl_trend(t - 1)
                ent_at_onset = st.entropy
            self._apply_fault(st, t, kl_at_onset, ent_at_onset)
            jr = _rng(sc.seed, t, _STREAM_HANG)
            jitter = jr.uniform(0.05, 0.8, sc.ranks)
            if st.oom:
                ts += float(np.sum(list(st.phases.values()))) * 0.5
                st.mem = np.minimum(st.mem, sc.gpu_memory_total_gb * 0.995)
                self._rank_events(t - 1, ts, st, None, jitter)
                self._run_event("run_finished", ts + 1.0, exit_code=1,
                                error="torch.OutOfMemoryError: CUDA out of memory")
                return self.events
            metrics, train, wall = self._driver_metrics(t, st)
            end = ts + wall
            for layer, ms in split_metrics(metrics).items():
                self._metric(t, end, layer, ms)
            rank_step = st.rank_step if st.rank_step is not None else train * st.rank_noise
            self._rank_events(t, end, st, rank_step, jitter)
            if st.save is not None:
                self._run_event("checkpoint_saved", end + 0.02, step=t,
                                path=f"{sc.ckpt_dir}/global_step_{t}")
            ts = end + 0.3
        self._run_event("run_finished", ts + 1.0, exit_code=0)
        return self.events

    def _hang(self, t: int, ts: float) -> None:
        """No step completes from ``t`` on; heartbeats and samplers keep reporting."""
        sc, p = self.sc, self.p
        last = t - 1
        ticks = max(10, sc.steps - t + 1)
        for j in range(ticks):
            st = self._healthy(t + j)  # only the resource side of it is used
            fr = _rng(sc.seed, t + j, _STREAM_FAULT)
            if p.hang_spin:  # a stuck NCCL collective spins the SMs at 100%
                st.util = np.clip(100.0 - np.abs(fr.normal(0.0, 0.4, sc.ranks)), 0.0, 100.0)
            else:  # every rank blocked on the host side: idle GPUs, quiet hosts
                st.util = fr.uniform(0.0, 2.0, sc.ranks)
                st.cpu_host = st.cpu_host * 0.3
            ts += sc.step_time_s * float(np.exp(fr.normal(0.0, 0.02)))
            jitter = _rng(sc.seed, t + j, _STREAM_HANG).uniform(0.05, 0.8, sc.ranks)
            self._rank_events(last, ts, st, None, jitter)
        self._run_event("run_finished", ts + 5.0, exit_code=1,
                        error="NCCL watchdog: collective operation timed out")


# --------------------------------------------------------------------------- public API


def _generate_objects(scenario: Scenario) -> list[MetricEvent | RunEvent]:
    events = _Simulator(scenario).run()
    return sorted(events, key=lambda e: e.ts)  # stable: equal ts keep emission order


def generate(scenario: Scenario) -> list[dict[str, Any]]:
    """The whole run as contract event dicts (MetricEvents and RunEvents), sorted by ts.

    Non-finite metric values are written as ``"nan"``/``"inf"``/``"-inf"``.
    """
    return [e.to_dict() for e in _generate_objects(scenario)]


def generate_file_logger_lines(scenario: Scenario) -> list[str]:
    """The run as verl's file logger writes it: ``{"step": N, "data": {...}}``, NaN as null.

    Only the driver's per-step metrics appear (verl logs no per-rank samples, heartbeats
    or run events); infinities are written as ``"inf"``/``"-inf"``.
    """
    by_step: dict[int, dict[str, float | str | None]] = {}
    for e in _generate_objects(scenario):
        if isinstance(e, MetricEvent) and e.rank is None:
            data = by_step.setdefault(e.step, {})
            for k, v in e.metrics.items():
                data[k] = None if math.isnan(v) else encode_metric_value(v)
    return [json.dumps({"step": s, "data": d}, separators=(",", ":"), allow_nan=False)
            for s, d in sorted(by_step.items())]


def random_scenario(rng: np.random.Generator | int, *, fault: str | None = "random",
                    **overrides: Any) -> Scenario:
    """A varied scenario for benchmarks; ``fault="random"`` picks any of SCENARIO_LABELS.

    Samples noise (0.5–2), step time (5–60 s, log-uniform), length (150–600 steps),
    ranks (1–16), onset (25–75% of the run), severity (0.7–2) and the run's cadence;
    ``overrides`` (any Scenario field) win over the sampled values.
    """
    g = np.random.default_rng(rng) if isinstance(rng, int) else rng
    if fault == "random":
        fault = str(g.choice(SCENARIO_LABELS))
    if fault == "healthy":
        fault = None
    if fault is not None and fault not in FAULT_LABELS:
        raise ValueError(f"unknown fault {fault!r}; valid: {', '.join(SCENARIO_LABELS)}")
    steps = int(g.integers(150, 601))
    algorithm = "grpo" if g.random() < 0.7 else "ppo"
    ranks = int(g.integers(1, 17))
    # Sample everything (so the stream of draws is the same), then let overrides shape it.
    steps = int(overrides.get("steps", steps))
    ranks = int(overrides.get("ranks", ranks))
    algorithm = str(overrides.get("algorithm", algorithm))
    if fault == "straggler":
        ranks = max(2, ranks)
    onset = int(g.integers(int(0.25 * steps), int(0.75 * steps) + 1))
    if fault == "stalled_learning" and g.random() < 0.3:
        onset = 1  # dead from the start
    seed = int(g.integers(0, 2**31 - 1))
    label = fault or "healthy"
    params: dict[str, Any] = dict(
        run_id=f"sim-{label}-{seed}",
        seed=seed,
        steps=steps,
        algorithm=algorithm,
        step_time_s=float(math.exp(g.uniform(math.log(5.0), math.log(60.0)))),
        noise=float(g.uniform(0.5, 2.0)),
        ranks=ranks,
        lr=float(g.choice([5e-7, 1e-6, 2e-6, 3e-6])),
        lr_warmup_steps=int(g.choice([0, 0, 10, 20])),
        lr_schedule=str(g.choice(["constant", "constant", "cosine"])),
        lr_milestones=((int(steps * 0.6), 0.5),) if g.random() < 0.15 else (),
        test_freq=int(g.choice([0, 5, 10, 20, 25])),
        save_freq=int(g.choice([0, 10, 20, 50, 100])),
        eval_in_step_timer=bool(g.random() < 0.5),
        zero_grad_prob=float(g.choice([0.0, 0.0, 0.05, 0.3])) if algorithm == "grpo" else 0.0,
        fault=fault,
        fault_onset=onset,
        fault_severity=float(g.uniform(0.7, 2.0)),
        fault_rank=int(g.integers(0, ranks)),
        start_ts=1764528000.0 + float(g.integers(0, 86400 * 30)),
    )
    params.update(overrides)
    return Scenario(**params)


def write_jsonl(events: Iterable[Mapping[str, Any]], path: str | Path) -> int:
    """Write events as compact JSON lines (``"-"`` = stdout); returns the number written."""
    if str(path) == "-":
        return _write_lines((dumps(e).decode() for e in events), sys.stdout)
    with _open_out(path) as fh:
        return _write_lines((dumps(e).decode() for e in events), fh)


def _open_out(path: str | Path) -> IO[str]:
    """``path`` opened for writing, or a TrainsentryError that says what to fix."""
    p = Path(path)
    if p.is_dir():
        raise TrainsentryError(f"--out {p} is a directory; give a file name, e.g. {p / 'run.jsonl'}")
    try:
        return open(p, "w", encoding="utf-8")
    except OSError as exc:
        raise TrainsentryError(f"cannot write --out {p}: {exc.strerror or exc}; pick a "
                               "writable path (its folder must exist)") from exc


def _write_lines(lines: Iterable[str], fh: IO[str]) -> int:
    n = 0
    for line in lines:
        fh.write(line + "\n")
        n += 1
    fh.flush()
    return n


def event_kind(event: Mapping[str, Any]) -> str:
    """Where an event goes: its layer (``data``/``compute``/``resource``) or ``run``."""
    layer = event.get("layer")
    return str(layer) if layer is not None else "run"


def publish(events: Iterable[Mapping[str, Any]], *, send: Callable[[str, dict[str, Any]], None],
            speed: float | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """Replay events in order through ``send(kind, event)``; returns the number sent.

    ``speed`` replays at that multiple of real time (gaps between ``ts`` divided by it);
    ``None`` sends as fast as possible.
    """
    if speed is not None and speed <= 0:
        raise ValueError("speed must be > 0 (or None for as fast as possible)")
    n, prev = 0, None
    for event in events:
        ts = float(event["ts"])
        if speed is not None and prev is not None and ts > prev:
            sleep((ts - prev) / speed)
        prev = ts if prev is None else max(prev, ts)
        send(event_kind(event), dict(event))
        n += 1
    return n


# --------------------------------------------------------------------------- CLI


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``trainsentry simulate`` to an argparse subparsers object; handler in ``func``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="generate a realistic verl run, optionally with an injected fault",
        description="Generate a simulated verl PPO/GRPO run as trainsentry events or verl "
                    f"file-logger lines. Fault labels: {', '.join(FAULT_LABELS)}.")
    p.add_argument("--fault", default=None, metavar="LABEL",
                   help="inject this fault (default: healthy run)")
    p.add_argument("--onset", type=int, default=None, help="first step of the fault (default: middle)")
    p.add_argument("--severity", type=float, default=1.0, help="fault strength, 1.0 = typical")
    p.add_argument("--fault-rank", type=int, default=None, help="the straggling rank (default: last)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-id", default=None, help="default: sim-<label>-<seed>")
    p.add_argument("--step-time", type=float, default=20.0, help="mean step time in seconds")
    p.add_argument("--noise", type=float, default=1.0, help="noise multiplier")
    p.add_argument("--algorithm", choices=("grpo", "ppo"), default="grpo")
    p.add_argument("--test-freq", type=int, default=10)
    p.add_argument("--save-freq", type=int, default=20)
    p.add_argument("--zero-grad-prob", type=float, default=0.0)
    p.add_argument("--out", default=None, metavar="FILE",
                   help="output file, '-' for stdout (default: stdout unless --publish)")
    p.add_argument("--format", choices=("events", "verl"), default="events",
                   help="events: contract JSON lines; verl: file-logger lines")
    p.add_argument("--publish", action="store_true", help="send the events to Kafka")
    p.add_argument("--bootstrap", default=None,
                   help="Kafka bootstrap (default: $TRAINSENTRY_KAFKA_BOOTSTRAP or 127.0.0.1:9092)")
    p.add_argument("--prefix", default=None,
                   help="topic prefix (default: $TRAINSENTRY_TOPIC_PREFIX or 'trainsentry.')")
    p.add_argument("--speed", type=float, default=None,
                   help="replay at X times real time (default: as fast as possible)")
    p.set_defaults(func=cmd_simulate)
    return p


def cmd_simulate(args: argparse.Namespace) -> int:
    """Handler of ``trainsentry simulate``; returns the exit code."""
    fault = args.fault
    if fault is not None and fault not in SCENARIO_LABELS:
        print(f"trainsentry simulate: unknown fault {fault!r}; valid labels: "
              f"{', '.join(SCENARIO_LABELS)}", file=sys.stderr)
        return 2
    label = fault or "healthy"
    try:
        scenario = Scenario(
            run_id=args.run_id or f"sim-{label}-{args.seed}", seed=args.seed, steps=args.steps,
            algorithm=args.algorithm, step_time_s=args.step_time, noise=args.noise,
            ranks=args.ranks, gpus_per_host=args.gpus_per_host, test_freq=args.test_freq,
            save_freq=args.save_freq, zero_grad_prob=args.zero_grad_prob, fault=fault,
            fault_onset=args.onset, fault_severity=args.severity, fault_rank=args.fault_rank)
    except ValueError as exc:
        print(f"trainsentry simulate: {exc}", file=sys.stderr)
        return 2
    if args.publish and args.format != "events":
        print("trainsentry simulate: --publish sends contract events; drop --format verl",
              file=sys.stderr)
        return 2
    out = args.out if args.out is not None else (None if args.publish else "-")
    events = generate(scenario)
    if out is not None:
        if args.format == "verl":
            lines = generate_file_logger_lines(scenario)
            if out == "-":
                _write_lines(lines, sys.stdout)
            else:
                with _open_out(out) as fh:
                    _write_lines(lines, fh)
        else:
            write_jsonl(events, out)
    if args.publish:
        from producers.kafka import KafkaOptions, make_sender  # lazy: only needed to publish
        from trainsentry.config import load_settings

        bootstrap = args.bootstrap or os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                     "127.0.0.1:9092")
        prefix = args.prefix if args.prefix is not None else os.environ.get(
            "TRAINSENTRY_TOPIC_PREFIX", "trainsentry.")
        try:
            # The TRAINSENTRY_KAFKA_* security settings (SASL/TLS) come from the environment.
            options = KafkaOptions.from_settings(load_settings(kafka_bootstrap=bootstrap))
            send = make_sender(options, prefix)
            try:
                n = publish(events, send=send, speed=args.speed)
            finally:
                close = getattr(send, "close", None)
                if callable(close):
                    close()
        except TrainsentryError as exc:
            print(f"trainsentry simulate: {exc}", file=sys.stderr)
            return 1
        print(f"published {n} events of run {scenario.run_id} to {bootstrap}", file=sys.stderr)
    return 0

