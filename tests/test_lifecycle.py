"""AlertBook: the notification lifecycle, without Kafka (notifiers/lifecycle.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from notifiers.lifecycle import (
    Ack,
    AlertBook,
    HistoryRecord,
    LifecycleConfig,
    Matcher,
    Notice,
    Plan,
    RunBook,
    Silence,
    parse_duration,
)
from tests.chat_servers import make_alert
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

RUN = "grpo/exp1"


def alert(diagnosis: str = "nan_loss", *, step: int = 10, status: str = "firing",
          severity: str = "critical", run: str = RUN, n: int = 0, **kw: Any) -> AlertEvent:
    """An engine-like alert: fingerprint per (run, diagnosis), id per (step, status, n)."""
    fields: dict[str, Any] = dict(
        id=f"{run}|{diagnosis}|{step}|{status}|{n}", fingerprint=f"fp:{run}:{diagnosis}",
        run_id=run, status=status, severity=severity, diagnosis=diagnosis, step=step,
        ts=1000.0 + step, summary=f"{diagnosis} at {step}",
        evidence={"actor/grad_norm": {"value": 1.0, "baseline": 0.5, "bound": 0.8}},
        actions=[], checks=[], secondary=[], confidence=0.9)
    fields.update(kw)
    return make_alert(**fields)


def book(**kw: Any) -> AlertBook:
    cfg: dict[str, Any] = dict(for_steps=0, for_s=0.0, escalate_after=2)
    cfg.update(kw)
    return AlertBook(LifecycleConfig(**cfg))


def run_through(b: AlertBook, alerts: list[AlertEvent], *, now: float = 100.0,
                deliver: bool = True, **kw: Any) -> tuple[Plan, list[HistoryRecord]]:
    plan = b.observe(alerts, now=now, **kw)
    delivered = {n.id for n in plan.notices} if deliver else set()
    return plan, b.settle(plan, delivered, now=now)


def transitions(records: list[HistoryRecord]) -> list[tuple[str, bool]]:
    return [(r.transition, r.notified) for r in records]


# ------------------------------------------------------------------------------ firing / pending

def test_critical_alert_is_sent_at_once_even_with_a_for_window() -> None:
    """Critical never waits for ``for``."""
    b = book(for_steps=5, for_s=60)
    plan, records = run_through(b, [alert()])
    assert [n.diagnosis for n in plan.notices] == ["nan_loss"]
    assert transitions(records) == [("firing", True)]


def test_warning_waits_pending_until_it_held_for_enough_steps() -> None:
    """A warning is pending; a later alert of the run past ``for_steps`` releases it."""
    b = book(for_steps=5, for_s=0)
    plan, records = run_through(b, [alert("kl_drift", severity="warning", step=10)])
    assert plan.notices == [] and transitions(records) == [("pending", False)]
    plan, _ = run_through(b, [alert("memory_leak", severity="critical", step=15,
                                    evidence={"gpu/memory_used_gb": {"value": 79.0}})])
    released = b.due(now=101.0)
    assert [n.diagnosis for n in released.notices] == ["kl_drift"]


def test_warning_waits_pending_until_it_held_for_enough_seconds() -> None:
    """``for_s`` releases a pending warning from the timer."""
    b = book(for_steps=0, for_s=60)
    run_through(b, [alert("kl_drift", severity="warning")], now=100.0)
    assert b.due(now=159.0).notices == []
    plan = b.due(now=160.0)
    assert [n.diagnosis for n in plan.notices] == ["kl_drift"]
    records = b.settle(plan, {plan.notices[0].id}, now=160.0)
    assert transitions(records) == [("firing", True)]
    assert b.due(now=200.0).notices == []  # notified: never again from the timer


def test_pending_warning_that_resolves_is_never_sent_nor_its_resolve() -> None:
    """Flapping: a warning that clears before ``for`` makes no noise at all."""
    b = book(for_steps=0, for_s=60)
    run_through(b, [alert("kl_drift", severity="warning")])
    plan, records = run_through(b, [alert("kl_drift", severity="warning", status="resolved",
                                          step=13)], now=120.0)
    assert plan.notices == []
    assert transitions(records) == [("resolved", False)]
    assert b.due(now=1000.0).notices == []


def test_pending_warning_upgraded_to_critical_goes_out_at_once() -> None:
    """The engine's warning → critical upgrade skips the rest of the wait."""
    b = book(for_steps=0, for_s=600)
    run_through(b, [alert("kl_drift", severity="warning")])
    plan, _ = run_through(b, [alert("kl_drift", severity="critical", step=11)])
    assert [n.severity for n in plan.notices] == ["critical"]


