"""experiments/overlap_rates.py: the stacks' rates from what ran beside each measured action."""

import numpy as np

from experiments.overlap_rates import fit, overlaps


def _acts(gen: dict, train: dict) -> dict:
    return {"generate": {(0, g, ("step", k)): [s, e, 64] for (g, k), (s, e) in gen.items()},
            "train": {(0, g, ("step", k)): [s, e, 0] for (g, k), (s, e) in train.items()}}


def test_each_action_is_split_into_its_seconds_beside_the_same_phase_and_beside_the_other():
    """Stack 0 generates 0-4 s while stack 1 generates 0-2 s and trains 2.5-5 s: 2 s beside a
    generation, 1.5 s beside only a train step, 0.5 s alone. Stack 1's train (2.5-5) ran 1.5 s beside
    stack 0's generation and 1 s beside its train (4-6), which ran 1 s beside it and no generation."""
    acts = _acts({(0, 0): (0.0, 4.0), (1, 0): (0.0, 2.0)}, {(0, 0): (4.0, 6.0), (1, 0): (2.5, 5.0)})
    got = overlaps(acts, "generate")
    assert got[(0, 0, ("step", 0))] == (4.0, 2.0, 1.5)
    assert got[(0, 1, ("step", 0))] == (2.0, 2.0, 0.0)
    tr = overlaps(acts, "train")
    assert tr[(0, 1, ("step", 0))] == (2.5, 1.0, 1.5)
    assert tr[(0, 0, ("step", 0))] == (2.0, 1.0, 0.0)  # stack 1 generated only before it


def test_the_fit_recovers_the_rates_that_made_the_actions():
    """Actions timed with known rates (alone 1.05, beside the same kind 0.8, beside the other 0.5)
    give those rates back, exactly without noise and within 0.02 with 3% noise on the durations."""
    rng = np.random.default_rng(0)
    r_alone, r_same, r_other = 1.05, 0.8, 0.5
    rows = []
    for _ in range(200):
        alone_s = rng.uniform(1.0, 3.0)
        f_same, f_other = rng.dirichlet([2, 1, 1])[:2]  # shares of the action's seconds
        d = alone_s * r_alone / (r_alone * (1 - f_same - f_other) + r_same * f_same + r_other * f_other)
        rows.append((alone_s, d, d * f_same, d * f_other))
    exact = fit(rows, r_alone)
    assert abs(exact["same"] - r_same) < 1e-9 and abs(exact["other"] - r_other) < 1e-9
    noisy = [(a, d * k, s * k, o * k) for (a, d, s, o), k in zip(rows, rng.normal(1, 0.03, len(rows)))]
    got = fit(noisy, r_alone)
    assert abs(got["same"] - r_same) < 0.02 and abs(got["other"] - r_other) < 0.02, got


def test_a_recorded_runs_actions_give_rates_that_the_written_profile_carries(tmp_path):
    """Session 63's H100 run of two stacks in step: its generations ran nearly all beside the other
    stack's and its trains beside the other's train; the fitted rates go into the written profile,
    and each action's work is priced within 10% on average."""
    import json
    from pathlib import Path

    from experiments.overlap_rates import main

    root = Path(__file__).resolve().parents[1]
    arms = root / "experiments/results/h100/session63/run/arms"
    run = arms / "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-audr1-sp4-k2-mb4k-s1"
    prof = root / "calibration/profiles/h100-xeon16-graphed-stacks-tied-bench60-qwen3-0.6b.json"
    out = tmp_path / "p.json"
    got = main(["--profile", str(prof), "--write-profile", str(out), "--out", str(tmp_path / "r"), str(run)])
    assert got["generate"]["actions"] == got["train"]["actions"] == 40
    assert got["generate"]["share_beside_same"] > 0.8 and got["train"]["share_beside_same"] > 0.8
    written = json.loads(out.read_text())["sharing"]
    assert written["mps_engines"] == got["generate"]["same"] and written["mps_stacks_trainer"] == got["train"]["other"]
    assert got["generate"]["rel_err_mean_abs"] < 0.1 and got["train"]["rel_err_mean_abs"] < 0.1
    assert json.loads((tmp_path / "r.json").read_text())["train"]["mps_trainers"] == got["train"]["same"]


def test_bad_input_is_named(tmp_path):
    """A profile that is not a file, and runs of one stack (nothing ran beside another stack's),
    each stop with what is wrong."""
    from pathlib import Path

    import pytest

    from experiments.overlap_rates import main

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit, match="--profile nope.json: no such file"):
        main(["--profile", "nope.json", "run"])
    prof = root / "calibration/profiles/h100-xeon16-graphed-stacks-tied-bench60-qwen3-0.6b.json"
    one = root / "experiments/results/h100/session63/run/arms/dedicated-cg-gm512-cpu2-audr1-mb8k-n5-s1"
    with pytest.raises(SystemExit, match="no generate action of these runs ran beside another stack's"):
        main(["--profile", str(prof), str(one)])
