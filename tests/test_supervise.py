"""``trainsentry supervise``: restart after rollback with attempt+1, bounded; pass other exits on."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from producers.remediate import ROLLBACK_EXIT_CODE, TRACKER_FILE
from trainsentry import supervise as sup
from trainsentry.events import ControlCommand, new_id
from trainsentry.signing import sign_command

REPO = Path(__file__).resolve().parents[1]
STAND_IN = REPO / "tests" / "stand_in_trainer.py"
SECRET = "supervise-secret"


def script(tmp_path: Path, body: str) -> list[str]:
    """A tiny child program (python) written to a file; returns its command line."""
    path = tmp_path / f"child_{new_id()[:6]}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def offline_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSENTRY_")}
    env.update({"TRAINSENTRY_KAFKA_BOOTSTRAP": "127.0.0.1:1", "TRAINSENTRY_FLUSH_TIMEOUT_S": "0.1",
                "TRAINSENTRY_SAMPLER": "0", "PYTHONWARNINGS": "ignore", **extra})
    return env


@pytest.mark.verl
@pytest.mark.slow
def test_rollback_restarts_the_stand_in_trainer_which_resumes_from_the_target(tmp_path: Path) -> None:
    """Stand-in trainer + plugin: rollback to 10 at step 25 → exit 75 → attempt 1 resumes from 10 → done."""
    pytest.importorskip("verl")
    ckpt = tmp_path / "ckpt"
    cmd_file = tmp_path / "command.json"
    command = sign_command(ControlCommand(id=new_id(), run_id="demo/exp1", action="rollback",
                                          to_step=10, reason="3 consecutive critical alerts: nan_loss",
                                          alert_ids=["a1", "a2", "a3"], issued_at=time.time()), SECRET)
    cmd_file.write_text(json.dumps(command.to_dict()))
    trainer = [sys.executable, str(STAND_IN), "--project", "demo", "--experiment", "exp1",
               "--steps", "30", "--save-freq", "10", "--checkpoint-dir", str(ckpt),
               "--command-file", str(cmd_file), "--command-at", "25", "--nan-from", "22",
               "--no-console"]
    out = subprocess.run(
        [sys.executable, "-m", "trainsentry.supervise", "--checkpoint-dir", str(ckpt),
         "--max-restarts", "2", "--", *trainer],
        env=offline_env(TRAINSENTRY_CONTROL_SECRET=SECRET), cwd=REPO, capture_output=True,
        text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "EXIT 75 at step 25" in out.stdout and "RESUMED_FROM 10" in out.stdout
    starts = [json.loads(line) for line in (ckpt / "stand_in_starts.jsonl").read_text().splitlines()]
    assert [(s["attempt"], s["resumed_from"]) for s in starts] == [(0, 0), (1, 10)]
    assert (ckpt / "rolled_back" / command.id / "global_step_20" / "actor").is_dir()
    assert (ckpt / TRACKER_FILE).read_text() == "30"  # attempt 1 trained on to the end
    report = json.loads((ckpt / f"trainsentry_diagnosis_{command.id}.json").read_text())
    assert report["checkpoint"]["step"] == 10 and report["checkpoint"]["path"].endswith("global_step_10")
    assert report["command"]["id"] == command.id and report["alert_ids"] == ["a1", "a2", "a3"]
    assert report["trainer_exit_code"] == 75 and report["next_attempt"] == 1
    assert report["evidence"]["last_metrics"]["actor/pg_loss"] == "nan"
    assert report["moved_aside"] == ["global_step_20"]


def test_other_exit_codes_end_supervision_with_that_code(tmp_path: Path) -> None:
    """A crash (exit 3) is not a rollback: no restart, same exit code."""
    runs = tmp_path / "runs"
    child = script(tmp_path, f"""
        import sys
        open({str(runs)!r}, "a").write("x")
        sys.exit(3)
    """)
    assert sup.supervise(child, checkpoint_dir=tmp_path / "ckpt", forward_signals=False) == 3
    assert runs.read_text() == "x"


def test_restarts_are_bounded_and_attempt_increments(tmp_path: Path) -> None:
    """Exit 75 every time: 1 start + max_restarts restarts with attempts 0..N, then 75."""
    seen = tmp_path / "attempts"
    child = script(tmp_path, f"""
        import os, sys
        open({str(seen)!r}, "a").write(os.environ["TRAINSENTRY_ATTEMPT"] + ",")
        sys.exit({ROLLBACK_EXIT_CODE})
    """)
    rc = sup.supervise(child, max_restarts=2, forward_signals=False)
    assert rc == ROLLBACK_EXIT_CODE
    assert seen.read_text() == "0,1,2,"


def _marker_child(tmp_path: Path, ckpt: Path, action: str, first_rc: int) -> list[str]:
    """A child that on attempt 0 writes a Remediator-style marker and exits first_rc (Ray: 1)."""
    return script(tmp_path, f"""
        import json, os, sys
        attempt = int(os.environ["TRAINSENTRY_ATTEMPT"])
        open(os.path.join({str(ckpt)!r}, "seen"), "a").write(str(attempt))
        if attempt == 0:
            body = {{"v": 1, "action": {action!r}, "step": 31, "to_step": 20, "run_id": "p/e",
                     "command": {{"id": "c1", "action": {action!r}, "reason": "r", "alert_ids": []}},
                     "reason": "r", "alert_ids": [], "last_metrics": {{}}, "moved": ["global_step_30"]}}
            open(os.path.join({str(ckpt)!r}, "trainsentry_{action}_c1.json"), "w").write(json.dumps(body))
            sys.exit({first_rc})
        sys.exit(0)
    """)


def test_rollback_marker_with_a_ray_style_exit_code_still_restarts(tmp_path: Path) -> None:
    """Under Ray the driver exits 1 when the trainer actor exits; the marker file says it was a rollback."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step_20").mkdir(parents=True)
    (ckpt / TRACKER_FILE).write_text("20")
    rc = sup.supervise(_marker_child(tmp_path, ckpt, "rollback", 1), checkpoint_dir=ckpt,
                       forward_signals=False)
    assert rc == 0 and (ckpt / "seen").read_text() == "01"
    assert (ckpt / sup.ATTEMPT_FILE).read_text() == "1"
    report = json.loads((ckpt / "trainsentry_diagnosis_c1.json").read_text())
    assert report["trainer_exit_code"] == 1 and report["checkpoint"]["step"] == 20


