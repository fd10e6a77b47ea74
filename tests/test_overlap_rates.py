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


class _Cost:
    """A decode step of b sequences takes b ms; prefill takes nothing."""

    def prefill_s(self, tokens, lora, cold):
        return 0.0

    def decode_step_s(self, batch, context_tokens, adapters, logprob_seqs=None):
        return batch * 1e-3


def test_a_generations_running_batch_follows_its_sequences_lengths():
    """Four sequences of 1, 1, 3 and 3 tokens: one step of 4 (4 ms), then two of 2 (4 ms): half the
    decode at four sequences, half at two."""
    from experiments.overlap_rates import batch_fractions

    got = batch_fractions([3, 1, 3, 1], 10.0, ["a", "a", "b", "b"], _Cost())
    assert [(round(f0, 9), round(f1, 9), b) for f0, f1, b in got] == [(0, 0, 4), (0, 0.5, 4), (0.5, 1, 2)]


def test_the_seconds_beside_the_other_phase_are_split_by_the_engines_running_batch():
    """Stack 0 generates 0-4 s, 256 sequences until 3 s and 8 after; stack 1 trains 2-5 s. With a
    tail of 32 sequences: the generation ran 1 s beside the train at its full batch and 1 s at its
    tail; the train ran 1 s beside the full engine, 1 s beside its tail and 1 s alone."""
    from experiments.overlap_rates import tail_overlaps

    acts = _acts({(0, 0): (0.0, 4.0)}, {(1, 0): (2.0, 5.0)})
    segs = {(0, 0, ("step", 0)): [(0.0, 3.0, 256), (3.0, 4.0, 8)]}
    assert tail_overlaps(acts, segs, "generate", 32)[(0, 0, ("step", 0))] == (4.0, 0.0, 1.0, 1.0)
    assert tail_overlaps(acts, segs, "train", 32)[(0, 1, ("step", 0))] == (3.0, 0.0, 1.0, 1.0)
    # A tail of 256 sequences or more holds the whole generation.
    assert tail_overlaps(acts, segs, "train", 256)[(0, 1, ("step", 0))] == (3.0, 0.0, 0.0, 2.0)


def test_the_fit_recovers_a_third_rate_for_the_tail():
    """Actions timed with rates alone 1.05, beside the same kind 0.8, beside the other 0.7 and beside
    the other at the engine's tail 0.45 give the three rates back."""
    rng = np.random.default_rng(1)
    r_alone, rates = 1.05, (0.8, 0.7, 0.45)
    rows = []
    for _ in range(200):
        alone_s = rng.uniform(1.0, 3.0)
        f = rng.dirichlet([2, 1, 1, 1])[1:]
        d = alone_s * r_alone / (r_alone * (1 - f.sum()) + sum(r * x for r, x in zip(rates, f)))
        rows.append((alone_s, d, *(d * f)))
    got = fit(rows, r_alone)
    assert all(abs(got[k] - r) < 1e-9 for k, r in zip(("same", "other", "other_tail"), rates)), got
    assert abs(got["share_beside_other_tail"] - sum(r[4] for r in rows) / sum(r[1] for r in rows)) < 1e-12


def test_tail_options_that_cannot_work_are_named(tmp_path):
    """--tail below 1, and --tail with --write-profile (a profile has no field for the tail's rate)."""
    import pytest

    from experiments.overlap_rates import main

    prof = tmp_path / "p.json"
    prof.write_text("{}")
    with pytest.raises(SystemExit, match="--tail 0: give the tail's largest running batch"):
        main(["--profile", str(prof), "--tail", "0", "run"])
    with pytest.raises(SystemExit, match="--write-profile with --tail"):
        main(["--profile", str(prof), "--tail", "32", "--write-profile", str(tmp_path / "o.json"), "run"])


def test_on_a_recorded_run_the_tail_split_keeps_the_seconds_beside_the_other_phase():
    """Session 63's H100 run of two stacks: with --tail the seconds beside the other phase are the
    same seconds, split in two, and the rate beside the same phase barely moves."""
    from pathlib import Path

    from experiments.overlap_rates import main

    root = Path(__file__).resolve().parents[1]
    arms = root / "experiments/results/h100/session63/run/arms"
    run = arms / "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-audr1-sp4-k2-mb4k-s1"
    prof = str(root / "calibration/profiles/h100-xeon16-graphed-stacks-tied-bench60-qwen3-0.6b.json")
    plain = main(["--profile", prof, str(run)])
    split = main(["--profile", prof, "--tail", "32", str(run)])
    for phase in ("generate", "train"):
        p, s = plain[phase], split[phase]
        assert s["share_beside_other_tail"] > 0
        assert abs(s["share_beside_other"] + s["share_beside_other_tail"] - p["share_beside_other"]) < 1e-9
        assert abs(s["share_beside_same"] - p["share_beside_same"]) < 1e-12