# ------------------------------------------------------------------------------ dedup, repeat

def test_redelivered_alert_id_is_not_sent_twice() -> None:
    """Dedup by id: a record redelivered after a restart is skipped."""
    b = book()
    run_through(b, [alert()])
    plan, records = run_through(b, [alert()])
    assert plan.notices == [] and plan.duplicates == 1 and records == []


def test_run_book_state_round_trips_through_json() -> None:
    """The state survives the Faust table (JSON) with dedup intact."""
    b = book()
    run_through(b, [alert()])
    saved = json.dumps(b.dump(RUN))
    fresh = book()
    fresh.restore(RUN, json.loads(saved))
    assert isinstance(fresh.runs[RUN], RunBook)
    plan, _ = run_through(fresh, [alert()])
    assert plan.notices == [] and plan.duplicates == 1


def test_repeats_escalate_after_two_repeats() -> None:
    """Firing, repeat 1 (plain), repeat 2 and later (escalated: @-mention on-call)."""
    b = book(escalate_after=2)
    out = []
    for i, step in enumerate((10, 60, 110, 160)):
        plan, records = run_through(b, [alert(step=step, n=i)])
        out.append((plan.notices[0], transitions(records)))
    assert [n.escalated for n, _ in out] == [False, False, True, True]
    assert [n.repeat for n, _ in out] == [0, 1, 2, 3]
    assert [t for _, t in out] == [[("firing", True)], [("repeat", True)],
                                   [("escalated", True)], [("repeat", True)]]
    assert isinstance(out[2][0], Notice) and isinstance(out[2][0], AlertEvent)


def test_repeat_interval_throttles_repeats() -> None:
    """A repeat sooner than ``repeat_interval_s`` after the last notice is held back."""
    b = book(repeat_interval_s=300)
    run_through(b, [alert(step=10)], now=100.0)
    plan, records = run_through(b, [alert(step=60, n=1)], now=200.0)
    assert plan.notices == [] and records[0].reason == "within repeat_interval"
    plan, _ = run_through(b, [alert(step=110, n=2)], now=401.0)
    assert len(plan.notices) == 1


def test_undelivered_firing_does_not_count_as_notified() -> None:
    """A firing that failed for good is retried as a first firing, and its resolve is not sent."""
    b = book()
    _, records = run_through(b, [alert()], deliver=False)
    assert transitions(records) == [("firing", False)]
    plan, _ = run_through(b, [alert(step=11, status="resolved")])
    assert plan.notices == []


# ------------------------------------------------------------------------------ acks

def test_ack_stops_repeats_but_keeps_the_resolve_notice() -> None:
    """Acknowledged: repeats and escalation stop; the resolved notice still goes out."""
    b = book()
    run_through(b, [alert(step=10)], now=100.0)
    acks = {"fp:grpo/exp1:nan_loss": Ack(fingerprint="fp:grpo/exp1:nan_loss", run_id=RUN,
                                         alert_id=alert(step=10).id, created_at=150.0,
                                         created_by="alice")}
    for i, step in enumerate((60, 110, 160), 1):
        plan, records = run_through(b, [alert(step=step, n=i)], now=200.0 + i, acks=acks)
        assert plan.notices == []
        assert records[0].reason == "acknowledged by alice"
    plan, records = run_through(b, [alert(step=163, status="resolved")], now=300.0, acks=acks)
    assert [n.status for n in plan.notices] == ["resolved"]
    assert transitions(records) == [("resolved", True)]


