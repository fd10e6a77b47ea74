"""compare_runs on synthetic run folders with known effects, its errors, and the Markdown report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nodus.compare import compare_runs, load_run, render_compare_markdown

N_ITEMS = 64


def exact_half(rng: np.random.Generator, n: int = N_ITEMS) -> list[int]:
    """n eval outcomes with accuracy exactly 0.5 in a random order."""
    return rng.permutation([1] * (n // 2) + [0] * (n - n // 2)).tolist()


def make_run(root, name, *, policy="dedicated", sharing="none", groups=1, seed=0, sph=100.0,
             n_jobs=4, correct=None, reward=0.5, steps=10, rng_seed=None, **overrides) -> str:
    """Write a run folder with summary.json; `correct(job_index, rng)` gives a job's 0/1 eval list
    (default: exactly half right, same order in every run of this seed, so arms tie exactly)."""
    rng = np.random.default_rng(seed if rng_seed is None else rng_seed)
    correct = correct or (lambda j, rng: exact_half(rng))
    per_job = {}
    for j in range(n_jobs):
        c = correct(j, rng)
        per_job[f"job{j}"] = {
            "task": "modular", "seed": 100 + j,
            "rewards": (reward + 0.01 * rng.standard_normal(steps)).tolist(),
            "eval": {"accuracy": float(np.mean(c)), "correct": c},
        }
    summary = {"policy": policy, "sharing": sharing, "groups": groups, "seed": seed,
               "steps_per_gpu_hour": sph, "per_job": per_job, **overrides}
    folder = root / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return str(folder)


def make_arms(root, *, arm_sph=(250.0, 245.0), aa_sph=252.0, n_jobs=4, **arm_overrides) -> list[str]:
    """Baseline (dedicated) and overlap runs on seeds 0 and 1, plus an A/A repeat of overlap seed 0;
    arm_overrides change only the overlap runs."""
    dirs = [make_run(root, f"base{s}", seed=s, n_jobs=n_jobs) for s in (0, 1)]
    arm = dict(policy="overlap", sharing="mps", groups=2, n_jobs=n_jobs) | arm_overrides
    dirs += [make_run(root, f"arm{s}", seed=s, sph=sph, **arm) for s, sph in zip((0, 1), arm_sph)]
    if aa_sph is not None:
        dirs.append(make_run(root, "arm0-again", seed=0, sph=aa_sph, **arm))
    return dirs


def arm_entry(report: dict, label: str = "overlap/mps/g2") -> dict:
    return next(a for a in report["arms"] if a["arm"] == label)


def test_clear_win_passes_the_gate(tmp_path):
    report = compare_runs(make_arms(tmp_path), n_boot=2000)
    assert report["baseline"] == "dedicated/none/g1"
    arm = arm_entry(report)
    # Seed 0 ran twice (250 and 252): its throughput is the repeats' mean.
    assert [r["ratio"] for r in arm["per_seed"]] == pytest.approx([2.51, 2.45])
    assert arm["per_seed"][0]["repeats"] == 2
    assert arm["aa_spread"]["max"] == pytest.approx(2 / 251)
    vs = arm["vs_baseline"]
    assert vs["acc_diff"]["mean"] == 0.0 and vs["acc_diff"]["lo"] == 0.0  # identical outcomes
    assert vs["acc_diff"]["n"] == 2 * 4 * N_ITEMS
    assert vs["gate"]["pass"], vs["gate"]
    assert json.loads(json.dumps(report)) == report


def test_equal_accuracy_gives_a_ci_around_zero(tmp_path):
    # Independent Bernoulli(0.5) outcomes in both arms: the true difference is 0.
    def coin(j, rng):
        return (rng.random(N_ITEMS) < 0.5).astype(int).tolist()

    dirs = [make_run(tmp_path, f"base{s}", seed=s, n_jobs=8, correct=coin) for s in (0, 1)]
    dirs += [make_run(tmp_path, f"arm{s}", seed=s, n_jobs=8, correct=coin, rng_seed=99 + s,
                      policy="overlap", sharing="mps", groups=2) for s in (0, 1)]
    acc = arm_entry(compare_runs(dirs, n_boot=2000))["vs_baseline"]["acc_diff"]
    assert acc["lo"] < 0.0 < acc["hi"] and acc["mean"] != 0.0
    assert acc["resample"] == "(job, seed) clusters"


def test_zero_accuracy_arm_fails_the_gate(tmp_path):
    dirs = make_arms(tmp_path, correct=lambda j, rng: [0] * N_ITEMS)
    vs = arm_entry(compare_runs(dirs, n_boot=2000))["vs_baseline"]
    assert vs["acc_diff"]["mean"] == pytest.approx(-0.5)
    assert vs["acc_diff"]["hi"] < 0
    assert not vs["gate"]["pass"]
    assert [n for n, c in vs["gate"]["criteria"].items() if not c["pass"]] == ["acc_ci_lower"]


def test_lower_reward_fails_the_gate(tmp_path):
    vs = arm_entry(compare_runs(make_arms(tmp_path, reward=0.3), n_boot=2000))["vs_baseline"]
    assert vs["reward_diff"]["mean"] == pytest.approx(-0.2, abs=0.02)
    assert vs["reward_diff"]["n"] == 2 * 4
    assert not vs["gate"]["criteria"]["reward_ci_lower"]["pass"] and not vs["gate"]["pass"]


def test_rewards_compare_over_the_common_steps(tmp_path):
    # The arm ran 20 steps, the later ones at a higher reward; only the first 10 are compared.
    def rewarding(root, name, steps, **kw):
        path = make_run(root, name, steps=steps, **kw)
        data = json.loads((root / name / "summary.json").read_text())
        for job in data["per_job"].values():
            job["rewards"] = [0.5] * 10 + [1.0] * (steps - 10)
        (root / name / "summary.json").write_text(json.dumps(data))
        return path
    dirs = [rewarding(tmp_path, "base", 10), rewarding(tmp_path, "arm", 20, policy="overlap", groups=2)]
    vs = arm_entry(compare_runs(dirs, n_boot=200), "overlap/none/g2")["vs_baseline"]
    assert vs["reward_diff"]["mean"] == 0.0


def test_one_slow_seed_fails_the_ratio_criterion(tmp_path):
    vs = arm_entry(compare_runs(make_arms(tmp_path, arm_sph=(250.0, 190.0)), n_boot=500))["vs_baseline"]
    ratio = vs["gate"]["criteria"]["ratio_every_seed"]
    assert ratio["value"] == pytest.approx(1.9) and not ratio["pass"]


def test_noisy_repeats_fail_the_noise_criterion(tmp_path):
    vs = arm_entry(compare_runs(make_arms(tmp_path, aa_sph=150.0), n_boot=500))["vs_baseline"]
    assert vs["noise_spread"] == pytest.approx(100 / 200)
    assert not vs["gate"]["criteria"]["gain_above_noise"]["pass"]


def test_without_repeats_the_gate_cannot_pass(tmp_path):
    vs = arm_entry(compare_runs(make_arms(tmp_path, aa_sph=None), n_boot=500))["vs_baseline"]
    assert vs["noise_spread"] is None and vs["noise_source"] == "no A/A repeats"
    assert not vs["gate"]["pass"]


def test_baseline_repeats_count_as_noise(tmp_path):
    dirs = make_arms(tmp_path, aa_sph=None) + [make_run(tmp_path, "base0-again", seed=0, sph=104.0)]
    report = compare_runs(dirs, n_boot=500)
    vs = arm_entry(report)["vs_baseline"]
    assert vs["noise_spread"] == pytest.approx(4 / 102) and vs["gate"]["pass"]
    # The baseline's repeats are averaged (100 and 104): whichever is named first.
    assert arm_entry(report)["per_seed"][0]["ratio"] == pytest.approx(250 / 102)
    flipped = compare_runs(list(reversed(dirs)), n_boot=500)
    assert arm_entry(flipped)["per_seed"][0]["ratio"] == pytest.approx(250 / 102)


def test_baseline_by_label_or_policy(tmp_path):
    dirs = make_arms(tmp_path)
    report = compare_runs(dirs, baseline="overlap", n_boot=200)
    assert report["baseline"] == "overlap/mps/g2"
    assert arm_entry(report, "dedicated/none/g1")["per_seed"][0]["ratio"] == pytest.approx(100 / 251)
    assert compare_runs(dirs, baseline="overlap/mps/g2", n_boot=200)["baseline"] == "overlap/mps/g2"


def test_unpaired_seeds_are_reported_not_compared(tmp_path):
    dirs = make_arms(tmp_path) + [make_run(tmp_path, "arm7", seed=7, sph=900.0, policy="overlap",
                                           sharing="mps", groups=2)]
    vs = arm_entry(compare_runs(dirs, n_boot=200))["vs_baseline"]
    assert vs["seeds"] == [0, 1] and vs["unpaired_seeds"] == [7]


def test_missing_dir_and_summary(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        compare_runs([str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/summary.json"):
        compare_runs([str(tmp_path / "empty")])


def test_missing_or_bad_fields_name_the_file_and_field(tmp_path):
    make_run(tmp_path, "r", correct=lambda j, rng: [1, 0])
    data = json.loads((tmp_path / "r" / "summary.json").read_text())
    del data["per_job"]["job1"]["eval"]["correct"]
    (tmp_path / "r" / "summary.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"r/summary.json: missing field 'per_job.job1.eval.correct'"):
        load_run(tmp_path / "r")
    make_run(tmp_path, "s", steps_per_gpu_hour="fast")
    with pytest.raises(ValueError, match="s/summary.json: field 'steps_per_gpu_hour'"):
        load_run(tmp_path / "s")
    make_run(tmp_path, "t", correct=lambda j, rng: [2, 0])
    with pytest.raises(ValueError, match="0/1"):
        load_run(tmp_path / "t")
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "summary.json").write_text("{oops")
    with pytest.raises(ValueError, match="u/summary.json: not valid JSON"):
        load_run(tmp_path / "u")


def test_no_baseline_run(tmp_path):
    dirs = [make_run(tmp_path, "a", policy="overlap", groups=2)]
    with pytest.raises(ValueError, match="no baseline run.*'dedicated'"):
        compare_runs(dirs)


def test_ambiguous_baseline_policy(tmp_path):
    dirs = [make_run(tmp_path, "a"), make_run(tmp_path, "b", sharing="mps")]
    with pytest.raises(ValueError, match="several arms"):
        compare_runs(dirs)


def test_arms_must_run_the_same_jobs_and_eval_sets(tmp_path):
    base = make_run(tmp_path, "base")
    fewer = make_run(tmp_path, "fewer", policy="overlap", groups=2, n_jobs=3)
    with pytest.raises(ValueError, match="job 'job3' is in .*base but not in .*fewer"):
        compare_runs([base, fewer])
    short = make_run(tmp_path, "short", policy="overlap", groups=2, correct=lambda j, rng: [1] * 10)
    with pytest.raises(ValueError, match="eval sets differ"):
        compare_runs([base, short])


def test_markdown_report(tmp_path):
    text = render_compare_markdown(compare_runs(make_arms(tmp_path), n_boot=500))
    assert "baseline `dedicated/none/g1`" in text
    assert "| overlap/mps/g2 | 0 | 251.0 | 2.51 |" in text
    assert "### Gate: overlap/mps/g2 PASS" in text
    assert "| ratio_every_seed | 2.450 | 2.000 | yes |" in text
    assert "paired 95% bootstrap CI" in text


def test_markdown_report_of_a_failing_arm(tmp_path):
    text = render_compare_markdown(compare_runs(make_arms(tmp_path, aa_sph=None), n_boot=200))
    assert "### Gate: overlap/mps/g2 FAIL" in text and "no A/A repeats" in text
    assert "| gain_above_noise | 1.475 | n/a | no |" in text


def test_a_repeat_reports_its_learning_against_the_first_run(tmp_path):
    """The baseline's A/A repeat: identical outcomes give exactly 0; a repeat that got 8 of 64
    items per job wrong that the first run got right gives -0.125, the learning noise floor the
    report puts beside the arm's own difference."""
    dirs = make_arms(tmp_path, aa_sph=None) + [make_run(tmp_path, "base0-same", seed=0)]
    aal = arm_entry(compare_runs(dirs, n_boot=500), "dedicated/none/g1")["aa_learning"]
    assert aal["seeds"] == [0] and aal["acc_diff"]["mean"] == 0.0 and aal["acc_diff"]["lo"] == 0.0

    def worse(j, rng):  # base0's outcomes (same rng), with its first 8 right answers lost
        c = exact_half(rng)
        lost = [i for i, x in enumerate(c) if x][:8]
        return [0 if i in lost else x for i, x in enumerate(c)]

    (tmp_path / "b").mkdir()
    dirs = make_arms(tmp_path / "b", aa_sph=None)
    dirs.append(make_run(tmp_path / "b", "base0-batching", seed=0, correct=worse))
    report = compare_runs(dirs, n_boot=500)
    aal = arm_entry(report, "dedicated/none/g1")["aa_learning"]
    assert aal["acc_diff"]["mean"] == pytest.approx(-8 / 64)
    assert aal["acc_diff"]["hi"] < 0
    assert "its A/A repeat" in render_compare_markdown(report)
    assert arm_entry(report)["aa_learning"] is None  # the arm has no repeat here


