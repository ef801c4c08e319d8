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

import atexit
import functools
import logging
import math
import numbers
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from producers.kafka import KafkaOptions, connect_error, producer_options, topic_for
from producers.layers import layer_of
from trainsentry.config import Topics
from trainsentry.events import MAX_RECORD_BYTES, MAX_RUN_ID_CHARS, MetricEvent, RunEvent, dumps

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
#: What the service accepts (trainsentry.events): a step is an int >= 0 (64-bit here), a
#: metric name a non-empty string; longer names than this are not signals anyone reads.
_MAX_STEP = 2**63 - 1
_MAX_NAME_CHARS = 1024
#: An event larger than the service's record limit is split into several of the same step
#: and layer (the service joins them), keeping room for the envelope.
_SPLIT_BYTES = MAX_RECORD_BYTES - 4096
#: At interpreter exit a producer that was not closed flushes for at most this long.
_EXIT_FLUSH_S = 5.0
#: Flush and close timeouts are clamped to this (an infinite one would hang the trainer).
_MAX_TIMEOUT_S = 3600.0
#: A value log() could not read as a number (kept out of the event, counted).
_BAD = object()


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
    #: Steps or events refused before they were queued or sent: a step that is not an int
    #: >= 0, an event that cannot be encoded, a log() after close(). Each kind is logged once.
    rejected: int = 0


def _to_float(value: Any) -> float | None:
    """A metric value as float; None for values that are not numbers (skipped, counted)."""
    if type(value) is float:  # the common case, first
        return value
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # beyond any float: the contract's infinity
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return float(value)
    if value is None:
        return math.nan
    item = getattr(value, "item", None)  # numpy / torch scalars and one-element arrays
    if item is not None:
        try:
            out = item()
        except Exception:
            return None
        return _to_float(out) if not hasattr(out, "item") else _number(out)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return _number(value)


def _number(value: Any) -> float | None:
    """Decimal, Fraction, numpy long double ...: any real number float() reads."""
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            return None
    return None


#: Values that cannot change after log() returns: kept as they are, read when sent.
_IMMUTABLE = (float, int, str, type(None))


