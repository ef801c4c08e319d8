"""Replay the real verl traces through ``trainsentry detect`` and show what fires.

Run ``python -m bench.traces [DIR]`` from the repository root (default DIR:
``../shared/eval/verl-traces`` next to the clone). Each trace is a verl file-logger log
(``{"step": N, "data": {...}}`` per line); it goes through
:func:`detectors.offline.detect_file`, the engine ``trainsentry detect`` runs. The table
lists, per trace, what the README says it is, the alerts that opened (label@step,
severity) and whether that matches the expectation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from detectors.offline import detect_file
from trainsentry.events import AlertEvent, ControlCommand

__all__ = ["EXPECTED", "TraceResult", "default_dir", "replay", "main"]

#: Trace file stem → the label its first alert must carry, or None: no alert at all.
EXPECTED: dict[str, str | None] = {
    "monte_ppo_qwen3_06b_gsm8k": None,
    "pr5469_grpo_qwen3_06b_gsm8k_dead": "stalled_learning",
    "pr5469_grpo_qwen3_30b_a3b_titan": None,
    "pr5545_grpo_qwen3_30b_moe_npu_dead": "stalled_learning",
    "pr5687_grpo_qwen2_7b_game2048_collapse": "entropy_collapse",
    "pr5687_grpo_qwen2_7b_gsm8k_math": None,
    "verl_nb_ppo_qwen05b_gsm8k": None,
}


def default_dir() -> Path:
    """``shared/eval/verl-traces`` beside the repository (CI puts a copy of shared/ there)."""
    return Path(__file__).resolve().parents[2] / "shared" / "eval" / "verl-traces"


@dataclass
class TraceResult:
    name: str
    expected: str | None
    opened: list[AlertEvent]  # firing alerts that opened an episode, in step order
    commands: list[ControlCommand]

    @property
    def first(self) -> AlertEvent | None:
        return self.opened[0] if self.opened else None

    @property
    def ok(self) -> bool:
        if self.expected is None:
            return not self.opened
        return self.first is not None and self.first.diagnosis == self.expected


def replay(path: Path) -> TraceResult:
    """One trace through the engine."""
    out = detect_file(path)
    alerts = [o for o in out if isinstance(o, AlertEvent)]
    seen: set[str] = set()
    opened: list[AlertEvent] = []
    for a in alerts:
        if a.status == "resolved":
            seen.discard(a.fingerprint)
        elif a.fingerprint not in seen:
            seen.add(a.fingerprint)
            opened.append(a)
    return TraceResult(path.stem, EXPECTED.get(path.stem), opened,
                       [o for o in out if isinstance(o, ControlCommand)])


def format_table(results: list[TraceResult]) -> str:
    lines = [f"{'trace':42} {'expected':18} {'what fires (label@step severity)':58} ok",
             "-" * 122]
    for r in results:
        fired = ", ".join(f"{a.diagnosis}@{a.step} {a.severity}" for a in r.opened) or "nothing"
        if r.commands:
            fired += "; " + ", ".join(f"{c.action} command" for c in r.commands)
        lines.append(f"{r.name:42} {r.expected or 'quiet':18} {fired:58} {'yes' if r.ok else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Replay the real verl traces through trainsentry detect.")
    ap.add_argument("dir", nargs="?", type=Path, default=default_dir())
    args = ap.parse_args(argv)
    files = sorted(args.dir.glob("*.jsonl"))
    if not files:
        print(f"no traces in {args.dir}", file=sys.stderr)
        return 2
    results = [replay(f) for f in files]
    print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