def test_runs_that_pack_prompts_are_their_own_arm(tmp_path):
    """A run whose trainer packed each prompt's responses (config.json trainer.share_prompts) is
    labelled +spK: never pooled with the plain arm as a repeat; a bad value names the file."""
    plain = make_run(tmp_path, "plain", policy="overlap", sharing="mps", groups=2)
    packed = make_run(tmp_path, "packed", policy="overlap", sharing="mps", groups=2)
    (Path(packed) / "config.json").write_text(json.dumps({"trainer": {"share_prompts": 4}}))
    base = make_run(tmp_path, "base")
    report = compare_runs([base, plain, packed])
    labels = {a["arm"] for a in report["arms"]}
    assert {"overlap/mps/g2", "overlap/mps/g2+sp4"} <= labels
    # K = 1 trains plain rows: a repeat of the plain arm, not an arm of its own
    (Path(packed) / "config.json").write_text(json.dumps({"trainer": {"share_prompts": 1}}))
    report = compare_runs([base, plain, packed])
    assert [[r["repeats"] for r in a["per_seed"]] for a in report["arms"] if a["arm"] == "overlap/mps/g2"] == [[2]]
    assert not any("+sp" in a["arm"] for a in report["arms"])
    (Path(packed) / "config.json").write_text(json.dumps({"trainer": {"share_prompts": -1}}))
    with pytest.raises(ValueError, match="config.json: field 'trainer.share_prompts' must be an integer >= 0"):
        compare_runs([base, plain, packed])


