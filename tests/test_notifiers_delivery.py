"""The deliverer: rate limits, digests instead of drops, retries, configuration errors, health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from notifiers import (
    ConfigurationError,
    Deliverer,
    DingTalk,
    MessageRejected,
    RetryPolicy,
    SlidingWindowLimiter,
    Throttled,
    TransientError,
    WeCom,
)
from trainsentry.errors import ConfigError
from trainsentry.events import AlertEvent

FAST = RetryPolicy(initial_s=0.02, max_backoff_s=0.2, max_total_s=30.0)

# The robot-server fixtures (dingtalk_server, wecom_server and their factories). The module
# is registered for assert rewriting before it is imported, as pytest does for plugins.
pytest.register_assert_rewrite("tests.chat_servers")
pytest_plugins = ["tests.chat_servers"]
from tests.chat_servers import FakeDingTalk, FakeWeCom, make_alert  # noqa: E402


class FakeClock:
    """A clock and a sleep that only move when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class MemoryRobot:
    """An in-memory receiver that records (time, alerts) per send and fails on request."""

    def __init__(self, clock: FakeClock, name: str = "mem", max_batch: int = 20) -> None:
        self.name = name
        self.max_batch = max_batch
        self.clock = clock
        self.sent: list[tuple[float, list[AlertEvent]]] = []
        self.errors: list[Exception] = []

    async def send_alerts(self, alerts: Sequence[AlertEvent]) -> None:
        await asyncio.sleep(0)
        if self.errors:
            raise self.errors.pop(0)
        self.sent.append((self.clock(), list(alerts)))


def _max_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best = j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


# -- building blocks -----------------------------------------------------------------------


def test_sliding_window_allows_n_per_window() -> None:
    """The limiter allows max_events, then asks to wait until the oldest leaves the window."""
    clock = FakeClock()
    lim = SlidingWindowLimiter(max_events=3, window_s=10.0, clock=clock)
    for _ in range(3):
        assert lim.wait_time() == 0
        lim.record()
        clock.now += 1
    assert lim.wait_time() == pytest.approx(7.0)
    clock.now += 7
    assert lim.wait_time() == 0


def test_backoff_grows_is_capped_and_jittered() -> None:
    """Backoff doubles, stops at max_backoff_s, and jitter only shortens it."""
    p = RetryPolicy(initial_s=1, multiplier=2, max_backoff_s=10, jitter=0.5)
    assert [p.backoff(n, lambda: 0.0) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 8, 10, 10]
    assert p.backoff(3, lambda: 1.0) == 2.0


def test_receiver_names_must_be_unique() -> None:
    """Two receivers with one name would share health and limits: refused."""
    clock = FakeClock()
    with pytest.raises(ConfigError):
        Deliverer(receivers=[MemoryRobot(clock), MemoryRobot(clock)])


# -- with a fake clock: the real 20-per-60-s window ----------------------------------------


async def test_burst_of_200_in_a_minute_is_merged_never_dropped_fake_clock() -> None:
    """200 alerts within a minute reach a robot in ≤ 20 messages per 60 s, none dropped."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep, retry=FAST) as d:
        tasks = []
        for i in range(200):
            tasks.append(asyncio.create_task(d.deliver([make_alert(id=f"a{i}")])))
            await clock.sleep(0.3)  # 200 alerts over 60 s
        results = await asyncio.gather(*tasks)
    assert all(r.ok for r in results)
    sent_ids = [a.id for _, batch in robot.sent for a in batch]
    assert sorted(sent_ids) == sorted(f"a{i}" for i in range(200))
    assert _max_in_window([t for t, _ in robot.sent], 60.0) <= 20
    assert len(robot.sent) < 200  # merged into digests
    assert max(len(b) for _, b in robot.sent) <= robot.max_batch


async def test_throttle_waits_at_least_one_rate_slot() -> None:
    """A robot's throttle answer waits at least window/limit, even when the backoff is shorter."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [Throttled("mem: errcode 130101", errcode=130101)]
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep, retry=FAST) as d:
        start = clock.now
        result = await d.deliver([make_alert()])
    assert result.ok
    assert robot.sent[0][0] - start >= 60.0 / 20


