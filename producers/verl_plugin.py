"""verl integration: ``trainer.logger=[console,trainsentry]`` without touching verl's files.

verl 0.9 imports every ``verl.plugins`` entry point when ``verl`` itself is imported
(``verl/__init__.py``; ``VERL_USE_EXTERNAL_MODULES=producers.verl_plugin`` does the same
on 0.6–0.8). Importing this module calls :func:`install`, which hooks exactly three things
on ``verl.utils.tracking.Tracking`` and nothing else:

1. ``Tracking.supported_backend`` gains ``"trainsentry"``, because ``Tracking.__init__``
   asserts every requested backend is in that list (verl has no backend registry).
2. ``Tracking.__init__`` is wrapped: after verl's own set-up, if ``"trainsentry"`` was
   requested, ``self.logger["trainsentry"] = TrainsentryBackend(project, experiment,
   config)``. ``Tracking.log`` already calls ``.log(data=, step=)`` on every entry of
   ``self.logger``, so ``log`` needs no hook.
3. ``Tracking.finish`` is wrapped: verl's ``finish`` only finalises the backends it knows,
   so the wrapper finishes ours (once) after verl's.

:func:`install` is idempotent and leaves ``Tracking`` alone when verl is not installed.

The step boundary: verl's trainers call ``Tracking.log(metrics, step)`` once per step,
at its very end (after the step's checkpoint save). :meth:`TrainsentryBackend.log`
therefore publishes the metrics and then asks the :class:`~producers.remediate.Remediator`
whether a verified stop/rollback is pending; if so it applies it, publishes
``command_applied`` and ``run_finished``, flushes, and raises :class:`RemediationExit`
(a ``SystemExit`` carrying the exit code). In a plain Python trainer the process exits
with that code. In verl's Ray-based ``main_ppo`` the trainer runs in the ``TaskRunner``
actor, so the actor exits and the driver fails with Ray's ``ActorDiedError`` (exit code
1): the supervisor (``trainsentry supervise``) recognises a rollback from the marker file
the Remediator wrote (``trainsentry_rollback_<id>.json``), not only from exit code 75.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from producers.control import ControlListener
from producers.kafka import KafkaOptions
from producers.producer import MetricsProducer
from producers.remediate import ROLLBACK_EXIT_CODE, STOP_EXIT_CODE, Decision, Remediator
from producers.sampler import ResourceSampler
from trainsentry.config import Settings, load_settings

__all__ = [
    "BACKEND_NAME",
    "install",
    "installed",
    "TrainsentryBackend",
    "TrainsentryCheckpointCallback",
    "RemediationExit",
    "active_backend",
    "ROLLBACK_EXIT_CODE",
    "STOP_EXIT_CODE",
]

log = logging.getLogger(__name__)

BACKEND_NAME = "trainsentry"
_MARK = "_trainsentry_hooked"

# The backend of this process, for the checkpoint callback (verl builds the callback in the
# trainer's __init__ and the Tracking in fit(); both live in the same driver/TaskRunner
# process, and verl gives neither a reference to the other). A weak reference, so a
# finished Tracking is not kept alive by us.
_active: weakref.ref[TrainsentryBackend] | None = None
_active_lock = threading.Lock()


class RemediationExit(SystemExit):
    """Raised from ``Tracking.log`` to end training after a stop/rollback was applied."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.exit_code)
        self.decision = decision


def active_backend() -> TrainsentryBackend | None:
    """The live backend of this process, if a Tracking with ``trainsentry`` was created."""
    with _active_lock:
        return None if _active is None else _active()


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, "") or default)
    except ValueError:
        log.warning("trainsentry: %s=%r is not an integer; using %d", name, env.get(name), default)
        return default


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive, finite number from ``env``; anything else warns and gives ``default``."""
    try:
        value = float(env.get(name, "") or default)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        log.warning("trainsentry: %s=%r is not a positive number; using %s", name,
                    env.get(name), default)
        return default
    return value


def _checkpoint_dir(config: Mapping[str, Any] | None, env: Mapping[str, str]) -> Path | None:
    """``TRAINSENTRY_CHECKPOINT_DIR``, else ``trainer.default_local_dir`` made absolute as verl does."""
    raw = env.get("TRAINSENTRY_CHECKPOINT_DIR")
    if not raw and isinstance(config, Mapping):
        trainer = config.get("trainer")
        if isinstance(trainer, Mapping):
            raw = trainer.get("default_local_dir")
    if not raw:
        return None
    path = Path(str(raw))
    return path if path.is_absolute() else Path(os.getcwd()) / path


def _attempt(env: Mapping[str, str], ckpt: Path | None) -> int:
    """``TRAINSENTRY_ATTEMPT`` (set by the supervisor), else the supervisor's attempt file."""
    if env.get("TRAINSENTRY_ATTEMPT"):
        return _env_int(env, "TRAINSENTRY_ATTEMPT", 0)
    if ckpt is not None:
        try:
            return int((ckpt / "trainsentry_attempt.txt").read_text().strip())
        except (OSError, ValueError):
            pass
    return 0


