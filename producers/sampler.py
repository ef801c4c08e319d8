"""ResourceSampler: the resource layer (NVML + host counters) and heartbeats, from a thread.

verl reports its own metrics once per step from the driver; GPU utilisation, host load and
disk waits come from here. Every ``interval_s`` the sampler reads:

* NVML (``pynvml`` / nvidia-ml-py), per GPU: ``gpu/utilization_pct`` (SM busy %),
  ``gpu/memory_util_pct``, ``gpu/memory_used_gb``, ``gpu/memory_total_gb`` (GiB, the unit of
  verl's ``*_memory_*_gb`` keys), ``gpu/temperature_c``, ``gpu/power_w``, ``gpu/sm_clock_mhz``,
  ``gpu/ecc_uncorrected`` (volatile count) and ``gpu/xid_errors`` (critical XID events seen
  since the sampler started; ``gpu/last_xid`` holds the latest code). A reading a device does
  not support is left out, not faked.
* the host (psutil, ``os.getloadavg``): ``system/cpu_load_avg`` (1-minute load average, not
  divided by cores; ``system/cpu_count`` is sent alongside), ``system/cpu_pct``,
  ``system/memory_used_pct``, ``system/iowait_pct`` (the /proc/stat iowait share of CPU time),
  ``system/disk_io_wait_ms`` (average milliseconds per completed disk I/O over the interval:
  Δ(read_time + write_time) / Δ(read_count + write_count) from ``psutil.disk_io_counters``,
  which is what ``iostat -x`` shows as ``await``; 0 when no I/O completed),
  ``system/disk_read_mb_s``, ``system/disk_write_mb_s``, ``system/net_sent_mb_s``,
  ``system/net_recv_mb_s``.

Each GPU is one resource MetricEvent; when the sampler watches every GPU of the host
(``gpu_index=None``) the event's ``rank`` is the device index, so peers can be compared.
Host metrics are one more event with the sampler's own ``rank``. After each reading a
heartbeat with ``step_fn()`` is published. Without NVML (no driver, no GPU) one warning is
logged and only host metrics are published.

It can also run alone as a per-node sidecar: ``python -m producers.sampler --run-id ID``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["ResourceSampler", "NO_GPU_WARNING"]

log = logging.getLogger(__name__)

NO_GPU_WARNING = "no NVIDIA GPU / NVML found: publishing host metrics only"
_GIB = 1024.0**3
_MB = 1e6


class _Publisher(Protocol):
    def log_layer(self, layer: str, metrics: Mapping[str, Any], step: int, *,
                  ts: float | None = None, host: str | None = None,
                  rank: int | None = None) -> None: ...

    def heartbeat(self, step: int) -> None: ...


def _load_pynvml() -> Any:
    with warnings.catch_warnings():  # pynvml 12+ warns that it is a shim for nvidia-ml-py
        warnings.simplefilter("ignore")
        import pynvml

    return pynvml


class ResourceSampler:
    """Publishes resource metrics and heartbeats every ``interval_s`` seconds from a daemon thread.

    ``nvml`` and ``psutil_mod`` are injectable (an object with the pynvml / psutil functions
    used), so tests run without a GPU; by default they are imported lazily in :meth:`start`.
    """

    def __init__(
        self,
        *,
        producer: _Publisher,
        interval_s: float = 5.0,
        host: str | None = None,
        rank: int | None = None,
        gpu_index: int | None = None,
        step_fn: Callable[[], int] = lambda: 0,
        heartbeat: bool = True,
        nvml: Any | None = None,
        psutil_mod: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.producer = producer
        self.interval_s = interval_s
        self.host = host or socket.gethostname()
        self.rank = rank
        self.gpu_index = gpu_index
        self.step_fn = step_fn
        self.heartbeat = heartbeat
        self._nvml = nvml
        self._psutil = psutil_mod
        self._clock = clock
        self._handles: list[tuple[int, Any]] | None = None  # None = not initialised yet
        self._xid_set: Any = None
        self._xid_count: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._prev_disk: Any = None
        self._prev_net: Any = None
        self._prev_t: float | None = None
        self._warned_no_gpu = False
        self._warned_no_psutil = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_sample: dict[str, dict[str, float]] = {}
        self.samples = 0

    # ------------------------------------------------------------------ public API
    def start(self) -> ResourceSampler:
        """Start the background thread (idempotent). Returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainsentry-sampler",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and release NVML. Never raises."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._handles and self._nvml is not None:
            try:
                if self._xid_set is not None:
                    self._nvml.nvmlEventSetFree(self._xid_set)
                self._nvml.nvmlShutdown()
            except Exception:
                log.debug("trainsentry: NVML shutdown failed", exc_info=True)
        self._handles = []

    def __enter__(self) -> ResourceSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def has_gpu(self) -> bool:
        self._init_nvml()
        return bool(self._handles)

    def sample(self) -> dict[str, dict[str, float]]:
        """One reading: ``{"host": {...}, "gpu0": {...}, ...}``. Never raises."""
        out: dict[str, dict[str, float]] = {"host": self._host_metrics()}
        self._init_nvml()
        for index, handle in self._handles or []:
            out[f"gpu{index}"] = self._gpu_metrics(index, handle)
        self.last_sample = out
        return out

    def sample_once(self) -> dict[str, dict[str, float]]:
        """Take one reading, publish it and a heartbeat; returns the reading."""
        reading = self.sample()
        try:
            step = int(self.step_fn())
        except Exception:
            step = 0
        ts = time.time()
        for name, metrics in reading.items():
            if not metrics:
                continue
            if name == "host":
                rank = self.rank
            else:
                rank = self.rank if self.gpu_index is not None else int(name[3:])
            self.producer.log_layer("resource", metrics, step, ts=ts, host=self.host, rank=rank)
        if self.heartbeat:
            self.producer.heartbeat(step)
        self.samples += 1
        return reading

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The latest reading (for diagnosis reports); takes one if none was taken yet."""
        return dict(self.last_sample) if self.last_sample else self.sample()

    # ------------------------------------------------------------------ internals
    def _run(self) -> None:
        self._host_metrics()  # prime the delta counters
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except Exception:  # never take the trainer down; keep sampling
                log.warning("trainsentry: resource sample failed", exc_info=True)

    def _init_nvml(self) -> None:
        if self._handles is not None:
            return
        self._handles = []
        try:
            nvml = self._nvml if self._nvml is not None else _load_pynvml()
            self._nvml = nvml
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
            indices = [self.gpu_index] if self.gpu_index is not None else list(range(count))
            for i in indices:
                if i is None or not 0 <= i < count:
                    raise ValueError(f"gpu_index {i} is not one of the {count} GPUs")
                self._handles.append((i, nvml.nvmlDeviceGetHandleByIndex(i)))
        except Exception as exc:
            self._handles = []
            if not self._warned_no_gpu:
                self._warned_no_gpu = True
                log.warning("trainsentry: %s (%s: %s)", NO_GPU_WARNING, type(exc).__name__, exc)
            return
        if not self._handles and not self._warned_no_gpu:
            self._warned_no_gpu = True
            log.warning("trainsentry: %s (NVML reports 0 devices)", NO_GPU_WARNING)
            return
        self._init_xid()

    def _init_xid(self) -> None:
        nvml: Any = self._nvml
        try:
            self._xid_set = nvml.nvmlEventSetCreate()
            for _, handle in self._handles or []:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                              self._xid_set)
        except Exception:
            self._xid_set = None  # not supported (MIG, containers without the capability)
            log.debug("trainsentry: XID events unavailable", exc_info=True)

    def _read(self, index: int, name: str, fn: Callable[[], float]) -> float | None:
        if (index, name) in self._unsupported:
            return None
        try:
            return float(fn())
        except Exception as exc:
            not_supported = getattr(self._nvml, "NVMLError_NotSupported", None)
            if not_supported is not None and isinstance(exc, not_supported):
                self._unsupported.add((index, name))
            log.debug("trainsentry: NVML %s on GPU %d failed: %s", name, index, exc)
            return None

    def _gpu_metrics(self, index: int, h: Any) -> dict[str, float]:
        nvml: Any = self._nvml
        out: dict[str, float] = {}

        def put(name: str, fn: Callable[[], float]) -> None:
            value = self._read(index, name, fn)
            if value is not None:
                out[name] = value

        put("gpu/utilization_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        put("gpu/memory_util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(h).memory)
        mem = self._mem(h)
        if mem is not None:
            out["gpu/memory_used_gb"] = mem[0] / _GIB
            out["gpu/memory_total_gb"] = mem[1] / _GIB
        put("gpu/temperature_c",
            lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        put("gpu/power_w", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        put("gpu/sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        put("gpu/ecc_uncorrected", lambda: nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
        if self._xid_set is not None:
            self._drain_xid()
            out["gpu/xid_errors"] = float(self._xid_count.get(index, 0))
            if index in self._last_xid:
                out["gpu/last_xid"] = float(self._last_xid[index])
        return out

    def _mem(self, h: Any) -> tuple[float, float] | None:
        try:
            nvml: Any = self._nvml
            info = nvml.nvmlDeviceGetMemoryInfo(h)
            return float(info.used), float(info.total)
        except Exception:
            return None

    def _drain_xid(self) -> None:
        nvml: Any = self._nvml
        by_handle = {id(h): i for i, h in self._handles or []}
        for _ in range(64):  # bounded: never spin on a flood of events
            try:
                data = nvml.nvmlEventSetWait(self._xid_set, 0)
            except Exception:
                return  # NVMLError_Timeout: nothing pending
            index = by_handle.get(id(getattr(data, "device", None)), -1)
            self._xid_count[index] = self._xid_count.get(index, 0) + 1
            self._last_xid[index] = int(getattr(data, "eventData", 0))
            log.warning("trainsentry: GPU %d reported XID %s", index,
                        getattr(data, "eventData", "?"))

    def _host_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with contextlib.suppress(OSError):
            out["system/cpu_load_avg"] = float(os.getloadavg()[0])
        out["system/cpu_count"] = float(os.cpu_count() or 0)
        ps = self._psutil_module()
        if ps is None:
            return out
        now = self._clock()
        try:
            out["system/cpu_pct"] = float(ps.cpu_percent(interval=None))
            out["system/memory_used_pct"] = float(ps.virtual_memory().percent)
            iowait = getattr(ps.cpu_times_percent(interval=None), "iowait", None)
            if iowait is not None:
                out["system/iowait_pct"] = float(iowait)
        except Exception:
            log.debug("trainsentry: psutil CPU/memory read failed", exc_info=True)
        disk = net = None
        try:
            disk = ps.disk_io_counters()
            net = ps.net_io_counters()
        except Exception:
            log.debug("trainsentry: psutil disk/net read failed", exc_info=True)
        dt = None if self._prev_t is None else now - self._prev_t
        if dt and dt > 0:
            prev_d, prev_n = self._prev_disk, self._prev_net
            if disk is not None and prev_d is not None:
                ops = (disk.read_count - prev_d.read_count) + (disk.write_count - prev_d.write_count)
                busy = (disk.read_time - prev_d.read_time) + (disk.write_time - prev_d.write_time)
                out["system/disk_io_wait_ms"] = float(busy) / ops if ops > 0 else 0.0
                out["system/disk_read_mb_s"] = (disk.read_bytes - prev_d.read_bytes) / _MB / dt
                out["system/disk_write_mb_s"] = (disk.write_bytes - prev_d.write_bytes) / _MB / dt
            if net is not None and prev_n is not None:
                out["system/net_sent_mb_s"] = (net.bytes_sent - prev_n.bytes_sent) / _MB / dt
                out["system/net_recv_mb_s"] = (net.bytes_recv - prev_n.bytes_recv) / _MB / dt
        self._prev_disk, self._prev_net, self._prev_t = disk, net, now
        return out

    def _psutil_module(self) -> Any:
        if self._psutil is None:
            try:
                import psutil

                self._psutil = psutil
            except ImportError:
                if not self._warned_no_psutil:
                    self._warned_no_psutil = True
                    log.warning("trainsentry: psutil is not installed (pip install "
                                "'trainsentry[gpu]'): publishing the load average only")
                self._psutil = False
        return self._psutil or None


def main(argv: list[str] | None = None) -> int:
    """Run the sampler alone (one per node): ``python -m producers.sampler --run-id ID``."""
    import argparse

    from producers.kafka import KafkaOptions
    from producers.producer import MetricsProducer
    from trainsentry.config import load_settings

    parser = argparse.ArgumentParser(prog="python -m producers.sampler",
                                     description="Publish this node's resource metrics.")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--attempt", type=int, default=int(os.environ.get("TRAINSENTRY_ATTEMPT", "0")))
    parser.add_argument("--gpu-index", type=int, default=None)
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = load_settings()
    producer = MetricsProducer(run_id=args.run_id, bootstrap=KafkaOptions.from_settings(settings),
                               topic_prefix=settings.topic_prefix, attempt=args.attempt,
                               host=socket.gethostname(), rank=args.rank)
    sampler = ResourceSampler(producer=producer, interval_s=args.interval, rank=args.rank,
                              gpu_index=args.gpu_index, heartbeat=False)
    try:
        sampler.start()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        sampler.stop()
        producer.close()


if __name__ == "__main__":
    raise SystemExit(main())
