"""Chat messages from AlertEvents: a title and a markdown or plain-text body, zh-CN or English.

One alert renders in full (what is wrong, evidence, quick checks, what to do); several
alerts (a digest, built when a robot's rate limit makes alerts queue up) render one line
per problem, repeats of the same fingerprint folded together, then the full detail of the
most severe one. Every message names each run_id verbatim and each diagnosis label
(contract), and the list comes before the detail so size truncation cuts detail first.

A repeated or escalated notice (:class:`notifiers.lifecycle.Notice` with ``repeat`` /
``escalated``) says so in its title and body (``第 2 次提醒 · 已升级`` / ``repeat 2 ·
escalated``). Checks and actions arrive in English on the AlertEvent and are shown in the
message's language (:func:`detectors.knowledge.localize`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from detectors.knowledge import localize
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

__all__ = [
    "LANGUAGES",
    "LABEL_NAMES",
    "Rendered",
    "label_name",
    "failed",
    "pages",
    "severity_name",
    "notice_badge",
    "render_title",
    "render_markdown",
    "render_text",
    "render_wecom_markdown",
    "truncate_utf8",
    "more_line",
    "WECOM_MARKDOWN_MAX_BYTES",
]

Language = Literal["zh", "en"]
LANGUAGES: tuple[str, ...] = ("zh", "en")
#: WeCom refuses markdown whose content is over 4096 bytes (UTF-8).
WECOM_MARKDOWN_MAX_BYTES = 4096

#: Localised names for every label of the contract's diagnosis vocabulary.
LABEL_NAMES: dict[str, dict[str, str]] = {
    "dataloader_stall": {"zh": "数据加载阻塞", "en": "Data loader stall"},
    "kl_drift": {"zh": "KL 散度漂移", "en": "KL drift"},
    "numeric_underflow": {"zh": "数值下溢", "en": "Numeric underflow"},
    "comm_degradation": {"zh": "通信性能退化", "en": "Communication degradation"},
    "memory_leak": {"zh": "显存泄漏", "en": "Memory leak"},
    "nan_loss": {"zh": "损失或梯度出现 NaN", "en": "NaN loss"},
    "training_hang": {"zh": "训练卡死", "en": "Training hang"},
    "straggler": {"zh": "慢节点", "en": "Straggler"},
    "gradient_instability": {"zh": "梯度不稳定", "en": "Gradient instability"},
    "lr_drift": {"zh": "学习率偏离计划", "en": "Learning-rate drift"},
    "entropy_collapse": {"zh": "熵坍缩", "en": "Entropy collapse"},
    "stalled_learning": {"zh": "学习停滞", "en": "Stalled learning"},
    "unknown": {"zh": "未知异常", "en": "Unknown anomaly"},
}

_SEVERITY_NAMES: dict[str, dict[str, str]] = {
    "critical": {"zh": "严重", "en": "CRITICAL"},
    "warning": {"zh": "警告", "en": "WARNING"},
    "info": {"zh": "提示", "en": "INFO"},
}
_SEVERITY_ICON = {"critical": "🔴", "warning": "🟠", "info": "🔵"}
_SEVERITY_RANK = {"critical": 3, "warning": 2, "info": 1}
#: WeCom markdown's three font colours: info (green), comment (grey), warning (orange-red).
_SEVERITY_WECOM_COLOR = {"critical": "warning", "warning": "warning", "info": "comment"}
_RESOLVED = {"zh": "已恢复", "en": "RESOLVED", "icon": "✅"}
#: A resolved notice whose run died with the problem still firing (``AlertEvent.run_exit``).
_FAILED = {"zh": "运行异常退出", "en": "RUN FAILED", "icon": "❌"}

_WORDS: dict[str, dict[str, str]] = {
    "run": {"zh": "运行", "en": "Run"},
    "step": {"zh": "步数", "en": "Step"},
    "time": {"zh": "时间", "en": "Time"},
    "attempt": {"zh": "重启次数", "en": "Attempt"},
    "confidence": {"zh": "置信度", "en": "Confidence"},
    "where": {"zh": "位置", "en": "Where"},
    "summary": {"zh": "摘要", "en": "Summary"},
    "evidence": {"zh": "证据（当前值 / 基线 / 界限）", "en": "Evidence (value / baseline / bound)"},
    "baseline": {"zh": "基线", "en": "baseline"},
    "bound": {"zh": "界限", "en": "bound"},
    "checks": {"zh": "快速检查", "en": "Quick checks"},
    "actions": {"zh": "建议操作", "en": "What to do"},
    "secondary": {"zh": "其他可能原因", "en": "Other possible causes"},
    "resolved_at": {"zh": "已于第 {step} 步恢复（{time}）", "en": "Resolved at step {step} ({time})"},
    "failed_at": {"zh": "训练进程在第 {step} 步异常退出{code}，问题没有恢复（{time}）",
                  "en": "The run exited{code} at step {step} with this problem unresolved ({time})"},
    "must_be_finite": {"zh": "须为有限值", "en": "must be finite"},
    "most_severe": {"zh": "最严重的一条", "en": "Most severe"},
    "dashboard": {"zh": "打开看板", "en": "Open dashboard"},
    "digest": {"zh": "告警汇总：{n} 条，{runs} 个运行", "en": "Alert digest: {n} alerts, {runs} runs"},
    "digest_title": {"zh": "{n} 条告警", "en": "{n} alerts"},
    "repeat": {"zh": "×{n}（步 {steps}）", "en": "×{n} (steps {steps})"},
    "at_step": {"zh": "第 {step} 步", "en": "step {step}"},
    "more": {"zh": "…（还有 {n} 行，详见看板）", "en": "…({n} more lines; see dashboard)"},
    "repeat_n": {"zh": "第 {n} 次提醒", "en": "repeat {n}"},
    "escalated": {"zh": "已升级", "en": "escalated"},
}
_REPEAT_ICON, _ESCALATED_ICON = "🔁", "⏫"


@dataclass(frozen=True, slots=True)
class Rendered:
    """A chat message: the notification title and the body."""

    title: str
    text: str


def _lang(language: str) -> Language:
    if language not in LANGUAGES:
        raise ConfigError(f"language must be 'zh' or 'en', got {language!r} (TRAINSENTRY_LANGUAGE)")
    return language  # type: ignore[return-value]


def _w(key: str, language: str, **kwargs: Any) -> str:
    text = _WORDS[key][language]
    return text.format(**kwargs) if kwargs else text


def label_name(label: str, language: str = "zh") -> str:
    """The localised name of a diagnosis label (the label itself if it is not in the vocabulary)."""
    names = LABEL_NAMES.get(label)
    return names[_lang(language)] if names else label


def failed(alert: AlertEvent) -> bool:
    """A resolved notice that closes the problem because the run died with it (not a recovery)."""
    return alert.status == "resolved" and bool(alert.run_exit)


def pages(alerts: Sequence[AlertEvent]) -> bool:
    """Whether a message @-mentions on-call: a critical or escalated firing alert, or a
    critical problem the run died with."""
    return any((a.status == "firing" or failed(a))
               and (a.severity == "critical" or getattr(a, "escalated", False)) for a in alerts)


def severity_name(alert: AlertEvent, language: str = "zh") -> str:
    """``严重`` / ``CRITICAL`` ..., ``已恢复`` / ``RESOLVED`` for a resolved alert, or
    ``运行异常退出`` / ``RUN FAILED`` when the run died with the problem."""
    if alert.status == "resolved":
        return (_FAILED if failed(alert) else _RESOLVED)[language]
    return _SEVERITY_NAMES.get(alert.severity, _SEVERITY_NAMES["info"])[language]


def _repeat_info(alerts: Sequence[AlertEvent]) -> tuple[int, bool]:
    """The highest repeat number and whether any is escalated, among firing notices.

    Plain AlertEvents have neither: only the lifecycle's Notice carries them."""
    firing = [a for a in alerts if a.status == "firing"]
    return (max((int(getattr(a, "repeat", 0) or 0) for a in firing), default=0),
            any(bool(getattr(a, "escalated", False)) for a in firing))


