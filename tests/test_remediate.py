"""Remediator: verified commands change the run only at step boundaries, and only safely."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from producers.control import ControlListener
from producers.remediate import (
    ROLLBACK_EXIT_CODE,
    STOP_EXIT_CODE,
    TRACKER_FILE,
    Remediator,
    marker_path,
    read_tracker,
    write_tracker,
)
from trainsentry.events import ControlCommand, new_id
from trainsentry.signing import sign_command

SECRET = "test-secret"
RUN = "proj/exp1"


class RecordingProducer:
    """Records run events; enough of MetricsProducer for the Remediator."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def run_event(self, type: str, *, step: int | None = None, **fields: Any) -> None:
        self.events.append({"type": type, "step": step, **fields})

    def of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type]


def make_ckpt(root: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    """A verl-layout checkpoint dir: global_step_N/actor/..., data.pt, tracker = last."""
    for s in steps:
        (root / f"global_step_{s}" / "actor").mkdir(parents=True)
        (root / f"global_step_{s}" / "actor" / "model.pt").write_text(f"weights {s}")
        (root / f"global_step_{s}" / "data.pt").write_text("loader")
    (root / TRACKER_FILE).write_text(str(steps[-1]))
    return root


def command(action: str, to_step: int | None = None, *, run_id: str = RUN,
            issued_at: float | None = None, id: str | None = None) -> ControlCommand:
    return ControlCommand(id=id or new_id(), run_id=run_id, action=action, to_step=to_step,
                          reason="3 consecutive critical alerts: nan_loss", alert_ids=["a1"],
                          issued_at=time.time() if issued_at is None else issued_at)


def signed(cmd: ControlCommand, secret: str = SECRET) -> bytes:
    return json.dumps(sign_command(cmd, secret).to_dict()).encode()


@pytest.mark.verl
def test_rollback_moves_newer_folders_aside_and_verl_resumes_from_the_target(tmp_path: Path) -> None:
    """After rollback to 20, verl's own find_latest_ckpt_path returns global_step_20; step 30 is kept aside."""
    pytest.importorskip("verl")
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    ckpt = make_ckpt(tmp_path / "ckpt")
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer, run_id=RUN,
                     resource_snapshot=lambda: {"host": {"system/cpu_load_avg": 1.0}})
    cmd = command("rollback", 20)
    rem.submit(cmd)
    decision = rem.at_step_boundary(31, {"actor/pg_loss": float("nan")})

    assert decision.action == "rollback" and decision.exit_code == ROLLBACK_EXIT_CODE == 75
    assert find_latest_ckpt_path(str(ckpt)) == str(ckpt / "global_step_20")
    aside = ckpt / "rolled_back" / cmd.id
    assert (aside / "global_step_30" / "actor" / "model.pt").read_text() == "weights 30"
    assert (aside / TRACKER_FILE).read_text() == "30"
    assert not (ckpt / "global_step_30").exists()
    assert (ckpt / "global_step_10").is_dir() and (ckpt / "global_step_20").is_dir()
    applied = producer.of("command_applied")
    assert applied[0]["command_id"] == cmd.id and applied[0]["action"] == "rollback"
    assert "rolled back to step 20" in applied[0]["result"]
    marker = json.loads(marker_path(ckpt, "rollback", cmd.id).read_text())
    assert marker["to_step"] == 20 and marker["moved"] == ["global_step_30"]
    assert marker["last_metrics"]["actor/pg_loss"] == "nan"
    assert marker["resource_snapshot"] == {"host": {"system/cpu_load_avg": 1.0}}
    assert marker["command"]["id"] == cmd.id and marker["previous_latest"] == 30


def test_commands_change_nothing_until_the_step_boundary(tmp_path: Path) -> None:
    """submit() only queues: the checkpoint dir is untouched until at_step_boundary()."""
    ckpt = make_ckpt(tmp_path)
    rem = Remediator(checkpoint_dir=ckpt, producer=RecordingProducer())
    rem.submit(command("rollback", 10))
    assert read_tracker(ckpt) == 30 and (ckpt / "global_step_30").is_dir()
    assert rem.pending is not None and rem.has_work
    assert rem.at_step_boundary(33).should_exit
    assert read_tracker(ckpt) == 10 and rem.pending is None


