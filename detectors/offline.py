"""``trainsentry detect``: the stream app's engine over a recorded run."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from detectors.engine import Engine, EngineConfig, Output, RunState
from producers.layers import split_metrics
from trainsentry.errors import EventError
from trainsentry.events import AlertEvent, MetricEvent, RunEvent, decode_event, decode_metric_value

__all__ = ["read_events", "detect_events", "detect_file", "run_id_from_path"]


def run_id_from_path(path: str | Path) -> str:
    return Path(path).stem


def _verl_line(obj: dict[str, Any], run_id: str, where: str) -> list[MetricEvent]:
    step = obj.get("step")
    data = obj.get("data")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(data, dict):
        raise EventError(f"{where}: verl file-logger lines need an integer 'step' and a 'data' object")
    metrics: dict[str, float] = {}
    for key, raw in data.items():
        try:
            metrics[key] = decode_metric_value(key, raw)
        except EventError:
            continue  # verl logs a few non-numeric values (e.g. strings); not signals
    # The file logger has no timestamps: one second per step keeps ts ordered (an alert's
    # ts is then the step number, not a time); hang detection needs real ts and so does not
    # apply to such files.
    return [MetricEvent(run_id=run_id, step=step, ts=float(step), layer=layer, metrics=values)
            for layer, values in split_metrics(metrics).items()]


def read_events(lines: Iterable[str | bytes], *, run_id: str | None, source: str = "input",
                default_run_id: str | None = None,
                on_error: Callable[[str], None] | None = None) -> Iterator[MetricEvent | RunEvent]:
    """Events from contract JSON lines or verl file-logger lines.

    A bad line (not UTF-8, not JSON, not an event) raises EventError naming the file and
    line, or, with ``on_error``, is reported to it and skipped: a trainer that crashed
    mid-write leaves a cut-off last line, and the lines before it still count.
    ``run_id`` (``--run-id``) and else ``default_run_id`` (the file name) name verl
    file-logger lines, which carry none; contract events keep their own run_id.
    """
    for lineno, raw in enumerate(lines, 1):
        where = f"{source}:{lineno}"
        try:
            yield from _line_events(raw, where, run_id or default_run_id)
        except EventError as exc:
            if on_error is None:
                raise
            on_error(str(exc))


def _line_events(raw: str | bytes, where: str,
                 verl_run_id: str | None) -> Iterator[MetricEvent | RunEvent]:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EventError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    line = raw.strip()
    if not line:
        return
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise EventError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise EventError(f"{where}: each line must be a JSON object")
    if "data" in obj and "run_id" not in obj:
        if verl_run_id is None:
            raise EventError(f"{where}: verl file-logger line without a run id; pass --run-id")
        yield from _verl_line(obj, verl_run_id, where)
        return
    try:
        yield decode_event(obj)
    except EventError as exc:
        raise EventError(f"{where}: {exc}") from exc


def detect_events(events: Iterable[MetricEvent | RunEvent], *,
                  config: EngineConfig | None = None) -> list[Output]:
    """Run the engine over events (any number of runs); alerts and commands in step order."""
    engine = Engine(config)
    states: dict[str, RunState] = {}
    out: list[Output] = []
    for event in events:
        state = states.get(event.run_id)
        if state is None:
            state = states[event.run_id] = engine.new_state(event.run_id)
        out += engine.process(state, event)
    for state in states.values():
        out += engine.flush(state)
    return sorted(out, key=lambda o: (o.step if isinstance(o, AlertEvent) else math.inf))


def detect_file(path: str | Path | IO[bytes] | IO[str], *, run_id: str | None = None,
                config: EngineConfig | None = None,
                on_error: Callable[[str], None] | None = None) -> list[Output]:
    """:func:`detect_events` over a file (or an open stream: stdin). Bad lines raise
    EventError, or go to ``on_error`` and are skipped; a file without a single good line
    raises EventError either way."""
    good = 0
    bad: list[str] = []

    def skip(msg: str) -> None:
        bad.append(msg)
        if on_error is not None:
            on_error(msg)

    def counted(events: Iterable[MetricEvent | RunEvent]) -> Iterator[MetricEvent | RunEvent]:
        nonlocal good
        for event in events:
            good += 1
            yield event

    handler = skip if on_error is not None else None
    if isinstance(path, (str, Path)):
        p = Path(path)
        if p.is_dir():
            raise EventError(f"{p} is a directory; pass a JSONL file (or - for stdin)")
        if not p.is_file():
            raise EventError(f"{p}: no such file")
        try:
            with p.open("rb") as fh:
                out = detect_events(counted(read_events(
                    fh, run_id=run_id, source=str(p), default_run_id=run_id_from_path(p),
                    on_error=handler)), config=config)
        except OSError as exc:
            raise EventError(f"cannot read {p}: {exc.strerror or exc}") from exc
        source = str(p)
    else:
        out = detect_events(counted(read_events(path, run_id=run_id, source="stdin",
                                                on_error=handler)), config=config)
        source = "stdin"
    if bad and not good:
        raise EventError(f"{source}: no line is a MetricEvent, RunEvent or verl file-logger "
                         f"line ({len(bad)} bad; the first: {bad[0]})")
    return out