def _find_verl_trainer(max_depth: int = 8) -> Any:
    """Best effort: the verl trainer whose ``fit()`` called ``Tracking.log`` (to save on stop).

    verl hands loggers no trainer reference, so we look up the call stack for a ``self``
    with ``_save_checkpoint`` and ``global_steps``; None when there is none.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if callable(getattr(candidate, "_save_checkpoint", None)) and hasattr(candidate, "global_steps"):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


class TrainsentryBackend:
    """verl Tracking backend: publishes to Kafka, listens for commands, samples resources.

    verl constructs it as ``TrainsentryBackend(project_name, experiment_name, config)``;
    the keyword arguments let tests and other trainers inject parts.
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        config: Mapping[str, Any] | None = None,
        *,
        settings: Settings | None = None,
        env: Mapping[str, str] | None = None,
        producer: MetricsProducer | None = None,
        save_checkpoint: Callable[[], None] | None = None,
        start_threads: bool = True,
    ) -> None:
        global _active
        env = os.environ if env is None else env
        # The plugin is verl's entry point into trainsentry, so it is where the env is read.
        self.settings = settings if settings is not None else load_settings(env=env)
        self.run_id = env.get("TRAINSENTRY_RUN_ID") or f"{project_name}/{experiment_name}"
        self.checkpoint_dir = _checkpoint_dir(config, env)
        self.attempt = _attempt(env, self.checkpoint_dir)
        self.host = socket.gethostname()
        self.flush_timeout_s = _env_float(env, "TRAINSENTRY_FLUSH_TIMEOUT_S", 10.0)
        self.step = 0
        self._finished = False
        self._save_hook = save_checkpoint
        self._trainer_ref: weakref.ref[Any] | None = None
        self.producer = producer if producer is not None else MetricsProducer(
            run_id=self.run_id, bootstrap=KafkaOptions.from_settings(self.settings),
            topic_prefix=self.settings.topic_prefix, attempt=self.attempt, host=self.host)
        self.sampler: ResourceSampler | None = None
        if env.get("TRAINSENTRY_SAMPLER", "1").lower() not in ("0", "false", "no", "off"):
            self.sampler = ResourceSampler(
                producer=self.producer, host=self.host,
                interval_s=_env_float(env, "TRAINSENTRY_SAMPLE_INTERVAL_S", 5.0),
                step_fn=lambda: self.step)
        self.remediator = Remediator(
            checkpoint_dir=self.checkpoint_dir, producer=self.producer,
            save_checkpoint=self._save_checkpoint if save_checkpoint else None,
            run_id=self.run_id, attempt=self.attempt,
            stale_after_steps=max(1, _env_int(env, "TRAINSENTRY_STALE_AFTER_STEPS", 1)),
            resource_snapshot=self.sampler.snapshot if self.sampler is not None else None)
        self.listener: ControlListener | None = None
        if self.settings.control_secret:
            self.listener = ControlListener(
                run_id=self.run_id, secret=self.settings.control_secret,
                on_command=self.remediator.submit, on_reject=self.remediator.reject,
                bootstrap=KafkaOptions.from_settings(self.settings),
                topic_prefix=self.settings.topic_prefix)
        else:
            log.info("trainsentry: TRAINSENTRY_CONTROL_SECRET is not set; run %s will not "
                     "accept stop/rollback commands", self.run_id)
        self.producer.run_started(config or {})
        if start_threads:
            if self.listener is not None:
                self.listener.start()
            if self.sampler is not None:
                self.sampler.start()
        with _active_lock:
            _active = weakref.ref(self)
        log.info("trainsentry: publishing run %s (attempt %d) to %s, checkpoints %s", self.run_id,
                 self.attempt, self.settings.kafka_bootstrap, self.checkpoint_dir or "unknown")

    # ------------------------------------------------------------------ verl's backend API
    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Publish one step's metrics, then apply a pending command (the step boundary)."""
        with contextlib.suppress(TypeError, ValueError):
            self.step = int(step)
        self.producer.log(data, step=self.step)
        if not self.remediator.has_work:
            return
        if self._save_hook is None:
            trainer = _find_verl_trainer()
            if trainer is not None:
                self._trainer_ref = weakref.ref(trainer)
        self.remediator.save_checkpoint = self._save_checkpoint if self.can_save else None
        decision = self.remediator.at_step_boundary(self.step, data)
        if decision.should_exit:
            self.finish(exit_code=decision.exit_code or 0)
            raise RemediationExit(decision)

    def finish(self, exit_code: int = 0) -> None:
        """Publish ``run_finished``, stop the threads, flush. Idempotent; never raises."""
        global _active
        if self._finished:
            return
        self._finished = True
        try:
            if self.listener is not None:
                self.listener.stop(timeout=2.0)
            if self.sampler is not None:
                self.sampler.stop(timeout=2.0)
            self.producer.run_finished(exit_code)
            self.producer.close(timeout=self.flush_timeout_s)
        except Exception:
            log.exception("trainsentry: finishing run %s failed", self.run_id)
        with _active_lock:
            if _active is not None and _active() is self:
                _active = None

    # ------------------------------------------------------------------ extras
    def checkpoint_saved(self, step: int, path: str, **fields: Any) -> None:
        """Publish ``checkpoint_saved`` and tell the remediator (the checkpoint callback)."""
        self.remediator.note_checkpoint(step)
        self.producer.run_event("checkpoint_saved", step=int(step), path=str(path), **fields)

    def deliver(self, raw: bytes | str | Mapping[str, Any]) -> None:
        """Hand one received command (JSON) to verification, as if it came from Kafka."""
        if self.listener is None:
            self.remediator.reject(raw if not isinstance(raw, Mapping) else dict(raw),
                                   "TRAINSENTRY_CONTROL_SECRET is not set; commands cannot be verified")
            return
        if isinstance(raw, Mapping):
            import json

            raw = json.dumps(dict(raw))
        self.listener.handle(None, raw.encode() if isinstance(raw, str) else raw)

    def set_save_checkpoint(self, save: Callable[[], None] | None) -> None:
        """Give the backend a way to save a checkpoint (for ``stop`` / ``checkpoint`` commands).

        Without one, on verl it uses the trainer found on the call stack (``_save_checkpoint``).
        """
        self._save_hook = save
        self.remediator.save_checkpoint = self._save_checkpoint if self.can_save else None

    def _save_checkpoint(self) -> None:
        if self._save_hook is not None:
            self._save_hook()
            return
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise RuntimeError("no verl trainer found on the call stack to save a checkpoint")
        trainer._save_checkpoint()

    @property
    def can_save(self) -> bool:
        return self._save_hook is not None or (
            self._trainer_ref is not None and self._trainer_ref() is not None)


