"""The simulator: determinism, contract-valid events, healthy cadence and fault signatures."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producers.layers import layer_of
from trainsentry.events import MetricEvent, RunEvent, decode_event
from trainsentry.simulate import (
    FAULT_LABELS,
    SCENARIO_LABELS,
    Scenario,
    add_cli,
    event_kind,
    generate,
    generate_file_logger_lines,
    publish,
    random_scenario,
    scheduled_lr,
    write_jsonl,
)

ONSET = 30
Events = list[dict[str, Any]]


def make(fault: str | None = None, **kw: Any) -> Scenario:
    """A small scenario factory: 60 steps, 8 ranks, fault at step 30."""
    params: dict[str, Any] = dict(run_id="t", seed=7, steps=60, ranks=8, fault=fault,
                                  fault_onset=ONSET, test_freq=10, save_freq=20)
    params.update(kw)
    return Scenario(**params)


def driver(events: Events, key: str) -> dict[int, float]:
    """The driver-level (rank-less) series of one metric, by step, decoded."""
    out: dict[int, float] = {}
    for e in events:
        if "metrics" in e and "rank" not in e and key in e["metrics"]:
            out[e["step"]] = MetricEvent.from_dict(e).metrics[key]
    return out


def per_rank(events: Events, key: str, rank: int | None = None) -> dict[int, float]:
    """A per-rank series averaged over ranks (or of one rank), by step."""
    acc: dict[int, list[float]] = {}
    for e in events:
        if (e.get("rank") is not None and "metrics" in e and key in e["metrics"]
                and (rank is None or e["rank"] == rank)):
            acc.setdefault(e["step"], []).append(float(e["metrics"][key]))
    return {s: float(np.mean(v)) for s, v in acc.items()}


def before(series: dict[int, float], lo: int = 5) -> list[float]:
    return [v for s, v in series.items() if lo <= s < ONSET]


def late(series: dict[int, float], first: int = ONSET + 6) -> list[float]:
    return [v for s, v in series.items() if s >= first]


@pytest.fixture(scope="module")
def runs() -> Callable[[str | None], Events]:
    """Generated runs by fault, cached for the module."""
    cache: dict[str | None, Events] = {}

    def get(fault: str | None) -> Events:
        if fault not in cache:
            cache[fault] = generate(make(fault))
        return cache[fault]

    return get


# --------------------------------------------------------------------------- basics


def test_same_seed_gives_identical_events() -> None:
    """Generation is a pure function of the scenario."""
    assert generate(make("straggler")) == generate(make("straggler"))
    assert generate_file_logger_lines(make()) == generate_file_logger_lines(make())


def test_different_seed_gives_different_events() -> None:
    """The seed matters."""
    assert generate(make(seed=1)) != generate(make(seed=2))


@pytest.mark.parametrize("fault", FAULT_LABELS)
def test_fault_run_equals_healthy_run_before_onset(fault: str, runs: Callable[[str | None], Events]) -> None:
    """Per-step random streams keep everything before the onset identical to the healthy run."""
    healthy = [e for e in runs(None) if e.get("step", ONSET) < ONSET - 1]
    faulty = [e for e in runs(fault) if e.get("step", ONSET) < ONSET - 1]
    assert len(healthy) > 500 and faulty == healthy


@pytest.mark.parametrize("label", SCENARIO_LABELS)
def test_every_event_validates_against_the_contract(label: str, runs: Callable[[str | None], Events]) -> None:
    """Each event decodes with trainsentry.events and is JSON-safe."""
    events = runs(None if label == "healthy" else label)
    for e in events:
        decoded = decode_event(json.loads(json.dumps(e, allow_nan=False)))
        if isinstance(decoded, MetricEvent):
            assert decoded.layer in ("data", "compute", "resource")
        else:
            assert isinstance(decoded, RunEvent)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    assert events[0]["type"] == "run_started"
    assert events[-1]["type"] == "run_finished"


def test_driver_metrics_are_split_by_layers_mapping(runs: Callable[[str | None], Events]) -> None:
    """Rank-less MetricEvents follow producers.layers; per-rank events are resource."""
    for e in runs(None):
        if "metrics" not in e:
            continue
        if "rank" in e:
            assert e["layer"] == "resource" and e["host"] == f"node-{e['rank'] // 8}"
        else:
            assert all(layer_of(k) == e["layer"] for k in e["metrics"])


def test_run_started_carries_flat_verl_config(runs: Callable[[str | None], Events]) -> None:
    """The config has the lr schedule and cadence under verl's flattened keys, no fault hint."""
    cfg = runs("lr_drift")[0]["config"]
    assert cfg["actor_rollout_ref.actor.optim.lr"] == 1e-6
    assert cfg["actor_rollout_ref.actor.optim.lr_warmup_steps"] == 0
    assert cfg["actor_rollout_ref.actor.optim.warmup_style"] == "constant"
    assert cfg["trainer.total_training_steps"] == 60
    assert cfg["trainer.save_freq"] == 20 and cfg["trainer.test_freq"] == 10
    assert cfg["n_gpus"] == 8
    assert all(not isinstance(v, (dict, list)) for v in cfg.values())
    assert "lr_drift" not in json.dumps(cfg)


