"""Remediator: applies verified control commands in the trainer, at a step boundary.

Commands arrive on the listener thread (:meth:`Remediator.submit`) but are never applied
there: a half-finished optimizer step or checkpoint write must not be interrupted. The
training loop calls :meth:`Remediator.at_step_boundary` once per step, after the step's
checkpoint (if any) was written, and obeys the returned :class:`Decision`:

``stop``
    Save a checkpoint if the last one is older than ``stale_after_steps`` steps (through the
    ``save_checkpoint`` callback, when the trainer offers one), publish ``command_applied``,
    write ``trainsentry_stop_<id>.json`` and end training with :data:`STOP_EXIT_CODE` (0: an
    orchestrator must not restart a job that was stopped on purpose).
``rollback`` (to step N)
    Check that ``global_step_N`` exists (else reject: ``command_rejected`` with the reason,
    training goes on), move every newer ``global_step_*`` folder into
    ``rolled_back/<command_id>/`` (never delete; the old tracker file goes along), rewrite
    ``latest_checkpointed_iteration.txt`` to N atomically (temp file, fsync, ``os.replace``),
    write ``trainsentry_rollback_<id>.json`` (what the supervisor turns into the diagnosis
    report), publish ``command_applied`` and exit with :data:`ROLLBACK_EXIT_CODE` (75,
    ``EX_TEMPFAIL``: "try again"), so a supervisor restarts the job and verl's
    ``resume_mode=auto`` resumes from step N.
``checkpoint``
    Save a checkpoint now (when the trainer offers a way) and go on training.

Rejected commands (bad signature, replay, expired, wrong run, impossible target) are
published as ``command_rejected`` RunEvents with the reason and never applied. The marker
files (``trainsentry_<action>_<id>.json``) double as a record of applied commands: one whose
marker exists is rejected as already applied, so a restarted trainer, whose listener
re-reads the last minute of the control topic, does not roll back again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainsentry.events import ControlCommand

__all__ = [
    "Remediator",
    "Decision",
    "ROLLBACK_EXIT_CODE",
    "STOP_EXIT_CODE",
    "TRACKER_FILE",
    "ROLLED_BACK_DIR",
    "marker_path",
    "read_tracker",
    "write_tracker",
    "checkpoint_steps",
]

log = logging.getLogger(__name__)

#: Exit code of a trainer that rolled back and wants to be restarted (sysexits EX_TEMPFAIL).
ROLLBACK_EXIT_CODE = 75
#: Exit code of a trainer that stopped on command: a clean, intended end.
STOP_EXIT_CODE = 0
#: verl's tracker file (``verl.utils.checkpoint.checkpoint_manager.get_checkpoint_tracker_filename``).
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: Where folders newer than a rollback target are moved, one sub-folder per command.
ROLLED_BACK_DIR = "rolled_back"

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class _Publisher(Protocol):
    def run_event(self, type: str, *, step: int | None = None, **fields: Any) -> None: ...


def marker_path(checkpoint_dir: str | os.PathLike[str], action: str, command_id: str) -> Path:
    """``<checkpoint_dir>/trainsentry_<action>_<command_id>.json``: what the supervisor reads."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", command_id)
    return Path(checkpoint_dir) / f"trainsentry_{action}_{safe}.json"


