"""``trainsentry score FILE.csv [--detector NAME]``, through its handler."""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path

import pytest

from detectors.score import (
    DETECTORS,
    PERIOD_ROWS,
    ScoreError,
    add_cli,
    read_nab_csv,
    run_score,
    score_series,
    values_per_day,
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainsentry")
    add_cli(parser.add_subparsers(dest="command"))
    return parser


def write_csv(path: Path, values: list[float]) -> Path:
    lines = ["timestamp,value"] + [f"2024-01-01 00:{i // 60:02d}:{i % 60:02d},{v}"
                                   for i, v in enumerate(values)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(argv: list[str]) -> tuple[int, str, str]:
    args = make_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    return args.func(args, out, err), out.getvalue(), err.getvalue()


def test_scores_every_row_in_unit_interval(tmp_path: Path) -> None:
    """Output has the input rows plus an anomaly_score in [0, 1]; the spike stands out."""
    values = [10.0 + (i % 3) for i in range(400)] + [500.0]
    rc, out, _ = run(["score", str(write_csv(tmp_path / "s.csv", values))])
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == len(values)
    assert list(rows[0]) == ["timestamp", "value", "anomaly_score"]
    scores = [float(r["anomaly_score"]) for r in rows]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores[-1] > 0.5 and sum(s > 0.5 for s in scores[:-1]) <= 2
    assert float(rows[-1]["value"]) == 500.0


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_every_named_detector_runs(tmp_path: Path, name: str) -> None:
    """Each name in DETECTORS is accepted by --detector."""
    rc, out, _ = run(["score", str(write_csv(tmp_path / "s.csv", [1.0, 2.0, 3.0] * 20)),
                      "--detector", name])
    assert rc == 0 and out.count("\n") == 61


def test_unknown_detector_lists_valid_names(tmp_path: Path) -> None:
    """An unknown --detector is an error naming every valid choice."""
    rc, out, err = run(["score", str(write_csv(tmp_path / "s.csv", [1.0])), "--detector", "nope"])
    assert rc == 2 and out == ""
    assert "nope" in err and all(name in err for name in DETECTORS)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """A file that does not exist gives exit status 2 and a message naming it."""
    rc, _, err = run(["score", str(tmp_path / "absent.csv")])
    assert rc == 2 and "absent.csv" in err


@pytest.mark.parametrize("content, fragment", [
    ("time,val\n1,2\n", "header"),
    ("timestamp,value\n2024-01-01,abc\n", "not a number"),
    ("timestamp,value\n2024-01-01\n", "expected"),
    ("", "header"),
])
def test_bad_file_is_a_clear_error(tmp_path: Path, content: str, fragment: str) -> None:
    """Malformed CSVs are reported with the reason, not a traceback."""
    path = tmp_path / "bad.csv"
    path.write_text(content)
    rc, _, err = run(["score", str(path)])
    assert rc == 2 and fragment in err


def test_binary_file_is_a_clear_error(tmp_path: Path) -> None:
    """A non-text file is reported, not a UnicodeDecodeError traceback."""
    path = tmp_path / "bin.csv"
    path.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(ScoreError):
        read_nab_csv(path)


def test_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """--help exits 0 and mentions the output columns."""
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["score", "--help"])
    assert exc.value.code == 0
    assert "anomaly_score" in capsys.readouterr().out


def test_score_series_sees_only_past_rows() -> None:
    """A row's score does not depend on any later row."""
    base = [float(i % 5) for i in range(300)]
    a = score_series(base + [100.0, 0.0])
    b = score_series(base + [100.0, 1e9])
    assert a[:-1] == b[:-1]


def test_score_series_unknown_name_raises() -> None:
    """The library function raises ScoreError listing valid names."""
    with pytest.raises(ScoreError, match="best"):
        score_series([1.0], detector="nope")


def test_run_score_default_streams_to_stdout(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Without explicit streams the handler writes to stdout."""
    args = make_parser().parse_args(["score", str(write_csv(tmp_path / "s.csv", [1.0, 2.0]))])
    assert run_score(args) == 0
    assert capsys.readouterr().out.startswith("timestamp,value,anomaly_score")


def test_nan_values_score_zero(tmp_path: Path) -> None:
    """A NaN row is read, scored 0 by the default detector, and echoed."""
    rc, out, _ = run(["score", str(write_csv(tmp_path / "s.csv", [1.0, math.nan, 2.0]))])
    assert rc == 0 and "nan" in out.lower()


def test_score_series_with_timestamps_sees_only_past_rows() -> None:
    """With timestamps (daily period), a row's score still depends on no later row."""
    n = 600
    stamps = [f"2024-01-{1 + i // 288:02d} {i % 288 // 12:02d}:{i % 12 * 5:02d}:00"
              for i in range(n + 2)]
    base = [float(i % 5) for i in range(n)]
    a = score_series(base + [100.0, 0.0], timestamps=stamps)
    b = score_series(base + [100.0, 1e9], timestamps=stamps)
    assert a[:-1] == b[:-1]
    assert a[:PERIOD_ROWS] == [0.0] * PERIOD_ROWS


def test_values_per_day_from_timestamps() -> None:
    """The period is 86400 s over the median interval; unparseable stamps give None."""
    hourly = [f"2011-07-01 {h:02d}:00:01" for h in range(21)]
    assert values_per_day(hourly) == 24
    assert values_per_day(["not a time", "either"]) is None
    assert values_per_day(["2024-01-01 00:00:00"]) is None


def test_value_column_is_copied_verbatim_and_an_empty_value_is_missing(tmp_path: Path) -> None:
    """The output's value column is the input's text (1.0 stays 1.0, 1e3 stays 1e3); an
    empty value (how pandas writes NaN) is a missing sample scored 0, not an error."""
    path = tmp_path / "s.csv"
    texts = ["1.0", "2.50", "1e3", "", "NaN", "7"]
    path.write_text("timestamp,value\n" + "".join(f"2024-01-01 00:00:{i:02d},{t}\n"
                                                  for i, t in enumerate(texts)))
    rc, out, err = run(["score", str(path)])
    assert rc == 0, err
    rows = list(csv.reader(io.StringIO(out)))[1:]
    assert [r[1] for r in rows] == texts
    assert float(rows[3][2]) == 0.0
    rc, _, err = run(["score", str(tmp_path)])
    assert rc == 2 and "is a directory" in err