def test_grpo_and_ppo_carry_their_own_keys() -> None:
    """GRPO logs kl_loss; PPO logs critic, values timing, returns and the reward KL."""
    grpo = generate(make())
    ppo = generate(make(algorithm="ppo"))
    assert driver(grpo, "actor/kl_loss") and not driver(grpo, "critic/vf_loss")
    for key in ("critic/vf_loss", "critic/grad_norm", "timing_s/values", "critic/returns/mean",
                "actor/reward_kl_penalty"):
        assert len(driver(ppo, key)) == 60, key


# --------------------------------------------------------------------------- healthy run


def test_healthy_run_validates_and_saves_at_configured_frequencies(runs: Callable[[str | None], Events]) -> None:
    """timing_s/testing on every 10th step, saves and checkpoint events every 20th."""
    events = runs(None)
    assert sorted(driver(events, "timing_s/testing")) == [10, 20, 30, 40, 50, 60]
    assert sorted(driver(events, "timing_s/save_checkpoint")) == [20, 40, 60]
    ckpts = [e for e in events if e.get("type") == "checkpoint_saved"]
    assert [(c["step"], c["path"]) for c in ckpts] == [
        (s, f"/checkpoints/t/global_step_{s}") for s in (20, 40, 60)]
    assert driver(events, "val-core/openai/gsm8k/acc/mean@1").keys() == {0, 10, 20, 30, 40, 50, 60}


def test_healthy_run_step_time_spikes_on_validation_steps(runs: Callable[[str | None], Events]) -> None:
    """Validation (and saving) show up as step-time spikes; plain steps stay near the mean."""
    step = driver(runs(None), "timing_s/step")
    plain = [v for s, v in step.items() if s > 1 and s % 10]
    assert 14.0 < float(np.median(plain)) < 26.0
    assert all(step[s] > 1.3 * float(np.median(plain)) for s in (10, 20, 30))


def test_healthy_run_learns(runs: Callable[[str | None], Events]) -> None:
    """Reward rises, entropy falls slowly, KL stays small, nothing is NaN."""
    events = runs(None)
    score = list(driver(events, "critic/score/mean").values())
    ent = list(driver(events, "actor/entropy").values())
    assert np.mean(score[-10:]) > np.mean(score[:10])
    assert np.mean(ent[-10:]) < np.mean(ent[:10])
    assert max(driver(events, "actor/kl_loss").values()) < 0.3
    assert all(math.isfinite(v) for v in driver(events, "actor/grad_norm").values())