def test_ack_of_an_earlier_episode_does_not_mute_a_new_one() -> None:
    """An ack belongs to the firing it was given for; the same problem firing again is new."""
    b = book()
    fp = "fp:grpo/exp1:nan_loss"
    acks = {fp: Ack(fingerprint=fp, alert_id="old", created_at=50.0)}
    plan, _ = run_through(b, [alert()], now=100.0, acks=acks)
    assert len(plan.notices) == 1


# ------------------------------------------------------------------------------ silences

def silence(*matchers: str, start: float = 0.0, end: float = 1e9) -> Silence:
    return Silence(id="s1", matchers=tuple(Matcher.parse(m) for m in matchers),
                   starts_at=start, ends_at=end, created_by="bob")


@pytest.mark.parametrize(("matcher", "hit"), [
    ("run_id=grpo/exp1", True), ("run_id=grpo/exp2", False), ("run=grpo/exp1", True),
    ("diagnosis=~nan_.*", True), ("diagnosis=~nan", False),  # anchored like Alertmanager
    ("diagnosis!=nan_loss", False), ("diagnosis!~kl_.*", True), ("severity=critical", True),
    ("alertname=nan_loss", True), ("host=node-1", False),
])
def test_silence_matchers_follow_alertmanager_semantics(matcher: str, hit: bool) -> None:
    """=, !=, =~, !~ with anchored regexes over the alert's labels."""
    b = book()
    plan, records = run_through(b, [alert()], silences=[silence(matcher)])
    assert (plan.notices == []) is hit
    if hit:
        assert transitions(records) == [("silenced", False)]


def test_silence_needs_every_matcher() -> None:
    """All matchers must match (AND)."""
    b = book()
    plan, _ = run_through(b, [alert()], silences=[silence("run_id=grpo/exp1", "severity=warning")])
    assert len(plan.notices) == 1


def test_expired_silence_releases_the_alert_from_the_timer() -> None:
    """A silenced alert is sent once its silence ends, if still firing."""
    b = book()
    s = silence("diagnosis=nan_loss", start=0.0, end=150.0)
    run_through(b, [alert()], now=100.0, silences=[s])
    assert b.due(now=120.0, silences=[s]).notices == []
    assert b.due(now=120.0, silences=[s]).records == []  # no history spam while held
    plan = b.due(now=151.0, silences=[s] if s.active(151.0) else [])
    assert [n.diagnosis for n in plan.notices] == ["nan_loss"]


def test_silenced_alert_resolve_is_sent_only_if_firing_was_delivered() -> None:
    """Resolved-after-silence rule: sent firing → resolve sent; never sent → resolve not sent."""
    b = book()
    s = [silence("diagnosis=nan_loss")]
    run_through(b, [alert("nan_loss")])  # delivered before the silence existed
    run_through(b, [alert("kl_drift", severity="critical")], silences=s + [silence("diagnosis=kl_drift")])
    plan, records = run_through(b, [alert("nan_loss", step=20, status="resolved"),
                                    alert("kl_drift", step=20, status="resolved",
                                          severity="critical")], silences=s)
    assert [n.diagnosis for n in plan.notices] == ["nan_loss"]
    kl = [r for r in records if r.diagnosis == "kl_drift"]
    assert transitions(kl) == [("resolved", False)] and "silenced" in kl[0].reason


def test_silence_refuses_bad_input() -> None:
    """No matchers, a bad regex or an end before the start are configuration errors."""
    with pytest.raises(ConfigError):
        Silence(id="x", matchers=(), starts_at=0, ends_at=1)
    with pytest.raises(ConfigError):
        Matcher.parse("diagnosis=~(")
    with pytest.raises(ConfigError):
        silence("run_id=a", start=10, end=5)


@given(st.integers(min_value=0, max_value=10_000), st.sampled_from(["s", "m", "h", "d"]))
def test_parse_duration_reads_units(n: int, unit: str) -> None:
    """``2h`` etc. are seconds times the unit."""
    assert parse_duration(f"{n}{unit}") == n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


# ------------------------------------------------------------------------------ inhibition

