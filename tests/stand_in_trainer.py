"""A small stand-in for a verl trainer, for tests and demos (no GPU, no Ray, no model).

It does what verl's PPO trainer does around the model, with verl's own code where it
matters: resumes like ``resume_mode=auto`` (``find_latest_ckpt_path`` on
``latest_checkpointed_iteration.txt``), builds the checkpoint callback with verl's
``build_checkpoint_callback`` from ``trainer.checkpoint_callback_class``, writes
``global_step_N/`` folders and the tracker every ``--save-freq`` steps, and logs each step's
metrics (verl's key names) through verl's ``Tracking`` with ``[console, trainsentry]`` —
so stop/rollback commands are applied by the trainsentry plugin exactly as in verl, and
the process exits with the plugin's exit code.

    python tests/stand_in_trainer.py --project demo --experiment exp1 --steps 60 \\
        --checkpoint-dir /tmp/ckpt --save-freq 10 --step-sleep 0.2 --nan-from 35

Faults: ``--nan-from S`` makes ``actor/pg_loss`` and ``actor/grad_norm`` NaN from step S;
``--hang-at S`` sleeps ``--hang-s`` seconds in step S; ``--slow-gen-from S`` multiplies
``timing_s/gen`` by 5 and drops GPU utilisation (a dataloader stall). Faults fire only in
the attempts listed by ``--fault-attempts`` (default ``0``; ``all`` for every attempt), so a
rolled-back run recovers. ``--command-file F``: each step, a signed ControlCommand JSON at
F is handed to the plugin's verifier (as if it came from Kafka) and then renamed to
``F.delivered`` (from step ``--command-at`` on). Every start appends ``{"attempt", "resumed_from", "pid"}`` to
``<checkpoint-dir>/stand_in_starts.jsonl`` and prints ``RESUMED_FROM <step>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project", default="stand-in")
    p.add_argument("--experiment", default="exp")
    p.add_argument("--run-id", default=None,
                   help="override the run_id (default project/experiment); sets TRAINSENTRY_RUN_ID")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--save-freq", type=int, default=10)
    p.add_argument("--nan-from", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--hang-s", type=float, default=3600.0)
    p.add_argument("--slow-gen-from", type=int, default=None)
    p.add_argument("--fault-attempts", default="0",
                   help="comma-separated attempts that get the faults, or 'all'")
    p.add_argument("--command-file", default=None)
    p.add_argument("--command-at", type=int, default=0,
                   help="look at --command-file only from this step on")
    p.add_argument("--no-console", action="store_true", help="log through [trainsentry] only")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _metrics(step: int, rng: random.Random, *, nan: bool, slow: bool) -> dict[str, Any]:
    progress = min(1.0, step / 200)
    gen = rng.gauss(3.0, 0.15) * (5.0 if slow else 1.0)
    old_lp, upd, sync = rng.gauss(1.0, 0.05), rng.gauss(2.0, 0.1), rng.gauss(0.3, 0.02)
    pg_loss = math.nan if nan else rng.gauss(-0.02, 0.01)
    grad = math.nan if nan else abs(rng.gauss(0.8, 0.1))
    return {
        "actor/pg_loss": pg_loss,
        "actor/grad_norm": grad,
        "actor/entropy": 1.2 - 0.3 * progress + rng.gauss(0, 0.01),
        "actor/ppo_kl": abs(rng.gauss(0.002, 0.0005)),
        "actor/kl_loss": 0.02 + 0.03 * progress + rng.gauss(0, 0.002),
        "actor/lr": 1e-6,
        "actor/perf/max_memory_allocated_gb": 40.0 + rng.gauss(0, 0.2),
        "critic/score/mean": 0.3 + 0.4 * progress + rng.gauss(0, 0.02),
        "critic/score/std": 0.25 + rng.gauss(0, 0.01),
        "critic/score/min": 0.0,
        "critic/score/max": 1.0,
        "response_length/mean": 600 + rng.gauss(0, 20),
        "response_length/clip_ratio": abs(rng.gauss(0.02, 0.005)),
        "timing_s/gen": gen,
        "timing_s/old_log_prob": old_lp,
        "timing_s/update_actor": upd,
        "timing_s/update_weights": sync,
        "timing_s/step": gen + old_lp + upd + sync,
        "perf/throughput": 1500 / (gen + old_lp + upd + sync),
        "gpu/utilization_pct": 15.0 if slow else 85.0 + rng.gauss(0, 3),
    }


def _save(ckpt: Path, step: int, callback: Any) -> None:
    """verl's layout: global_step_N/actor/..., data.pt, then the tracker, then on_save."""
    folder = ckpt / f"global_step_{step}"
    (folder / "actor").mkdir(parents=True, exist_ok=True)
    (folder / "actor" / "state.json").write_text(json.dumps({"step": step}))
    (folder / "data.pt").write_text(json.dumps({"step": step}))
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))  # verl writes it plainly
    callback.on_save(trainer=None, global_step=step, checkpoint_dir=str(folder), async_save=False)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.run_id:
        os.environ["TRAINSENTRY_RUN_ID"] = args.run_id
    ckpt = Path(args.checkpoint_dir).absolute()
    ckpt.mkdir(parents=True, exist_ok=True)
    attempt = int(os.environ.get("TRAINSENTRY_ATTEMPT", "0") or 0)
    faulty = args.fault_attempts == "all" or str(attempt) in args.fault_attempts.split(",")

    from omegaconf import OmegaConf
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
    from verl.utils.tracking import Tracking

    import producers.verl_plugin  # noqa: F401  (verl imports it too, via the entry point)

    config = OmegaConf.create({"trainer": {
        "project_name": args.project, "experiment_name": args.experiment,
        "default_local_dir": str(ckpt), "save_freq": args.save_freq,
        "total_training_steps": args.steps, "resume_mode": "auto",
        "logger": ["trainsentry"] if args.no_console else ["console", "trainsentry"],
        "checkpoint_callback_class": "producers.verl_plugin.TrainsentryCheckpointCallback",
    }})
    callback = build_checkpoint_callback(config)

    # resume exactly as verl's _load_checkpoint does for resume_mode=auto
    folder = find_latest_ckpt_path(str(ckpt))
    start = 0 if folder is None else int(folder.split("global_step_")[-1])
    if folder is not None:
        state = json.loads((Path(folder) / "actor" / "state.json").read_text())
        assert state["step"] == start, f"checkpoint {folder} holds step {state['step']}"
    print(f"RESUMED_FROM {start}", flush=True)
    with (ckpt / "stand_in_starts.jsonl").open("a") as fh:
        fh.write(json.dumps({"attempt": attempt, "resumed_from": start, "pid": os.getpid(),
                             "ts": time.time()}) + "\n")

    tracking = Tracking(project_name=args.project, experiment_name=args.experiment,
                        default_backend=list(config.trainer.logger),
                        config=OmegaConf.to_container(config, resolve=True))
    backend = tracking.logger["trainsentry"]
    backend.set_save_checkpoint(lambda: _save(ckpt, backend.step, callback))
    rng = random.Random(args.seed * 1000 + start)
    command_file = Path(args.command_file) if args.command_file else None
    exit_code = 0
    try:
        for step in range(start + 1, args.steps + 1):
            if faulty and args.hang_at == step:
                time.sleep(args.hang_s)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            metrics = _metrics(step, rng,
                               nan=faulty and args.nan_from is not None and step >= args.nan_from,
                               slow=faulty and args.slow_gen_from is not None
                               and step >= args.slow_gen_from)
            if args.save_freq > 0 and (step % args.save_freq == 0 or step == args.steps):
                _save(ckpt, step, callback)
            if command_file is not None and step >= args.command_at and command_file.exists():
                raw = command_file.read_bytes()
                command_file.rename(command_file.with_name(command_file.name + ".delivered"))
                backend.deliver(raw)
            tracking.log(data=metrics, step=step)  # the step boundary: may raise SystemExit
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
        print(f"EXIT {exit_code} at step {backend.step}", flush=True)
        return exit_code
    finally:
        tracking.finish(exit_code=exit_code)
    print(f"FINISHED {args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