def test_every_rank_reports_resources_and_heartbeat_each_step(runs: Callable[[str | None], Events]) -> None:
    """One resource event and one heartbeat per rank per step, with the per-rank step time."""
    events = runs(None)
    res = [e for e in events if e.get("rank") is not None and "metrics" in e]
    hb = [e for e in events if e.get("type") == "heartbeat"]
    assert len(res) == len(hb) == 60 * 8
    keys = {"gpu/utilization_pct", "gpu/memory_used_gb", "gpu/memory_total_gb",
            "system/cpu_load_avg", "system/disk_io_wait_ms", "timing_s/rank_step"}
    assert all(keys <= e["metrics"].keys() for e in res)
    assert {(e["host"], e["rank"]) for e in hb} == {(f"node-{r // 8}", r) for r in range(8)}


def test_zero_gradient_steps_are_a_healthy_grpo_case() -> None:
    """With zero_grad_prob, some steps have exactly zero gradient and advantages."""
    events = generate(make(zero_grad_prob=0.3))
    zeros = [s for s, v in driver(events, "actor/grad_norm").items() if v == 0.0]
    assert 5 <= len(zeros) <= 35
    adv = driver(events, "critic/advantages/max")
    assert all(adv[s] == 0.0 for s in zeros)


def test_lr_follows_warmup_cosine_and_milestones() -> None:
    """The logged lr is exactly the configured schedule, planned steps included."""
    sc = make(lr_warmup_steps=10, lr_schedule="cosine", lr_milestones=((40, 0.5),))
    lr = driver(generate(sc), "actor/lr")
    assert lr[1] == 0.0 and lr[6] == pytest.approx(0.5e-6)
    assert lr[11] == pytest.approx(1e-6)
    assert lr[39] > lr[30] * 0.5 and lr[40] == pytest.approx(scheduled_lr(sc, 40))
    assert all(lr[s] == pytest.approx(scheduled_lr(sc, s)) for s in lr)
    assert generate(sc)[0]["config"]["actor_rollout_ref.actor.optim.lr_milestones"] == "40:0.5"


def test_multi_host_scenario_names_nodes() -> None:
    """Ranks map to node-<rank // gpus_per_host>."""
    events = generate(make(ranks=12, steps=3))
    assert {e["host"] for e in events if e.get("type") == "heartbeat"} == {"node-0", "node-1"}
    assert events[0]["config"]["trainer.nnodes"] == 2


# --------------------------------------------------------------------------- fault signatures


def test_dataloader_stall_raises_gen_time_and_drops_gpu_util(runs: Callable[[str | None], Events]) -> None:
    """Rollout time up several times, util ~10-30%, io wait up, forward time flat."""
    e = runs("dataloader_stall")
    gen, fwd = driver(e, "timing_s/gen"), driver(e, "timing_s/old_log_prob")
    util, io = per_rank(e, "gpu/utilization_pct"), per_rank(e, "system/disk_io_wait_ms")
    assert min(late(gen)) > 3 * np.mean(before(gen))
    assert 8 <= np.mean(late(util)) <= 32 and min(before(util)) > 60
    assert min(late(io)) > 5 * max(before(io))
    assert np.mean(late(fwd)) < 1.2 * np.mean(before(fwd))


def test_kl_drift_climbs_past_half_one_sidedly(runs: Callable[[str | None], Events]) -> None:
    """KL to the reference stays small before, passes 0.5 and keeps climbing after."""
    kl = driver(runs("kl_drift"), "actor/kl_loss")
    assert max(before(kl)) < 0.3
    tail = late(kl, ONSET + 12)
    assert tail[0] > 0.5 and tail[-1] > 2 * tail[0]
    assert all(b > a for a, b in zip(tail, tail[3:], strict=False))


def test_numeric_underflow_empties_responses(runs: Callable[[str | None], Events]) -> None:
    """Aborted ratio over 10% and response length collapsed."""
    e = runs("numeric_underflow")
    ab, ln = driver(e, "response/aborted_ratio"), driver(e, "response_length/mean")
    assert max(before(ab)) == 0.0 and min(late(ab)) > 0.1
    assert max(late(ln)) < 0.4 * np.mean(before(ln))


