"""`trainsentry detect` as operators script it: bad lines, run ids, settings, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainsentry.cli import main
from trainsentry.simulate import Scenario, generate, generate_file_logger_lines, write_jsonl


def _events_file(path: Path, fault: str = "nan_loss", run_id: str = "exp/nan", **kw: object) -> Path:
    write_jsonl(generate(Scenario(run_id=run_id, fault=fault, steps=120, ranks=2, seed=4, **kw)),
                path)
    return path


def _detect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict], str]:
    code = main(["detect", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_a_cut_off_last_line_is_skipped_with_a_warning_and_the_alerts_stand(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A crashed trainer leaves half a line: the alerts of the lines before it are printed,
    stderr names the bad line, exit 0; --strict makes the same file an error."""
    run = _events_file(tmp_path / "run.jsonl")
    code, whole, _ = _detect(capsys, str(run))
    assert code == 0 and any(a["diagnosis"] == "nan_loss" for a in whole)
    cut = tmp_path / "cut.jsonl"
    lines = run.read_text().splitlines()
    cut.write_text("\n".join([*lines[:50], "garbage in the middle", *lines[50:]])
                   + '\n{"v": 1, "run_id": "exp/nan", "step": 121, "metr')
    code, alerts, err = _detect(capsys, str(cut))
    assert code == 0 and alerts == whole
    assert f"{cut}:51: not valid JSON" in err and f"{cut}:{len(lines) + 2}:" in err
    assert "2 bad line(s) skipped" in err
    code, alerts, err = _detect(capsys, "--strict", str(cut))
    assert code == 2 and alerts == [] and f"{cut}:51" in err and "Traceback" not in err


def test_a_file_without_one_good_line_is_an_error_not_silence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Binary junk or garbage only: exit 2 with what was wrong, never a traceback."""
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    code, alerts, err = _detect(capsys, str(binary))
    assert code == 2 and alerts == [] and "not UTF-8" in err and "Traceback" not in err
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello\n[1, 2]\n")
    code, _, err = _detect(capsys, str(junk))
    assert code == 2 and "no line is a MetricEvent" in err and "2 bad" in err
    code, _, err = _detect(capsys, str(tmp_path))
    assert code == 2 and "is a directory" in err


def test_run_id_names_verl_lines_and_never_merges_contract_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--run-id names file-logger lines; two contract runs in one file stay two runs."""
    two = tmp_path / "two.jsonl"
    a = _events_file(tmp_path / "a.jsonl", "nan_loss", "exp/a")
    b = _events_file(tmp_path / "b.jsonl", "kl_drift", "exp/b")
    two.write_text(a.read_text() + b.read_text())
    _, plain, _ = _detect(capsys, str(two))
    code, named, _ = _detect(capsys, str(two), "--run-id", "X")
    assert code == 0 and named == plain
    assert {x["run_id"] for x in named} == {"exp/a", "exp/b"}
    verl = tmp_path / "verl-run.jsonl"
    sc = Scenario(run_id="ignored", fault="nan_loss", steps=120, ranks=2, seed=4)
    verl.write_text("\n".join(generate_file_logger_lines(sc)) + "\n")
    _, by_name, _ = _detect(capsys, str(verl))
    _, by_flag, _ = _detect(capsys, str(verl), "--run-id", "team/run7")
    assert by_name and {x["run_id"] for x in by_name} == {"verl-run"}
    assert {x["run_id"] for x in by_flag} == {"team/run7"}


def test_detect_reads_the_same_settings_as_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """TRAINSENTRY_DETECTOR_CONFIG and TRAINSENTRY_BREAKER_THRESHOLD apply as in serve; the
    flags win; a threshold under 1 is refused with what to fix."""
    run = _events_file(tmp_path / "run.jsonl")
    _, default, _ = _detect(capsys, "--commands", str(run))
    cmds = [o for o in default if "action" in o and "sig" in o]
    assert cmds, "the nan run trips the breaker at the default threshold"
    monkeypatch.setenv("TRAINSENTRY_BREAKER_THRESHOLD", "1000")
    _, quiet, _ = _detect(capsys, "--commands", str(run))
    assert not [o for o in quiet if "action" in o and "sig" in o]
    _, flag_wins, _ = _detect(capsys, "--commands", "--breaker-threshold", "3", str(run))
    assert flag_wins == default
    monkeypatch.setenv("TRAINSENTRY_BREAKER_THRESHOLD", "0")
    code, _, err = _detect(capsys, str(run))
    assert code == 2 and "TRAINSENTRY_BREAKER_THRESHOLD" in err and ">= 1" in err
    monkeypatch.delenv("TRAINSENTRY_BREAKER_THRESHOLD")
    monkeypatch.setenv("TRAINSENTRY_DETECTOR_CONFIG", str(tmp_path / "missing.yaml"))
    code, _, err = _detect(capsys, str(run))
    assert code == 2 and "missing.yaml does not exist" in err
    monkeypatch.setenv("TRAINSENTRY_DETECTOR_CONFIG", str(tmp_path))
    code, _, err = _detect(capsys, str(run))
    assert code == 2 and "is a directory" in err


def test_simulate_out_to_a_bad_path_says_what_to_fix(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for out, fragment in ((tmp_path, "is a directory"),
                          (tmp_path / "no" / "such" / "run.jsonl", "cannot write --out")):
        code = main(["simulate", "--steps", "5", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "Traceback" not in err, err