#: The engine's resolved summary (detectors/engine.py ``Engine._resolved``): structured, so
#: it is rendered in the message's language; other summaries are the rules' free text.
_RESOLVED_SUMMARY = re.compile(r"(?P<label>[\w./-]+): resolved at step (?P<step>-?\d+) "
                               r"\((?P<reason>[^)]*)\); firing since step (?P<since>-?\d+)")
_CLEAR_FOR = re.compile(r"clear for (\d+) steps?")
_IDLE_FOR = re.compile(r"no event for ([\d.]+) days; the watchdog stopped watching this run")
_REASONS_ZH = {"run finished": "训练已结束"}


def summary_text(alert: AlertEvent, language: str = "zh") -> str:
    """The alert's summary in ``language``: the engine's Chinese summary of a firing alert
    (``summary_zh``), the resolved notice's known pattern rendered in zh, else verbatim.

    >>> a = AlertEvent(id="x", fingerprint="f", run_id="r", status="resolved",
    ...                severity="critical", diagnosis="nan_loss", step=71, ts=0.0,
    ...                summary="nan_loss: resolved at step 71 (clear for 3 steps); "
    ...                        "firing since step 67", evidence={}, actions=[])
    >>> summary_text(a, "zh")
    'nan_loss：已于第 71 步恢复（连续 3 步正常）；自第 67 步起告警'
    """
    if language != "zh":
        return alert.summary
    if alert.summary_zh:
        return alert.summary_zh
    m = _RESOLVED_SUMMARY.fullmatch(alert.summary)
    if m is None:
        return alert.summary
    clear = _CLEAR_FOR.fullmatch(m["reason"])
    idle = _IDLE_FOR.fullmatch(m["reason"])
    if clear:
        reason = f"连续 {clear[1]} 步正常"
    elif idle:
        reason = f"已 {idle[1]} 天没有任何事件，trainsentry 不再监视这个运行"
    else:
        reason = _REASONS_ZH.get(m["reason"], m["reason"])
    return f"{m['label']}：已于第 {m['step']} 步恢复（{reason}）；自第 {m['since']} 步起告警"