def test_root_cause_inhibits_its_symptom_from_the_table() -> None:
    """nan_loss mutes gradient_instability of the same run, in the same batch too."""
    b = book()
    plan, records = run_through(b, [alert("gradient_instability", severity="warning"),
                                    alert("nan_loss")])
    assert [n.diagnosis for n in plan.notices] == ["nan_loss"]
    inhibited = [r for r in records if r.transition == "inhibited"]
    assert inhibited and inhibited[0].diagnosis == "gradient_instability"


def test_inhibition_is_per_run() -> None:
    """Another run's root cause does not mute this run's alert."""
    b = book()
    plan, _ = run_through(b, [alert("nan_loss", run="other"),
                              alert("gradient_instability", severity="warning")])
    assert sorted(n.diagnosis for n in plan.notices) == ["gradient_instability", "nan_loss"]


def test_dataloader_stall_mutes_only_latency_unknown_alerts() -> None:
    """The table's evidence condition: an unknown about timing is explained, one about KL is not."""
    b = book()
    stall = alert("dataloader_stall", evidence={"timing_s/gen": {"value": 9.0}})
    latency = alert("unknown", severity="warning", evidence={"timing_s/step": {"value": 30.0}})
    other = alert("unknown", severity="warning", run=RUN, fingerprint="fp:other-unknown",
                  id="u2", evidence={"actor/kl_loss": {"value": 3.0}})
    plan, _ = run_through(b, [stall, latency, other])
    assert sorted(n.id for n in plan.notices) == sorted([stall.id, "u2"])


def test_secondary_labels_inhibit_what_the_primary_explains() -> None:
    """AlertEvent.secondary: the primary explains those labels in the same run."""
    b = book()
    primary = alert("comm_degradation", secondary=["straggler"],
                    evidence={"timing_s/reduce": {"value": 4.0}})
    symptom = alert("straggler", severity="warning", evidence={"timing_s/rank3": {"value": 4.0}})
    plan, _ = run_through(b, [primary, symptom])
    assert [n.diagnosis for n in plan.notices] == ["comm_degradation"]


def test_critical_inhibits_warning_on_the_same_signal() -> None:
    """Same run, same evidence key: the critical one speaks for both."""
    b = book()
    crit = alert("kl_drift", severity="critical", evidence={"actor/kl_loss": {"value": 9.0}})
    warn = alert("entropy_collapse", severity="warning", evidence={"actor/kl_loss": {"value": 9.0}})
    unrelated = alert("lr_drift", severity="warning", evidence={"actor/lr": {"value": 1.0}})
    plan, _ = run_through(b, [crit, warn, unrelated])
    assert sorted(n.diagnosis for n in plan.notices) == ["kl_drift", "lr_drift"]


def test_inhibited_alert_is_released_when_the_root_cause_resolves() -> None:
    """Once nan_loss resolves, a still-firing gradient_instability is sent by the timer."""
    b = book()
    run_through(b, [alert("nan_loss"), alert("gradient_instability", severity="warning")])
    run_through(b, [alert("nan_loss", status="resolved", step=13)])
    plan = b.due(now=101.0)
    assert [n.diagnosis for n in plan.notices] == ["gradient_instability"]


def test_mutual_inhibition_never_mutes_both() -> None:
    """Two alerts naming each other as secondary: the heavier one is sent."""
    b = book()
    a1 = alert("kl_drift", severity="critical", secondary=["entropy_collapse"],
               evidence={"a": {"value": 1}})
    a2 = alert("entropy_collapse", severity="critical", secondary=["kl_drift"],
               evidence={"b": {"value": 1}})
    plan, _ = run_through(b, [a1, a2])
    assert len(plan.notices) == 1


def test_history_records_are_json_and_keyed_uniquely() -> None:
    """Every transition record has a unique id and round-trips through JSON."""
    b = book(for_steps=0, for_s=60)
    _, r1 = run_through(b, [alert("kl_drift", severity="warning")])
    plan = b.due(now=200.0)
    r2 = b.settle(plan, {n.id for n in plan.notices}, now=200.0)
    records = r1 + r2
    assert len({r.id for r in records}) == len(records) == 2
    back = [HistoryRecord.from_dict(json.loads(json.dumps(r.to_dict()))) for r in records]
    assert back == records
    assert back[1].series == {} or isinstance(back[1].series, dict)


