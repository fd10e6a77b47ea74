"""experiments/stack_alignment.py: how a run's stacks' phases lined up."""

import json

import pytest

from experiments import stack_alignment as sa
from nodus.simulate import config_from_args, simulate


def _write_run(path, spans, sph=1000.0, jobs=("job0", "job1")):
    path.mkdir(parents=True)
    with open(path / "spans.jsonl", "w") as f:
        for stack, phase, s, e in spans:
            for job in jobs:  # every job of the stack records the same action: merged, not counted twice
                f.write(json.dumps({"stack": stack, "phase": phase, "start_s": s, "end_s": e, "job": job}) + "\n")
    (path / "summary.json").write_text(json.dumps({"steps_per_gpu_hour": sph,
                                                   "per_job": {j: {} for j in jobs}}))
    return path


def test_known_overlaps(tmp_path):
    # Stack 0 trains 2-4 s; stack 1 trains 3-5 s (1 s beside stack 0's train) and generates 0-3 s
    # (1 s beside stack 0's train); stack 0 generates 0-2 and 4-6 s (1 s beside stack 1's train).
    rd = _write_run(tmp_path / "r", [(0, "generate", 0, 2), (0, "train", 2, 4), (0, "generate", 4, 6),
                                     (1, "generate", 0, 3), (1, "train", 3, 5)])
    r = sa.run_alignment(rd)
    assert r["train_beside_train"] == pytest.approx(2 * 1 / 4)
    assert r["train_beside_generate"] == pytest.approx((1 + 1) / 4)
    assert r["train_s"] == pytest.approx(2.0)
    assert r["generate_s"] == pytest.approx((2 + 2 + 3) / 3)
    assert r["jobs"] == 2 and r["steps_per_gpu_hour"] == 1000.0 and r["stacks"] == 2


def test_three_stacks_beside_any_other(tmp_path):
    # Stack 0 trains 2-4 s: beside stack 1's train 3-5 s (1 s) and stack 2's train 1-3 s (1 s), the
    # union 2 s; beside stack 1's generation 0-3 s (1 s) and stack 2's 3-6 s (1 s), the union 2 s.
    # Stack 1 trains 3-5 s: beside stack 0's 2-4 s (1 s), stack 2's none; beside stack 0's generation
    # 4-6 s (1 s) and stack 2's 3-6 s (2 s), the union 2 s. Stack 2 trains 1-3 s: beside stack 0's
    # train 2-3 s (1 s); beside stack 0's generation 0-2 s (1 s) and stack 1's 0-3 s (2 s), union 2 s.
    rd = _write_run(tmp_path / "r3", [(0, "generate", 0, 2), (0, "train", 2, 4), (0, "generate", 4, 6),
                                      (1, "generate", 0, 3), (1, "train", 3, 5),
                                      (2, "train", 1, 3), (2, "generate", 3, 6)])
    r = sa.run_alignment(rd)
    assert r["stacks"] == 3
    assert r["train_beside_train"] == pytest.approx((2 + 1 + 1) / 6)
    assert r["train_beside_generate"] == pytest.approx((2 + 2 + 2) / 6)
    assert r["train_s"] == pytest.approx(2.0)


def test_one_stack_run_is_refused_by_name(tmp_path):
    rd = _write_run(tmp_path / "one", [(0, "generate", 0, 1), (0, "train", 1, 2)])
    with pytest.raises(ValueError, match="expected two stacks or more.*found stacks \\[0\\]"):
        sa.run_alignment(rd)
    with pytest.raises(SystemExit, match="stack_alignment: .*expected two stacks or more"):
        sa.main([str(rd)])


def test_simulated_two_stack_runs_and_correlations(tmp_path):
    runs = []
    for seed in (1, 2, 3):
        out = tmp_path / f"s{seed}"
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", seed=seed, stacks=2),
                 out=out)
        runs.append(str(out))
    res = sa.main(runs + ["--out", str(tmp_path / "align" / "a")])
    assert len(res["rows"]) == 3
    for r in res["rows"]:
        assert 0.0 <= r["train_beside_train"] <= 1.0 and 0.0 <= r["train_beside_generate"] <= 1.0
        assert r["train_beside_train"] + r["train_beside_generate"] <= 1.0 + 1e-9
        assert r["jobs"] == 4 and r["train_s"] > 0 and r["generate_s"] > 0
    assert set(res["correlations"]) == {"4x2"} and res["correlations"]["4x2"]["runs"] == 3
    assert (tmp_path / "align" / "a.md").read_text().startswith("| run | jobs |")
    assert json.loads((tmp_path / "align" / "a.json").read_text())["rows"][0]["run"] == runs[0]


