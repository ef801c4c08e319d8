"""Fault injection on the real broker (bench/chaos.py's scenarios, sized for CI).

Each test runs one scenario end to end against real processes: ``trainsentry serve``
subprocesses, a real Kafka broker (a private one where the broker itself is stopped),
fake chat robots over HTTP. The full-length versions (60 s broker outage, 10 min webhook
outage) are ``python -m bench.chaos``.
"""

from __future__ import annotations

import pytest

from bench import chaos


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkilled_worker_is_replaced_with_its_state_and_no_alert_is_lost_or_repeated(
        kafka_bootstrap: str) -> None:
    """kill -9 after 61 healthy steps; the restarted worker catches a fault that only a warm
    baseline sees, at the same step as the offline engine, exactly once in the chat."""
    result = chaos.worker_kill(kafka_bootstrap, runs=2)
    assert result.lost == 0, result.line()
    assert result.duplicated == 0, result.line()


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_broker_outage_loses_no_record_from_trainers() -> None:
    """A private broker stops for 10 s mid-run: producers buffer and resend, the service
    reconnects and consumes every record once, and both runs are diagnosed."""
    result = chaos.broker_down(down_s=10.0, runs=2, steps=30)
    assert result.lost == 0, result.line()
    assert result.duplicated == 0, result.line()
    assert any("alerts for 2/2 runs" in n for n in result.notes), result.line()


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chat_robots_down_then_back_get_every_alert_once(kafka_bootstrap: str) -> None:
    """DingTalk and WeCom refuse connections while runs turn faulty; after they come back
    each gets every run's alert, none twice."""
    result = chaos.webhook_down(kafka_bootstrap, down_s=8.0, runs=2)
    assert result.lost == 0, result.line()
    assert result.duplicated == 0, result.line()


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_flood_of_malformed_records_is_dead_lettered_with_reasons(kafka_bootstrap: str) -> None:
    """Hypothesis-drawn bad records (not JSON, missing fields, wrong types, bad metric
    values) between good runs: each bad one is in the dead-letter topic with a reason,
    each good run is still diagnosed."""
    result = chaos.malformed(kafka_bootstrap, bad=120, good_runs=2)
    assert result.lost == 0, result.line()
    assert result.duplicated == 0, result.line()
    assert any("diagnosed 2/2" in n for n in result.notes), result.line()


def test_malformed_generator_yields_only_records_the_contract_rejects() -> None:
    """The chaos generator's records are all invalid (so 'all dead-lettered' is the truth)."""
    from trainsentry.errors import EventError
    from trainsentry.events import decode_record

    records = chaos.malformed_records(count=150)
    assert len(records) == 150
    for value, defect in records:
        with pytest.raises(EventError):
            decode_record(value, "metric")
        assert defect


@pytest.mark.slow
def test_trainer_with_unreachable_broker_is_not_slowed_and_memory_is_bounded() -> None:
    """With no broker for the whole run, log() stays in the microseconds (p99 < 50 µs),
    the buffer holds max_buffer steps, every other step is counted as dropped, and memory
    stays flat."""
    result = chaos.trainer_offline(steps=20_000, max_buffer=2_000, budget_us=50.0)
    assert result.lost == 0, result.line()
    p99 = float(result.notes[0].split("p99 ")[1].split("us")[0])
    assert p99 < 50.0, result.line()
    rss = float(result.notes[2].split("+")[1].split(" ")[0])
    assert rss < 20.0, result.line()