def test_staged_notices_resume_for_the_receivers_that_did_not_acknowledge() -> None:
    """After a crash: the outbox resumes per receiver, and the timer does not send it again."""
    b = book()
    plan = b.observe([alert()], now=100.0)
    b.stage(plan)
    notice = plan.notices[0]
    b.mark(RUN, notice.id, "dingtalk", ok=True)
    restored = book()
    restored.restore(RUN, json.loads(json.dumps(b.dump(RUN))))
    assert restored.due(now=200.0).notices == []  # staged: not a new firing
    again = restored.resume([RUN])
    assert [n.id for n in again.notices] == [notice.id]
    assert restored.todo(RUN, notice.id, ["dingtalk", "wecom"]) == ["wecom"]
    restored.mark(RUN, notice.id, "wecom", ok=True)
    records = restored.settle(again, now=201.0)
    assert transitions(records) == [("firing", True)]
    assert restored.runs[RUN].outbox == [] and not restored.runs[RUN].waiting


def test_critical_that_fires_and_resolves_within_one_batch_is_sent_with_its_resolve() -> None:
    """A replayed or fast run: firing and resolved in one batch still reach people."""
    b = book()
    plan, _ = run_through(b, [alert(step=35), alert(step=42, status="resolved")])
    assert [n.status for n in plan.notices] == ["firing", "resolved"]


def test_several_firings_of_one_problem_in_a_batch_make_one_notice() -> None:
    """First firing and a repeat in the same batch: one notice, the latest."""
    b = book()
    plan, records = run_through(b, [alert(step=10), alert(step=60, n=1)])
    assert [n.step for n in plan.notices] == [60]
    assert transitions(records) == [("firing", True)]


# ------------------------------------------------------------------------------ retention

def test_a_quiet_book_is_retirable_only_after_the_retention_and_never_while_open() -> None:
    b = book(book_retention_s=100.0)
    run_through(b, [alert(step=10)], now=1000.0)  # firing, notified: an open episode
    assert b.runs[RUN].open and b.runs[RUN].touched == 1000.0
    assert not b.retirable(RUN, now=10_000.0)  # open: kept however old
    run_through(b, [alert(step=12, status="resolved")], now=1050.0)
    run = b.runs[RUN]
    assert not run.open and run.touched == 1050.0
    assert not b.retirable(RUN, now=1149.0)
    assert b.retirable(RUN, now=1150.0)
    assert not b.retirable("never/seen", now=1e9)


def test_a_staged_notice_keeps_the_book_and_settling_refreshes_its_age() -> None:
    b = book(book_retention_s=10.0)
    plan = b.observe([alert(step=3)], now=0.0)
    b.stage(plan)
    b.settle(plan, {n.id for n in plan.notices}, now=0.5)
    resolved = b.observe([alert(step=4, status="resolved")], now=1.0)
    b.stage(resolved)  # the resolved notice is staged, not settled (a crash here)
    assert b.runs[RUN].outbox and not b.runs[RUN].episodes
    assert not b.retirable(RUN, now=500.0)
    b.settle(resolved, {n.id for n in resolved.notices}, now=600.0)
    assert not b.runs[RUN].outbox and b.runs[RUN].touched == 600.0
    assert not b.retirable(RUN, now=605.0) and b.retirable(RUN, now=610.0)


def test_the_age_survives_the_table_and_an_old_book_counts_from_when_it_is_read() -> None:
    b = book(book_retention_s=60.0)
    run_through(b, [alert(step=1), alert(step=2, status="resolved")], now=500.0)
    raw = json.loads(json.dumps(b.dump(RUN)))
    assert raw["touched"] == 500.0
    restored = book(book_retention_s=60.0)
    restored.restore(RUN, raw)
    assert restored.runs[RUN].touched == 500.0 and restored.retirable(RUN, now=560.0)
    del raw["touched"]  # written before books recorded their age
    old = book(book_retention_s=60.0)
    old.restore(RUN, raw)
    assert not old.retirable(RUN, now=9_000.0)  # unknown age: counted from now
    assert not old.retirable(RUN, now=9_059.0) and old.retirable(RUN, now=9_060.0)


