"""The ``trainsentry`` command line (contract: docs/cli.md).

The entry point is the only place that reads the environment and configures logging;
each subcommand's handler gets the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from trainsentry import __version__
from trainsentry.errors import TrainsentryError

__all__ = ["main", "build_parser"]

log = logging.getLogger("trainsentry")

#: Modules that add their own subcommands with ``add_cli(subparsers)``.
_PLUGGED = (
    "trainsentry.kafka_local",
    "trainsentry.topics",
    "trainsentry.simulate",
    "trainsentry.supervise",
    "detectors.score",
    "trainsentry.alerting_cli",
)


def _cmd_detect(args: argparse.Namespace) -> int:
    from detectors.catalog import load_catalog
    from detectors.engine import EngineConfig
    from detectors.offline import detect_file
    from trainsentry.errors import ConfigError
    from trainsentry.events import AlertEvent, dumps

    # As `trainsentry serve` reads them, so both run the same engine on the same settings.
    catalog = load_catalog(args.config or os.environ.get("TRAINSENTRY_DETECTOR_CONFIG") or None)
    threshold = args.breaker_threshold
    if threshold is None:
        raw = os.environ.get("TRAINSENTRY_BREAKER_THRESHOLD") or "3"
        try:
            threshold = int(raw)
        except ValueError:
            raise ConfigError(f"TRAINSENTRY_BREAKER_THRESHOLD={raw!r} is not an integer; "
                              "set it to the number of critical steps (default 3)") from None
    if threshold < 1:
        raise ConfigError(f"breaker threshold {threshold} must be >= 1 "
                          "(--breaker-threshold or TRAINSENTRY_BREAKER_THRESHOLD)")
    config = EngineConfig(catalog=catalog, breaker_threshold=threshold)
    skipped: list[str] = []

    def skip(msg: str) -> None:
        skipped.append(msg)
        if len(skipped) <= _SHOWN_BAD_LINES:
            print(f"trainsentry detect: warning: skipped {msg}", file=sys.stderr)

    source = sys.stdin.buffer if args.file == "-" else args.file
    outputs = detect_file(source, run_id=args.run_id, config=config,
                          on_error=None if args.strict else skip)
    out = sys.stdout
    for o in outputs:
        if isinstance(o, AlertEvent) or args.commands:
            out.write(dumps(o).decode() + "\n")
    out.flush()
    if skipped:
        more = len(skipped) - _SHOWN_BAD_LINES
        print(f"trainsentry detect: warning: {len(skipped)} bad line(s) skipped"
              + (f" ({more} not shown)" if more > 0 else "")
              + "; the alerts above come from the other lines (--strict: fail instead)",
              file=sys.stderr)
    return 0


_SHOWN_BAD_LINES = 20


def _cmd_serve(args: argparse.Namespace) -> int:
    from stream_app.service import run_service
    from trainsentry.config import load_settings

    settings = load_settings(args.config, web_port=args.web_port, partitions=args.partitions)
    return run_service(settings, workdir=args.workdir)


def _cmd_demo(args: argparse.Namespace) -> int:
    from trainsentry.demo import run_demo

    return run_demo(fault=args.fault, steps=args.steps, port=args.port, web_port=args.web_port,
                    keep=args.keep, language=args.language)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainsentry",
        description="Watchdog for LLM RL post-training runs: detect, diagnose, alert, stop/rollback.",
    )
    parser.add_argument("--version", action="version", version=f"trainsentry {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    parser.add_argument("--log-json", action="store_true", help="structured JSON log lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("detect", help="run the detection engine over a recorded run",
                       description="Runs the same detection and diagnosis engine as the stream "
                       "app over a recorded run (contract MetricEvent/RunEvent lines or verl "
                       "file-logger lines). Prints AlertEvent JSON lines in step order. A bad "
                       "line (a cut-off last line of a crashed trainer, garbage) is skipped "
                       "with a warning on stderr naming the line.",
                       epilog="Exit codes: 0 done (alerts or none); 2 no usable line, a "
                       "missing file, a bad config or a bad line with --strict (the message "
                       "says what to fix).")
    p.add_argument("file", metavar="FILE", help="JSONL file, or - for stdin")
    p.add_argument("--run-id", help="run id for verl file-logger lines (default: the file "
                   "name); contract events keep their own run_id")
    p.add_argument("--config", help="YAML/JSON detector config (signals: overrides; default: "
                   "TRAINSENTRY_DETECTOR_CONFIG, as serve)")
    p.add_argument("--breaker-threshold", type=int, default=None,
                   help="consecutive critical steps before a command (default: "
                   "TRAINSENTRY_BREAKER_THRESHOLD, else 3)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 2) on the first bad line instead of skipping it with a "
                   "warning on stderr")
    p.add_argument("--commands", action="store_true",
                   help="also print the ControlCommands the service would issue (unsigned)")
    p.set_defaults(func=_cmd_detect)

    p = sub.add_parser("serve", help="run the stream app as a service",
                       description="Runs the stream app (detection, diagnosis, notifications, "
                       "HTTP on TRAINSENTRY_WEB_PORT). Workers join by Kafka consumer group. "
                       "Configured by environment variables (docs/configuration.md) or --config.",
                       epilog="Exit codes: 0 stopped (SIGTERM/SIGINT); 2 bad configuration or "
                       "broker unreachable (the message says what to fix); 70 the worker stopped "
                       "itself because its table recovery stalled (TRAINSENTRY_RECOVERY_STALL_S): "
                       "run it under a supervisor that restarts it.")
    p.add_argument("--config", help="YAML/JSON config file (environment variables win)")
    p.add_argument("--web-port", type=int, default=None, help="override TRAINSENTRY_WEB_PORT")
    p.add_argument("--partitions", type=int, default=None, help="partitions for created topics")
    p.add_argument("--workdir", default=None, help="Faust data dir (default: a temp dir per worker)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("demo", help="end-to-end demo on local defaults",
                       description="Starts a local Kafka broker (if none runs), the service, a "
                       "local chat sink, and a simulated verl run with an injected fault; shows "
                       "the chat alerts and the signed stop command, then stops everything.")
    p.add_argument("--fault", default="nan_loss", help="fault label to inject (default nan_loss; see `trainsentry simulate --help`)")
    p.add_argument("--steps", type=int, default=80, help="steps to simulate (default 80)")
    p.add_argument("--port", type=int, default=9092, help="Kafka port (default 9092)")
    p.add_argument("--web-port", type=int, default=6066, help="service HTTP port (default 6066)")
    p.add_argument("--language", default="en", choices=("zh", "en"), help="chat language")
    p.add_argument("--keep", action="store_true", help="leave the broker running afterwards")
    p.set_defaults(func=_cmd_demo)

    for module in _PLUGGED:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_cli(sub)
    return parser


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                "logger": record.name, "event": record.getMessage()}
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if root.level > logging.DEBUG:
        # Client libraries narrate every connection at INFO; keep their warnings only.
        for noisy in ("kafka", "aiokafka", "faust", "mode", "httpx", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _setup_logging(args.log_level, args.log_json)
    try:
        return int(args.func(args) or 0)
    except TrainsentryError as exc:
        print(f"trainsentry: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`trainsentry detect run.jsonl | head`): stop quietly, as
        # a program killed by SIGPIPE would, without a traceback or a second error when
        # Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
