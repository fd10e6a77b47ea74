"""experiments/what_it_takes.py: the grid of hypothetical train and decode speed-ups on any arm."""

import json

import pytest

from experiments import what_it_takes as wit
from nodus.config import STACKS_PROFILE, with_default_packing
from nodus.simulate import config_from_args, simulate


def test_factors_parse_and_refuse_bad_input():
    assert wit.factors("1,0.9,0.5", "--train") == (1.0, 0.9, 0.5)
    with pytest.raises(SystemExit, match="--decode 'x': expected comma-separated numbers"):
        wit.factors("x", "--decode")
    with pytest.raises(SystemExit, match=r"every factor must be > 0.*\[0\.0\]"):
        wit.factors("1,0", "--train")


def test_first_reaching_takes_the_least_speed_up_per_train_factor():
    rows = [{"train_factor": t, "decode_factor": d, "steps_per_gpu_hour": sph}
            for t, d, sph in [(1, 1, 8000), (1, 0.8, 9500), (0.8, 1, 9000), (0.8, 0.9, 10100), (0.8, 0.8, 10900)]]
    assert wit.first_reaching(rows, 10_000) == {1: None, 0.8: 0.9}


def test_two_stack_grid_matches_nodus_sim_and_speeds_up_with_cheaper_phases():
    rows = wit.grid(STACKS_PROFILE, steps=2, train=(1.0, 0.7), decode=(1.0, 0.7),
                    arm={"policy": "shared-sync", "groups": 1, "stacks": 2})
    cell = {(r["train_factor"], r["decode_factor"]): r for r in rows}
    # The unscaled cell is what nodus sim predicts for the arm (the graphed trainer's packed rows).
    cfg = with_default_packing(config_from_args(jobs=8, steps=2, policy="shared-sync", groups=1, sharing="mps",
                                                seed=1, profile=STACKS_PROFILE, stacks=2), True)
    assert cfg.trainer.share_prompts == cell[(1.0, 1.0)]["share_prompts"] == 4
    assert cell[(1.0, 1.0)]["steps_per_gpu_hour"] == pytest.approx(simulate(cfg)["steps_per_gpu_hour"], rel=1e-9)
    base = cell[(1.0, 1.0)]["steps_per_gpu_hour"]
    assert cell[(0.7, 1.0)]["steps_per_gpu_hour"] > base
    assert cell[(1.0, 0.7)]["steps_per_gpu_hour"] > base
    assert cell[(0.7, 0.7)]["steps_per_gpu_hour"] > max(cell[(0.7, 1.0)]["steps_per_gpu_hour"],
                                                        cell[(1.0, 0.7)]["steps_per_gpu_hour"])


def test_main_writes_the_grid_with_its_arm_and_target(tmp_path):
    out = tmp_path / "w"
    # Two stacks and no --profile: the shipped stacks profile, as nodus sim picks it.
    res = wit.main(["--policy", "shared-sync", "--stacks", "2", "--steps", "2",
                    "--train", "1,0.5", "--decode", "1,0.5", "--target", "9000", "--out", str(out)])
    assert res["profile"] == STACKS_PROFILE
    saved = json.loads((out / "what_it_takes_sim.json").read_text())
    assert saved["arm"] == {"policy": "shared-sync", "stacks": 2, "groups": 1} == res["arm"]
    assert len(saved["rows"]) == 4 and saved["target"] == 9000
    assert set(saved["reach"]) == {"1", "0.5"}
    text = (out / "what_it_takes_sim.md").read_text()
    assert "shared-sync + MPS, one group, 2 stacks, each prompt's responses 4 to a row" in text
    assert "To reach 9,000 steps per GPU-hour" in text
    assert "Two stacks' engines (sharing.mps_engines)" in text  # the stacks profile's error bar


def test_main_refuses_groups_on_shared_sync(tmp_path):
    with pytest.raises(SystemExit, match="--groups 2: phase-offset groups are overlap's"):
        wit.main(["--policy", "shared-sync", "--groups", "2", "--out", str(tmp_path / "w")])


def test_main_names_an_unknown_profile(tmp_path):
    with pytest.raises(SystemExit, match="what_it_takes: profile='nope' is neither a file nor a shipped profile"):
        wit.main(["--profile", "nope", "--out", str(tmp_path / "w")])