def test_a_fresh_book_after_retirement_notifies_the_next_problem() -> None:
    b = book(book_retention_s=1.0)
    run_through(b, [alert(step=1), alert(step=2, status="resolved")], now=0.0)
    assert b.retirable(RUN, now=5.0)
    b.runs.pop(RUN)
    plan, records = run_through(b, [alert(step=40)], now=6.0)
    assert [n.id for n in plan.notices] == [f"{RUN}|nan_loss|40|firing|0"]
    assert transitions(records) == [("firing", True)]


@pytest.mark.parametrize("bad", [0.0, -5.0])
def test_book_retention_must_be_positive(bad: float) -> None:
    with pytest.raises(ConfigError, match="TRAINSENTRY_ALERT_BOOK_RETENTION_S"):
        LifecycleConfig(book_retention_s=bad)


# ------------------------------------------------------------------------------ breaker notices

def _order(step: int = 12, diagnosis: str = "nan_loss", **kw: Any) -> AlertEvent:
    """The engine's notice of a breaker command: an alert of the lead problem with ``command``."""
    return alert(diagnosis, step=step, n=99,
                 command={"id": "cmd1", "action": "rollback", "to_step": 5, "sent": True}, **kw)


def test_a_breaker_notice_goes_out_at_once_escalated_even_when_acknowledged() -> None:
    b = book(repeat_interval_s=3600.0, escalate_after=0)
    run_through(b, [alert(step=10)], now=100.0)  # notified
    fp = f"fp:{RUN}:nan_loss"
    acks = {fp: Ack(fingerprint=fp, run_id=RUN, alert_id=f"{RUN}|nan_loss|10|firing|0",
                    created_at=110.0, created_by="alice")}
    plan, records = run_through(b, [alert(step=11, n=1)], now=120.0, acks=acks)
    assert plan.notices == []  # acknowledged and within the repeat interval: held
    plan, records = run_through(b, [_order()], now=130.0, acks=acks)
    assert [(n.command or {}).get("id") for n in plan.notices] == ["cmd1"]
    assert plan.notices[0].escalated and transitions(records) == [("escalated", True)]


def test_a_breaker_notice_is_sent_even_when_its_problem_is_inhibited() -> None:
    b = book()
    plan, _ = run_through(b, [alert("nan_loss"), alert("gradient_instability",
                                                        severity="warning")])
    assert [n.diagnosis for n in plan.notices] == ["nan_loss"]
    plan, _ = run_through(b, [_order(diagnosis="gradient_instability")], now=150.0)
    assert [n.diagnosis for n in plan.notices] == ["gradient_instability"]
    assert plan.notices[0].command is not None


def test_a_silence_holds_a_breaker_notice_and_a_first_notice_is_escalated() -> None:
    b = book()
    plan, records = run_through(b, [_order()], silences=[silence(f"run_id={RUN}")])
    assert plan.notices == [] and transitions(records) == [("silenced", False)]
    other = book()
    plan, records = run_through(other, [_order()])  # no earlier notice of the problem
    assert len(plan.notices) == 1 and plan.notices[0].escalated
    assert transitions(records) == [("firing", True)]


@pytest.mark.parametrize("outcome, paged", [("applied", False), ("rejected", True)])
def test_the_trainers_answer_is_sent_and_pages_only_when_refused(outcome: str,
                                                                  paged: bool) -> None:
    b = book(repeat_interval_s=3600.0, escalate_after=0)
    run_through(b, [alert(step=10)], now=100.0)
    answer = alert(step=13, n=98, command={"id": "cmd1", "action": "stop", "outcome": outcome})
    plan, records = run_through(b, [answer], now=110.0)  # within the repeat interval
    assert len(plan.notices) == 1 and plan.notices[0].escalated is paged
