"""What one ``MetricsProducer.log()`` costs a training loop, against verl's own file logger.

The file logger is verl's real ``verl.utils.tracking.FileLogger`` (the ``file`` backend of
``Tracking``: orjson of ``{"step", "data"}`` written unbuffered to a JSONL file), fed the
same dict: a simulated verl step's driver metrics (~50 keys).

Two measurements per logger, each over ``--steps`` steps:

- *call*: the wall time of the ``log()`` call alone (median and p99, in µs);
- *CPU per step*: a training loop does ``--work-us`` of pure-Python work per step (holding
  the GIL, the worst case for a background sender thread) and then logs; the figure is the
  process CPU time (all threads) per step over the same loop without logging. It includes
  the sender thread's encoding and kafka-python's sending, which in a GIL-bound loop
  competes with training; in a GPU-bound verl step (seconds) it is spread across the step.

MetricsProducer is measured with the broker up (``--bootstrap``) and with it down (a
port nothing listens on: the producer buffers up to ``max_buffer`` steps and drops the
oldest). The figure printed last is the producer's loop overhead vs the file logger's.

    python -m bench.producer_overhead [--steps 5000 --work-us 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import free_port, fresh_prefix, rss_mb  # noqa: E402


def _step_metrics() -> list[dict[str, Any]]:
    from trainsentry.simulate import Scenario, generate

    by_step: dict[int, dict[str, Any]] = {}
    for ev in generate(Scenario(run_id="bench/overhead", steps=50, ranks=1, seed=1)):
        if "layer" in ev and ev.get("rank") is None:
            by_step.setdefault(ev["step"], {}).update(
                {k: float(v) if not isinstance(v, str) else float(v) for k, v in ev["metrics"].items()})
    steps = [by_step[s] for s in sorted(by_step)]
    full = max(len(d) for d in steps)
    return [d for d in steps if len(d) >= full * 0.8]  # training steps, not the val-only one


_LOOPS_PER_US = 1.0


def _calibrate(us: float) -> None:
    """Find how many loop turns take ``us`` microseconds here, so work is a fixed amount of
    computation (a background thread that takes the GIL makes it last longer)."""
    global _LOOPS_PER_US
    n = 200_000
    t0 = time.perf_counter()
    _spin(n)
    _LOOPS_PER_US = n / ((time.perf_counter() - t0) * 1e6)


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _work(us: float) -> None:
    """Pure-Python work that holds the GIL: a fixed number of loop turns (~``us`` µs)."""
    _spin(int(us * _LOOPS_PER_US))


def _measure(log: Callable[[dict[str, Any], int], None], dicts: list[dict[str, Any]],
             steps: int, work_us: float) -> tuple[float, float, float]:
    """(median call µs, p99 call µs, process CPU seconds, all threads) for ``steps`` steps.

    CPU time rather than wall time: the machine is shared, and what matters is what the
    logger adds on top of training (its own threads included), not others' load.
    """
    calls = []
    t0 = time.process_time()
    for step in range(steps):
        _work(work_us)
        data = dicts[step % len(dicts)]
        c0 = time.perf_counter_ns()
        log(data, step)
        calls.append(time.perf_counter_ns() - c0)
    loop = time.process_time() - t0
    calls.sort()
    return calls[len(calls) // 2] / 1000, calls[int(len(calls) * 0.99)] / 1000, loop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("TRAINSENTRY_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"))
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--work-us", type=float, default=2000.0)
    args = ap.parse_args(argv)

    from verl.utils.tracking import FileLogger

    from producers import MetricsProducer

    dicts = _step_metrics()
    _calibrate(args.work_us)
    keys = max(len(d) for d in dicts)
    steps, work = args.steps, args.work_us
    results: dict[str, tuple[float, float, float]] = {}

    results["no logging"] = _measure(lambda d, s: None, dicts, steps, work)

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VERL_FILE_LOGGER_PATH"] = os.path.join(tmp, "run.jsonl")
        devnull = open(os.devnull, "w")  # noqa: SIM115 - FileLogger prints its path
        saved, sys.stdout = sys.stdout, devnull
        try:
            flog = FileLogger("bench", "overhead")
        finally:
            sys.stdout = saved
        results["verl FileLogger"] = _measure(flog.log, dicts, steps, work)
        flog.finish()

    prefix = fresh_prefix("overhead")
    p = MetricsProducer(run_id="bench/overhead", bootstrap=args.bootstrap, topic_prefix=prefix)
    p.log(dicts[0], step=-1)
    p.flush(30)  # connected, as in a running job
    results["MetricsProducer, broker up"] = _measure(lambda d, s: p.log(d, step=s), dicts, steps, work)
    t0 = time.perf_counter()
    p.close(60)
    drain = time.perf_counter() - t0
    up_stats = p.stats

    rss0 = rss_mb()
    down = MetricsProducer(run_id="bench/overhead", bootstrap=f"127.0.0.1:{free_port()}",
                           topic_prefix=prefix, max_buffer=2000)
    results["MetricsProducer, broker down"] = _measure(lambda d, s: down.log(d, step=s), dicts,
                                                       steps, work)
    rss1 = rss_mb()
    down_stats = down.stats
    down.close(0.5)

    base = results["no logging"][2]
    from kafka.record import util as kafka_record_util

    crc = "C" if getattr(kafka_record_util, "crc32c_c", None) is not None else "pure-Python"
    print(f"{steps} steps, {keys} metrics per step, {work:.0f} us of GIL-holding work per step; "
          f"kafka-python crc32c: {crc}")
    print(f"{'logger':30} {'call p50':>9} {'call p99':>9} {'CPU/step (all threads)':>23}")
    for name, (p50, p99, loop) in results.items():
        extra = (loop - base) / steps * 1e6
        print(f"{name:30} {p50:7.1f}us {p99:7.1f}us {extra:20.1f}us")
    print(f"broker up: sent {up_stats.sent} records, dropped {up_stats.dropped}, "
          f"close() drained the rest in {drain:.2f} s")
    print(f"broker down: buffered {down.buffered} (max_buffer 2000), dropped {down_stats.dropped}, "
          f"connect failures {down_stats.connect_failures}, rss +{rss1 - rss0:.1f} MiB")
    fl = (results["verl FileLogger"][2] - base) / steps * 1e6
    up = (results["MetricsProducer, broker up"][2] - base) / steps * 1e6
    dn = (results["MetricsProducer, broker down"][2] - base) / steps * 1e6
    fl50 = results["verl FileLogger"][0]
    if min(fl, up, dn) < 0:
        print("  (a negative CPU figure is this run's noise: the loop without logging varied "
              "more than the logger costs; rerun with more --steps, default 5000)")
    print(f"MetricsProducer.log() call p50 {results['MetricsProducer, broker up'][0]:.1f} us vs "
          f"verl FileLogger.log() {fl50:.1f} us (target: cheaper); CPU per step incl. "
          f"background threads: producer {up:.0f} us (broker down {dn:.0f} us) vs file logger "
          f"{fl:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