def test_rollback_to_a_step_without_a_folder_is_rejected_and_reported(tmp_path: Path) -> None:
    """A rollback target with no global_step_N folder is refused with a reason; training goes on."""
    ckpt = make_ckpt(tmp_path)
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer)
    cmd = command("rollback", 15)
    rem.submit(cmd)
    assert rem.at_step_boundary(31).action == "continue"
    rejected = producer.of("command_rejected")
    assert rejected[0]["command_id"] == cmd.id and "15" in rejected[0]["reason"]
    assert "available steps: [10, 20, 30]" in rejected[0]["reason"]
    assert read_tracker(ckpt) == 30 and not (ckpt / "rolled_back").exists()
    assert not producer.of("command_applied")


def test_rollback_target_that_vanished_before_the_boundary_is_rejected(tmp_path: Path) -> None:
    """The target is checked again at the boundary: a folder deleted meanwhile is not rolled back to."""
    import shutil

    ckpt = make_ckpt(tmp_path)
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer)
    rem.submit(command("rollback", 20))
    shutil.rmtree(ckpt / "global_step_20")
    assert not rem.at_step_boundary(31).should_exit
    assert producer.of("command_rejected") and read_tracker(ckpt) == 30


def test_stop_saves_a_stale_checkpoint_then_ends_cleanly(tmp_path: Path) -> None:
    """stop: save when the last checkpoint is older than the current step, then exit 0."""
    ckpt = make_ckpt(tmp_path)
    saves: list[int] = []
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer, save_checkpoint=lambda: saves.append(1))
    cmd = command("stop")
    rem.submit(cmd)
    decision = rem.at_step_boundary(34)
    assert decision.action == "stop" and decision.exit_code == STOP_EXIT_CODE == 0
    assert saves == [1]
    applied = producer.of("command_applied")[0]
    assert applied["action"] == "stop" and "saved a checkpoint at step 34" in applied["result"]
    assert json.loads(marker_path(ckpt, "stop", cmd.id).read_text())["step"] == 34
    assert read_tracker(ckpt) == 30  # stop never touches the tracker itself


def test_stop_does_not_save_when_the_checkpoint_is_current(tmp_path: Path) -> None:
    """A checkpoint of this very step (saved before Tracking.log, as verl does) is not saved again."""
    ckpt = make_ckpt(tmp_path)
    saves: list[int] = []
    rem = Remediator(checkpoint_dir=ckpt, producer=RecordingProducer(),
                     save_checkpoint=lambda: saves.append(1), stale_after_steps=5)
    rem.note_checkpoint(30)
    rem.submit(command("stop"))
    assert rem.at_step_boundary(33).exit_code == 0
    assert saves == []


def test_checkpoint_command_saves_and_training_continues(tmp_path: Path) -> None:
    """checkpoint: save now, publish command_applied, do not exit."""
    saves: list[int] = []
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=tmp_path, producer=producer, save_checkpoint=lambda: saves.append(1))
    rem.submit(command("checkpoint"))
    assert not rem.at_step_boundary(5).should_exit
    assert saves == [1] and producer.of("command_applied")[0]["action"] == "checkpoint"


def test_rollback_supersedes_a_pending_stop_and_a_second_stop_is_refused(tmp_path: Path) -> None:
    """Only one terminal command per boundary: rollback wins over stop; duplicates are reported."""
    ckpt = make_ckpt(tmp_path)
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer)
    stop, rollback, stop2 = command("stop"), command("rollback", 20), command("stop")
    rem.submit(stop)
    rem.submit(rollback)
    rem.submit(stop2)
    assert rem.at_step_boundary(31).command_id == rollback.id
    assert producer.of("command_applied")[0]["result"].startswith("superseded by rollback")
    assert producer.of("command_rejected")[0]["command_id"] == stop2.id


def test_tracker_is_rewritten_atomically(tmp_path: Path) -> None:
    """write_tracker replaces the file in one rename and leaves no temp files behind."""
    (tmp_path / TRACKER_FILE).write_text("30")
    write_tracker(tmp_path, 20)
    assert (tmp_path / TRACKER_FILE).read_text() == "20"
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_FILE]


# ---------------------------------------------------------------- verification before use
@pytest.fixture
def wired(tmp_path: Path) -> tuple[ControlListener, Remediator, RecordingProducer, list[ControlCommand]]:
    ckpt = make_ckpt(tmp_path / "ckpt")
    producer = RecordingProducer()
    rem = Remediator(checkpoint_dir=ckpt, producer=producer, run_id=RUN)
    reached: list[ControlCommand] = []

    def on_command(cmd: ControlCommand) -> None:
        reached.append(cmd)
        rem.submit(cmd)

    listener = ControlListener(run_id=RUN, secret=SECRET, on_command=on_command,
                               on_reject=rem.reject, bootstrap="127.0.0.1:1")
    return listener, rem, producer, reached


