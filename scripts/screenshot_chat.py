"""Render a real diagnosed alert as the DingTalk robot would show it, to docs/img/chat-alert.png.

The alert comes from the engine over a simulated faulty run (the same path as the
service), the message from notifiers.templates; the page only mimics a chat bubble.
Needs Debian's chromium (`make setup` installs it as root).

    .venv/bin/python scripts/screenshot_chat.py [--language zh|en]
"""

from __future__ import annotations

import argparse
import html
import subprocess
import tempfile
from pathlib import Path

import markdown

from detectors.offline import detect_events
from notifiers.templates import render_markdown, render_title
from trainsentry.events import AlertEvent, decode_event
from trainsentry.simulate import Scenario, generate

PAGE = """<!doctype html><meta charset="utf-8"><style>
body {{ background:#eef0f3; font-family: 'Noto Sans CJK SC','PingFang SC',sans-serif; margin:0; padding:24px; }}
.bubble {{ background:#fff; border-radius:10px; padding:16px 22px; max-width:760px;
           box-shadow:0 1px 3px rgba(0,0,0,.15); font-size:14px; line-height:1.5; }}
.who {{ color:#666; font-size:12px; margin-bottom:6px; }}
code {{ background:#f3f3f3; padding:1px 4px; border-radius:3px; }}
h3 {{ margin:4px 0 8px; }}
</style><div class="who">trainsentry 机器人 · {title}</div><div class="bubble">{body}</div>"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--language", default="zh", choices=("zh", "en"))
    ap.add_argument("--out", default="docs/img/chat-alert.png")
    args = ap.parse_args()
    events = generate(Scenario(run_id="grpo-qwen7b/exp3", steps=90, fault="dataloader_stall",
                               fault_onset=60, ranks=8, seed=5))
    alerts = [a for a in detect_events(decode_event(e) for e in events)
              if isinstance(a, AlertEvent) and a.status == "firing"]
    alert = alerts[0]
    body = markdown.markdown(render_markdown(alert, language=args.language).text, extensions=["nl2br", "sane_lists"])
    page = PAGE.format(title=html.escape(render_title(alert, language=args.language)), body=body)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "chat.html"
        src.write_text(page, encoding="utf-8")
        out = Path(args.out).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--screenshot={out}", "--window-size=820,760",
                        src.as_uri()], check=True, capture_output=True, timeout=60)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
