"""MetricsProducer: what a training loop calls once per step.

Design (see docs/events.md): ``log()`` only appends ``(step, ts, dict)`` to a bounded
deque and sets an event; a daemon thread does everything else — splitting the dict into
the three layers, JSON encoding, connecting (lazily, with backoff) and sending with
kafka-python (acks=all, idempotent). So ``log()`` costs about a microsecond, never
blocks on the network and never raises into training. While the broker is unreachable
the deque holds up to ``max_buffer`` steps; when full the oldest is dropped and counted
(one warning per 1000 drops). ``close()`` flushes what is buffered within a timeout.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from producers.kafka import KafkaOptions, connect_error, producer_options, topic_for
from producers.layers import layer_of
from trainsentry.config import Topics
from trainsentry.events import MetricEvent, RunEvent, dumps

_orjson_dumps: Callable[[Any], bytes] | None
try:  # optional (the [service] extra has it): 5-10x faster JSON on the sender thread
    from orjson import dumps as _orjson_dumps
except ImportError:
    _orjson_dumps = None

__all__ = ["MetricsProducer", "ProducerStats"]

log = logging.getLogger(__name__)

_METRIC = 0
_RUN = 1
_RAW = 2
_RECORD = 3  # an encoded record whose delivery failed: sent again as it is
#: The sender thread lets steps gather this long before it encodes and hands them to
#: kafka-python, which batches them another _LINGER_MS: far fewer wake-ups, GIL hand-offs
#: and produce requests per step (docs/performance.md) for at most ~70 ms of latency.
_GATHER_S = 0.02
_LINGER_MS = 50
#: Distinct metric names whose layer is remembered (verl logs the same ~100 every step).
_LAYER_CACHE_MAX = 10_000


@dataclass
class ProducerStats:
    """Counters a trainer (or a test) can read: nothing is dropped silently."""

    logged: int = 0
    sent: int = 0
    dropped: int = 0
    send_errors: int = 0
    #: Records kafka-python accepted but then could not deliver (e.g. the broker came back
    #: without the producer's idempotence state): queued again and re-sent, not lost.
    resent: int = 0
    connect_failures: int = 0
    bad_values: int = 0


def _to_float(value: Any) -> float | None:
    """A metric value as float; None for values that are not numbers (skipped, counted)."""
    if type(value) is float:  # the common case, first
        return value
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if value is None:
        return math.nan
    item = getattr(value, "item", None)  # numpy / torch scalars
    if item is not None:
        try:
            out = item()
        except Exception:
            return None
        return float(out) if isinstance(out, (int, float)) else None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


class MetricsProducer:
    """Publishes a run's per-step metrics and lifecycle events; never slows or crashes training.

    >>> p = MetricsProducer(run_id="demo/exp1", bootstrap="127.0.0.1:1", connect=False)
    >>> p.log({"actor/pg_loss": 0.1, "timing_s/gen": 3.2}, step=1)
    >>> p.stats.logged
    1
    >>> p.close(timeout=0)
    """

    def __init__(
        self,
        *,
        run_id: str,
        bootstrap: str | KafkaOptions = "127.0.0.1:9092",
        topic_prefix: str = "trainsentry.",
        attempt: int = 0,
        host: str | None = None,
        rank: int | None = None,
        max_buffer: int = 10_000,
        connect: bool = True,
        producer_factory: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not run_id:
            raise ValueError("run_id must be a non-empty string (e.g. 'project/experiment')")
        if max_buffer < 1:
            raise ValueError("max_buffer must be >= 1")
        self.run_id = run_id
        self.options = bootstrap if isinstance(bootstrap, KafkaOptions) else KafkaOptions(bootstrap=bootstrap)
        self.topics = Topics(topic_prefix)
        self.attempt = attempt
        self.host = host
        self.rank = rank
        self.max_buffer = max_buffer
        self.stats = ProducerStats()
        self._clock = clock
        self._factory = producer_factory
        self._queue: deque[tuple[int, Any]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._idle = threading.Event()
        self._idle.set()
        self._producer: Any = None
        self._thread: threading.Thread | None = None
        self._connect = connect
        self._layers: dict[str, str] = {}

    # ------------------------------------------------------------------ public API
    def log(self, metrics: Mapping[str, Any], step: int, *, ts: float | None = None) -> None:
        """Queue one step's metrics dict (verl's ``Tracking.log(data, step)``). Never raises."""
        try:
            self._put(_METRIC, (int(step), self._clock() if ts is None else ts, dict(metrics),
                                None, self.host, self.rank))
        except Exception:  # never into training
            log.debug("trainsentry: could not queue metrics", exc_info=True)

    def log_layer(self, layer: str, metrics: Mapping[str, Any], step: int, *,
                  ts: float | None = None, host: str | None = None, rank: int | None = None) -> None:
        """Queue metrics for one layer explicitly (the resource sampler uses this)."""
        try:
            self._put(_METRIC, (int(step), self._clock() if ts is None else ts, dict(metrics),
                                layer, host if host is not None else self.host,
                                rank if rank is not None else self.rank))
        except Exception:
            log.debug("trainsentry: could not queue metrics", exc_info=True)

    def run_event(self, type: str, *, step: int | None = None, **fields: Any) -> None:
        """Queue a RunEvent (``run_started``, ``checkpoint_saved``, ``heartbeat``, ...)."""
        try:
            event = RunEvent(run_id=self.run_id, type=type, ts=self._clock(), attempt=self.attempt,
                             step=step, fields=fields)
            self._put(_RUN, event)
        except Exception:
            log.debug("trainsentry: could not queue run event", exc_info=True)

    def run_started(self, config: Mapping[str, Any] | None = None) -> None:
        self.run_event("run_started", config=_flat_jsonable(config or {}))

    def run_finished(self, exit_code: int = 0) -> None:
        self.run_event("run_finished", exit_code=int(exit_code))

    def checkpoint_saved(self, step: int, path: str) -> None:
        self.run_event("checkpoint_saved", step=int(step), path=str(path))

    def heartbeat(self, step: int) -> None:
        self.run_event("heartbeat", step=int(step), host=self.host, rank=self.rank)

    def send_raw(self, kind: str, event: Mapping[str, Any]) -> None:
        """Queue an already-built contract event dict for the topic of ``kind``."""
        self._put(_RAW, (kind, dict(event)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is handed to Kafka and acknowledged."""
        if self._thread is None:
            return not self._queue
        deadline = time.monotonic() + timeout
        while True:
            while time.monotonic() < deadline:
                with self._lock:
                    empty = not self._queue
                if empty and self._idle.is_set():
                    break
                self._wake.set()
                time.sleep(0.005)
            producer = self._producer
            if producer is not None:
                try:
                    producer.flush(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    log.warning("trainsentry: flush did not complete within %.1fs", timeout)
                    return False
            # A failed delivery puts its record back in the queue: go round again.
            if not self._queue or time.monotonic() >= deadline:
                return not self._queue

    def close(self, timeout: float = 10.0) -> None:
        """Flush within ``timeout`` seconds, then stop the sender thread. Never raises."""
        try:
            self.flush(timeout)
        finally:
            self._closing = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join(timeout=max(0.1, min(timeout, 5.0)))
            producer, self._producer = self._producer, None
            if producer is not None:
                try:
                    producer.close(timeout=max(0.0, min(timeout, 5.0)))
                except Exception:
                    log.debug("trainsentry: producer close failed", exc_info=True)
            if self._queue:
                log.warning("trainsentry: %d events not delivered at close (broker %s unreachable?)",
                            len(self._queue), self.options.bootstrap)

    def __enter__(self) -> MetricsProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def buffered(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ internals
    def _put(self, kind: int, item: Any) -> None:
        with self._lock:
            # The sender drains until the queue is empty, so it only needs waking when
            # this item is the first: saves a condition notify and a GIL hand-off per step.
            wake = not self._queue
            if len(self._queue) >= self.max_buffer:
                self._queue.popleft()
                self.stats.dropped += 1
                if self.stats.dropped % 1000 == 1:
                    log.warning("trainsentry: buffer full (%d events, broker %s unreachable); "
                                "dropped %d oldest so far", self.max_buffer,
                                self.options.bootstrap, self.stats.dropped)
            self._queue.append((kind, item))
            if kind == _METRIC:
                self.stats.logged += 1
        if self._thread is None and self._connect and not self._closing:
            self._start_thread()
        if wake:
            self._wake.set()

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="trainsentry-producer",
                                            daemon=True)
            self._thread.start()

    def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        try:
            if self._factory is not None:
                self._producer = self._factory()
            else:
                from kafka import KafkaProducer

                options = {**producer_options(self.options), "linger_ms": _LINGER_MS}
                self._producer = KafkaProducer(**options, max_block_ms=2000)
            return True
        except Exception as exc:
            self.stats.connect_failures += 1
            if self.stats.connect_failures in (1, 10) or self.stats.connect_failures % 100 == 0:
                # Say what to fix (TLS CA, SASL login, down broker); never the password.
                why = (str(connect_error(self.options, exc)) if self._factory is None
                       else f"cannot reach Kafka at {self.options.bootstrap} ({type(exc).__name__})")
                log.warning("trainsentry: %s; buffering up to %d events", why, self.max_buffer)
            return False

    def _run(self) -> None:
        backoff = 0.1
        while True:
            self._wake.wait(timeout=0.5)
            if not self._closing:
                time.sleep(_GATHER_S)
            self._wake.clear()
            if self._closing and not self._queue:
                return
            if not self._queue:
                continue
            if not self._ensure_producer():
                if self._closing:
                    return
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self._idle.clear()
            try:
                self._drain()
            finally:
                self._idle.set()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                kind, item = self._queue[0]
            try:
                for topic, key, value in self._encode(kind, item):
                    future = self._producer.send(topic, key=key, value=value)
                    future.add_errback(self._failed, (topic, key, value))
                    self.stats.sent += 1
            except Exception as exc:
                # BufferError / KafkaTimeoutError while the broker is down: keep the item.
                self.stats.send_errors += 1
                if self.stats.send_errors in (1, 10) or self.stats.send_errors % 100 == 0:
                    log.warning("trainsentry: send failed (%s); will retry", type(exc).__name__)
                time.sleep(0.2)
                return
            with self._lock:
                if self._queue and self._queue[0][1] is item:
                    self._queue.popleft()
                else:  # a failed record was put back in front meanwhile (or item dropped)
                    for i, (_, queued) in enumerate(self._queue):
                        if queued is item:
                            del self._queue[i]
                            break

    def _failed(self, record: tuple[str, bytes, bytes], exc: BaseException) -> None:
        """kafka-python gave up on a record it had accepted: queue it again (its own thread)."""
        with self._lock:
            self._queue.appendleft((_RECORD, record))
            self.stats.resent += 1
            self.stats.sent -= 1
        if self.stats.resent in (1, 10) or self.stats.resent % 1000 == 0:
            log.warning("trainsentry: delivery failed (%s); re-sending", type(exc).__name__)
        self._wake.set()

    def _encode(self, kind: int, item: Any) -> list[tuple[str, bytes, bytes]]:
        if kind == _RECORD:
            return [item]
        key = self.run_id.encode()
        if kind == _RUN:
            return [(self.topics.runs, key, dumps(item))]
        if kind == _RAW:
            ekind, event = item
            return [(topic_for(ekind, self.topics), str(event.get("run_id", self.run_id)).encode(),
                     dumps(event))]
        step, ts, metrics, layer, host, rank = item
        values: dict[str, float] = {}
        for name, raw in metrics.items():
            value = _to_float(raw)
            if value is None:
                self.stats.bad_values += 1
                continue
            values[str(name)] = value
        layers = {layer: values} if layer else self._split(values)
        out = []
        fast = _orjson_dumps is not None and math.isfinite(ts)  # orjson would write NaN as null
        for lname, lvalues in layers.items():
            event = MetricEvent(run_id=self.run_id, step=step, ts=ts, layer=lname, metrics=lvalues,
                                attempt=self.attempt, host=host, rank=rank)
            data = _orjson_dumps(event.to_dict()) if fast and _orjson_dumps else dumps(event)
            out.append((self.topics.metrics(lname), key, data))
        return out

    def _split(self, values: dict[str, float]) -> dict[str, dict[str, float]]:
        """``producers.layers.split_metrics`` with each name's layer looked up once."""
        cache = self._layers
        out: dict[str, dict[str, float]] = {}
        for name, value in values.items():
            lname = cache.get(name)
            if lname is None:
                lname = layer_of(name)
                if len(cache) < _LAYER_CACHE_MAX:
                    cache[name] = lname
            bucket = out.get(lname)
            if bucket is None:
                bucket = out[lname] = {}
            bucket[name] = value
        return out


def _flat_jsonable(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested config into ``a.b.c: value`` with JSON-safe leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat_jsonable(value, f"{name}."))
        elif value is None or isinstance(value, (bool, int, str)):
            out[name] = value
        elif isinstance(value, float):
            out[name] = value if math.isfinite(value) else str(value)
        elif isinstance(value, (list, tuple)):
            out[name] = [v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
                         for v in value]
        else:
            out[name] = str(value)
    return out
