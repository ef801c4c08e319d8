"""ResourceSampler: NVML and host readings become resource MetricEvents and heartbeats."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from producers.sampler import NO_GPU_WARNING, ResourceSampler


class RecordingProducer:
    """Stands in for MetricsProducer: records what the sampler publishes."""

    def __init__(self) -> None:
        self.layers: list[dict[str, Any]] = []
        self.heartbeats: list[int] = []

    def log_layer(self, layer: str, metrics: Mapping[str, Any], step: int, *,
                  ts: float | None = None, host: str | None = None, rank: int | None = None) -> None:
        self.layers.append({"layer": layer, "metrics": dict(metrics), "step": step,
                            "host": host, "rank": rank})

    def heartbeat(self, step: int) -> None:
        self.heartbeats.append(step)


class NoNvml:
    """pynvml as it behaves on a host without the NVIDIA driver."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("NVML Shared Library Not Found")


class FakeNvml:
    """Two GPUs; GPU 1 does not support power readings."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    class NVMLError_NotSupported(Exception):
        pass

    class NVMLError_Timeout(Exception):
        pass

    def __init__(self) -> None:
        self.handles = [SimpleNamespace(i=0), SimpleNamespace(i=1)]
        self.power_calls = 0
        self.pending_xids: list[Any] = []
        self.shut = False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.handles[i]

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return SimpleNamespace(gpu=90 - 60 * h.i, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        return SimpleNamespace(used=70 * 1024**3, total=80 * 1024**3)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return 65

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        self.power_calls += 1
        if h.i == 1:
            raise self.NVMLError_NotSupported()
        return 350_000

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        return 1980

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        return 0

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, s: str) -> None: ...
    def nvmlEventSetFree(self, s: str) -> None: ...

    def nvmlEventSetWait(self, s: str, timeout_ms: int) -> Any:
        if not self.pending_xids:
            raise self.NVMLError_Timeout()
        return self.pending_xids.pop(0)


class FakePsutil:
    """psutil with disk counters that advance by a fixed amount per call."""

    def __init__(self) -> None:
        self.calls = 0

    def cpu_percent(self, interval: Any = None) -> float:
        return 12.5

    def virtual_memory(self) -> Any:
        return SimpleNamespace(percent=40.0)

    def cpu_times_percent(self, interval: Any = None) -> Any:
        return SimpleNamespace(iowait=7.0)

    def disk_io_counters(self) -> Any:
        n = self.calls
        self.calls += 1
        # each interval: 10 reads + 10 writes, taking 150 ms + 250 ms in total
        return SimpleNamespace(read_count=10 * n, write_count=10 * n, read_time=150 * n,
                               write_time=250 * n, read_bytes=5_000_000 * n, write_bytes=0)

    def net_io_counters(self) -> Any:
        return SimpleNamespace(bytes_sent=1_000_000 * self.calls, bytes_recv=0)


def test_without_nvml_warns_once_and_still_publishes_host_metrics(caplog: pytest.LogCaptureFixture) -> None:
    """No GPU: one clear warning, then host metrics and heartbeats at every tick."""
    producer = RecordingProducer()
    sampler = ResourceSampler(producer=producer, nvml=NoNvml(), step_fn=lambda: 42, host="node-1")
    with caplog.at_level(logging.WARNING, logger="producers.sampler"):
        for _ in range(3):
            sampler.sample_once()
    warnings = [r for r in caplog.records if NO_GPU_WARNING in r.getMessage()]
    assert len(warnings) == 1
    assert len(producer.layers) == 3
    for event in producer.layers:
        assert event["layer"] == "resource" and event["step"] == 42 and event["host"] == "node-1"
        assert "system/cpu_load_avg" in event["metrics"]
        assert not any(name.startswith("gpu/") for name in event["metrics"])
    assert producer.heartbeats == [42, 42, 42]


def test_real_pynvml_on_a_host_without_gpu_reports_host_metrics_only(caplog: pytest.LogCaptureFixture) -> None:
    """With the real pynvml and no driver (CI), the sampler degrades to host metrics."""
    sampler = ResourceSampler(producer=RecordingProducer())
    if sampler.has_gpu:
        pytest.skip("this host has an NVIDIA GPU")
    reading = sampler.sample()
    assert set(reading) == {"host"}
    assert reading["host"]["system/cpu_load_avg"] >= 0


def test_disk_io_wait_is_milliseconds_per_completed_io() -> None:
    """system/disk_io_wait_ms = Δ(read_time+write_time) / Δ(read_count+write_count), like iostat await."""
    now = [0.0]
    sampler = ResourceSampler(producer=RecordingProducer(), nvml=NoNvml(), psutil_mod=FakePsutil(),
                              clock=lambda: now[0])
    first = sampler.sample()["host"]
    assert "system/disk_io_wait_ms" not in first  # no interval yet
    now[0] = 2.0
    second = sampler.sample()["host"]
    assert second["system/disk_io_wait_ms"] == pytest.approx(400 / 20)
    assert second["system/disk_read_mb_s"] == pytest.approx(2.5)
    assert second["system/net_sent_mb_s"] == pytest.approx(0.5)
    assert second["system/iowait_pct"] == 7.0


def test_each_gpu_is_one_event_ranked_by_device_index_with_contract_names() -> None:
    """With NVML: per-GPU events carry the contract names; unsupported readings are skipped, not faked."""
    nvml = FakeNvml()
    producer = RecordingProducer()
    sampler = ResourceSampler(producer=producer, nvml=nvml, psutil_mod=FakePsutil(), host="n")
    sampler.sample_once()
    sampler.sample_once()
    gpu = [e for e in producer.layers if "gpu/utilization_pct" in e["metrics"]]
    assert [e["rank"] for e in gpu] == [0, 1, 0, 1]
    g0, g1 = gpu[0]["metrics"], gpu[1]["metrics"]
    assert g0["gpu/utilization_pct"] == 90 and g1["gpu/utilization_pct"] == 30
    assert g0["gpu/memory_used_gb"] == pytest.approx(70.0)
    assert g0["gpu/memory_total_gb"] == pytest.approx(80.0)
    assert g0["gpu/power_w"] == pytest.approx(350.0) and "gpu/power_w" not in g1
    assert g0["gpu/temperature_c"] == 65 and g0["gpu/xid_errors"] == 0
    assert nvml.power_calls == 3  # the unsupported reading is not retried every tick
    sampler.stop()
    assert nvml.shut


def test_xid_events_are_counted_per_gpu() -> None:
    """A critical XID event shows up as gpu/xid_errors and gpu/last_xid on its GPU."""
    nvml = FakeNvml()
    sampler = ResourceSampler(producer=RecordingProducer(), nvml=nvml, psutil_mod=FakePsutil())
    sampler.sample()
    nvml.pending_xids.append(SimpleNamespace(device=nvml.handles[1], eventData=79))
    reading = sampler.sample()
    assert reading["gpu1"]["gpu/xid_errors"] == 1 and reading["gpu1"]["gpu/last_xid"] == 79
    assert reading["gpu0"]["gpu/xid_errors"] == 0


def test_background_thread_samples_until_stopped() -> None:
    """start() publishes every interval from a daemon thread; stop() ends it."""
    producer = RecordingProducer()
    steps = iter(range(1000))
    sampler = ResourceSampler(producer=producer, nvml=NoNvml(), interval_s=0.02,
                              step_fn=lambda: next(steps)).start()
    deadline = time.monotonic() + 5
    while len(producer.heartbeats) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    count = len(producer.heartbeats)
    assert count >= 3 and producer.heartbeats[:3] == [0, 1, 2]
    time.sleep(0.1)
    assert len(producer.heartbeats) == count