class TrainsentryCheckpointCallback:
    """``trainer.checkpoint_callback_class=producers.verl_plugin.TrainsentryCheckpointCallback``.

    verl (0.9.1, v1 trainer) builds it with ``config=`` and calls :meth:`on_save` after
    each save, on the driver. It publishes ``checkpoint_saved`` through the process's
    trainsentry backend (so ``trainer.logger`` must include ``trainsentry``).
    """

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self._warned = False

    def on_save(self, trainer: Any, global_step: int, checkpoint_dir: str,
                async_save: bool = False, **kwargs: Any) -> None:
        backend = active_backend()
        if backend is None:
            if not self._warned:
                self._warned = True
                log.warning("trainsentry: checkpoint at step %s not published: add 'trainsentry' "
                            "to trainer.logger", global_step)
            return
        try:
            backend.checkpoint_saved(int(global_step), str(checkpoint_dir),
                                     **({"async_save": True} if async_save else {}))
        except Exception:  # verl aborts training on callback errors; publishing is best effort
            log.exception("trainsentry: publishing checkpoint_saved failed")


# ---------------------------------------------------------------------- the hook
def installed() -> bool:
    """Whether verl's Tracking currently accepts the ``trainsentry`` backend."""
    try:
        from verl.utils.tracking import Tracking
    except Exception:
        return False
    return bool(getattr(Tracking, _MARK, False))


def install(tracking_cls: Any = None) -> bool:
    """Teach verl's ``Tracking`` the ``trainsentry`` backend (idempotent). False without verl."""
    if tracking_cls is None:
        try:
            from verl.utils.tracking import Tracking as tracking_cls
        except Exception as exc:  # verl missing or broken: nothing to hook
            log.debug("trainsentry: verl Tracking not importable (%s); plugin inactive", exc)
            return False
    if getattr(tracking_cls, _MARK, False):
        return True
    supported = getattr(tracking_cls, "supported_backend", None)
    if isinstance(supported, list) and BACKEND_NAME not in supported:
        supported.append(BACKEND_NAME)
    original_init = tracking_cls.__init__
    original_finish = getattr(tracking_cls, "finish", None)

    init_sig = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        bound = init_sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        backends = a.get("default_backend", "console")
        names = [backends] if isinstance(backends, str) else list(backends or [])
        if BACKEND_NAME in names:
            try:
                self.logger[BACKEND_NAME] = TrainsentryBackend(
                    str(a.get("project_name")), str(a.get("experiment_name")), a.get("config"))
            except Exception as exc:
                # A bad trainsentry setting must not stop a training run: say what to fix,
                # loudly, and train without the watchdog.
                log.error("trainsentry: NOT watching this run: %s. Fix the setting and "
                          "restart to get alerts; training goes on without trainsentry.", exc)

    tracking_cls.__init__ = __init__
    if original_finish is not None:

        takes_code = "exit_code" in inspect.signature(original_finish).parameters

        @functools.wraps(original_finish)
        def finish(self: Any, exit_code: int = 0) -> None:
            already = getattr(self, "_finished", False)
            try:
                if takes_code:
                    original_finish(self, exit_code=exit_code)
                else:
                    original_finish(self)
            finally:
                backend = getattr(self, "logger", {}).get(BACKEND_NAME)
                if not already and backend is not None:
                    backend.finish(exit_code=exit_code)

        tracking_cls.finish = finish
    setattr(tracking_cls, _MARK, True)
    log.debug("trainsentry: registered the 'trainsentry' backend in %s", tracking_cls)
    return True


install()
