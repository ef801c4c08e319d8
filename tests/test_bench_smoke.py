"""The benchmark scripts run end to end and print their figure last (tiny sizes).

docs/performance.md quotes what these scripts print; these tests keep them runnable and
their last line in the documented form. They check no figure against its target: the
figures are ratios measured in one run on a shared machine, for people to read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args: str, timeout: float = 300) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, out[-3000:]
    return lines


def _number(pattern: str, line: str) -> float:
    m = re.search(pattern, line)
    assert m, (pattern, line)
    return float(m.group(1).replace(",", ""))


def test_detectors_bench_prints_the_slowest_ratio_last() -> None:
    lines = _run("bench.detectors", "-n", "2000", "--repeat", "1")
    assert _number(r"every detector >= ([\d.]+)x cheaper", lines[-1]) > 0
    assert any(ln.startswith("| `best`") or "best" in ln for ln in lines)


def test_detect_rate_bench_prints_the_rate_last() -> None:
    lines = _run("bench.detect_rate", "--steps", "300")
    assert _number(r"rate: ([\d,]+) steps/s", lines[-1]) > 0
    assert "exit 0" in "\n".join(lines)


@pytest.mark.kafka
def test_throughput_bench_prints_the_ratio_last(kafka_bootstrap: str) -> None:
    lines = _run("bench.throughput", "--bootstrap", kafka_bootstrap, "--runs", "5", "--steps",
                 "6", "--ranks", "1")
    assert _number(r"ratio \(service / bare consumer\): ([\d.]+)", lines[-1]) > 0
    text = "\n".join(lines)
    for what in ("bare aiokafka consumer", "JSON parse only", "decode + validate only", "service logic in process",
                 "getmany batches through the service logic", "faust no-op agent",
                 "trainsentry serve"):
        assert what in text, what


@pytest.mark.kafka
def test_latency_bench_prints_p50_and_p99_last(kafka_bootstrap: str) -> None:
    lines = _run("bench.latency", "--bootstrap", kafka_bootstrap, "--runs", "3")
    p50 = _number(r"p50 ([\d.]+) ms", lines[-1])
    p99 = _number(r"p99 ([\d.]+) ms", lines[-1])
    assert 0 < p50 <= p99


@pytest.mark.kafka
def test_producer_overhead_bench_prints_both_call_costs_last(kafka_bootstrap: str) -> None:
    lines = _run("bench.producer_overhead", "--bootstrap", kafka_bootstrap, "--steps", "200")
    last = lines[-1]  # the figure is printed last
    assert _number(r"log\(\) call p50 ([\d.]+) us", last) > 0
    assert _number(r"FileLogger.log\(\) ([\d.]+) us", last) > 0


@pytest.mark.kafka
def test_scale_bench_prints_memory_per_run_last(kafka_bootstrap: str) -> None:
    lines = _run("bench.scale", "--bootstrap", kafka_bootstrap, "--runs", "4", "--steps", "6",
                 "--workers", "1", "--step-s", "1")
    assert _number(r"memory per run: ([\d.]+) MiB", lines[-1]) >= 0
    text = "\n".join(lines)
    assert "published" in text and "lag:" in text, text[-2000:]