def test_stop_marker_ends_supervision_with_0(tmp_path: Path) -> None:
    """A stop applied by the plugin ends supervision cleanly even if Ray turned it into exit 1."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rc = sup.supervise(_marker_child(tmp_path, ckpt, "stop", 1), checkpoint_dir=ckpt,
                       forward_signals=False)
    assert rc == 0 and (ckpt / "seen").read_text() == "0"


def test_old_markers_do_not_trigger_a_restart(tmp_path: Path) -> None:
    """Only markers written during this child's run count, not leftovers from earlier runs."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainsentry_rollback_old.json").write_text(json.dumps({"action": "rollback"}))
    child = script(tmp_path, "import sys; sys.exit(1)")
    assert sup.supervise(child, checkpoint_dir=ckpt, forward_signals=False) == 1


def test_no_restart_when_the_tracker_names_a_missing_checkpoint(tmp_path: Path) -> None:
    """Restarting into a missing checkpoint would train from scratch: refuse, keep the code."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / TRACKER_FILE).write_text("20")  # but no global_step_20
    child = script(tmp_path, f"import sys; sys.exit({ROLLBACK_EXIT_CODE})")
    assert sup.supervise(child, checkpoint_dir=ckpt, forward_signals=False) == ROLLBACK_EXIT_CODE
    report = next(ckpt.glob("trainsentry_diagnosis_*.json"))
    assert "does not exist" in json.loads(report.read_text())["checkpoint"]["problem"]


def test_sigterm_is_forwarded_to_the_trainer_and_supervision_ends(tmp_path: Path) -> None:
    """SIGTERM to the supervisor reaches the child; no restart afterwards, even for exit 75."""
    ready = tmp_path / "ready"
    got = tmp_path / "got"
    child = script(tmp_path, f"""
        import signal, sys, time
        def on_term(signum, frame):
            open({str(got)!r}, "w").write(str(signum))
            sys.exit({ROLLBACK_EXIT_CODE})
        signal.signal(signal.SIGTERM, on_term)
        open({str(ready)!r}, "w").write("1")
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "trainsentry.supervise", "--", *child],
                            cwd=REPO, env=offline_env())
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == ROLLBACK_EXIT_CODE
    assert got.read_text() == str(int(signal.SIGTERM))
    assert ready.read_text() == "1"  # started once only


def test_add_cli_wires_the_supervise_subcommand(tmp_path: Path) -> None:
    """add_cli(subparsers) parses options and the command after `--`; the handler returns an int."""
    parser = argparse.ArgumentParser(prog="trainsentry")
    sub = parser.add_subparsers(dest="cmd")
    sup.add_cli(sub)
    args = parser.parse_args(["supervise", "--max-restarts", "1", "--checkpoint-dir", str(tmp_path),
                              "--", sys.executable, "-c", "import sys; sys.exit(4)"])
    assert args.max_restarts == 1 and args.command[-2:] == ["-c", "import sys; sys.exit(4)"]
    assert args.func(args) == 4
    empty = parser.parse_args(["supervise"])
    assert empty.func(empty) == 2


@pytest.mark.kafka
@pytest.mark.verl
@pytest.mark.slow
def test_rollback_sent_on_the_control_topic_restarts_the_stand_in_trainer(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    """Signed rollback on Kafka mid-run → plugin exits 75 → supervisor restarts → resumes at target."""
    pytest.importorskip("verl")
    from producers.kafka import make_sender

    ckpt = tmp_path / "ckpt"
    trainer = [sys.executable, str(STAND_IN), "--run-id", "demo/kafka", "--steps", "40",
               "--save-freq", "5", "--step-sleep", "0.25", "--checkpoint-dir", str(ckpt),
               "--no-console"]
    env = offline_env(TRAINSENTRY_CONTROL_SECRET=SECRET, TRAINSENTRY_KAFKA_BOOTSTRAP=kafka_bootstrap,
                      TRAINSENTRY_TOPIC_PREFIX=topic_prefix, TRAINSENTRY_FLUSH_TIMEOUT_S="5")
    proc = subprocess.Popen([sys.executable, "-m", "trainsentry.supervise", "--checkpoint-dir",
                             str(ckpt), "--", *trainer], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (ckpt / "global_step_10").is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    command = sign_command(ControlCommand(id=new_id(), run_id="demo/kafka", action="rollback",
                                          to_step=5, reason="test", issued_at=time.time()), SECRET)
    send = make_sender(kafka_bootstrap, topic_prefix)
    send("control", command.to_dict())
    send.close()  # type: ignore[attr-defined]
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    starts = [json.loads(line) for line in (ckpt / "stand_in_starts.jsonl").read_text().splitlines()]
    assert [(s["attempt"], s["resumed_from"]) for s in starts] == [(0, 0), (1, 5)]
    assert (ckpt / f"trainsentry_diagnosis_{command.id}.json").is_file()
    assert (ckpt / "rolled_back" / command.id / "global_step_10").is_dir()