def test_runs_on_several_stacks_are_their_own_arm(tmp_path):
    """A run on two engine + trainer stacks (summary arm.stacks) is labelled /k2: never pooled with
    the one-stack arm as its A/A repeat."""
    one = make_run(tmp_path, "one", policy="shared-sync", sharing="mps", sph=200.0)
    two = make_run(tmp_path, "two", policy="shared-sync", sharing="mps", sph=260.0,
                   arm={"policy": "shared-sync", "sharing": "mps", "groups": 1, "stacks": 2})
    report = compare_runs([make_run(tmp_path, "base"), one, two])
    labels = {a["arm"]: a for a in report["arms"]}
    assert {"shared-sync/mps/g1", "shared-sync/mps/g1/k2"} <= set(labels)
    assert [[r["repeats"] for r in a["per_seed"]] for a in report["arms"] if a["arm"] == "shared-sync/mps/g1"] == [[1]]


def test_packed_rows_is_the_one_reading_of_share_prompts():
    """0, 1 and a missing value all mean plain rows (0) wherever a run's setting is read: the
    compare and sweep labels, validate's configuration key, gpu_table's label and crossday's filter."""
    from calibration.validate import _packed
    from experiments.crossday import comparable
    from nodus.compare import arm_label
    from nodus.config import packed_rows
    from nodus.simulate import arm_label as sweep_label

    assert [packed_rows(k) for k in (None, 0, 1, 2, 4)] == [0, 0, 0, 2, 4]
    for k, tag in ((None, ""), (0, ""), (1, ""), (4, "+sp4")):
        assert arm_label("overlap", "mps", 2, k) == "overlap/mps/g2" + tag
        assert sweep_label({"policy": "overlap", "groups": 2, "sharing": "mps", "share_prompts": k}) == (
            "overlap g=2 mps" + (" " + tag if tag else ""))
        assert _packed({"share_prompts": k}) == packed_rows(k)
        graphed = {"controls": {"trainer_step_mode": "graphed", "lora_kernels": "tuned"}, "share_prompts": k}
        assert comparable(graphed) is (not tag)