def test_comm_degradation_jumps_weight_sync(runs: Callable[[str | None], Events]) -> None:
    """update_weights time several times its baseline and over 0.5 s above it."""
    uw = driver(runs("comm_degradation"), "timing_s/update_weights")
    base = float(np.mean(before(uw)))
    assert min(late(uw)) > 3 * base and min(late(uw)) - base > 0.5


def test_memory_leak_climbs_step_after_step(runs: Callable[[str | None], Events]) -> None:
    """GPU memory and actor peak memory rise monotonically after the onset."""
    e = runs("memory_leak")
    mem, actor = per_rank(e, "gpu/memory_used_gb"), driver(e, "actor/perf/max_memory_allocated_gb")
    tail = late(mem, ONSET)
    assert np.ptp(before(mem)) < 1.0
    assert all(b > a for a, b in zip(tail, tail[1:], strict=False)) and tail[-1] > tail[0] + 4
    assert late(actor)[-1] > max(before(actor)) + 4


def test_memory_leak_ends_in_oom_when_it_reaches_capacity() -> None:
    """A strong leak fills the GPU and the run finishes with a non-zero exit code."""
    events = generate(make("memory_leak", fault_severity=2.0, steps=100))
    last = events[-1]
    assert last["type"] == "run_finished" and last["exit_code"] == 1
    assert max(per_rank(events, "gpu/memory_used_gb").values()) > 0.95 * 80
    assert max(driver(events, "timing_s/step")) < 100


def test_nan_loss_writes_nan_from_onset(runs: Callable[[str | None], Events]) -> None:
    """NaN grad norm and loss at the onset, none before; NaN travels as the string "nan"."""
    e = runs("nan_loss")
    g, loss = driver(e, "actor/grad_norm"), driver(e, "actor/pg_loss")
    assert all(math.isfinite(v) for s, v in g.items() if s < ONSET)
    assert math.isnan(g[ONSET]) and math.isnan(loss[ONSET])
    raw = [x for x in e if x.get("step") == ONSET and "actor/grad_norm" in x.get("metrics", {})]
    assert raw[0]["metrics"]["actor/grad_norm"] == "nan"


def test_training_hang_stops_steps_but_heartbeats_continue(runs: Callable[[str | None], Events]) -> None:
    """No step metrics from the onset; heartbeats keep the last step, time keeps moving."""
    e = runs("training_hang")
    assert max(driver(e, "timing_s/step")) == ONSET - 1
    last_step_ts = max(x["ts"] for x in e if "rank" not in x and x.get("layer") == "compute")
    later_hb = [x for x in e if x.get("type") == "heartbeat" and x["ts"] > last_step_ts + 5]
    assert len(later_hb) >= 10 * 8 and {x["step"] for x in later_hb} == {ONSET - 1}
    assert max(x["ts"] for x in later_hb) > last_step_ts + 10 * 15
    late_util = [x["metrics"]["gpu/utilization_pct"] for x in e
                 if x.get("rank") is not None and "metrics" in x and x["ts"] > last_step_ts + 5]
    assert all(u <= 3 for u in late_util) or all(u >= 97 for u in late_util)
    assert e[-1]["type"] == "run_finished" and e[-1]["exit_code"] != 0


def test_straggler_rank_is_slow_while_peers_wait(runs: Callable[[str | None], Events]) -> None:
    """The named rank's own step time doubles; peers stay on time with lower util."""
    e = runs("straggler")
    slow, peer = per_rank(e, "timing_s/rank_step", 7), per_rank(e, "timing_s/rank_step", 0)
    assert all(abs(slow[s] / peer[s] - 1) < 0.05 for s in range(1, ONSET))
    assert all(slow[s] / peer[s] > 1.8 for s in range(ONSET + 3, 61))
    assert np.mean(late(peer)) < 1.1 * np.mean(before(peer))
    util_peer, util_slow = per_rank(e, "gpu/utilization_pct", 0), per_rank(e, "gpu/utilization_pct", 7)
    assert np.mean(late(util_peer)) < 0.7 * np.mean(late(util_slow))


