"""The verl plugin: verl's own Tracking accepts ``trainsentry``, publishes, and obeys commands."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")

from producers import verl_plugin  # noqa: E402
from producers.remediate import ROLLBACK_EXIT_CODE, TRACKER_FILE  # noqa: E402
from trainsentry.config import Secret, Settings, Topics  # noqa: E402
from trainsentry.events import ControlCommand, new_id  # noqa: E402
from trainsentry.signing import sign_command  # noqa: E402

pytestmark = pytest.mark.verl

SECRET = "plugin-secret"


class RecordingProducer:
    """Enough of MetricsProducer for the backend; records everything."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.closed = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_layer(self, *a: Any, **k: Any) -> None: ...
    def heartbeat(self, step: int) -> None: ...

    def run_event(self, type: str, *, step: int | None = None, **fields: Any) -> None:
        self.events.append({"type": type, "step": step, **fields})

    def run_started(self, config: Mapping[str, Any]) -> None:
        self.run_event("run_started", config=dict(config))

    def run_finished(self, exit_code: int = 0) -> None:
        self.run_event("run_finished", exit_code=exit_code)

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def make_ckpt(root: Path) -> Path:
    for s in (10, 20, 30):
        (root / f"global_step_{s}" / "actor").mkdir(parents=True)
    (root / TRACKER_FILE).write_text("30")
    return root


def signed(action: str, run_id: str, to_step: int | None = None, secret: str = SECRET) -> dict[str, Any]:
    cmd = ControlCommand(id=new_id(), run_id=run_id, action=action, to_step=to_step,
                         reason="test", issued_at=time.time())
    return sign_command(cmd, secret).to_dict()


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No broker: a refused port, short flushes, no sampler thread."""
    monkeypatch.setenv("TRAINSENTRY_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("TRAINSENTRY_FLUSH_TIMEOUT_S", "0.1")
    monkeypatch.setenv("TRAINSENTRY_SAMPLER", "0")
    monkeypatch.delenv("TRAINSENTRY_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("TRAINSENTRY_ATTEMPT", raising=False)
    monkeypatch.delenv("TRAINSENTRY_RUN_ID", raising=False)
    yield


def test_importing_verl_loads_the_plugin_through_the_entry_point() -> None:
    """In a fresh interpreter, `import verl` alone makes Tracking accept 'trainsentry'."""
    code = ("import verl\nfrom verl.utils.tracking import Tracking\n"
            "print('trainsentry' in Tracking.supported_backend, "
            "getattr(Tracking, '_trainsentry_hooked', False))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=240)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_install_is_idempotent() -> None:
    """Installing twice neither duplicates the backend name nor wraps Tracking twice."""
    from verl.utils.tracking import Tracking

    init = Tracking.__init__
    assert verl_plugin.install() and verl_plugin.install()
    assert Tracking.supported_backend.count("trainsentry") == 1
    assert Tracking.__init__ is init and verl_plugin.installed()


def test_verl_tracking_with_trainsentry_creates_our_backend_and_finishes_it(offline_env: None, tmp_path: Path) -> None:
    """Tracking(default_backend=[console, trainsentry]) logs through our backend; finish() publishes once."""
    from verl.utils.tracking import Tracking

    config = {"trainer": {"default_local_dir": str(tmp_path), "total_training_steps": 5}}
    tracking = Tracking(project_name="proj", experiment_name="exp1",
                        default_backend=["console", "trainsentry"], config=config)
    backend = tracking.logger["trainsentry"]
    assert isinstance(backend, verl_plugin.TrainsentryBackend)
    assert backend.run_id == "proj/exp1" and backend.checkpoint_dir == tmp_path
    assert verl_plugin.active_backend() is backend
    tracking.log({"actor/pg_loss": 0.5}, step=1)
    tracking.log({"actor/pg_loss": 0.4}, step=2)
    assert backend.producer.stats.logged == 2 and backend.step == 2
    tracking.finish()
    tracking.finish()
    assert backend._finished and verl_plugin.active_backend() is None


def test_attempt_comes_from_the_supervisor_env(offline_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRAINSENTRY_ATTEMPT (set by `trainsentry supervise`) becomes the events' attempt."""
    monkeypatch.setenv("TRAINSENTRY_ATTEMPT", "2")
    backend = verl_plugin.TrainsentryBackend("p", "e", None, producer=RecordingProducer(),  # type: ignore[arg-type]
                                             start_threads=False)
    assert backend.attempt == 2 and backend.remediator.attempt == 2
    backend.finish()


