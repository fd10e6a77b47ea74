"""arm.offset_stacks: a shared-sync arm's stacks started out of step (stack k starts when stack k-1's
first generation ends), through the scheduler, config, CLI, simulator, the GPU scripts' arm specs and
labels and validation's configurations (the two-engine rate's fit: tests/test_lockstep.py)."""

import functools
import json

import pytest

from experiments import stack_alignment as sa
from experiments.gpu_arms import parse_arm
from experiments.gpu_table import arm_label
from factories import ScriptedBackend, simulate_with_and_without
from nodus.accounting import audit_on_policy
from nodus.config import ConfigError
from nodus.scheduler import Scheduler, drive
from nodus.simulate import config_from_args


@pytest.mark.parametrize("offset", [False, True])
def test_each_stack_starts_when_the_one_before_has_generated(offset):
    s = Scheduler({"a": 2, "b": 2, "c": 2}, [(0, ["a"]), (1, ["b"]), (2, ["c"])], stagger=False,
                  offset_stacks=offset)
    b = ScriptedBackend()

    finish = functools.partial(b.answer, s)  # one action's result, as drive() would get it

    first = s.start()
    if not offset:
        assert [(type(x).__name__, x.stack) for x in first] == [("Generate", 0), ("Generate", 1), ("Generate", 2)]
        return
    (gen_a,) = first
    assert gen_a.stack == 0
    train_a, gen_b = finish(gen_a)  # stack 0 trains while stack 1 generates
    assert (type(train_a).__name__, train_a.stack, type(gen_b).__name__, gen_b.stack) == ("Train", 0, "Generate", 1)
    train_b, gen_c = finish(gen_b)
    assert (train_b.stack, type(gen_c).__name__, gen_c.stack) == (1, "Generate", 2)
    (pub_a,) = finish(train_a)
    (again_a,) = finish(pub_a)  # then free: stack 0's next generation cues nobody
    assert (type(again_a).__name__, again_a.stack) == ("Generate", 0)
    assert finish(again_a)[0].stack == 0 and all(g.stack != 1 or g.state != "pending" for g in s._groups)


def test_a_stack_with_nothing_to_run_still_cues_the_next():
    # Stack 0's job resumed at its last step: it never generates, and stack 1 must start anyway.
    s = Scheduler({"a": 2, "b": 2}, [(0, ["a"]), (1, ["b"])], stagger=False, offset_stacks=True,
                  start_versions={"a": 2})
    spans = drive(s, ScriptedBackend())
    assert s.done() and sum(sp.phase == "train" and sp.job == "b" for sp in spans) == 2
    assert not audit_on_policy(spans)


@pytest.mark.parametrize("kw", [dict(policy="shared-sync"), dict(policy="overlap", stacks=2),
                                dict(policy="shared-sync", stacks=2, lockstep=True)])
def test_offset_stacks_needs_free_shared_sync_on_two_stacks_or_more(kw):
    with pytest.raises(ConfigError, match="arm.offset_stacks"):
        config_from_args(jobs=4, steps=2, sharing="mps", offset_stacks=True, **kw)


def test_simulated_offset_stacks_start_apart(tmp_path):
    runs = simulate_with_and_without(tmp_path, "offset_stacks", jobs=4, steps=3, policy="shared-sync",
                                     sharing="mps", stacks=2)
    spans = [json.loads(x) for x in (runs[True] / "spans.jsonl").read_text().splitlines()]
    first = {st: min(s["start_s"] for s in spans if s["phase"] == "generate" and s["stack"] == st) for st in (0, 1)}
    end0 = max(s["end_s"] for s in spans if s["phase"] == "generate" and s["stack"] == 0 and s["attrs"]["step"] == 0)
    assert first[0] == 0.0 and first[1] == pytest.approx(end0)
    free, off = (sa.run_alignment(runs[k]) for k in (False, True))
    assert off["train_beside_generate"] > free["train_beside_generate"]
    assert json.loads((runs[True] / "summary.json").read_text())["arm"]["offset_stacks"] is True
    assert "offset_stacks" not in json.loads((runs[False] / "summary.json").read_text())["arm"]


def test_cli_offset_stacks_flag_is_flagged_as_outside_the_profile(capsys):
    from nodus.cli import main

    from nodus.config import STACKS_PAIR_PROFILE

    def flagged(*profile):
        assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "shared-sync", "--stacks", "2",
                     "--offset-stacks", "--json", *profile]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps_per_gpu_hour"] > 0
        return any("arm.offset_stacks" in f for d in out["diagnostics"] for f in d.get("outside_profile", []))

    assert not flagged()  # the shipped stacks profile's lone-trainer rate was fitted on offset stacks
    assert flagged("--profile", STACKS_PAIR_PROFILE)  # the pair's trainer rate, fitted on one stack
    assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "shared-sync", "--stacks", "2",
                 "--offset-stacks", "--lockstep"]) != 0
    assert "choose one" in capsys.readouterr().err


def test_gpu_arms_off_spec_label_and_configuration():
    from calibration.validate import config_key, config_label

    assert parse_arm("shared-sync+mps:k2:off:s1")[-1] == {"stacks": 2, "offset_stacks": True}
    for bad in ("shared-sync+mps:off", "overlap+mps:k2:off", "shared-sync+mps:k2:lock:off"):
        with pytest.raises(SystemExit, match="off starts each stack"):
            parse_arm(bad)
    arm = {"policy": "shared-sync", "sharing": "mps", "groups": 1, "stacks": 2}
    assert arm_label({**arm, "offset_stacks": True}) == "shared-sync/mps/g1/k2+off"
    free, off = {"jobs": 8, "arm": arm}, {"jobs": 8, "arm": {**arm, "offset_stacks": True}}
    assert config_key(free) != config_key(off)
    assert config_label(off) == "8 jobs shared-sync g=1 mps stacks=2 offset"

