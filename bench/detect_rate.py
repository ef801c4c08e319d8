"""How fast `trainsentry detect` runs: a 10,000-step recorded run with ~40 signals.

Writes a simulated verl run (driver metrics + one rank's resource samples, 40+ signals
per step) to a temp JSONL file, then times the real CLI entry point over it, and prints
steps/s, values/s and the wall time. Baseline for comparison in the same run: reading
and decoding the same file without detection (the I/O floor).

    python -m bench.detect_rate [--steps 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from detectors.offline import read_events
from trainsentry.cli import main as cli_main
from trainsentry.simulate import Scenario, generate, write_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    args = ap.parse_args(argv)
    events = generate(Scenario(run_id="bench/detect", steps=args.steps, ranks=1, seed=11))
    keys = {k for e in events if "metrics" in e for k in e["metrics"]}
    values = sum(len(e["metrics"]) for e in events if "metrics" in e)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        write_jsonl(events, str(path))
        t0 = time.perf_counter()
        with path.open() as fh:
            n_decoded = sum(1 for _ in read_events(fh, run_id=None))
        floor = time.perf_counter() - t0
        out = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out):
            rc = cli_main(["--log-level", "WARNING", "detect", str(path)])
        wall = time.perf_counter() - t0
    alerts = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    print(f"run: {args.steps} steps, {len(keys)} signals, {values} values, {n_decoded} events")
    print(f"decode only (floor): {floor:.2f} s")
    print(f"trainsentry detect:  {wall:.2f} s  (exit {rc}, {len(alerts)} alerts on a healthy run)")
    print(f"rate: {args.steps / wall:,.0f} steps/s, {values / wall:,.0f} values/s; "
          f"detect/decode ratio {wall / floor:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