def test_backend_publishes_flat_config_metrics_and_finish(tmp_path: Path) -> None:
    """run_started carries the config, log() forwards metrics, finish() sends run_finished and closes."""
    producer = RecordingProducer()
    backend = verl_plugin.TrainsentryBackend(
        "p", "e", {"trainer": {"default_local_dir": str(tmp_path)}}, settings=Settings(),
        env={}, producer=producer, start_threads=False)  # type: ignore[arg-type]
    backend.log({"actor/pg_loss": 1.0}, step=3)
    backend.finish(exit_code=0)
    assert producer.metrics == [(3, {"actor/pg_loss": 1.0})]
    assert producer.types() == ["run_started", "run_finished"] and producer.closed
    assert producer.events[0]["config"]["trainer"]["default_local_dir"] == str(tmp_path)


def test_rollback_delivered_to_the_plugin_exits_75_at_the_next_log(tmp_path: Path) -> None:
    """A verified rollback is applied in Tracking.log: SystemExit(75), tracker rewritten for verl."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
    from verl.utils.tracking import Tracking

    ckpt = make_ckpt(tmp_path / "ckpt")
    producer = RecordingProducer()
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console"])
    backend = verl_plugin.TrainsentryBackend(
        "p", "e", {"trainer": {"default_local_dir": str(ckpt)}},
        settings=Settings(control_secret=Secret(SECRET)),
        env={}, producer=producer, start_threads=False)  # type: ignore[arg-type]
    tracking.logger["trainsentry"] = backend
    backend.deliver(signed("rollback", "p/e", 20))
    with pytest.raises(SystemExit) as exc:
        tracking.log({"actor/pg_loss": float("nan")}, step=31)
    assert exc.value.code == ROLLBACK_EXIT_CODE
    assert isinstance(exc.value, verl_plugin.RemediationExit)
    assert find_latest_ckpt_path(str(ckpt)) == str(ckpt / "global_step_20")
    assert producer.types()[-2:] == ["command_applied", "run_finished"]
    assert producer.events[-1]["exit_code"] == 75 and producer.closed


def test_commands_without_a_secret_are_rejected_and_reported(tmp_path: Path) -> None:
    """With no TRAINSENTRY_CONTROL_SECRET a trainer cannot verify, so it applies nothing."""
    producer = RecordingProducer()
    backend = verl_plugin.TrainsentryBackend("p", "e", None, settings=Settings(), env={},
                                             producer=producer, start_threads=False)  # type: ignore[arg-type]
    backend.deliver(signed("stop", "p/e"))
    backend.log({"x": 1.0}, step=1)
    assert backend.listener is None and "command_rejected" in producer.types()
    backend.finish()


def test_checkpoint_callback_built_by_verl_publishes_checkpoint_saved(tmp_path: Path) -> None:
    """trainer.checkpoint_callback_class=...TrainsentryCheckpointCallback works with verl's loader."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

    producer = RecordingProducer()
    backend = verl_plugin.TrainsentryBackend("p", "e", None, settings=Settings(), env={},
                                             producer=producer, start_threads=False)  # type: ignore[arg-type]
    config = OmegaConf.create({"trainer": {
        "checkpoint_callback_class": "producers.verl_plugin.TrainsentryCheckpointCallback"}})
    callback = build_checkpoint_callback(config)
    assert isinstance(callback, verl_plugin.TrainsentryCheckpointCallback)
    callback.on_save(trainer=None, global_step=40, checkpoint_dir=str(tmp_path / "global_step_40"),
                     async_save=False)
    saved = [e for e in producer.events if e["type"] == "checkpoint_saved"]
    assert saved == [{"type": "checkpoint_saved", "step": 40, "path": str(tmp_path / "global_step_40")}]
    assert backend.remediator.last_saved_step == 40
    backend.finish()


