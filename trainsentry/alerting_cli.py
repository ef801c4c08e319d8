"""``trainsentry silence …``, ``trainsentry ack …`` and ``trainsentry history …``.

They talk to a running service's HTTP endpoints (stream_app/alerting_api.py) rather
than to Kafka, so operators need no broker access or client library, and any worker can
take the request: the service writes it to the compacted silences topic that every
worker reads. ``--url`` defaults to ``http://127.0.0.1:$TRAINSENTRY_WEB_PORT`` (6066).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import getpass
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from trainsentry.errors import TrainsentryError

__all__ = ["add_cli", "AlertingApiError"]


class AlertingApiError(TrainsentryError):
    """The service answered with an error, or did not answer."""


def _default_url() -> str:
    # The entry point is where the environment is read (STYLE rule 5).
    return f"http://127.0.0.1:{os.environ.get('TRAINSENTRY_WEB_PORT') or '6066'}"


def _call(url: str, method: str, path: str, body: dict[str, Any] | None = None,
          timeout: float = 15.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - operator's URL
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):  # not our JSON error body
            text = json.loads(text).get("error", text)
        raise AlertingApiError(f"{method} {path}: HTTP {exc.code}: {text}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise AlertingApiError(f"cannot reach the trainsentry service at {url} ({exc}); "
                               "is `trainsentry serve` running? (--url)") from exc
    return json.loads(raw) if raw else {}


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


# ------------------------------------------------------------------------------ handlers

def _silence_add(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"matchers": list(args.match or []), "duration": args.duration,
                            "comment": args.comment or "", "created_by": args.by or _user()}
    for key in ("run", "diagnosis", "severity", "fingerprint"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    if not body["matchers"] and not any(k in body for k in ("run", "diagnosis", "severity",
                                                            "fingerprint")):
        print("trainsentry silence add: give --run, --diagnosis, --severity, --fingerprint "
              "or --match", file=sys.stderr)
        return 2
    s = _call(args.url, "POST", "/api/silences", body)
    if args.json:
        _print_json(s)
    else:
        print(s["id"])
    return 0


def _fmt_matchers(s: dict[str, Any]) -> str:
    return ",".join(f"{m['name']}{m['op']}{m['value']}" for m in s.get("matchers", []))


def _silence_list(args: argparse.Namespace) -> int:
    out = _call(args.url, "GET", "/api/silences" + ("?all=1" if args.all else ""))
    if args.json:
        _print_json(out)
        return 0
    rows = out.get("silences", [])
    if not rows:
        print("no silences")
        return 0
    print(f"{'ID':<14}{'STATE':<9}{'ENDS':<21}{'BY':<12}MATCHERS / COMMENT")
    for s in rows:
        print(f"{s['id']:<14}{s.get('state', ''):<9}{_when(s['ends_at']):<21}"
              f"{(s.get('created_by') or '-')[:11]:<12}{_fmt_matchers(s)}"
              + (f"  # {s['comment']}" if s.get("comment") else ""))
    return 0


def _silence_expire(args: argparse.Namespace) -> int:
    s = _call(args.url, "DELETE", f"/api/silences/{urllib.parse.quote(args.id, safe='')}")
    if args.json:
        _print_json(s)
    else:
        print(f"{s['id']} {s.get('state', 'expired')}")
    return 0


def _ack(args: argparse.Namespace) -> int:
    body = {"comment": args.comment or "", "by": args.by or _user()}
    if args.fingerprint:
        out = _call(args.url, "POST", "/api/ack", {**body, "fingerprint": args.fingerprint})
    elif args.alert_id:
        out = _call(args.url, "POST",
                    f"/api/alerts/{urllib.parse.quote(args.alert_id, safe='')}/ack", body)
    else:
        print("trainsentry ack: give ALERT_ID or --fingerprint FP", file=sys.stderr)
        return 2
    if args.json:
        _print_json(out)
    else:
        print(f"acknowledged {out.get('fingerprint')} (run {out.get('run_id')})")
    return 0


def _history(args: argparse.Namespace) -> int:
    q = urllib.parse.urlencode({"run": args.run, **({"limit": args.limit} if args.limit else {})})
    out = _call(args.url, "GET", f"/api/history?{q}")
    if args.json:
        _print_json(out)
        return 0
    rows = out.get("history", [])
    if not rows:
        print(f"no alert history for run {args.run}")
        return 0
    for r in rows:
        sent = "sent" if r.get("notified") else "    "
        extra = f"  ({r['reason']})" if r.get("reason") else ""
        by = f" by {r['by']}" if r.get("by") else ""
        print(f"{_when(r['ts'])}  step {r.get('step', ''):>6}  {r['transition']:<12} {sent} "
              f"{r.get('severity', ''):<8} {r.get('diagnosis', ''):<20} "
              f"{r.get('alert_id', '')}{by}{extra}")
    return 0


# ------------------------------------------------------------------------------ parser

def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``silence {add,list,expire}``, ``ack`` and ``history``."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=_default_url(),
                       help="the service's HTTP base URL (default http://127.0.0.1:"
                       "$TRAINSENTRY_WEB_PORT, port 6066)")
        p.add_argument("--json", action="store_true", help="print the service's JSON answer")

    p = subparsers.add_parser("silence", help="mute alerts for a while (Alertmanager-style)",
                              description="Create, list and expire silences on the running "
                              "service. A silence mutes matching alerts until it ends; resolved "
                              "notices of alerts already sent still go out.")
    sub = p.add_subparsers(dest="silence_command", metavar="{add,list,expire}", required=True)
    a = sub.add_parser("add", help="create a silence; prints its id")
    a.add_argument("--run", help="run_id to mute (exact)")
    a.add_argument("--diagnosis", help="diagnosis label to mute (exact), e.g. kl_drift")
    a.add_argument("--severity", help="severity to mute: info, warning or critical")
    a.add_argument("--fingerprint", help="one problem's fingerprint")
    a.add_argument("--match", action="append", metavar="MATCHER",
                   help="label matcher: name=value, name!=value, name=~regex, name!~regex "
                   "(labels: run_id, diagnosis, severity, fingerprint, host, rank, attempt); "
                   "repeatable, all must match")
    a.add_argument("--duration", default="2h", help="how long: 30m, 2h, 1d (default 2h)")
    a.add_argument("--comment", default="", help="why (shown in `silence list`)")
    a.add_argument("--by", default=None, help="who (default: your user name)")
    common(a)
    a.set_defaults(func=_silence_add)
    ls = sub.add_parser("list", help="list active and pending silences")
    ls.add_argument("--all", action="store_true", help="include expired ones")
    common(ls)
    ls.set_defaults(func=_silence_list)
    ex = sub.add_parser("expire", help="end a silence now")
    ex.add_argument("id", metavar="ID", help="the silence id")
    common(ex)
    ex.set_defaults(func=_silence_expire)

    p = subparsers.add_parser("ack", help="acknowledge an alert: stop its repeats",
                              description="Acknowledge a firing problem: its repeats and "
                              "escalations stop; its resolved notice still goes out.")
    p.add_argument("alert_id", nargs="?", metavar="ALERT_ID", help="an alert id from chat/history")
    p.add_argument("--fingerprint", help="acknowledge by fingerprint instead")
    p.add_argument("--comment", default="", help="note for the history")
    p.add_argument("--by", default=None, help="who (default: your user name)")
    common(p)
    p.set_defaults(func=_ack)

    p = subparsers.add_parser("history", help="a run's alert transitions",
                              description="Every transition of a run's alerts (pending, firing, "
                              "repeat, escalated, acknowledged, silenced, inhibited, resolved), "
                              "oldest first; 'sent' marks those a chat message carried.")
    p.add_argument("--run", required=True, help="the run_id")
    p.add_argument("--limit", type=int, default=0, help="only the last N transitions")
    common(p)
    p.set_defaults(func=_history)