def test_an_aa_pair_given_apart_is_the_noise_floor_and_nothing_else(tmp_path):
    """--aa-runs: a repeat recorded in another call gives the spread where the compared arms have no
    repeats; the ratios and learning CIs stay those of the compared runs; runs without a repeat among
    them are refused by name; the arm's own repeats still come first."""
    dirs = make_arms(tmp_path, aa_sph=None)
    alone = compare_runs(dirs, n_boot=500)
    (tmp_path / "aa").mkdir()
    pair = [make_run(tmp_path / "aa", name, seed=7, sph=sph) for name, sph in (("d1", 100.0), ("d2", 110.0))]
    report = compare_runs(dirs, n_boot=500, aa_runs=pair)
    vs = arm_entry(report)["vs_baseline"]
    assert vs["noise_spread"] == pytest.approx(10 / 105) and vs["gate"]["pass"]
    assert vs["noise_source"].startswith("the given A/A runs (dedicated/none/g1 in ")
    assert vs["ratios"] == arm_entry(alone)["vs_baseline"]["ratios"]
    assert vs["acc_diff"] == arm_entry(alone)["vs_baseline"]["acc_diff"]
    assert "`--aa-runs`" in render_compare_markdown(report) and "spread 0.095" in render_compare_markdown(report)
    with pytest.raises(ValueError, match="--aa-runs: no arm and seed has two runs"):
        compare_runs(dirs, n_boot=500, aa_runs=pair[:1])
    # A call's repeats pair among themselves: another folder's run of the arm and seed is no repeat;
    # a throughput run without an eval serves.
    (tmp_path / "bb").mkdir()
    other = make_run(tmp_path / "bb", "d3", seed=7, sph=200.0)
    summary = json.loads((Path(other) / "summary.json").read_text())
    for job in summary["per_job"].values():
        del job["eval"]
    (Path(other) / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="--aa-runs: no arm and seed has two runs"):
        compare_runs(dirs, n_boot=500, aa_runs=[pair[0], other])
    mixed = compare_runs(dirs, n_boot=500, aa_runs=pair + [other])["aa_runs"]
    assert mixed["max"] == pytest.approx(10 / 105) and len(mixed["arms"]) == 1
    (tmp_path / "noisy").mkdir()
    noisy = make_arms(tmp_path / "noisy", aa_sph=150.0)
    own = arm_entry(compare_runs(noisy, n_boot=500, aa_runs=pair))["vs_baseline"]
    assert own["noise_spread"] == pytest.approx(100 / 200) and own["noise_source"] == "arm and baseline repeats"
    # Another compared arm's repeats, wider than the given ones, win (the wider counts).
    (tmp_path / "third").mkdir()
    third = [make_run(tmp_path / "third", n, policy="shared-sync", sharing="mps", seed=0, sph=sph)
             for n, sph in (("s0", 200.0), ("s0-again", 120.0))]
    wide = arm_entry(compare_runs(dirs + third, n_boot=500, aa_runs=pair))["vs_baseline"]
    assert wide["noise_spread"] == pytest.approx(80 / 160) and wide["noise_source"].startswith("other arms' repeats")