def test_stop_saves_through_the_verl_trainer_found_on_the_stack(tmp_path: Path) -> None:
    """On verl, stop saves a stale checkpoint with the calling trainer's _save_checkpoint()."""
    from verl.utils.tracking import Tracking

    producer = RecordingProducer()
    backend = verl_plugin.TrainsentryBackend(
        "p", "e", {"trainer": {"default_local_dir": str(tmp_path)}},
        settings=Settings(control_secret=Secret(SECRET)),
        env={}, producer=producer, start_threads=False)  # type: ignore[arg-type]

    class FakeTrainer:
        global_steps = 7
        saved: list[int] = []

        def _save_checkpoint(self) -> None:
            self.saved.append(self.global_steps)

        def fit(self) -> None:
            self.logger = Tracking(project_name="p", experiment_name="e", default_backend="console")
            self.logger.logger["trainsentry"] = backend
            self.logger.log(data={"actor/pg_loss": 0.1}, step=self.global_steps)

    backend.deliver(signed("stop", "p/e"))
    trainer = FakeTrainer()
    with pytest.raises(SystemExit) as exc:
        trainer.fit()
    assert exc.value.code == 0 and trainer.saved == [7]
    applied = [e for e in producer.events if e["type"] == "command_applied"][0]
    assert "saved a checkpoint at step 7" in applied["result"]


# ---------------------------------------------------------------- through the real broker
def _consume(bootstrap: str, topics: list[str], until: Any, timeout: float = 30.0) -> list[tuple[str, dict[str, Any]]]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(*topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=1000)
    got: list[tuple[str, dict[str, Any]]] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(got):
            for record in consumer:
                assert record.key is not None
                got.append((record.topic, json.loads(record.value)))
    finally:
        consumer.close()
    return got