async def test_down_for_ten_minutes_still_gets_everything_fake_clock() -> None:
    """With the default 15-minute bound, a webhook down for 10 minutes gets every alert."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [TransientError("down")] * 1000

    async def heal() -> None:
        while clock.now < 1000.0 + 600:
            await asyncio.sleep(0)
        robot.errors.clear()

    healer = asyncio.create_task(heal())
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep) as d:
        result = await d.deliver([make_alert(id=f"a{i}") for i in range(5)])
    await healer
    assert result.ok and clock.now - 1000.0 >= 600
    assert sum(len(b) for _, b in robot.sent) == 5


async def test_retries_stop_at_the_total_time_bound() -> None:
    """A webhook that never recovers is given up after max_total_s (kind gave_up, settled)."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [TransientError("down")] * 10_000
    policy = RetryPolicy(initial_s=1, max_backoff_s=60, max_total_s=900)
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep, retry=policy) as d:
        result = await d.deliver([make_alert()])
        health = d.health()["mem"]
    assert [f.kind for f in result.failed] == ["gave_up"] and result.settled
    assert 900 <= clock.now - 1000.0 <= 900 + 1
    assert health["failed"] == 1 and health["retries"] > 5


async def test_rejected_message_fails_only_that_message() -> None:
    """MessageRejected fails the batch without retry and leaves the receiver usable."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [MessageRejected("too long")]
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep) as d:
        first = await d.deliver([make_alert(id="x")])
        second = await d.deliver([make_alert(id="y")])
        assert d.health()["mem"]["state"] == "ok"
    assert [f.kind for f in first.failed] == ["rejected"]
    assert second.ok


async def test_after_a_config_error_alerts_fail_fast_until_recheck() -> None:
    """Alerts for a misconfigured receiver fail at once, and it is tried again after the recheck period."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [ConfigurationError("mem: errcode 300001")]
    async with Deliverer(receivers=[robot], clock=clock, sleep=clock.sleep,
                         config_recheck_s=600) as d:
        assert not (await d.deliver([make_alert(id="1")])).ok
        again = await d.deliver([make_alert(id="2")])
        assert [f.kind for f in again.failed] == ["config_error"]
        assert d.health()["mem"]["attempts"] == 1
        clock.now += 601
        assert (await d.deliver([make_alert(id="3")])).ok
        assert d.health()["mem"]["state"] == "ok"


async def test_one_bad_receiver_does_not_hold_back_the_other() -> None:
    """Each receiver has its own lane: one's failure is reported, the other's alerts arrive."""
    clock = FakeClock()
    good, bad = MemoryRobot(clock, "good"), MemoryRobot(clock, "bad")
    bad.errors = [ConfigurationError("bad: errcode 93000")]
    async with Deliverer(receivers=[good, bad], clock=clock, sleep=clock.sleep) as d:
        result = await d.deliver([make_alert()])
    assert result.delivered["good"] == ("a-0001",) and result.delivered["bad"] == ()
    assert [f.receiver for f in result.failed] == ["bad"]


