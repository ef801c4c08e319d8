"""Chat message templates: content, languages, digests and byte-exact truncation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.knowledge import KNOWLEDGE, KNOWLEDGE_ZH, knowledge, localize
from notifiers.lifecycle import Notice
from notifiers.templates import (
    LABEL_NAMES,
    WECOM_MARKDOWN_MAX_BYTES,
    command_text,
    label_name,
    more_line,
    notice_badge,
    pages,
    render_markdown,
    render_text,
    render_title,
    render_wecom_markdown,
    summary_text,
    truncate_utf8,
)
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

pytest.register_assert_rewrite("tests.chat_servers")
from tests.chat_servers import make_alert  # noqa: E402

VOCABULARY = ["dataloader_stall", "kl_drift", "numeric_underflow", "comm_degradation",
              "memory_leak", "nan_loss", "training_hang", "straggler", "gradient_instability",
              "lr_drift", "entropy_collapse", "stalled_learning", "unknown"]


def test_every_contract_label_has_zh_and_en_names() -> None:
    """Each diagnosis label of the contract has a Chinese and an English name."""
    assert set(LABEL_NAMES) == set(VOCABULARY)
    for label in VOCABULARY:
        zh, en = label_name(label, "zh"), label_name(label, "en")
        assert zh and en and zh != en
        assert any("\u4e00" <= ch <= "\u9fff" for ch in zh)


@pytest.mark.parametrize("language", ["zh", "en"])
@pytest.mark.parametrize("label", VOCABULARY)
def test_message_names_run_id_and_label_in_both_languages(language: str, label: str) -> None:
    """Every rendering names the run_id verbatim and the label (contract)."""
    alert = make_alert(diagnosis=label, run_id="grpo-qwen7b/exp3_β")
    for text in (render_markdown(alert, language=language).text,
                 render_text(alert, language=language).text,
                 render_wecom_markdown(alert, language=language),
                 render_title(alert, language=language)):
        assert "grpo-qwen7b/exp3_β" in text
        assert label in text
    assert label_name(label, language) in render_markdown(alert, language=language).text


def test_zh_single_alert_has_evidence_checks_actions_and_secondary() -> None:
    """A single zh alert shows severity, step, evidence with baseline and bound, checks, actions."""
    text = render_markdown(make_alert(), language="zh").text
    for part in ("严重", "数据加载阻塞", "431", "`timing_s/gen`: 12.3（基线 3.1，界限 6）",
                 "快速检查", "iostat -x 1", "建议操作", "1. check the dataset mount",
                 "其他可能原因", "`straggler` 慢节点", "0.82"):
        assert part in text, part


def test_en_single_alert_reads_in_english() -> None:
    """language='en' switches every fixed word to English."""
    text = render_markdown(make_alert(), language="en").text
    for part in ("CRITICAL", "Data loader stall", "Step", "baseline 3.1, bound 6", "Quick checks",
                 "What to do", "Other possible causes"):
        assert part in text, part
    assert "基线" not in text and "严重" not in text


def test_resolved_alert_says_resolved() -> None:
    """A resolved alert carries a resolved line instead of a severity."""
    alert = make_alert(status="resolved", step=500)
    assert "已于第 500 步恢复" in render_markdown(alert, language="zh").text
    en = render_markdown(alert, language="en")
    assert "Resolved at step 500" in en.text and "RESOLVED" in en.title


@pytest.mark.parametrize("reason, zh", [
    ("clear for 3 steps", "连续 3 步正常"),
    ("run finished", "训练已结束"),
    ("no event for 7.0 days; the watchdog stopped watching this run",
     "已 7.0 天没有任何事件，trainsentry 不再监视这个运行"),
    ("attempt 2 started", "attempt 2 started")])
def test_resolved_summary_is_rendered_in_chinese(reason: str, zh: str) -> None:
    """The engine's resolved summary reads in zh (en keeps it); free-text summaries stay."""
    summary = f"nan_loss: resolved at step 71 ({reason}); firing since step 67"
    alert = make_alert(status="resolved", step=71, diagnosis="nan_loss", summary=summary)
    expected = f"nan_loss：已于第 71 步恢复（{zh}）；自第 67 步起告警"
    assert summary_text(alert, "zh") == expected
    assert expected in render_markdown(alert, language="zh").text
    assert summary in render_markdown(alert, language="en").text
    assert "resolved at step" not in render_markdown(alert, language="zh").text
    firing = make_alert()
    assert summary_text(firing, "zh") == firing.summary  # no Chinese summary: verbatim