def test_forged_command_is_rejected_reported_and_never_applied(wired: Any) -> None:
    """A command signed with another key is reported as command_rejected and never queued."""
    listener, rem, producer, reached = wired
    cmd = command("rollback", 20)
    listener.handle(RUN.encode(), signed(cmd, secret="not-the-secret"))
    assert reached == [] and rem.pending is None
    rejected = producer.of("command_rejected")
    assert rejected[0]["command_id"] == cmd.id and "signature" in rejected[0]["reason"]


def test_tampered_command_is_rejected(wired: Any) -> None:
    """Changing to_step after signing breaks the signature."""
    listener, rem, producer, reached = wired
    body = json.loads(signed(command("rollback", 20)))
    body["to_step"] = 10
    listener.handle(RUN.encode(), json.dumps(body).encode())
    assert reached == [] and "signature" in producer.of("command_rejected")[0]["reason"]


def test_replayed_command_is_applied_once_and_the_replay_reported(wired: Any) -> None:
    """The same command id a second time is a replay: rejected, reported."""
    listener, rem, producer, reached = wired
    raw = signed(command("stop"))
    listener.handle(RUN.encode(), raw)
    listener.handle(RUN.encode(), raw)
    assert len(reached) == 1
    assert "replay" in producer.of("command_rejected")[0]["reason"]


def test_expired_command_is_rejected_and_reported(wired: Any) -> None:
    """A command issued an hour ago is outside the age window."""
    listener, rem, producer, reached = wired
    listener.handle(RUN.encode(), signed(command("stop", issued_at=time.time() - 3600)))
    assert reached == [] and "old" in producer.of("command_rejected")[0]["reason"]


def test_command_for_another_run_never_reaches_the_callback(wired: Any) -> None:
    """Another run's command is refused: reported when keyed to us, ignored when keyed to its run."""
    listener, rem, producer, reached = wired
    other = command("stop", run_id="proj/other")
    listener.handle(RUN.encode(), signed(other))  # body names another run under our key
    listener.handle(b"proj/other", signed(command("stop", run_id="proj/other")))
    assert reached == [] and rem.pending is None
    rejected = producer.of("command_rejected")
    assert len(rejected) == 1 and "proj/other" in rejected[0]["reason"]


def test_garbage_on_the_control_topic_is_reported_without_an_id(wired: Any) -> None:
    """Non-JSON records are rejected with a reason and no command_id."""
    listener, rem, producer, reached = wired
    listener.handle(RUN.encode(), b"{not json")
    rejected = producer.of("command_rejected")
    assert reached == [] and "command_id" not in rejected[0] and rejected[0]["reason"]


def test_a_command_applied_before_a_restart_is_not_applied_again(tmp_path: Path) -> None:
    """The restarted trainer re-reads the same rollback from Kafka: the marker on disk refuses it."""
    ckpt = make_ckpt(tmp_path)
    cmd = command("rollback", 20)
    first = Remediator(checkpoint_dir=ckpt, producer=RecordingProducer())
    first.submit(cmd)
    assert first.at_step_boundary(31).should_exit
    producer = RecordingProducer()
    restarted = Remediator(checkpoint_dir=ckpt, producer=producer, attempt=1)
    restarted.submit(cmd)
    assert restarted.pending is None and not restarted.at_step_boundary(21).should_exit
    assert "already applied" in producer.of("command_rejected")[0]["reason"]
    assert read_tracker(ckpt) == 20


def test_a_tombstone_or_unreadable_record_never_stops_the_next_command(wired: Any) -> None:
    """A tombstone (value None) is ignored; a record nested too deep for the JSON parser or
    of the wrong type is refused and reported; the signed command after them is applied."""
    listener, rem, producer, reached = wired
    listener.handle(RUN.encode(), None)
    listener.handle(RUN.encode(), b'{"a":' * 100_000)
    listener.handle(RUN.encode(), 12345)  # type: ignore[arg-type]
    listener.handle(RUN.encode(), signed(command("stop")))
    assert [c.action for c in reached] == ["stop"]
    reasons = [r["reason"] for r in producer.of("command_rejected")]
    assert len(reasons) == 2 and "not valid JSON" in reasons[0]