_COMMAND_TAGS = {None: {"zh": "⛔ 熔断", "en": "⛔ BREAKER"},
                 "applied": {"zh": "✅ 命令已执行", "en": "✅ COMMAND APPLIED"},
                 "rejected": {"zh": "❌ 命令被拒绝", "en": "❌ COMMAND REJECTED"}}


def _command_tag(alert: AlertEvent, lang: str) -> str:
    """The title / digest tag of a notice that carries a command, else ``""``."""
    if not alert.command:
        return ""
    return _COMMAND_TAGS.get(alert.command.get("outcome"), _COMMAND_TAGS[None])[lang]


def command_text(alert: AlertEvent, language: str = "zh") -> str:
    """What the circuit breaker ordered, for a notice that carries a command (else ``""``):
    what happens to the run and whether it was sent (:func:`undo_text`: how to undo it).

    >>> a = AlertEvent(id="x", fingerprint="f", run_id="r", status="firing",
    ...                severity="critical", diagnosis="nan_loss", step=52, ts=0.0, summary="",
    ...                evidence={}, actions=[], command={"id": "c1", "action": "rollback",
    ...                                                  "to_step": 40, "sent": True})
    >>> command_text(a, "en")[:60]
    '⛔ Circuit breaker: a signed command c1 (roll back to step 40'
    """
    c = alert.command
    if not c:
        return ""
    action, to, cid = c.get("action"), c.get("to_step"), c.get("id", "?")
    if action == "rollback":
        zh, en = f"回滚到第 {to} 步", f"roll back to step {to}"
    elif c.get("checkpoint_first"):
        zh, en = "先保存 checkpoint 再停止", "save a checkpoint, then stop"
    else:
        zh, en = "停止训练", "stop the run"
    sent = c.get("sent")
    key = c.get("outcome") or ("sent" if sent is True else "stale" if c.get("stale_s") is not None
                               else "unsent" if sent is False else "ordered")
    minutes = f"{float(c.get('stale_s') or 0) / 60:.0f}"
    texts = {
        "applied": (f"✅ 训练进程已执行命令 {cid}（{zh}）",
                    f"✅ The trainer applied command {cid} ({en})"),
        "rejected": (f"❌ 训练进程拒绝了命令 {cid}（{zh}），训练仍在继续：请确认训练侧与服务使用相同的 "
                     "TRAINSENTRY_CONTROL_SECRET、两边时钟一致，或手动处理这个运行",
                     f"❌ The trainer REJECTED command {cid} ({en}) and the run goes on: check "
                     "that the trainer and the service share TRAINSENTRY_CONTROL_SECRET and that "
                     "their clocks agree, or act on the run by hand"),
        "sent": (f"⛔ 熔断：已向训练进程下发签名命令 {cid}（{zh}），它会在下一个训练步的边界执行，"
                 "并上报 command_applied（看板可见）",
                 f"⛔ Circuit breaker: a signed command {cid} ({en}) was sent to the trainer; it "
                 "acts at the next step boundary and reports command_applied (dashboard)"),
        "unsent": (f"⛔ 熔断：命令 {cid}（{zh}）没有下发，因为服务没有设置 "
                   "TRAINSENTRY_CONTROL_SECRET：请手动处理这个运行",
                   f"⛔ Circuit breaker: command {cid} ({en}) was NOT sent, because "
                   "TRAINSENTRY_CONTROL_SECRET is not set on the service: act on the run by hand"),
        "stale": (f"⛔ 熔断：命令 {cid}（{zh}）没有下发，因为触发它的数据已是 {minutes} 分钟前的（回放或积压，"
                  "超过 TRAINSENTRY_COMMAND_MAX_DATA_AGE_S）：请检查这个运行，如仍异常请手动处理",
                  f"⛔ Circuit breaker: command {cid} ({en}) was NOT sent, because the data that "
                  f"tripped it is {minutes} min old (a replay or a backlog, over "
                  "TRAINSENTRY_COMMAND_MAX_DATA_AGE_S): check the run and act by hand if it is "
                  "still failing"),
        "ordered": (f"⛔ 熔断：{zh}（命令 {cid}）", f"⛔ Circuit breaker: {en} (command {cid})"),
    }
    zh_text, en_text = texts.get(key, texts["ordered"])
    return zh_text if _lang(language) == "zh" else en_text