def test_a_firing_alert_shows_its_chinese_summary_in_zh_and_the_english_one_in_en() -> None:
    """The engine writes ``summary_zh`` with the same figures; zh messages (markdown, text,
    WeCom markdown and digests) show it, en keeps ``summary``; it survives the wire."""
    en = "kl_drift: actor/kl_loss 0.31 and rising for 4 steps (+0.05/step; baseline 0.02)"
    zh = "kl_drift：actor/kl_loss 为 0.31，已连续 4 步上升（每步 +0.05；基线 0.02）"
    alert = make_alert(diagnosis="kl_drift", summary=en, summary_zh=zh)
    assert AlertEvent.from_dict(alert.to_dict()) == alert
    assert "summary_zh" not in make_alert().to_dict()  # absent when there is none
    for render in (render_markdown, render_text):
        text_zh = render(alert, language="zh").text
        assert zh in text_zh and "rising for" not in text_zh, render
        assert en in render(alert, language="en").text, render
    assert zh in render_wecom_markdown(alert, language="zh")
    assert en in render_wecom_markdown(alert, language="en")
    digest = [alert, make_alert(run_id="other/run", diagnosis="nan_loss")]
    assert zh in render_markdown(digest, language="zh").text
    notice = Notice.of(alert, repeat=2)
    assert summary_text(notice, "zh") == zh


def test_nonfinite_and_missing_evidence_values_render() -> None:
    """NaN/inf values (float or contract string) and missing baselines do not break rendering."""
    alert = make_alert(diagnosis="nan_loss", evidence={
        "actor/grad_norm": {"value": float("nan"), "baseline": 1.2},
        "actor/pg_loss": {"value": "inf"}, "odd": 3})
    text = render_text(alert, language="en").text
    assert "actor/grad_norm: NaN (baseline 1.2)" in text
    assert "actor/pg_loss: inf" in text


def test_digest_lists_every_run_and_folds_repeats() -> None:
    """A digest names every run_id and label once per problem and folds repeated fingerprints."""
    alerts = [make_alert(id=f"x{i}", step=400 + i) for i in range(5)]
    alerts.append(make_alert(id="y", run_id="ppo-llama/exp9", fingerprint="fp-nan",
                             diagnosis="nan_loss", severity="critical"))
    alerts.append(make_alert(id="z", run_id="grpo-7b/exp1", fingerprint="fp-kl",
                             diagnosis="kl_drift", severity="warning"))
    for language in ("zh", "en"):
        r = render_markdown(alerts, language=language)
        for run_id in ("grpo-qwen7b/exp3", "ppo-llama/exp9", "grpo-7b/exp1"):
            assert run_id in r.text
        for label in ("dataloader_stall", "nan_loss", "kl_drift"):
            assert label in r.text
        assert "×5" in r.text
        assert "7" in r.title
    assert r.text.index("grpo-7b/exp1") < r.text.index("Most severe")


def test_digest_details_a_problem_still_firing() -> None:
    """The detail section of a digest skips a problem whose latest alert is resolved."""
    alerts = [make_alert(id="a", step=1), make_alert(id="b", step=2, status="resolved"),
              make_alert(id="c", run_id="r2", fingerprint="f2", diagnosis="memory_leak",
                         severity="warning")]
    text = render_text(alerts, language="en").text
    detail = text.split("Most severe")[1]
    assert "memory_leak" in detail.splitlines()[1]