def test_pearson():
    assert sa.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert sa.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert sa.pearson([1, 2], [1, 2]) is None  # fewer than three runs
    assert sa.pearson([1, 1, 1], [1, 2, 3]) is None  # no spread


def test_train_actions_by_what_ran_beside_them(tmp_path):
    # Stack 0 trains 0-2 s beside stack 1's train 0-2.1 s (in step, both), then 3-4 s beside
    # stack 1's generation 2.5-5 s (alternating); stack 1's second train 5-6 s has stack 0's train
    # beside it for none of it and its generation 4.5-5.2 for 20%: neither kind, not counted.
    rd = _write_run(tmp_path / "r", [(0, "train", 0, 2), (0, "generate", 2, 3), (0, "train", 3, 4),
                                     (0, "generate", 4.5, 5.2), (1, "train", 0, 2.1), (1, "generate", 2.5, 5),
                                     (1, "train", 5, 6)])
    r = sa.run_alignment(rd)
    assert r["train_in_step_n"] == 2 and r["train_in_step_s"] == pytest.approx(2 + 2.1)
    assert r["train_alternating_n"] == 1 and r["train_alternating_s"] == pytest.approx(1.0)
    sides = sa.train_by_side([r, r])[(2, 2)]
    assert sides["runs"] == 2 and sides["in_step"]["actions"] == 4
    assert sides["in_step"]["mean_s"] == pytest.approx(2.05)
    assert sides["alternating"]["mean_s"] == pytest.approx(1.0)
    assert sides["in_step_over_alternating"] == pytest.approx(2.05)
    text = sa.render([r], {}, sa.train_by_side([r]))
    assert "| 2 | 2 | 1 | 2 at 2.050 s | 1 at 1.000 s | 2.05x |" in text


def _write_stepped(path, gens):
    """gens: (stack, step, start) generations of 1 s each; each followed by a 0.5 s train."""
    path.mkdir(parents=True)
    with open(path / "spans.jsonl", "w") as f:
        for stack, step, start in gens:
            f.write(json.dumps({"stack": stack, "phase": "generate", "start_s": start, "end_s": start + 1.0,
                                "job": f"job{stack}", "attrs": {"step": step}}) + "\n")
            f.write(json.dumps({"stack": stack, "phase": "train", "start_s": start + 1.0, "end_s": start + 1.5,
                                "job": f"job{stack}", "attrs": {"step": step}}) + "\n")
    (path / "summary.json").write_text(json.dumps({"steps_per_gpu_hour": 1.0, "per_job": {"job0": {}, "job1": {}}}))
    return path


def test_phase_by_step_folds_the_lag_into_cycles(tmp_path):
    # Stack 0 starts a step every 2 s. Stack 1 starts half a cycle later, then drifts by 0.5 s a step:
    # lags 1.0, 1.5, 2.0 (a whole cycle: in step again), 2.5 -> 0.5, 0.75 -> 0.25, 0.0, 0.25 cycles.
    gens = [(0, t, 2.0 * t) for t in range(4)] + [(1, t, 2.0 * t + 1.0 + 0.5 * t) for t in range(4)]
    r = sa.run_alignment(_write_stepped(tmp_path / "drift", gens))
    assert r["phase_by_step"][1] == pytest.approx([0.5, 0.25, 0.0, 0.25])
    assert r["apart_share"] == pytest.approx(3 / 4)  # at least a quarter cycle apart: three steps of four
    text = sa.render([r], {})
    assert "stack 1: 0.50 0.25 0.00 0.25" in text and "| 75% |" in text


