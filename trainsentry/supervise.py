"""``trainsentry supervise``: run a trainer, restart it after a rollback, stop after a stop.

``trainsentry supervise [--max-restarts N] [--checkpoint-dir D] -- python -m verl.trainer.main_ppo ...``

The trainer runs as a child process in its own session with ``TRAINSENTRY_ATTEMPT=<n>``
(also written to ``D/trainsentry_attempt.txt`` for Ray workers that do not inherit the
supervisor's environment). SIGINT and SIGTERM are forwarded to the child's process group
and end supervision once the child has exited. When the child exits:

* with :data:`~producers.remediate.ROLLBACK_EXIT_CODE` (75), or with any other non-zero
  code while it left a new ``trainsentry_rollback_<id>.json`` in ``D`` (verl under Ray
  turns the trainer's exit into a driver failure, exit code 1): the supervisor writes
  ``D/trainsentry_diagnosis_<id>.json``, checks that ``latest_checkpointed_iteration.txt``
  names an existing ``global_step_N`` folder, and starts the trainer again with attempt+1,
  at most ``--max-restarts`` times (then it exits with 75);
* after a stop command (a new ``trainsentry_stop_<id>.json``): it ends with
  :data:`~producers.remediate.STOP_EXIT_CODE` (0), whatever Ray made of the exit;
* otherwise: it ends with the child's exit code (128+signal if the child was killed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from producers.remediate import (
    ROLLBACK_EXIT_CODE,
    STOP_EXIT_CODE,
    TRACKER_FILE,
    read_tracker,
)

__all__ = ["supervise", "add_cli", "run_cli", "main", "ATTEMPT_FILE", "DEFAULT_MAX_RESTARTS"]

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
ATTEMPT_FILE = "trainsentry_attempt.txt"


def _markers(checkpoint_dir: Path | None) -> dict[str, float]:
    """Marker file name → mtime for every ``trainsentry_{stop,rollback}_*.json``."""
    if checkpoint_dir is None or not checkpoint_dir.is_dir():
        return {}
    out: dict[str, float] = {}
    for pattern in ("trainsentry_rollback_*.json", "trainsentry_stop_*.json"):
        for path in checkpoint_dir.glob(pattern):
            try:
                out[path.name] = path.stat().st_mtime
            except OSError:
                continue
    return out


def _new_markers(checkpoint_dir: Path | None, before: Mapping[str, float]) -> list[dict[str, Any]]:
    """Markers written while the child ran, oldest first, decoded (unreadable ones skipped)."""
    found = []
    for name, mtime in _markers(checkpoint_dir).items():
        if name in before and before[name] == mtime:
            continue
        assert checkpoint_dir is not None
        try:
            body = json.loads((checkpoint_dir / name).read_text())
        except (OSError, ValueError) as exc:
            log.warning("trainsentry: cannot read %s: %s", name, exc)
            continue
        body["_file"] = str(checkpoint_dir / name)
        found.append((mtime, body))
    return [body for _, body in sorted(found, key=lambda x: x[0])]


def _host_snapshot(checkpoint_dir: Path | None) -> dict[str, Any]:
    snap: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        snap["system/cpu_load_avg"] = os.getloadavg()[0]
    try:
        import psutil

        snap["system/memory_used_pct"] = psutil.virtual_memory().percent
        if checkpoint_dir is not None:
            usage = psutil.disk_usage(str(checkpoint_dir))
            snap["checkpoint_disk_free_gb"] = usage.free / 1024**3
    except Exception:
        pass
    return snap


def _resume_point(checkpoint_dir: Path) -> tuple[int | None, str | None, str | None]:
    """(step, folder, problem): what verl's ``find_latest_ckpt_path`` will resume from."""
    step = read_tracker(checkpoint_dir)
    if step is None:
        return None, None, f"{checkpoint_dir / TRACKER_FILE} is missing or unreadable"
    folder = checkpoint_dir / f"global_step_{step}"
    if not folder.is_dir():
        return step, None, f"{TRACKER_FILE} names step {step} but {folder} does not exist"
    return step, str(folder), None


def write_report(checkpoint_dir: Path, marker: Mapping[str, Any] | None, *, exit_code: int,
                 attempt: int, next_attempt: int) -> Path:
    """Write ``trainsentry_diagnosis_<id>.json`` next to the checkpoints; returns its path."""
    marker = dict(marker or {})
    command = marker.get("command") or {}
    command_id = str(command.get("id") or f"attempt{attempt}")
    step, folder, problem = _resume_point(checkpoint_dir)
    report = {
        "v": 1,
        "kind": "trainsentry_diagnosis",
        "ts": time.time(),
        "run_id": marker.get("run_id") or command.get("run_id"),
        "command": command,
        "action": marker.get("action", "rollback"),
        "reason": marker.get("reason") or command.get("reason"),
        "alert_ids": marker.get("alert_ids") or command.get("alert_ids") or [],
        "applied_at_step": marker.get("step"),
        "evidence": {
            "reason": marker.get("reason") or command.get("reason"),
            "alert_ids": marker.get("alert_ids") or command.get("alert_ids") or [],
            "last_metrics": marker.get("last_metrics") or {},
        },
        "resource_snapshot": {
            "trainer": marker.get("resource_snapshot"),
            "supervisor_host": _host_snapshot(checkpoint_dir),
        },
        "checkpoint": {"step": step, "path": folder, "problem": problem,
                       "requested_step": marker.get("to_step")},
        "moved_aside": marker.get("moved") or [],
        "rolled_back_dir": marker.get("rolled_back_dir"),
        "previous_latest": marker.get("previous_latest"),
        "trainer_exit_code": exit_code,
        "attempt": attempt,
        "next_attempt": next_attempt,
        "marker_file": marker.get("_file"),
    }
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in command_id)
    path = checkpoint_dir / f"trainsentry_diagnosis_{safe}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)
    return path