async def test_closing_fails_queued_alerts_as_not_settled() -> None:
    """Alerts still queued when the deliverer closes fail with kind closed: do not commit them."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [TransientError("down")] * 1000
    d = Deliverer(receivers=[robot], retry=RetryPolicy(initial_s=10))
    task = asyncio.create_task(d.deliver([make_alert()]))
    await asyncio.sleep(0.05)
    await d.aclose()
    result = await task
    assert [f.kind for f in result.failed] == ["closed"] and not result.settled


async def test_deliver_with_no_receivers_returns_at_once() -> None:
    """No configured webhook: deliver is a no-op that reports success."""
    async with Deliverer(receivers=[]) as d:
        assert (await d.deliver([make_alert()])).ok


# -- against the real local robots ---------------------------------------------------------


async def test_burst_of_200_reaches_both_robots_within_their_rate_limit(
        dingtalk_server_factory, wecom_server_factory) -> None:  # type: ignore[no-untyped-def]
    """200 alerts in one (time-scaled) minute reach both robots, merged, none dropped, ≤ 20 per window."""
    window = 1.0  # one "minute" of the robots' rate limit, scaled to a second
    dt_server: FakeDingTalk = await dingtalk_server_factory(window_s=window)
    wc_server: FakeWeCom = await wecom_server_factory(window_s=window)
    robots = [DingTalk(url=dt_server.url, secret=dt_server.secret),
              WeCom(url=wc_server.url)]
    async with Deliverer(receivers=robots, window_s=window, retry=FAST) as d:
        async def one(i: int) -> bool:
            await asyncio.sleep(i * window / 200)
            alert = make_alert(id=f"a{i}", run_id=f"burst-run-{i:03d}", fingerprint=f"fp{i}")
            return (await d.deliver([alert])).ok
        started = time.monotonic()
        oks = await asyncio.gather(*(one(i) for i in range(200)))
        health = d.health()
    assert all(oks)
    assert time.monotonic() - started < 20
    for server, name, throttle in ((dt_server, "dingtalk", 130101), (wc_server, "wecom", 45009)):
        text = server.all_text()
        missing = [i for i in range(200) if f"burst-run-{i:03d}" not in text]
        assert missing == [], f"{name} lost {missing}"
        assert server.errcodes()[throttle] == 0  # our limiter kept under the robot's
        assert server.max_in_window() <= 20
        assert len(server.messages) < 200  # digests
        assert health[name]["sent"] == len(server.messages)
        assert health[name]["alerts_sent"] == 200


async def test_retries_on_500_then_succeeds(dingtalk_server: FakeDingTalk) -> None:
    """Three HTTP 500s, then the message is delivered; the retries are counted."""
    dingtalk_server.fail_next(3)
    robot = DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret)
    async with Deliverer(receivers=[robot], retry=FAST) as d:
        result = await d.deliver([make_alert()])
        health = d.health()["dingtalk"]
    assert result.ok
    assert dingtalk_server.statuses() == {500: 3, 200: 1}
    assert health["retries"] == 3 and health["sent"] == 1 and health["state"] == "ok"
    assert len(dingtalk_server.messages) == 1


async def test_robot_down_then_up_gets_the_alerts(wecom_server: FakeWeCom) -> None:
    """Connection refused for a while is retried until the robot is back."""
    robot = WeCom(url=wecom_server.url)
    async with Deliverer(receivers=[robot], retry=FAST) as d:
        comeback = await wecom_server.down_for(0.5)
        result = await d.deliver([make_alert(id="1"), make_alert(id="2", run_id="r2")])
        await comeback
        retries = d.health()["wecom"]["retries"]
    assert result.ok and retries >= 1
    assert "grpo-qwen7b/exp3" in wecom_server.all_text() and "r2" in wecom_server.all_text()


async def test_slow_robot_times_out_and_is_retried(dingtalk_server: FakeDingTalk) -> None:
    """A read timeout is retried; the alert arrives (at least once)."""
    dingtalk_server.delay_s = 0.5
    robot = DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret, timeout=0.2)

    async def speed_up() -> None:
        await asyncio.sleep(0.6)
        dingtalk_server.delay_s = 0.0

    async with Deliverer(receivers=[robot], retry=FAST) as d:
        _, result = await asyncio.gather(speed_up(), d.deliver([make_alert()]))
        assert d.health()["dingtalk"]["retries"] >= 1
    assert result.ok and len(dingtalk_server.messages) >= 1


async def test_500s_for_a_while_then_everything_arrives(
        dingtalk_server: FakeDingTalk) -> None:
    """HTTP 500 for a period: alerts queued meanwhile are sent in digests once it recovers."""
    dingtalk_server.fail_for(0.5)
    robot = DingTalk(url=dingtalk_server.url, secret=dingtalk_server.secret)
    async with Deliverer(receivers=[robot], retry=FAST) as d:
        results = await asyncio.gather(*(d.deliver([make_alert(id=f"{i}", run_id=f"run-{i}")])
                                         for i in range(30)))
    assert all(r.ok for r in results)
    text = dingtalk_server.all_text()
    assert all(f"run-{i}" in text for i in range(30))
    assert len(dingtalk_server.messages) < 30


async def test_time_bound_covers_waiting_for_a_rate_slot() -> None:
    """Failed attempts use up rate slots; waiting for one never stretches past max_total_s."""
    clock = FakeClock()
    robot = MemoryRobot(clock)
    robot.errors = [TransientError("timeout")] * 100
    policy = RetryPolicy(initial_s=0.1, max_total_s=10)
    async with Deliverer(receivers=[robot], max_messages=2, window_s=60, clock=clock,
                         sleep=clock.sleep, retry=policy) as d:
        result = await d.deliver([make_alert()])
    assert [f.kind for f in result.failed] == ["gave_up"]
    assert clock.now - 1000.0 <= 10 + 1e-6