def test_gradient_instability_explodes_grad_norm_variance(runs: Callable[[str | None], Events]) -> None:
    """The 3-step std of grad_norm exceeds twice its historical mean in most late windows."""
    g = driver(runs("gradient_instability"), "actor/grad_norm")
    hist = float(np.mean(before(g)))
    vals = late(g, ONSET + 3)
    hits = [np.std(vals[i:i + 3]) > 2 * hist for i in range(len(vals) - 2)]
    assert np.mean(hits) > 0.4
    pre = before(g)
    pre_hits = [np.std(pre[i:i + 3]) > 2 * hist for i in range(len(pre) - 2)]
    assert np.mean(pre_hits) < 0.15


def test_lr_drift_leaves_schedule_by_more_than_ten_percent(runs: Callable[[str | None], Events]) -> None:
    """lr equals the schedule before the onset and is off by >10% after it."""
    e = runs("lr_drift")
    sc = make("lr_drift")
    lr = driver(e, "actor/lr")
    assert all(lr[s] == pytest.approx(scheduled_lr(sc, s)) for s in lr if s < ONSET)
    assert all(abs(lr[s] / scheduled_lr(sc, s) - 1) > 0.1 for s in lr if s >= ONSET + 1)


def test_entropy_collapse_drops_entropy_with_reward_up(runs: Callable[[str | None], Events]) -> None:
    """Entropy falls to ~0.2x within a few steps while reward rises and KL accelerates."""
    e = runs("entropy_collapse")
    ent, score = driver(e, "actor/entropy"), driver(e, "critic/score/mean")
    kl = driver(e, "actor/kl_loss")
    assert ent[ONSET + 4] < 0.3 * ent[ONSET - 1]
    assert np.mean(late(score)) > np.mean(before(score, ONSET - 5))
    assert kl[59] - kl[50] > kl[ONSET - 1] - kl[ONSET - 10]


@pytest.mark.parametrize("onset", [ONSET, 1])
def test_stalled_learning_has_no_learning_signal(onset: int) -> None:
    """Constant reward, zero advantages and gradient, clip ratio ~1, also dead from step 1."""
    e = generate(make("stalled_learning", fault_onset=onset))
    smin, smax = driver(e, "critic/score/min"), driver(e, "critic/score/max")
    g, clip = driver(e, "actor/grad_norm"), driver(e, "response_length/clip_ratio")
    adv = driver(e, "critic/advantages/max")
    for s in range(onset, 61):
        assert smin[s] == smax[s] and g[s] == 0.0 and adv[s] == 0.0 and clip[s] > 0.97
    if onset > 1:
        assert all(g[s] > 0 for s in range(2, onset)) and max(before(clip)) < 0.2


def test_faults_ramp_with_severity() -> None:
    """A stronger fault gives a stronger signature."""
    weak = driver(generate(make("comm_degradation", fault_severity=0.7)), "timing_s/update_weights")
    strong = driver(generate(make("comm_degradation", fault_severity=2.0)), "timing_s/update_weights")
    assert np.mean(late(strong)) > 1.5 * np.mean(late(weak))


# --------------------------------------------------------------------------- outputs, helpers


def test_file_logger_lines_write_nan_as_null() -> None:
    """verl's layout: {"step", "data"}, NaN as null, step 0 validation only."""
    lines = [json.loads(x) for x in generate_file_logger_lines(make("nan_loss"))]
    assert [x["step"] for x in lines] == list(range(0, 61))
    assert set(lines[0]["data"]) == {"val-core/openai/gsm8k/acc/mean@1",
                                     "val-aux/openai/gsm8k/reward/mean@1"}
    onset = lines[ONSET]["data"]
    assert onset["actor/grad_norm"] is None and onset["actor/pg_loss"] is None
    assert "gpu/utilization_pct" not in onset and "timing_s/step" in onset


def test_write_jsonl_round_trips(tmp_path: Any) -> None:
    """Written lines decode back to the same events."""
    events = generate(make(steps=5))
    path = tmp_path / "run.jsonl"
    assert write_jsonl(events, path) == len(events)
    assert [json.loads(x) for x in path.read_text().splitlines()] == events