def undo_text(alert: AlertEvent, language: str = "zh") -> str:
    """How to undo a rollback that was sent or applied (else ``""``)."""
    c = alert.command or {}
    if c.get("action") != "rollback" or not (c.get("sent") is True or c.get("outcome") == "applied"):
        return ""
    if _lang(language) == "zh":
        return ("撤销回滚：把移到一旁的 global_step_* 目录移回，并改回 latest_checkpointed_iteration.txt"
                "（trainsentry 文档 verl.md「Undoing a rollback」）")
    return ("To undo the rollback, move the global_step_* folders set aside back and restore "
            "latest_checkpointed_iteration.txt (trainsentry docs, verl.md, \"Undoing a rollback\")")


def notice_badge(alerts: AlertEvent | Sequence[AlertEvent], language: str = "zh", *,
                 icons: bool = False) -> str:
    """``第 2 次提醒 · 已升级`` / ``repeat 2 · escalated`` for a repeated or escalated notice,
    ``""`` for a first notice or a resolve."""
    lang = _lang(language)
    repeat, escalated = _repeat_info(_alerts(alerts))
    parts = []
    if repeat:
        parts.append(f"{_REPEAT_ICON} " * icons + _w("repeat_n", lang, n=repeat))
    if escalated:
        parts.append(f"{_ESCALATED_ICON} " * icons + _w("escalated", lang))
    return " · ".join(parts)


def _icon(alert: AlertEvent) -> str:
    if alert.status == "resolved":
        return (_FAILED if failed(alert) else _RESOLVED)["icon"]
    return _SEVERITY_ICON.get(alert.severity, _SEVERITY_ICON["info"])


def _rank(alert: AlertEvent) -> int:
    if alert.status == "resolved" and not failed(alert):
        return 0
    return _SEVERITY_RANK.get(alert.severity, 1)