def checkpoint_steps(checkpoint_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """Step → folder for every ``global_step_N`` folder directly under ``checkpoint_dir``."""
    out: dict[int, Path] = {}
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            out[int(m.group(1))] = child
    return out


def read_tracker(checkpoint_dir: str | os.PathLike[str]) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt``, or None if missing/unreadable."""
    try:
        return int((Path(checkpoint_dir) / TRACKER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(str(path.parent), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_tracker(checkpoint_dir: str | os.PathLike[str], step: int) -> None:
    """Atomically set ``latest_checkpointed_iteration.txt`` to ``step`` (as verl writes it)."""
    _atomic_write(Path(checkpoint_dir) / TRACKER_FILE, str(int(step)).encode())


@dataclass(frozen=True)
class Decision:
    """What the training loop must do after this step."""

    action: str = "continue"  # "continue" | "stop" | "rollback"
    exit_code: int | None = None
    command_id: str | None = None
    to_step: int | None = None
    checkpoint: str | None = None
    result: str = ""
    marker: str | None = None

    @property
    def should_exit(self) -> bool:
        return self.exit_code is not None


CONTINUE = Decision()


@dataclass
class _Pending:
    command: ControlCommand
    received_at: float
    extra: dict[str, Any] = field(default_factory=dict)


class Remediator:
    """Applies verified stop / rollback / checkpoint commands at step boundaries.

    Thread-safe: :meth:`submit` and :meth:`reject` may be called from the control
    listener's thread; :meth:`at_step_boundary` from the training loop.
    """

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike[str] | None,
        producer: _Publisher,
        save_checkpoint: Callable[[], None] | None = None,
        stale_after_steps: int = 1,
        save_before_rollback: bool = False,
        run_id: str = "",
        attempt: int = 0,
        resource_snapshot: Callable[[], Mapping[str, Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if stale_after_steps < 1:
            raise ValueError("stale_after_steps must be >= 1")
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.producer = producer
        self.save_checkpoint = save_checkpoint
        self.stale_after_steps = stale_after_steps
        self.save_before_rollback = save_before_rollback
        self.run_id = run_id
        self.attempt = attempt
        self.resource_snapshot = resource_snapshot
        self._clock = clock
        self._lock = threading.Lock()
        self._terminal: _Pending | None = None  # stop or rollback
        self._saves: list[_Pending] = []  # checkpoint requests
        self._last_saved: int | None = None
        self.applied: list[Decision] = []
        self.rejected: list[tuple[str | None, str]] = []

    # ------------------------------------------------------------------ inputs
    def submit(self, command: ControlCommand) -> None:
        """Queue a *verified* command for the next step boundary (listener's ``on_command``)."""
        earlier = self._applied_before(command)
        if earlier is not None:
            # The listener re-reads the last minute of the control topic at start-up, and its
            # replay memory dies with the process: after a restart the command that caused it
            # arrives again. The marker on disk makes "applied once" survive restarts.
            self._reject(command.id, command.action,
                         f"command {command.id} was already applied (see {earlier})")
            return
        if command.action == "rollback":
            reason = self._rollback_problem(command.to_step, current_step=None)
            if reason:
                self._reject(command.id, command.action, reason)
                return
        with self._lock:
            if command.action == "checkpoint":
                self._saves.append(_Pending(command, self._clock()))
                return
            held = self._terminal
            if held is None:
                self._terminal = _Pending(command, self._clock())
                return
            if held.command.action == "stop" and command.action == "rollback":
                self._terminal = _Pending(command, self._clock())
                superseded: ControlCommand | None = held.command
            else:
                superseded = None
        if superseded is not None:
            self._publish("command_applied", command_id=superseded.id, action=superseded.action,
                          result=f"superseded by rollback {command.id}")
        else:
            self._reject(command.id, command.action,
                         f"command {held.command.id} ({held.command.action}) is already pending")

    def reject(self, raw: Mapping[str, Any] | bytes | str, reason: str) -> None:
        """Report a command that failed verification (listener's ``on_reject``)."""
        command_id = action = None
        try:
            obj = json.loads(raw) if isinstance(raw, (bytes, str)) else dict(raw)
            if isinstance(obj, dict):
                command_id = obj.get("id") if isinstance(obj.get("id"), str) else None
                action = obj.get("action") if isinstance(obj.get("action"), str) else None
        except (ValueError, TypeError, RecursionError):
            pass
        self._reject(command_id, action, reason)

    def note_checkpoint(self, step: int) -> None:
        """Tell the remediator a checkpoint of ``step`` was saved (checkpoint callback)."""
        with self._lock:
            self._last_saved = int(step) if self._last_saved is None else max(self._last_saved, int(step))

    @property
    def pending(self) -> ControlCommand | None:
        """The stop / rollback waiting for the next step boundary, if any."""
        with self._lock:
            return None if self._terminal is None else self._terminal.command

    @property
    def has_work(self) -> bool:
        """Whether anything waits for the next step boundary (cheap; checked every step)."""
        return self._terminal is not None or bool(self._saves)

    @property
    def last_saved_step(self) -> int | None:
        with self._lock:
            last = self._last_saved
        if last is None and self.checkpoint_dir is not None:
            last = read_tracker(self.checkpoint_dir)
        return last

    # ------------------------------------------------------------------ the boundary
    def at_step_boundary(self, step: int, metrics: Mapping[str, Any] | None = None) -> Decision:
        """Apply what is pending now that ``step`` is complete; say whether to exit."""
        with self._lock:
            saves, self._saves = self._saves, []
            pending, self._terminal = self._terminal, None
        for item in saves:
            self._apply_checkpoint(item.command, step)
        if pending is None:
            return CONTINUE
        command = pending.command
        if command.action == "stop":
            decision = self._apply_stop(command, step, metrics)
        else:
            decision = self._apply_rollback(command, step, metrics)
        if decision.should_exit:
            self.applied.append(decision)
        return decision

    # ------------------------------------------------------------------ actions
    def _apply_checkpoint(self, command: ControlCommand, step: int) -> None:
        if self.save_checkpoint is None:
            self._reject(command.id, command.action,
                         "this trainer offers no way to save a checkpoint on request")
            return
        try:
            self.save_checkpoint()
        except Exception as exc:
            log.exception("trainsentry: checkpoint on command %s failed", command.id)
            self._reject(command.id, command.action, f"checkpoint save failed: {exc}")
            return
        self.note_checkpoint(step)
        result = f"checkpoint saved at step {step}"
        self._write_marker("checkpoint", command, step, None, {"result": result})
        self._publish("command_applied", step=step, command_id=command.id, action="checkpoint",
                      result=result)

    def _save_if_stale(self, step: int) -> str:
        last = self.last_saved_step
        if last is not None and step - last < self.stale_after_steps:
            return f"checkpoint of step {last} is current"
        if self.save_checkpoint is None:
            return (f"no checkpoint saved (last is step {last}; the trainer offers no save hook)"
                    if last is not None else "no checkpoint saved (none exists; no save hook)")
        try:
            self.save_checkpoint()
        except Exception as exc:
            log.exception("trainsentry: saving a checkpoint before stopping failed")
            return f"saving a checkpoint at step {step} failed: {exc}"
        self.note_checkpoint(step)
        return f"saved a checkpoint at step {step}"

    def _apply_stop(self, command: ControlCommand, step: int,
                    metrics: Mapping[str, Any] | None) -> Decision:
        saved = self._save_if_stale(step)
        result = f"stopped at step {step}; {saved}"
        marker = self._write_marker("stop", command, step, metrics, {"result": result,
                                                                     "exit_code": STOP_EXIT_CODE})
        self._publish("command_applied", step=step, command_id=command.id, action="stop",
                      result=result)
        log.warning("trainsentry: %s (command %s: %s)", result, command.id, command.reason)
        return Decision(action="stop", exit_code=STOP_EXIT_CODE, command_id=command.id,
                        result=result, marker=marker)

    def _apply_rollback(self, command: ControlCommand, step: int,
                        metrics: Mapping[str, Any] | None) -> Decision:
        target = command.to_step
        problem = self._rollback_problem(target, current_step=step)
        if problem:
            self._reject(command.id, command.action, problem)
            return CONTINUE
        assert self.checkpoint_dir is not None and target is not None
        saved = self._save_if_stale(step) if self.save_before_rollback else "no save before rollback"
        root = self.checkpoint_dir
        previous = read_tracker(root)
        aside = root / ROLLED_BACK_DIR / re.sub(r"[^A-Za-z0-9_.-]", "_", command.id)
        moved: list[str] = []
        newer = sorted(s for s in checkpoint_steps(root) if s > target)
        try:
            if newer or (root / TRACKER_FILE).exists():
                aside.mkdir(parents=True, exist_ok=True)
            if (root / TRACKER_FILE).exists():
                shutil.copy2(root / TRACKER_FILE, aside / TRACKER_FILE)
            for s in newer:
                src = root / f"global_step_{s}"
                os.replace(src, aside / src.name)  # same filesystem: a rename, nothing copied
                moved.append(src.name)
            write_tracker(root, target)
        except OSError as exc:
            reason = (f"rollback to step {target} failed while moving checkpoints aside "
                      f"(moved so far: {moved or 'none'} into {aside}): {exc}")
            log.error("trainsentry: %s", reason)
            self._reject(command.id, command.action, reason)
            return CONTINUE
        ckpt = str(root / f"global_step_{target}")
        result = (f"rolled back to step {target} from step {step}; "
                  f"moved {', '.join(moved) or 'nothing'} to {aside}; {saved}")
        marker = self._write_marker("rollback", command, step, metrics, {
            "result": result, "exit_code": ROLLBACK_EXIT_CODE, "to_step": target,
            "checkpoint": ckpt, "previous_latest": previous, "moved": moved,
            "rolled_back_dir": str(aside)})
        self._publish("command_applied", step=step, command_id=command.id, action="rollback",
                      result=result, to_step=target, checkpoint=ckpt)
        log.warning("trainsentry: %s (command %s: %s)", result, command.id, command.reason)
        return Decision(action="rollback", exit_code=ROLLBACK_EXIT_CODE, command_id=command.id,
                        to_step=target, checkpoint=ckpt, result=result, marker=marker)

    # ------------------------------------------------------------------ helpers
    def _applied_before(self, command: ControlCommand) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        path = marker_path(self.checkpoint_dir, command.action, command.id)
        return path if path.exists() else None

    def _rollback_problem(self, target: int | None, current_step: int | None) -> str | None:
        if target is None:
            return "rollback needs to_step"
        if self.checkpoint_dir is None:
            return "the trainer's checkpoint directory is unknown (set trainer.default_local_dir)"
        if current_step is not None and target > current_step:
            return f"rollback target step {target} is after the current step {current_step}"
        folder = self.checkpoint_dir / f"global_step_{target}"
        if not folder.is_dir():
            have = sorted(checkpoint_steps(self.checkpoint_dir))
            return (f"no checkpoint folder {folder} for rollback target step {target} "
                    f"(available steps: {have or 'none'})")
        return None

    def _write_marker(self, action: str, command: ControlCommand, step: int,
                      metrics: Mapping[str, Any] | None, extra: Mapping[str, Any]) -> str | None:
        if self.checkpoint_dir is None:
            return None
        snapshot: Any = None
        if self.resource_snapshot is not None:
            try:
                snapshot = dict(self.resource_snapshot())
            except Exception:
                log.debug("trainsentry: resource snapshot failed", exc_info=True)
        body = {
            "v": 1, "kind": f"trainsentry_{action}", "run_id": self.run_id or command.run_id,
            "attempt": self.attempt, "ts": self._clock(), "step": step, "action": action,
            "command": command.to_dict(), "reason": command.reason,
            "alert_ids": list(command.alert_ids),
            "last_metrics": _jsonable(metrics or {}), "resource_snapshot": snapshot, **extra,
        }
        path = marker_path(self.checkpoint_dir, action, command.id)
        try:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, json.dumps(body, indent=2, default=str).encode())
        except OSError:
            log.exception("trainsentry: could not write %s", path)
            return None
        return str(path)

    def _reject(self, command_id: str | None, action: str | None, reason: str) -> None:
        self.rejected.append((command_id, reason))
        log.warning("trainsentry: command %s (%s) rejected: %s", command_id or "?", action or "?",
                    reason)
        fields: dict[str, Any] = {"reason": reason}
        if command_id is not None:
            fields["command_id"] = command_id
        if action is not None:
            fields["action"] = action
        self._publish("command_rejected", **fields)

    def _publish(self, type: str, *, step: int | None = None, **fields: Any) -> None:
        try:
            self.producer.run_event(type, step=step, **fields)
        except Exception:  # the producer never raises, but a stand-in might
            log.exception("trainsentry: could not publish %s", type)


def _jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        try:
            f = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = f if f == f and abs(f) != float("inf") else str(f)
    return out