def _snapshot(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The step's values, with anything mutable read as a number now, in the caller's
    thread: a tensor or array is read once (a later in-place change is not published, and
    its autograd graph is not kept alive while the step waits in the buffer). A dict of
    floats, the usual case, costs one copy and one type check per value."""
    values = dict(metrics)
    for value in values.values():
        if type(value) is not float and not isinstance(value, _IMMUTABLE):
            return {name: v if isinstance(v, _IMMUTABLE) else _scalar(v)
                    for name, v in values.items()}
    return values


def _scalar(value: Any) -> Any:
    out = _to_float(value)
    return _BAD if out is None else out


def _step_of(step: Any) -> int | None:
    try:
        s = int(step)
    except Exception:
        return None
    return s if 0 <= s <= _MAX_STEP else None


def _clamp_timeout(timeout: Any, default: float = 10.0) -> float:
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        return default
    if math.isnan(t):
        return default
    return min(max(t, 0.0), _MAX_TIMEOUT_S)


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
        if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_CHARS:
            raise ValueError(f"run_id must be a string of 1..{MAX_RUN_ID_CHARS} characters "
                             "(e.g. 'project/experiment'); the service refuses others")
        if max_buffer < 1:
            raise ValueError("max_buffer must be >= 1")
        self.run_id = run_id
        self.options = bootstrap if isinstance(bootstrap, KafkaOptions) else KafkaOptions(bootstrap=bootstrap)
        self.topics = Topics(topic_prefix)
        # Plain ints (a numpy int from a launcher's rank would not encode as JSON).
        self.attempt = int(attempt)
        self.host = None if host is None else str(host)
        self.rank = None if rank is None else int(rank)
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
        self._ok_names: set[str] = set()
        self._bad_names: set[str] = set()
        self._said: set[str] = set()  # kinds of refusal already logged (once each)
        self._closed = False
        # Interpreter exit without close() still delivers what is buffered (a script that
        # just ends); the hook holds only a weak reference and is dropped by close().
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        _LIVE.add(self)

    # ------------------------------------------------------------------ public API
    def log(self, metrics: Mapping[str, Any], step: int, *, ts: float | None = None) -> None:
        """Queue one step's metrics dict (verl's ``Tracking.log(data, step)``). Never raises."""
        try:
            self._put_metrics(metrics, step, ts, None, self.host, self.rank)
        except Exception:  # never into training
            log.debug("trainsentry: could not queue metrics", exc_info=True)

    def log_layer(self, layer: str, metrics: Mapping[str, Any], step: int, *,
                  ts: float | None = None, host: str | None = None, rank: int | None = None) -> None:
        """Queue metrics for one layer explicitly (the resource sampler uses this)."""
        try:
            self._put_metrics(metrics, step, ts, layer, self.host if host is None else str(host),
                              self.rank if rank is None else int(rank))
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
        try:
            flat = _flat_jsonable(config or {})
        except Exception as exc:  # e.g. an OmegaConf config with a missing (???) value
            self._refuse("config", f"run_started: the config could not be read "
                         f"({type(exc).__name__}: {exc}); sent without it")
            flat = {}
        self.run_event("run_started", config=flat)

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
        timeout = _clamp_timeout(timeout)
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
        """Flush within ``timeout`` seconds, then stop the sender thread; the whole call
        takes at most about ``timeout`` (0.1 s at least). A second call returns at once.
        Never raises."""
        if self._closed:
            return
        atexit.unregister(self._exit_hook)
        timeout = _clamp_timeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._closing = True
            self._wake.set()

            def left() -> float:
                return max(0.1, deadline - time.monotonic())

            if self._thread is not None:
                self._thread.join(timeout=min(left(), 5.0))
            producer, self._producer = self._producer, None
            if producer is not None:
                try:
                    producer.close(timeout=min(left(), 5.0))
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
    def _refuse(self, kind: str, message: str) -> None:
        """Count a refused step or event; log the first of each kind (never per step)."""
        self.stats.rejected += 1
        self._say_once(kind, f"{message} (later ones are only counted in stats.rejected)")

    def _say_once(self, kind: str, message: str) -> None:
        if kind not in self._said and len(self._said) < 1000:
            self._said.add(kind)
            log.warning("trainsentry: %s (run %s)", message, self.run_id)

    def _put_metrics(self, metrics: Mapping[str, Any], step: Any, ts: Any, layer: str | None,
                     host: str | None, rank: int | None) -> None:
        s = step if type(step) is int and 0 <= step <= _MAX_STEP else _step_of(step)
        if s is None:
            self._refuse("step", f"step {step!r} is not an integer in 0..2**63-1; "
                         "that step's metrics were not sent")
            return
        when: float | None = None if ts is None else _to_float(ts)
        if when is None or not math.isfinite(when):
            when = self._clock()  # none given, or not a finite time: the time of the call
        self._put(_METRIC, (s, when, _snapshot(metrics), layer, host, rank))

    def _put(self, kind: int, item: Any) -> None:
        if self._closed:
            self._refuse("closed", "an event was logged after close(); it was not sent")
            return
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
            # Again, now after kafka-python's own exit hook (atexit is last-in first-out),
            # so ours runs first, while the Kafka producer can still send.
            atexit.unregister(self._exit_hook)
            atexit.register(self._exit_hook)
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
                records = self._encode(kind, item)
            except Exception as exc:
                # Not the broker's fault and it will not get better: drop this one event,
                # say why once, and go on (retrying it would block every later step).
                self._refuse(f"encode-{type(exc).__name__}",
                             f"an event could not be encoded ({type(exc).__name__}: "
                             f"{str(exc)[:200]}); it was dropped")
                self._pop(item)
                continue
            try:
                for topic, key, value in records:
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
            self._pop(item)

    def _pop(self, item: Any) -> None:
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
            value = raw if type(raw) is float else None if raw is _BAD else _to_float(raw)
            if value is None:
                self._bad_value(name, raw)
                continue
            if type(name) is not str:
                name = str(name)
            if name not in self._ok_names and not self._name_ok(name):
                self.stats.bad_values += 1
                continue
            values[name] = value
        layers = {layer: values} if layer else self._split(values)
        out: list[tuple[str, bytes, bytes]] = []
        for lname, lvalues in layers.items():
            self._encode_layer(out, key, step, ts, lname, lvalues, host, rank)
        return out

    def _encode_layer(self, out: list[tuple[str, bytes, bytes]], key: bytes, step: int, ts: float,
                      lname: str, values: dict[str, float], host: str | None,
                      rank: int | None) -> None:
        event = MetricEvent(run_id=self.run_id, step=step, ts=ts, layer=lname, metrics=values,
                            attempt=self.attempt, host=host, rank=rank)
        data = _orjson_dumps(event.to_dict()) if _orjson_dumps is not None else dumps(event)
        if len(data) > _SPLIT_BYTES and len(values) > 1:
            # Over the service's record limit: two events of the same step and layer (the
            # service joins the parts of a step), halved again until each fits.
            names = list(values)
            half = len(names) // 2
            for part in (names[:half], names[half:]):
                self._encode_layer(out, key, step, ts, lname, {n: values[n] for n in part},
                                   host, rank)
            return
        out.append((self.topics.metrics(lname), key, data))

    def _name_ok(self, name: str) -> bool:
        """Whether the service accepts ``name`` as a metric name (checked once per name)."""
        if name in self._bad_names:
            return False
        ok = 0 < len(name) <= _MAX_NAME_CHARS
        if ok:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                ok = False
        seen = self._ok_names if ok else self._bad_names
        if len(seen) < _LAYER_CACHE_MAX:
            seen.add(name)
        if not ok:
            self._say_once("name", f"metric name {name[:60]!r}{'…' if len(name) > 60 else ''} "
                           f"is empty, longer than {_MAX_NAME_CHARS} characters or not text; "
                           "it is left out of every event (counted in stats.bad_values)")
        return ok

    def _bad_value(self, name: Any, raw: Any) -> None:
        self.stats.bad_values += 1
        self._say_once(f"value:{name}", f"metric {str(name)[:60]!r} has a value of type "
                       f"{'unreadable' if raw is _BAD else type(raw).__name__} that is not a "
                       "number; it is skipped (log a float)")

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


#: Producers alive in this process (a forked child resets them: see _reset_after_fork).
_LIVE: weakref.WeakSet[MetricsProducer] = weakref.WeakSet()


def _close_at_exit(ref: weakref.ref[MetricsProducer]) -> None:
    """Interpreter exit without close(): deliver what is buffered, for a few seconds."""
    producer = ref()
    if producer is None or producer._closed:
        return
    if producer._producer is None and producer.stats.connect_failures:
        # The broker was already found unreachable: waiting at exit would only delay it.
        producer._closed = True
        if producer._queue:
            log.warning("trainsentry: %d events not delivered at exit (broker %s unreachable)",
                        len(producer._queue), producer.options.bootstrap)
        return
    producer.close(timeout=_EXIT_FLUSH_S)


def _reset_after_fork() -> None:
    """In a forked child (a data-loader worker, a multiprocessing pool), the parent's sender
    thread does not exist and its Kafka connection is not the child's: start over empty (the
    parent sends its own buffered events), with a sender of the child's own when it logs."""
    for producer in list(_LIVE):
        producer._lock = threading.Lock()
        producer._wake = threading.Event()
        producer._idle = threading.Event()
        producer._idle.set()
        producer._thread = None
        producer._producer = None
        producer._queue.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


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
            out[name] = [v if isinstance(v, (bool, int, str)) or v is None
                         or (isinstance(v, float) and math.isfinite(v)) else str(v)
                         for v in value]
        else:
            out[name] = str(value)
    return out