def test_publish_routes_by_kind_and_paces_by_speed() -> None:
    """send gets data/compute/resource/run; sleeps are ts gaps divided by speed."""
    events = generate(make(steps=4, ranks=2))
    sent: list[tuple[str, dict[str, Any]]] = []
    sleeps: list[float] = []
    n = publish(events, send=lambda k, e: sent.append((k, e)), speed=10.0, sleep=sleeps.append)
    assert n == len(events) and [e for _, e in sent] == events
    assert {k for k, _ in sent} == {"data", "compute", "resource", "run"}
    assert all(k == event_kind(e) for k, e in sent)
    assert sum(sleeps) == pytest.approx((events[-1]["ts"] - events[0]["ts"]) / 10.0)
    fast: list[float] = []
    publish(events, send=lambda k, e: None, sleep=fast.append)
    assert fast == []


def test_random_scenarios_vary_within_ranges() -> None:
    """random_scenario samples varied, valid scenarios, deterministically from the rng."""
    rng = np.random.default_rng(0)
    scs = [random_scenario(rng) for _ in range(40)]
    assert {s.label for s in scs} > {"healthy"}
    for s in scs:
        assert 150 <= s.steps <= 600 and 1 <= s.ranks <= 16 and 5 <= s.step_time_s <= 60
        assert 0.7 <= s.fault_severity <= 2.0 and 1 <= s.onset <= s.steps
    again = [random_scenario(np.random.default_rng(0)) for _ in range(1)]
    assert again[0] == scs[0]
    assert random_scenario(1, fault="straggler").ranks >= 2
    assert random_scenario(1, fault="healthy", steps=10).fault is None


def test_scenario_rejects_unknown_fault() -> None:
    """An unknown label is an error that lists the valid ones."""
    with pytest.raises(ValueError, match="dataloader_stall"):
        Scenario(fault="gremlins")


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainsentry")
    add_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_writes_events_and_verl_lines(tmp_path: Any) -> None:
    """`trainsentry simulate` writes contract events or verl file-logger lines."""
    out = tmp_path / "ev.jsonl"
    args = _cli(["simulate", "--fault", "nan_loss", "--steps", "20", "--onset", "10",
                 "--ranks", "2", "--seed", "3", "--out", str(out)])
    assert args.func(args) == 0
    events = [json.loads(x) for x in out.read_text().splitlines()]
    assert events[0]["run_id"] == "sim-nan_loss-3"
    verl = tmp_path / "verl.jsonl"
    args = _cli(["simulate", "--steps", "5", "--format", "verl", "--out", str(verl)])
    assert args.func(args) == 0
    assert json.loads(verl.read_text().splitlines()[-1])["step"] == 5


def test_cli_unknown_label_lists_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --fault exits 2 and names the valid labels."""
    args = _cli(["simulate", "--fault", "gremlins"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "gremlins" in err and "stalled_learning" in err


@pytest.mark.parametrize("command", [["simulate", "--fault", "nan_loss", "--steps", "400"],
                                     ["detect", "RUN"], ["score", "CSV"]])
def test_cli_stops_quietly_when_the_reader_goes_away(tmp_path: Path, command: list[str]) -> None:
    """``trainsentry … | head -1``: no traceback when the pipe closes early, exit 141."""
    import subprocess
    import sys

    run = tmp_path / "run.jsonl"
    write_jsonl(generate(make("nan_loss", steps=400, ranks=2)), run)
    csv = tmp_path / "series.csv"
    csv.write_text("timestamp,value\n" + "".join(
        f"2024-01-01 {i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{i % 7}\n" for i in range(20000)))
    argv = [str(run) if a == "RUN" else str(csv) if a == "CSV" else a for a in command]
    proc = subprocess.Popen([sys.executable, "-m", "trainsentry.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    rc = proc.wait(120)
    assert first.strip(), "the command printed nothing before the pipe closed"
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 141, (rc, err)
