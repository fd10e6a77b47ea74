"""The window split into the jobs' steady pace and its ramp (nodus.accounting.pace_of): what a run of
a few steps charges once (offset stacks' start, an overlap arm's groups ending apart) against what
every further step costs, on hand-made timelines, the simulator and a recorded run's spans."""

import json

import pytest

from nodus.accounting import (own_pace_steps_per_gpu_hour, pace_of, projected_steps_per_gpu_hour,
                              runs_by_gpu, summarize)
from nodus.messages import Span
from nodus.simulate import config_from_args, simulate


def _cycle(job: str, steps: int, period: float, start: float = 0.0, gen: float = 0.6, train: float = 0.3,
           stack: int = 0) -> list[Span]:
    """One job stepping every ``period`` seconds from ``start``: generate, train, publish."""
    out = []
    for k in range(steps):
        t = start + k * period
        out += [Span(job, stack, "generate", t, t + gen, stack, {"step": k, "adapter_version": k}),
                Span(job, stack, "train", t + gen, t + gen + train, stack, {"step": k, "consumed_version": k}),
                Span(job, stack, "publish", t + gen + train, t + period, stack, {"version": k + 1})]
    return out


def test_a_run_in_step_has_no_ramp_and_its_pace_is_its_window():
    run = _cycle("a", 5, 1.0) + _cycle("b", 5, 1.0, stack=1)
    s = summarize([run])
    assert s["pace"]["pace_steps_per_gpu_hour"] == pytest.approx(2 * 3600)  # two jobs, a step a second
    assert s["pace"]["ramp_gpu_s"] == pytest.approx(0.0, abs=1e-9)
    assert s["steps_per_gpu_hour"] == pytest.approx(s["pace"]["pace_steps_per_gpu_hour"])
    assert projected_steps_per_gpu_hour(s, 20) == pytest.approx(2 * 3600)


def test_an_offset_start_is_charged_once():
    # Stack 1 starts 0.6 s late and ends 0.6 s late: 5.6 s of window for 10 steps at 2 steps a second.
    run = _cycle("a", 5, 1.0) + _cycle("b", 5, 1.0, start=0.6, stack=1)
    s = summarize([run])
    assert s["steps_per_gpu_hour"] == pytest.approx(10 / 5.6 * 3600)
    assert s["pace"]["pace_steps_per_gpu_hour"] == pytest.approx(2 * 3600)
    assert s["pace"]["ramp_gpu_s"] == pytest.approx(0.6)
    # 20 steps a job: 0.6 s + 40 steps at 2 a second.
    assert projected_steps_per_gpu_hour(s, 20) == pytest.approx(40 / 20.6 * 3600)
    assert projected_steps_per_gpu_hour(s, 5) == pytest.approx(s["steps_per_gpu_hour"])
    with pytest.raises(ValueError, match="steps_per_job"):
        projected_steps_per_gpu_hour(s, 0)


def test_dedicated_runs_pace_is_the_harmonic_mean_like_the_window():
    # One job a GPU, at 1 and 2 s a step: 10 steps over 5 + 10 GPU-seconds.
    runs = [_cycle("a", 5, 1.0), _cycle("b", 5, 2.0, gen=1.2, train=0.6)]
    s = summarize(runs)
    assert s["pace"]["pace_steps_per_gpu_hour"] == pytest.approx(2 / 3.0 * 3600)
    assert s["pace"]["pace_steps_per_gpu_hour"] == pytest.approx(s["steps_per_gpu_hour"])


def test_no_pace_without_two_generations_a_job():
    s = summarize([_cycle("a", 1, 1.0) + _cycle("b", 3, 1.0, stack=1)])
    assert s["pace"] == {}
    assert projected_steps_per_gpu_hour(s, 20) is None


def test_recorded_spans_split_by_gpu():
    rows = [dict(sp.to_dict(), gpu=0) for sp in _cycle("a", 4, 1.0)]
    rows += [dict(sp.to_dict(), gpu=1) for sp in _cycle("b", 4, 2.0, gen=1.2, train=0.6)]
    p = pace_of(runs_by_gpu(json.loads(json.dumps(rows))))
    assert p["jobs"] == 2 and p["pace_steps_per_gpu_hour"] == pytest.approx(2 / 3.0 * 3600)