def test_held_cycle_and_the_pace_projected_unheld():
    # Two stacks on a 4 s cycle of which 0.5 s a step (after the first) went to holds: 3.5 s unheld.
    starts = {0: {0: 0.0, 1: 4.0, 2: 8.0}, 1: {0: 2.0, 1: 6.0, 2: 10.0}}
    held = {0: {1: 0.5, 2: 0.5}, 1: {1: 1.0, 2: 0.0}}
    h = sa.held_cycle(starts, held, {"pace_steps_per_gpu_hour": 7000.0})
    assert h == pytest.approx({"cycle_s": 4.0, "held_s_per_step": 0.5, "unheld_cycle_s": 3.5, "pace": 7000.0,
                               "unheld_pace_projected": 8000.0})
    assert sa.held_cycle(starts, {}, {"pace_steps_per_gpu_hour": 7000.0}) == {}  # nothing held
    assert "pace" not in sa.held_cycle(starts, held, {})
    text = sa.render([{"run": "r", "jobs": 8, "stacks": 2, "steps_per_gpu_hour": 7000.0, "train_beside_train": 0.0,
                       "train_beside_generate": 1.0, "train_s": 1.0, "generate_s": 2.0, **h}], {})
    assert "| r | 4.00 | 0.50 | 3.50 | 7000 | 8000 |" in text


def test_phase_by_step_needs_step_numbers(tmp_path):
    rd = _write_run(tmp_path / "nostep", [(0, "generate", 0, 2), (0, "train", 2, 4), (1, "generate", 0, 3),
                                          (1, "train", 3, 5)])
    r = sa.run_alignment(rd)
    assert r["phase_by_step"] is None and r["apart_share"] is None
    assert sa.phase_by_step({0: {0: 0.0}, 1: {0: 1.0}}) is None  # one step of stack 0: no cycle


def test_simulated_offset_stacks_start_half_a_cycle_apart(tmp_path):
    out = tmp_path / "off"
    simulate(config_from_args(jobs=4, steps=4, policy="shared-sync", sharing="mps", seed=1, stacks=2,
                              offset_stacks=True), out=out)
    r = sa.run_alignment(out)
    assert r["phase_by_step"][1][0] >= sa.APART  # the second stack's first generation follows the first's


def test_leading_and_trailing_actions_of_each_step(tmp_path):
    """Two stacks, two steps. Step 0: stack 0 generates 0-2 s and trains 2-3.2 s; stack 1 generates
    0.1-2.2 s and trains 2.2-3.3 s. Step 1: stack 1 leads its generation (3.3-5.3 against stack 0's
    3.4-5.3) and stack 0 its train (5.3-6.5 against 5.35-6.45). The leading train ran 1.2 s both
    steps, the trailing 1.1 s: below 1, the train step narrows the gap; the trailing generation ran
    2.1 then 1.9 s against 2.0 and 2.0. Spans without a step, and runs of three stacks, give none."""
    rd = tmp_path / "r"
    rd.mkdir()
    acts = [(0, "generate", 0, 0.0, 2.0), (0, "train", 0, 2.0, 3.2), (1, "generate", 0, 0.1, 2.2),
            (1, "train", 0, 2.2, 3.3), (1, "generate", 1, 3.3, 5.3), (0, "generate", 1, 3.4, 5.3),
            (0, "train", 1, 5.3, 6.5), (1, "train", 1, 5.35, 6.45)]
    with open(rd / "spans.jsonl", "w") as f:
        for stack, phase, step, s, e in acts:
            for job in ("a", "b"):
                f.write(json.dumps({"stack": stack, "phase": phase, "start_s": s, "end_s": e, "job": job,
                                    "attrs": {"step": step}}) + "\n")
    (rd / "summary.json").write_text(json.dumps({"steps_per_gpu_hour": 1000.0, "per_job": {"a": {}, "b": {}}}))
    r = sa.run_alignment(rd)
    assert r["train_pairs"] == r["generate_pairs"] == 2
    assert r["train_leading_s"] == pytest.approx(1.2) and r["train_trailing_s"] == pytest.approx(1.1)
    assert r["generate_leading_s"] == pytest.approx(2.0) and r["generate_trailing_s"] == pytest.approx(2.0)
    text = sa.render([r], {}, {})
    assert "| 2.000 / 2.000 | 1.000 | 1.200 / 1.100 | 0.917 |" in text
    assert sa.leading_and_trailing({(0, "train", 0): [0, 1], (1, "train", 0): [0, 1], (2, "train", 0): [0, 1]},
                                   [0, 1, 2]) == {}
    plain = sa.run_alignment(_write_run(tmp_path / "p", [(0, "generate", 0, 2), (0, "train", 2, 4),
                                                         (1, "generate", 0, 3), (1, "train", 3, 5)]))
    assert "train_pairs" not in plain and "Leading and trailing" not in sa.render([plain], {}, {})