def test_plain_text_has_no_markdown_marks() -> None:
    """The text renderer is plain: no bold stars, no code backticks, no headings."""
    text = render_text(make_alert(), language="zh").text
    assert "**" not in text and "`" not in text and "###" not in text


def test_run_id_with_backticks_stays_verbatim_in_markdown() -> None:
    """A run_id holding backticks is fenced so it is still shown verbatim."""
    text = render_markdown(make_alert(run_id="weird`run``id"), language="en").text
    assert "weird`run``id" in text


def test_unknown_label_outside_vocabulary_renders_verbatim() -> None:
    """A label the vocabulary lacks is shown as itself."""
    assert label_name("brand_new_label", "zh") == "brand_new_label"
    assert "brand_new_label" in render_text(make_alert(diagnosis="brand_new_label")).text


def test_bad_language_is_a_config_error() -> None:
    """Only zh and en exist; anything else names the setting."""
    with pytest.raises(ConfigError, match="TRAINSENTRY_LANGUAGE"):
        render_markdown(make_alert(), language="fr")


def test_wecom_markdown_with_chinese_text_fits_4096_bytes() -> None:
    """A long Chinese alert is cut to ≤ 4096 bytes at a character, with a "more" line and mentions."""
    alert = make_alert(actions=[f"第{i}步：检查数据集挂载、增加加载进程并使用内存映射数据集🚀" for i in range(200)])
    content = render_wecom_markdown(alert, language="zh", mentions=["zhangsan"])
    raw = content.encode("utf-8")
    assert len(raw) <= WECOM_MARKDOWN_MAX_BYTES
    raw.decode("utf-8")  # a whole number of characters
    assert "详见看板" in content
    assert content.endswith("<@zhangsan>")
    assert "grpo-qwen7b/exp3" in content and "dataloader_stall" in content


