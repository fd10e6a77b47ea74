"""arm.lockstep: stacks of a shared-sync arm held in step, through config, CLI, simulator, the GPU
scripts' arm specs and labels, and the two-engine rate's fit."""

import json

import pytest

from experiments import stack_alignment as sa
from experiments.gpu_arms import parse_arm
from experiments.gpu_table import arm_label
from factories import simulate_with_and_without
from nodus.config import ConfigError, DEFAULT_PROFILE
from nodus.simulate import config_from_args, simulate


@pytest.mark.parametrize("kw", [dict(policy="shared-sync"), dict(policy="overlap", stacks=2),
                                dict(policy="continuous", stacks=2)])
def test_lockstep_needs_shared_sync_on_two_stacks_or_more(kw):
    with pytest.raises(ConfigError, match="arm.lockstep .*needs policy 'shared-sync' on arm.stacks >= 2"):
        config_from_args(jobs=4, steps=2, sharing="mps", lockstep=True, **kw)


def test_simulated_lockstep_stacks_train_together(tmp_path):
    # Two stacks of unequal work drift apart free; in lockstep every step's generations start after
    # every stack's publish of the step before.
    runs = simulate_with_and_without(tmp_path, "lockstep", jobs=3, steps=4, policy="shared-sync", sharing="mps",
                                     stacks=2)
    spans = [json.loads(x) for x in (runs[True] / "spans.jsonl").read_text().splitlines()]
    for step in range(1, 4):
        pubs = [s["end_s"] for s in spans if s["phase"] == "publish" and s["attrs"]["version"] == step]
        gens = [s["start_s"] for s in spans if s["phase"] == "generate" and s["attrs"]["step"] == step]
        assert len(pubs) == 3 and len(gens) == 3 and min(gens) >= max(pubs) - 1e-9
    free, lock = (sa.run_alignment(runs[k]) for k in (False, True))
    assert lock["train_beside_train"] > free["train_beside_train"]
    assert json.loads((runs[True] / "config.json").read_text())["arm"]["lockstep"] is True
    summary = json.loads((runs[True] / "summary.json").read_text())
    assert summary["arm"]["lockstep"] is True
    assert "lockstep" not in json.loads((runs[False] / "summary.json").read_text())["arm"]


def test_cli_lockstep_flag(capsys):
    from nodus.cli import main

    from nodus.config import STACKS_DECODE_PROFILE

    def lockstep_flags(*profile):
        assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "shared-sync", "--stacks", "2", "--lockstep",
                     *profile, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps_per_gpu_hour"] > 0
        return [f for d in out["diagnostics"] for f in d.get("outside_profile", []) if "arm.lockstep=True" in f]

    # A two-engine rate fitted to free-running stacks' steps/GPU-h averages over how they lined up:
    # a lockstep arm is outside it. The default's rates were fitted to phase times (fit-stacks --rate
    # phases), whatever the alignment: not flagged.
    assert lockstep_flags("--profile", STACKS_DECODE_PROFILE)
    assert not lockstep_flags()
    assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "shared-sync", "--lockstep"]) != 0
    assert "needs policy 'shared-sync' on arm.stacks >= 2" in capsys.readouterr().err


def test_gpu_arms_lock_spec_and_label():
    assert parse_arm("shared-sync+mps:k2:lock:s1")[-1] == {"stacks": 2, "lockstep": True}
    with pytest.raises(SystemExit, match="a shared-sync arm on kN stacks"):
        parse_arm("shared-sync+mps:lock")
    with pytest.raises(SystemExit, match="a shared-sync arm on kN stacks"):
        parse_arm("overlap+mps:k2:lock")
    arm = {"policy": "shared-sync", "sharing": "mps", "groups": 1, "stacks": 2}
    assert arm_label(arm) == "shared-sync/mps/g1/k2"
    assert arm_label({**arm, "lockstep": True}) == "shared-sync/mps/g1/k2+lock"


@pytest.mark.parametrize("field", ["lockstep", "offset_stacks"])
def test_fit_stacks_refuses_free_runs_with_lockstep_or_offset_ones(tmp_path, field):
    # Free stacks, stacks held in step (arm.lockstep) and stacks started apart (arm.offset_stacks)
    # line up differently: one two-engine rate is not fitted over two of them.
    from calibration.stacks import fit

    runs = []
    for on in (None, True):
        out = tmp_path / f"r{on}"
        simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, **{field: on}), out)
        runs.append(out)
    with pytest.raises(ConfigError, match=f"differ in {field}"):
        fit(runs, DEFAULT_PROFILE)