@pytest.mark.kafka
def test_verl_tracking_publishes_to_the_real_broker(kafka_bootstrap: str, topic_prefix: str,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """verl's own Tracking with [console, trainsentry]: metrics, resources and run events reach Kafka."""
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("TRAINSENTRY_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("TRAINSENTRY_TOPIC_PREFIX", topic_prefix)
    monkeypatch.setenv("TRAINSENTRY_SAMPLE_INTERVAL_S", "0.2")
    monkeypatch.setenv("TRAINSENTRY_ATTEMPT", "1")
    monkeypatch.delenv("TRAINSENTRY_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("TRAINSENTRY_RUN_ID", raising=False)
    config = {"trainer": {"project_name": "proj", "experiment_name": "kafka1",
                          "default_local_dir": str(tmp_path), "total_training_steps": 3}}
    tracking = Tracking(project_name="proj", experiment_name="kafka1",
                        default_backend=["console", "trainsentry"], config=config)
    for step in (1, 2, 3):
        tracking.log({"actor/pg_loss": 0.1 * step, "timing_s/gen": 3.0,
                      "actor/grad_norm": float("nan") if step == 3 else 1.0}, step=step)
    time.sleep(0.6)  # let the sampler publish a couple of resource readings
    tracking.finish()
    topics = Topics(topic_prefix)

    def done(got: list[tuple[str, dict[str, Any]]]) -> bool:
        return any(e.get("type") == "run_finished" for _, e in got) and any(
            t == topics.resource for t, _ in got)

    got = _consume(kafka_bootstrap, [topics.data, topics.compute, topics.resource, topics.runs], done)
    runs = [e for t, e in got if t == topics.runs]
    assert runs[0]["type"] == "run_started" and runs[0]["run_id"] == "proj/kafka1"
    assert runs[0]["attempt"] == 1
    assert runs[0]["config"]["trainer.default_local_dir"] == str(tmp_path)
    assert runs[-1]["type"] == "run_finished" and runs[-1]["exit_code"] == 0
    compute = [e for t, e in got if t == topics.compute]
    assert [e["step"] for e in compute] == [1, 2, 3]
    assert compute[-1]["metrics"]["actor/grad_norm"] == "nan"
    assert [e["metrics"]["timing_s/gen"] for t, e in got if t == topics.data] == [3.0] * 3
    resource = [e for t, e in got if t == topics.resource]
    assert resource and "system/cpu_load_avg" in resource[0]["metrics"]


@pytest.mark.kafka
def test_rollback_from_the_control_topic_is_obeyed_and_forgeries_reported(
        kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A signed rollback on the control topic ends the run with 75; a forged one is reported, not applied."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
    from verl.utils.tracking import Tracking

    from producers.kafka import make_sender

    ckpt = make_ckpt(tmp_path / "ckpt")
    monkeypatch.setenv("TRAINSENTRY_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("TRAINSENTRY_TOPIC_PREFIX", topic_prefix)
    monkeypatch.setenv("TRAINSENTRY_CONTROL_SECRET", SECRET)
    monkeypatch.setenv("TRAINSENTRY_SAMPLER", "0")
    monkeypatch.delenv("TRAINSENTRY_RUN_ID", raising=False)
    monkeypatch.delenv("TRAINSENTRY_ATTEMPT", raising=False)
    send = make_sender(kafka_bootstrap, topic_prefix)
    forged = signed("rollback", "proj/ctl", 10, secret="wrong")
    good = signed("rollback", "proj/ctl", 20)
    send("control", forged)
    send("control", good)
    send.close()  # type: ignore[attr-defined]
    tracking = Tracking(project_name="proj", experiment_name="ctl",
                        default_backend=["trainsentry"], config={"trainer": {"default_local_dir": str(ckpt)}})
    backend = tracking.logger["trainsentry"]
    deadline = time.monotonic() + 60
    while backend.remediator.pending is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.remediator.pending is not None and backend.remediator.pending.id == good["id"]
    with pytest.raises(SystemExit) as exc:
        tracking.log({"actor/pg_loss": 0.0}, step=31)
    assert exc.value.code == ROLLBACK_EXIT_CODE
    assert find_latest_ckpt_path(str(ckpt)) == str(ckpt / "global_step_20")
    topics = Topics(topic_prefix)
    got = _consume(kafka_bootstrap, [topics.runs],
                   lambda g: any(e.get("type") == "run_finished" for _, e in g))
    by_type = {e["type"]: e for _, e in got}
    assert by_type["command_rejected"]["command_id"] == forged["id"]
    assert "signature" in by_type["command_rejected"]["reason"]
    assert by_type["command_applied"]["command_id"] == good["id"]
    assert by_type["run_finished"]["exit_code"] == ROLLBACK_EXIT_CODE


def test_a_bad_trainsentry_setting_never_stops_verl_from_training(
        offline_env: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A setting the service would refuse (TRAINSENTRY_WEB_PORT=abc) does not make verl's
    Tracking raise: the run trains without the watchdog and the log says so and why. A
    sample interval or flush timeout that is not a positive number falls back to its default."""
    import logging

    from verl.utils.tracking import Tracking

    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("TRAINSENTRY_WEB_PORT", "abc")
    tracking = Tracking(project_name="proj", experiment_name="bad",
                        default_backend=["console", "trainsentry"], config={})
    assert "trainsentry" not in tracking.logger
    tracking.log({"actor/pg_loss": 0.5}, step=1)
    said = [r.getMessage() for r in caplog.records if "NOT watching" in r.getMessage()]
    assert said and "TRAINSENTRY_WEB_PORT" in said[0]
    monkeypatch.delenv("TRAINSENTRY_WEB_PORT")
    monkeypatch.setenv("TRAINSENTRY_FLUSH_TIMEOUT_S", "inf")
    monkeypatch.setenv("TRAINSENTRY_SAMPLE_INTERVAL_S", "0")
    monkeypatch.setenv("TRAINSENTRY_SAMPLER", "1")
    tracking = Tracking(project_name="proj", experiment_name="ok",
                        default_backend=["console", "trainsentry"], config={})
    backend = tracking.logger["trainsentry"]
    assert backend.flush_timeout_s == 10.0
    assert backend.sampler is not None and backend.sampler.interval_s == 5.0
    backend.flush_timeout_s = 0.1  # no broker here: do not wait the default 10 s
    tracking.finish()