def _normalise(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # Popen: -N means killed by signal N


def supervise(
    command: Sequence[str],
    *,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    attempt: int = 0,
    env: Mapping[str, str] | None = None,
    popen: Callable[..., Any] = subprocess.Popen,
    forward_signals: bool = True,
) -> int:
    """Run ``command`` until it ends for good; returns the exit code to end with."""
    if not command:
        raise ValueError("no training command given (put it after `--`)")
    if max_restarts < 0:
        raise ValueError("max_restarts must be >= 0")
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir).absolute()
    base_env = dict(os.environ if env is None else env)
    restarts = 0
    child: Any = None
    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            log.warning("trainsentry supervise: forwarding signal %d to the trainer", signum)
            try:
                os.killpg(child.pid, signum)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)

    previous: dict[signal.Signals, Any] = {}
    if forward_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            before = _markers(ckpt)
            if ckpt is not None:
                ckpt.mkdir(parents=True, exist_ok=True)
                (ckpt / ATTEMPT_FILE).write_text(str(attempt))
            child_env = {**base_env, "TRAINSENTRY_ATTEMPT": str(attempt)}
            log.warning("trainsentry supervise: starting attempt %d: %s", attempt,
                        " ".join(command))
            child = popen(list(command), env=child_env, start_new_session=True)
            while True:
                try:
                    rc = _normalise(child.wait())
                    break
                except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                    continue
            if stopping:
                log.warning("trainsentry supervise: trainer exited with %d after signal %d; "
                            "not restarting", rc, stopping[0])
                return rc
            new = _new_markers(ckpt, before)
            rollbacks = [m for m in new if m.get("action") == "rollback"]
            stops = [m for m in new if m.get("action") == "stop"]
            if rc == ROLLBACK_EXIT_CODE or (rc != 0 and rollbacks):
                marker = rollbacks[-1] if rollbacks else None
                if restarts >= max_restarts:
                    log.error("trainsentry supervise: rollback requested but %d restarts are "
                              "used up; giving up", max_restarts)
                    return ROLLBACK_EXIT_CODE
                if ckpt is None:
                    log.warning("trainsentry supervise: no --checkpoint-dir: restarting without "
                                "a diagnosis report or resume check")
                else:
                    report = write_report(ckpt, marker, exit_code=rc, attempt=attempt,
                                          next_attempt=attempt + 1)
                    step, _folder, problem = _resume_point(ckpt)
                    if problem:
                        log.error("trainsentry supervise: not restarting: %s (report %s)",
                                  problem, report)
                        return rc
                    log.warning("trainsentry supervise: rollback: resuming from step %s "
                                "(diagnosis report %s)", step, report)
                restarts += 1
                attempt += 1
                continue
            if stops:
                if rc != STOP_EXIT_CODE:
                    log.warning("trainsentry supervise: trainer stopped on command %s "
                                "(its exit code %d is the runtime's rendering of that exit)",
                                stops[-1].get("command", {}).get("id"), rc)
                return STOP_EXIT_CODE
            return rc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``supervise`` to the ``trainsentry`` CLI; the handler (``func``) returns an int."""
    parser = subparsers.add_parser(
        "supervise",
        help="run a trainer; restart it after a rollback",
        description="Run a training command as a child process; when it exits after a "
                    "trainsentry rollback (exit code 75, or a rollback marker in the "
                    "checkpoint dir), write a diagnosis report and restart it with "
                    "TRAINSENTRY_ATTEMPT+1 so it resumes from the rollback target.")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                        help="most restarts after rollbacks (default %(default)s)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="the trainer's checkpoint dir (verl: trainer.default_local_dir)")
    parser.add_argument("--attempt", type=int, default=0,
                        help="attempt number of the first start (default %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command, after `--`")
    parser.set_defaults(func=run_cli)
    return parser  # type: ignore[no-any-return]


def run_cli(args: argparse.Namespace) -> int:
    """Handler for the parsed ``supervise`` arguments."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("trainsentry supervise: give the training command after `--`", file=sys.stderr)
        return 2
    return supervise(command, max_restarts=args.max_restarts,
                     checkpoint_dir=args.checkpoint_dir, attempt=args.attempt)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainsentry.supervise ...`` (same as ``trainsentry supervise``)."""
    parser = argparse.ArgumentParser(prog="trainsentry")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_cli(sub)
    args = parser.parse_args(["supervise", *(sys.argv[1:] if argv is None else argv)])
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