def test_truncation_counts_the_missing_lines() -> None:
    """The "more" line says how many lines were cut."""
    text = "\n".join(f"line {i}" for i in range(100))
    out = truncate_utf8(text, 100, language="en")
    kept = out.split("\n")[:-1]
    missing = 100 - sum(1 for line in kept if not line.endswith("…"))
    assert out.endswith(more_line(missing, "en"))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab 中文字\n🚀é`*")), max_size=3000),
       max_bytes=st.integers(min_value=60, max_value=5000),
       language=st.sampled_from(["zh", "en"]))
def test_truncate_utf8_never_exceeds_the_limit(text: str, max_bytes: int, language: str) -> None:
    """Any text fits after truncation, is unchanged when it already fit, and keeps a prefix."""
    out = truncate_utf8(text, max_bytes, language=language)
    assert len(out.encode("utf-8")) <= max_bytes
    if len(text.encode("utf-8")) <= max_bytes:
        assert out == text
    else:
        assert out.endswith(more_line(int(out.rsplit("还有 ", 1)[-1].split(" ")[0])
                                      if language == "zh" else
                                      int(out.rsplit("…(", 1)[-1].split(" ")[0]), language))
        body = out.rsplit("\n", 1)[0] if "\n" in out else ""
        whole = [line for line in body.split("\n") if body and not line.endswith("…")]
        assert "\n".join(whole) == "\n".join(text.split("\n")[: len(whole)])


# -- repeats and escalation (notifiers.lifecycle.Notice) ------------------------------------

def _notice(*, repeat: int = 0, escalated: bool = False, **overrides: object) -> Notice:
    return Notice.of(make_alert(**overrides), repeat=repeat, escalated=escalated)


@pytest.mark.parametrize(("language", "repeat_text", "escalated_text"),
                         [("zh", "第 3 次提醒", "已升级"), ("en", "repeat 3", "escalated")])
def test_escalated_repeat_says_so_in_title_and_body(language: str, repeat_text: str,
                                                    escalated_text: str) -> None:
    """An escalated third repeat shows "第 3 次提醒 · 已升级" / "repeat 3 · escalated"
    in the title and the body of every rendering."""
    notice = _notice(repeat=3, escalated=True)
    assert render_title(notice, language=language).endswith(f"{repeat_text} · {escalated_text}")
    for text in (render_markdown(notice, language=language).text,
                 render_text(notice, language=language).text,
                 render_wecom_markdown(notice, language=language)):
        head = "\n".join(text.splitlines()[:3])  # next to the headline, not in the detail
        assert f"🔁 {repeat_text} · ⏫ {escalated_text}" in head


def test_repeat_without_escalation_shows_only_the_count() -> None:
    """A repeat below the escalation threshold says which reminder it is, not "escalated"."""
    text = render_markdown(_notice(repeat=1), language="zh").text
    assert "🔁 第 1 次提醒" in text and "已升级" not in text
    assert notice_badge(_notice(repeat=1), "en") == "repeat 1"


@pytest.mark.parametrize("alert", [make_alert(), _notice(), _notice(status="resolved")],
                         ids=["alert-event", "first-notice", "resolved"])
def test_first_notice_and_resolve_carry_no_badge(alert: AlertEvent) -> None:
    """A plain AlertEvent, a first notice and a resolve have no repeat/escalation badge."""
    assert notice_badge(alert, "zh") == ""
    for language in ("zh", "en"):
        text = render_markdown(alert, language=language)
        for word in ("次提醒", "已升级", "repeat ", "escalated"):
            assert word not in text.text and word not in text.title


def test_digest_line_shows_repeat_and_escalation_and_title_says_escalated() -> None:
    """In a digest the repeated problem's line carries its badge; the title flags escalation."""
    alerts = [_notice(id="a", repeat=2, escalated=True),
              _notice(id="b", run_id="ppo/exp9", fingerprint="fp-kl", diagnosis="kl_drift")]
    for language, badge, flag in (("zh", "🔁 第 2 次提醒 · ⏫ 已升级", "已升级"),
                                  ("en", "🔁 repeat 2 · ⏫ escalated", "escalated")):
        r = render_text(alerts, language=language)
        lines = r.text.splitlines()
        assert any("dataloader_stall" in line and badge in line for line in lines)
        assert not any("kl_drift" in line and badge in line for line in lines)
        assert r.title.endswith(f" · {flag}")


# -- knowledge in the message's language ---------------------------------------------------

@pytest.mark.parametrize("label", VOCABULARY)
def test_zh_message_shows_the_labels_checks_and_actions_in_chinese(label: str) -> None:
    """The default language: the knowledge base's checks and actions appear in Chinese."""
    en, zh = knowledge(label, "en"), knowledge(label, "zh")
    alert = make_alert(diagnosis=label, checks=list(en.checks), actions=list(en.actions))
    text = render_markdown(alert, language="zh").text
    for line in (*zh.checks, *zh.actions):
        assert line in text, line
    for line in (*en.checks, *en.actions):
        if line not in (*zh.checks, *zh.actions):  # a bare command reads the same in both
            assert line not in text, line


@pytest.mark.parametrize("label", VOCABULARY)
def test_en_message_keeps_the_english_checks_and_actions(label: str) -> None:
    """language='en' shows the AlertEvent's English texts unchanged."""
    en = knowledge(label, "en")
    alert = make_alert(diagnosis=label, checks=list(en.checks), actions=list(en.actions))
    text = render_text(alert, language="en").text
    for i, action in enumerate(en.actions, 1):
        assert f"{i}. {action}" in text
    for check in en.checks:
        assert f"- {check}" in text


def test_custom_actions_outside_the_knowledge_base_stay_verbatim() -> None:
    """Texts the knowledge base does not know (custom rules) are shown as they came."""
    alert = make_alert(actions=["page the data team", "lower the learning rate"])
    text = render_text(alert, language="zh").text
    assert "1. page the data team" in text and "2. 降低学习率" in text


def test_every_label_has_chinese_knowledge_parallel_to_the_english() -> None:
    """Each label's zh title, checks and actions exist, are Chinese and match the en ones
    one to one; one English text always gets the same translation."""
    assert set(KNOWLEDGE_ZH) == set(KNOWLEDGE) == set(VOCABULARY)
    seen: dict[str, str] = {}
    for label in VOCABULARY:
        en, zh = KNOWLEDGE[label], KNOWLEDGE_ZH[label]
        assert len(zh.checks) == len(en.checks) and len(zh.actions) == len(en.actions), label
        for src, dst in zip((en.title, *en.checks, *en.actions),
                            (zh.title, *zh.checks, *zh.actions), strict=True):
            assert dst == src or any("\u4e00" <= ch <= "\u9fff" for ch in dst), (label, dst)
            assert seen.setdefault(src, dst) == dst, (label, src)
    assert localize(list(KNOWLEDGE["nan_loss"].actions), "zh") == list(KNOWLEDGE_ZH["nan_loss"].actions)
    assert knowledge("not_a_label", "zh") == KNOWLEDGE_ZH["unknown"]


def _breaker_notice(sent: bool | None, action: str = "rollback") -> AlertEvent:
    command = {"id": "c0ffee", "action": action, "to_step": 40 if action == "rollback" else None,
               "checkpoint_first": action == "checkpoint"}
    if sent is not None:
        command["sent"] = sent
    return make_alert(diagnosis="nan_loss", severity="critical", step=52,
                      command={**command, "action": "stop" if action == "checkpoint" else action})


@pytest.mark.parametrize("sent, zh, en", [
    (True, "已向训练进程下发签名命令 c0ffee（回滚到第 40 步）",
     "a signed command c0ffee (roll back to step 40) was sent to the trainer"),
    (False, "命令 c0ffee（回滚到第 40 步）没有下发，因为服务没有设置 TRAINSENTRY_CONTROL_SECRET",
     "command c0ffee (roll back to step 40) was NOT sent, because TRAINSENTRY_CONTROL_SECRET"),
    (None, "熔断：回滚到第 40 步（命令 c0ffee）", "Circuit breaker: roll back to step 40 (command c0ffee)"),
])
def test_a_breaker_notice_says_what_happens_to_the_run_in_both_languages(
        sent: bool | None, zh: str, en: str) -> None:
    alert = _breaker_notice(sent)
    text_zh, text_en = render_markdown(alert, language="zh"), render_markdown(alert, language="en")
    assert zh in text_zh.text and en in text_en.text
    assert text_zh.title.startswith("[trainsentry] ⛔ 熔断 · 严重 nan_loss")
    assert text_en.title.startswith("[trainsentry] ⛔ BREAKER · CRITICAL nan_loss")
    # How to undo a rollback is told once it was really sent.
    assert ("撤销回滚：把移到一旁的 global_step_* 目录移回" in text_zh.text) is (sent is True)
    assert ("To undo the rollback" in text_en.text) is (sent is True)
    assert "⛔ 熔断" in render_markdown([alert, make_alert(run_id="x/y")], language="zh").text


@pytest.mark.parametrize("action, zh, en", [("stop", "停止训练", "stop the run"),
                                            ("checkpoint", "先保存 checkpoint 再停止",
                                             "save a checkpoint, then stop")])
def test_a_stop_notice_names_the_stop_and_no_undo(action: str, zh: str, en: str) -> None:
    alert = _breaker_notice(True, action)
    assert zh in command_text(alert, "zh") and en in command_text(alert, "en")
    assert "撤销" not in command_text(alert, "zh") and "undo" not in command_text(alert, "en")
    assert command_text(make_alert(), "zh") == ""


@pytest.mark.parametrize("outcome, zh, en, title_zh", [
    ("applied", "✅ 训练进程已执行命令 c0ffee（回滚到第 40 步）",
     "✅ The trainer applied command c0ffee (roll back to step 40)", "✅ 命令已执行"),
    ("rejected", "❌ 训练进程拒绝了命令 c0ffee（回滚到第 40 步），训练仍在继续",
     "❌ The trainer REJECTED command c0ffee (roll back to step 40) and the run goes on",
     "❌ 命令被拒绝"),
])
def test_the_trainers_answer_reads_in_both_languages(outcome: str, zh: str, en: str,
                                                     title_zh: str) -> None:
    alert = make_alert(diagnosis="nan_loss", command={"id": "c0ffee", "action": "rollback",
                                                      "to_step": 40, "outcome": outcome})
    assert zh in render_markdown(alert, language="zh").text
    assert en in render_markdown(alert, language="en").text
    assert render_title(alert, language="zh").startswith(f"[trainsentry] {title_zh} · ")
    assert ("撤销回滚" in render_markdown(alert, language="zh").text) is (outcome == "applied")


def test_a_run_that_died_with_its_problem_is_not_shown_as_recovered() -> None:
    """A resolved notice carrying ``run_exit`` (the run crashed while the problem fired)
    reads as a failure with the exit code, keeps paging on-call, and never says recovered."""
    died = make_alert(id="x", status="resolved", diagnosis="memory_leak",
                      summary="memory_leak: the run exited with code 1 at step 154 ...",
                      summary_zh="memory_leak：训练进程在第 154 步异常退出（退出码 1）……",
                      run_exit={"exit_code": 1, "error": "torch.OutOfMemoryError"}, step=154)
    for lang, failed_word, recovered in (("zh", "运行异常退出", "已恢复"), ("en", "RUN FAILED", "RESOLVED")):
        md = render_markdown(died, language=lang).text
        assert failed_word in render_title(died, language=lang)
        assert failed_word in md and recovered not in md and "✅" not in md and "❌" in md
        assert ("退出码 1" if lang == "zh" else "with code 1") in md
    assert pages([died])
    assert not pages([make_alert(status="resolved")])  # a plain recovery pages no one
    assert pages([make_alert()]) and not pages([make_alert(severity="warning")])
    # A digest whose problem ended with the run's death details that death.
    digest = render_text([make_alert(id="a", fingerprint="fp", step=150), died.__class__(
        **{**died.to_dict(), "fingerprint": "fp"})], language="en").text
    assert "RUN FAILED" in digest.split("Most severe")[1]


def test_a_digest_whose_problem_recovered_still_details_what_paged() -> None:
    """A critical episode with a breaker notice that recovered within the digest's window:
    the line keeps the breaker tag, and the detail is the breaker notice, not the recovery."""
    fp = {"fingerprint": "fp-leak", "diagnosis": "memory_leak"}
    breaker = make_alert(id="b", step=150, command={"id": "c1", "action": "stop", "sent": True},
                         **fp)
    alerts = [make_alert(id="a", step=148, **fp), breaker,
              make_alert(id="c", step=154, status="resolved", **fp)]
    text = render_text(alerts, language="en").text
    head, detail = text.split("Most severe")
    assert "BREAKER" in head
    assert "Circuit breaker" in detail and "RESOLVED" not in detail.splitlines()[1]


def test_evidence_reads_right_for_non_finite_and_two_sided_checks() -> None:
    """A value sent as the string "nan" reads NaN and a finiteness check's bound says so; a
    two-sided check shows its range; ``unknown`` next to a specific label is not listed;
    English plain text uses plain brackets."""
    a = make_alert(evidence={
        "actor/pg_loss": {"value": "nan", "baseline": 0.0049, "bound": None, "bound_kind": "finite"},
        "actor/grad_norm": {"value": 0.038, "baseline": 0.136, "bound": 0.213,
                            "lower_bound": 0.0931}},
        secondary=["unknown"])
    zh = render_markdown(a, language="zh").text
    en = render_text(a, language="en").text
    assert "NaN（基线 0.0049，界限 须为有限值）" in zh
    assert "NaN (baseline 0.0049, bound must be finite)" in en
    assert "0.0931 – 0.213" in zh
    assert "unknown" not in zh.split("actor/grad_norm")[1] and "其他可能原因" not in zh
    assert "【" not in en and "[Evidence" in en
    assert "【证据" in render_text(a, language="zh").text
