"""What each diagnosis means for the people on call: quick checks and remedies.

From the operators' table in DOMAIN.md (and verl practice for the labels it does not
cover). Alerts carry these so a message at 3 a.m. says what to do next.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LABELS", "Knowledge", "KNOWLEDGE"]

LABELS: tuple[str, ...] = (
    "dataloader_stall", "kl_drift", "numeric_underflow", "comm_degradation", "memory_leak",
    "nan_loss", "training_hang", "straggler", "gradient_instability", "lr_drift",
    "entropy_collapse", "stalled_learning", "unknown",
)


@dataclass(frozen=True)
class Knowledge:
    title: str
    checks: tuple[str, ...]
    actions: tuple[str, ...]


KNOWLEDGE: dict[str, Knowledge] = {
    "dataloader_stall": Knowledge(
        "input pipeline stall (GPUs starved)",
        ("iostat -x 1 (await, %util) on the rollout hosts", "nvidia-smi dmon -s u"),
        ("check the dataset mount / object store", "add data-loader workers",
         "use memory-mapped or locally cached datasets"),
    ),
    "kl_drift": Knowledge(
        "KL to the reference running away",
        ("freeze the critic briefly and see whether KL settles",
         "look for bias or an exploit in the reward function"),
        ("lower the critic learning rate", "more critic steps per update",
         "review the reward prompt / reward shaping", "raise the KL coefficient"),
    ),
    "numeric_underflow": Knowledge(
        "logits underflow: empty responses, collapsing length",
        ("print logits max/min before sampling", "check fp16 in attention"),
        ("switch to bf16", "clip logits before softmax", "check for corrupted weights"),
    ),
    "comm_degradation": Knowledge(
        "communication (NCCL / network) degraded",
        ("nvidia-smi nvlink -g 0", "ibstat", "NCCL_DEBUG=INFO logs"),
        ("restart NCCL / the affected nodes", "check the RDMA configuration",
         "fall back to plain data parallel to confirm"),
    ),
    "memory_leak": Knowledge(
        "GPU memory creeping toward OOM",
        ("torch.cuda.memory_summary() before/after a step", "look for retain_graph=True"),
        ("enforce use_cache=False / gradient checkpointing", "upgrade PyTorch",
         "tracemalloc for Python-side leaks", "save a checkpoint before it OOMs"),
    ),
    "nan_loss": Knowledge(
        "loss or gradient norm is NaN/inf",
        ("find the first step with a non-finite value in the trainer log",
         "check the batch at that step for empty or extreme samples"),
        ("roll back to the last healthy checkpoint", "lower the learning rate",
         "enable gradient clipping", "use bf16 instead of fp16"),
    ),
    "training_hang": Knowledge(
        "no new training step",
        ("py-spy dump --pid <trainer pid> on each rank", "NCCL_DEBUG=INFO, check for a stuck collective",
         "is the process / host alive? (ray status, dmesg)"),
        ("kill and restart from the last checkpoint", "set NCCL timeouts (NCCL_TIMEOUT)"),
    ),
    "straggler": Knowledge(
        "one rank much slower than its peers",
        ("nvidia-smi -q -d CLOCK,PERFORMANCE on the slow host (throttling?)",
         "dmesg for XID errors", "check the host's network link"),
        ("drain or replace the slow node", "rebalance the rollout workers"),
    ),
    "gradient_instability": Knowledge(
        "gradient norm unstable",
        ("plot actor/grad_norm and pg_clipfrac for the last steps",
         "look for outlier samples or rewards"),
        ("lower the learning rate", "tighten gradient clipping", "increase the batch size"),
    ),
    "lr_drift": Knowledge(
        "learning rate off its configured schedule",
        ("compare actor/lr with the scheduler config (warmup, decay, total steps)",
         "did a resume restore the scheduler state?",
         "was the change planned? declare it in actor_rollout_ref.actor.optim.lr_milestones"),
        ("fix the scheduler configuration or the resume step", "restart from a checkpoint"),
    ),
    "entropy_collapse": Knowledge(
        "policy entropy collapsed (possible reward hacking)",
        ("read a sample of recent responses for repetition / exploits",
         "compare reward with validation score"),
        ("roll back to before the collapse", "raise the entropy coefficient or temperature",
         "lower the learning rate", "fix the reward exploit"),
    ),
    "stalled_learning": Knowledge(
        "no learning signal (dead run)",
        ("are all rewards identical? check the reward function on a few samples",
         "are responses cut at max_response_length? (response_length/clip_ratio)"),
        ("fix the reward function or data", "raise max_response_length",
         "stop the run: it is burning GPU time without learning"),
    ),
    "unknown": Knowledge(
        "anomalous signal, no known pattern",
        ("look at the signal's chart around the step", "check the trainer log"),
        ("watch the next steps; acknowledge if expected",),
    ),
}