def _num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):  # the wire's spelling
        value = float(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        x = float(value)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{value:d}" if isinstance(value, int) else f"{x:.4g}"
    return str(value)


def _when(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, tz=UTC).astimezone().strftime(
            "%Y-%m-%d %H:%M:%S %z")
    except (OverflowError, OSError, ValueError):
        return f"ts={ts}"


def _alerts(alerts: AlertEvent | Sequence[AlertEvent]) -> list[AlertEvent]:
    seq = [alerts] if isinstance(alerts, AlertEvent) else list(alerts)
    if not seq:
        raise ValueError("render needs at least one AlertEvent")
    return seq


class _Fmt:
    """Markdown or plain text: the two differ only in these few marks."""

    def __init__(self, markdown: bool, wecom: bool = False, language: str = "zh") -> None:
        self.markdown = markdown
        self.wecom = wecom
        self.language = language

    def code(self, s: str) -> str:
        if not self.markdown:
            return s
        fence = "`"
        while fence in s:
            fence += "`"
        pad = " " if s.startswith("`") or s.endswith("`") else ""
        return f"{fence}{pad}{s}{pad}{fence}"

    def bold(self, s: str) -> str:
        return f"**{s}**" if self.markdown else s

    def heading(self, s: str) -> str:
        return f"### {s}" if self.markdown else s

    def section(self, s: str) -> str:
        if self.markdown:
            return f"**{s}**"
        return f"【{s}】" if self.language == "zh" else f"[{s}]"

    def severity(self, alert: AlertEvent, language: str) -> str:
        name = severity_name(alert, language)
        if self.wecom and (alert.status != "resolved" or failed(alert)):
            color = _SEVERITY_WECOM_COLOR.get(alert.severity, "comment")
            return f'<font color="{color}">{name}</font>'
        if self.wecom:
            return f'<font color="info">{name}</font>'
        return name


def render_title(alerts: AlertEvent | Sequence[AlertEvent], *, language: str = "zh") -> str:
    """The notification title: ``[trainsentry] 严重 dataloader_stall · run_id`` or a digest count."""
    lang = _lang(language)
    seq = _alerts(alerts)
    if len(seq) == 1:
        a = seq[0]
        badge = notice_badge(a, lang)
        tag = _command_tag(a, lang)
        breaker = f"{tag} · " if tag else ""
        return (f"[trainsentry] {breaker}{severity_name(a, lang)} {a.diagnosis} · {a.run_id}"
                + (f" · {badge}" if badge else ""))
    # A digest's title tells only that someone is being paged; its lines tell the repeats.
    tail = f" · {_w('escalated', lang)}" if _repeat_info(seq)[1] else ""
    runs = list(dict.fromkeys(a.run_id for a in seq))
    count = _w("digest_title", lang, n=len(seq))
    if len(runs) == 1:
        return f"[trainsentry] {count} · {runs[0]}{tail}"
    labels = list(dict.fromkeys(a.diagnosis for a in seq))
    return (f"[trainsentry] {count} · {', '.join(labels[:3])}{' …' if len(labels) > 3 else ''}"
            f"{tail}")


def _bound(ev: dict[str, Any], lang: str) -> str:
    """The bound a value crossed: a range when the rule checks both sides, "must be finite"
    for a non-finite check."""
    bound, lower = ev.get("bound"), ev.get("lower_bound")
    if bound is None and ev.get("bound_kind") == "finite":
        return _w("must_be_finite", lang)
    if lower is not None and bound is not None:
        return f"{_num(lower)} – {_num(bound)}"
    return _num(bound)


def _single_lines(a: AlertEvent, lang: str, f: _Fmt, *, heading: bool = True) -> list[str]:
    lines: list[str] = []
    head = f"{_icon(a)} [{f.severity(a, lang)}] {label_name(a.diagnosis, lang)} {f.code(a.diagnosis)}"
    lines.append(f.heading(head) if heading else f.bold(head) if f.markdown else head)
    badge = notice_badge(a, lang, icons=True)
    if badge:
        lines.append(f.bold(badge))
    lines.append(f"{f.bold(_w('run', lang))}: {f.code(a.run_id)}")
    meta = [f"{f.bold(_w('step', lang))}: {a.step}"]
    if a.attempt:
        meta.append(f"{f.bold(_w('attempt', lang))}: {a.attempt}")
    if a.confidence is not None:
        meta.append(f"{f.bold(_w('confidence', lang))}: {a.confidence:.2f}")
    if a.host is not None or a.rank is not None:
        where = " ".join(x for x in (a.host, None if a.rank is None else f"rank {a.rank}") if x)
        meta.append(f"{f.bold(_w('where', lang))}: {where}")
    lines.append(" · ".join(meta))
    lines.append(f"{f.bold(_w('time', lang))}: {_when(a.ts)}")
    if failed(a):
        code = (a.run_exit or {}).get("exit_code")
        code_s = "" if code is None else (f"（退出码 {code}）" if lang == "zh" else f" with code {code}")
        lines.append(f"{_FAILED['icon']} " + f.bold(_w("failed_at", lang, step=a.step, code=code_s,
                                                       time=_when(a.ts))))
    elif a.status == "resolved":
        lines.append(f"{_RESOLVED['icon']} " + f.bold(_w("resolved_at", lang, step=a.step,
                                                         time=_when(a.ts))))
    if a.command:
        lines.append(f.bold(command_text(a, lang)))
        if undo := undo_text(a, lang):
            lines.append(undo)
    if a.summary:
        lines.append(f"{f.bold(_w('summary', lang))}: {summary_text(a, lang)}")
    if a.evidence:
        lines.append(f.section(_w("evidence", lang)))
        for signal, ev in a.evidence.items():
            ev = ev if isinstance(ev, dict) else {"value": ev}
            extra = []
            if "baseline" in ev:
                extra.append(f"{_w('baseline', lang)} {_num(ev.get('baseline'))}")
            if "bound" in ev:
                extra.append(f"{_w('bound', lang)} {_bound(ev, lang)}")
            tail = ""
            if extra:
                tail = f"（{'，'.join(extra)}）" if lang == "zh" else f" ({', '.join(extra)})"
            lines.append(f"- {f.code(signal)}: {_num(ev.get('value'))}{tail}")
    if a.checks:
        lines.append(f.section(_w("checks", lang)))
        lines.extend(f"- {c}" for c in localize(a.checks, lang))
    if a.actions:
        lines.append(f.section(_w("actions", lang)))
        lines.extend(f"{i}. {act}" for i, act in enumerate(localize(a.actions, lang), 1))
    # ``unknown`` next to a specific diagnosis adds nothing a reader can act on.
    secondary = [s for s in a.secondary if s != "unknown"]
    if secondary:
        causes = ", ".join(f"{f.code(s)} {label_name(s, lang)}" for s in secondary)
        lines.append(f"{f.bold(_w('secondary', lang))}: {causes}")
    return lines


def _digest_lines(seq: list[AlertEvent], lang: str, f: _Fmt) -> list[str]:
    runs: dict[str, dict[str, list[AlertEvent]]] = {}
    for a in seq:  # keep arrival order; fold repeats of one problem (same fingerprint)
        runs.setdefault(a.run_id, {}).setdefault(a.fingerprint or a.id, []).append(a)
    lines = [f.heading(f"[trainsentry] {_w('digest', lang, n=len(seq), runs=len(runs))}")]
    for run_id, problems in runs.items():
        lines.append(f"{f.bold(_w('run', lang))} {f.code(run_id)}")
        for group in problems.values():
            last = group[-1]
            worst = max(group, key=_rank)
            shown = last if last.status == "resolved" else worst
            line = (f"- {_icon(shown)} {f.severity(shown, lang)} {f.code(last.diagnosis)} "
                    f"{label_name(last.diagnosis, lang)} · {_w('at_step', lang, step=last.step)}")
            if len(group) > 1:
                steps = [str(a.step) for a in group]
                steps_s = ", ".join(steps if len(steps) <= 4 else [*steps[:3], "…", steps[-1]])
                line += " " + _w("repeat", lang, n=len(group), steps=steps_s)
            badge = notice_badge(group, lang, icons=True)
            if badge:
                line += f" · {badge}"
            commanded = [a for a in group if a.command]
            if commanded:  # the breaker acted on this problem in the digest's window
                line += f" · {_command_tag(commanded[-1], lang)}"
            if last.summary:
                line += f" — {summary_text(last, lang)}"
            lines.append(line)
    # Detail the worst problem still open (a folded group shows its latest state: firing, or
    # the run died with it); when every problem has recovered, the worst alert of the window,
    # so the reason anyone was paged is still there to read.
    latest = [group[-1] for problems in runs.values() for group in problems.values()]
    open_now = [a for a in latest if _rank(a) > 0]
    pool = open_now or seq
    top = pool[max(range(len(pool)), key=lambda i: (_rank(pool[i]), pool[i].ts, i))]
    lines.append("---" if f.markdown else "")
    lines.append(f.section(_w("most_severe", lang)))
    lines.extend(_single_lines(top, lang, f, heading=False))
    return lines


def _body(seq: list[AlertEvent], lang: str, f: _Fmt, link: str | None) -> list[str]:
    lines = _single_lines(seq[0], lang, f) if len(seq) == 1 else _digest_lines(seq, lang, f)
    if link:
        lines.append(f"[{_w('dashboard', lang)}]({link})" if f.markdown
                     else f"{_w('dashboard', lang)}: {link}")
    return lines


def more_line(n: int, language: str = "zh") -> str:
    """The line that replaces what truncation cut: ``…(N more lines; see dashboard)``."""
    return _w("more", _lang(language), n=n)


def truncate_utf8(text: str, max_bytes: int, *, language: str = "zh") -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, at a line if possible, never mid-character.

    What was cut is replaced by :func:`more_line` naming how many lines are missing.
    """
    if max_bytes <= 0:
        return ""
    if len(text.encode()) <= max_bytes:
        return text
    lines = text.split("\n")
    sizes = [len(line.encode()) for line in lines]

    def total(k: int) -> int:  # k whole lines, a newline, the more line
        body = sum(sizes[:k]) + max(k - 1, 0)
        return body + (1 if k else 0) + len(more_line(len(lines) - k, language).encode())

    best = -1
    for k in range(len(lines) + 1):
        if total(k) > max_bytes:
            break
        best = k
    if best < 0:  # not even the more line fits: cut the text itself
        return text.encode()[:max_bytes].decode("utf-8", "ignore")
    kept = lines[:best]
    if best < len(lines):
        # room left for a part of the next line? cut it at a character boundary
        budget = max_bytes - total(best) - 1 - len("…".encode())
        if budget >= 24:
            part = lines[best].encode()[:budget].decode("utf-8", "ignore")
            if part:
                kept.append(part + "…")
                # the partial line stays counted in "N more lines": it is not shown whole
                if len("\n".join([*kept, more_line(len(lines) - best, language)]).encode()) > max_bytes:
                    kept.pop()
    return "\n".join([*kept, more_line(len(lines) - best, language)])


def _finish(lines: list[str], *, footer: str, max_bytes: int | None, language: str) -> str:
    text = "\n".join(lines)
    if max_bytes is not None:
        room = max_bytes - (len(footer.encode()) + 1 if footer else 0)
        text = truncate_utf8(text, room, language=language)
    return f"{text}\n{footer}" if footer else text


def render_markdown(alerts: AlertEvent | Sequence[AlertEvent], *, language: str = "zh",
                    link: str | None = None, footer: str = "", max_bytes: int | None = None,
                    wecom_colors: bool = False) -> Rendered:
    """Title and markdown body for one alert or a digest; ``footer`` (e.g. @mentions) is never cut."""
    lang = _lang(language)
    seq = _alerts(alerts)
    f = _Fmt(markdown=True, wecom=wecom_colors, language=lang)
    text = _finish(_body(seq, lang, f, link), footer=footer, max_bytes=max_bytes, language=lang)
    return Rendered(render_title(seq, language=lang), text)


def render_text(alerts: AlertEvent | Sequence[AlertEvent], *, language: str = "zh",
                link: str | None = None, footer: str = "", max_bytes: int | None = None) -> Rendered:
    """Title and plain-text body (DingTalk ``text`` msgtype, terminals, logs)."""
    lang = _lang(language)
    seq = _alerts(alerts)
    f = _Fmt(markdown=False, language=lang)
    lines = [render_title(seq, language=lang), *_body(seq, lang, f, link)]
    text = _finish(lines, footer=footer, max_bytes=max_bytes, language=lang)
    return Rendered(render_title(seq, language=lang), text)


def render_wecom_markdown(alerts: AlertEvent | Sequence[AlertEvent], *, language: str = "zh",
                          link: str | None = None, mentions: Sequence[str] = (),
                          max_bytes: int = WECOM_MARKDOWN_MAX_BYTES) -> str:
    """WeCom markdown ``content``: coloured severity, ``<@userid>`` mentions, at most 4096 bytes."""
    footer = " ".join(f"<@{m}>" for m in mentions)
    return render_markdown(alerts, language=language, link=link, footer=footer,
                           max_bytes=max_bytes, wecom_colors=True).text