def test_simulated_offset_stacks_ramp_is_their_start():
    # The simulator's offset stacks: stack 1 waits for stack 0's first generation, paid once; free
    # stacks start together and pay (almost) nothing.
    kw = dict(jobs=4, policy="shared-sync", sharing="mps", stacks=2, steps=6, seed=1)
    free, off = (simulate(config_from_args(offset_stacks=o, **kw)) for o in (False, True))
    step_s = free["gpu_seconds"] / 6
    assert abs(free["pace"]["ramp_gpu_s"]) < 0.1 * step_s  # the stacks' last steps end apart, no more
    # Offset: about one generation (0.8-1.2 s here against a 3 s step) more, and the pace is the
    # free stacks' within 5% while the window's steps per GPU-hour are not.
    assert 0.2 * step_s < off["pace"]["ramp_gpu_s"] - free["pace"]["ramp_gpu_s"] < step_s
    assert off["pace"]["pace_steps_per_gpu_hour"] == pytest.approx(free["pace"]["pace_steps_per_gpu_hour"], rel=0.05)
    assert off["steps_per_gpu_hour"] < 0.97 * free["steps_per_gpu_hour"]
    assert "pace_ratio_vs_dedicated" in off


def test_jobs_of_different_paces_end_further_apart_with_every_step():
    """Two jobs on one GPU, one stepping every second and one every two: at 10 steps each the fast
    one ends at 10 s and the slow one at 20 s, so the GPU is billed 20 s for 20 steps (own pace).
    The start-and-drain-once projection bills 16.7 s (its 3.3 s of drain at the 5-step size); both
    give the window back at the measured steps, and agree where the jobs go in step."""
    run = _cycle("a", 5, 1.0) + _cycle("b", 5, 2.0, stack=1)
    s = summarize([run])
    assert own_pace_steps_per_gpu_hour([run], 10) == pytest.approx(20 / 20 * 3600)
    assert projected_steps_per_gpu_hour(s, 10) == pytest.approx(20 / (10 - 10 / 1.5 + 20 / 1.5) * 3600)
    assert own_pace_steps_per_gpu_hour([run], 5) == pytest.approx(s["steps_per_gpu_hour"])
    assert own_pace_steps_per_gpu_hour(runs_by_gpu([sp.to_dict() for sp in run]), 10) == pytest.approx(3600)
    even = _cycle("a", 5, 1.0) + _cycle("b", 5, 1.0, stack=1)
    assert own_pace_steps_per_gpu_hour([even], 20) == pytest.approx(projected_steps_per_gpu_hour(summarize([even]), 20))
    with pytest.raises(ValueError, match="at least 1"):
        own_pace_steps_per_gpu_hour([run], 0)
    assert own_pace_steps_per_gpu_hour([_cycle("a", 1, 1.0)], 5) is None  # one generation: no pace


def test_continuous_runs_of_more_steps_fall_between_the_two_projections(tmp_path):
    """The simulator's continuous arm on two stacks (jobs of short responses run ahead): its own
    20-step run lies between the own-pace projection from 6 steps (no speed-up for the jobs left at
    the end) and the start-and-drain-once one (no drift of the ends); shared-sync's stacks go in
    step, and its two projections agree."""
    from nodus.config import STACKS_PROFILE

    def run(policy, steps):
        out = tmp_path / f"{policy}-{steps}"
        s = simulate(config_from_args(None, policy=policy, sharing="mps", steps=steps, stacks=2, seed=1,
                                      profile=STACKS_PROFILE), out=out)
        return s, [json.loads(x) for x in (out / "spans.jsonl").read_text().splitlines()]

    (short, spans), (long, _) = run("continuous", 6), run("continuous", 20)
    own, drain_once = own_pace_steps_per_gpu_hour(runs_by_gpu(spans), 20), projected_steps_per_gpu_hour(short, 20)
    assert own < long["steps_per_gpu_hour"] < drain_once
    assert drain_once > 1.02 * own  # the ends drift apart: the two differ
    sync, sync_spans = run("shared-sync", 6)
    assert own_pace_steps_per_gpu_hour(runs_by_gpu(sync_spans), 20) == pytest.approx(
        projected_steps_per_gpu_hour(sync, 20), rel=0.01)
