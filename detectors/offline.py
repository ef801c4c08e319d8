"""``trainsentry detect``: the stream app's engine over a recorded run."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from detectors.engine import Engine, EngineConfig, Output, RunState
from producers.layers import split_metrics
from trainsentry.errors import EventError
from trainsentry.events import AlertEvent, MetricEvent, RunEvent, decode_event, decode_metric_value

__all__ = ["read_events", "detect_events", "detect_file", "run_id_from_path"]


def run_id_from_path(path: str | Path) -> str:
    return Path(path).stem


def _verl_line(obj: dict[str, Any], run_id: str, lineno: int) -> list[MetricEvent]:
    step = obj.get("step")
    data = obj.get("data")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(data, dict):
        raise EventError(f"line {lineno}: verl file-logger lines need an integer 'step' and a 'data' object")
    metrics: dict[str, float] = {}
    for key, raw in data.items():
        try:
            metrics[key] = decode_metric_value(key, raw)
        except EventError:
            continue  # verl logs a few non-numeric values (e.g. strings); not signals
    # The file logger has no timestamps: one second per step keeps ts ordered; hang
    # detection needs real ts and so does not apply to such files.
    return [MetricEvent(run_id=run_id, step=step, ts=float(step), layer=layer, metrics=values)
            for layer, values in split_metrics(metrics).items()]


def read_events(lines: Iterable[str], *, run_id: str | None, source: str = "input",
                default_run_id: str | None = None) -> Iterator[MetricEvent | RunEvent]:
    """Events from contract JSON lines or verl file-logger lines; bad lines raise EventError.

    ``run_id`` (``--run-id``) overrides every event's run id; ``default_run_id`` (the file
    name) only names verl file-logger lines, which carry none.
    """
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise EventError(f"{source}:{lineno}: not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise EventError(f"{source}:{lineno}: each line must be a JSON object")
        if "data" in obj and "run_id" not in obj:
            name = run_id or default_run_id
            if name is None:
                raise EventError(f"{source}:{lineno}: verl file-logger line without a run id; pass --run-id")
            yield from _verl_line(obj, name, lineno)
            continue
        try:
            event = decode_event(obj)
        except EventError as exc:
            raise EventError(f"{source}:{lineno}: {exc}") from exc
        if run_id is not None and event.run_id != run_id:
            event = _with_run_id(event, run_id)
        yield event


def _with_run_id(event: MetricEvent | RunEvent, run_id: str) -> MetricEvent | RunEvent:
    from dataclasses import replace

    return replace(event, run_id=run_id)


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


def detect_file(path: str | Path | IO[str], *, run_id: str | None = None,
                config: EngineConfig | None = None) -> list[Output]:
    if isinstance(path, (str, Path)):
        p = Path(path)
        if not p.is_file():
            raise EventError(f"{p}: no such file")
        with p.open(encoding="utf-8") as fh:
            return detect_events(read_events(fh, run_id=run_id, source=str(p),
                                             default_run_id=run_id_from_path(p)), config=config)
    return detect_events(read_events(path, run_id=run_id, source="stdin"), config=config)
