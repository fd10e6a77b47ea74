"""arm.max_lead: how far a continuous (or overlap) arm's jobs may run ahead of the least advanced job
of their stack, through the scheduler, config, CLI, simulator and the GPU scripts' arm specs."""

import functools
import json

import pytest

from experiments.gpu_arms import parse_arm
from experiments.gpu_table import arm_label
from factories import ScriptedBackend
from nodus.accounting import audit_on_policy, job_overlaps
from nodus.config import ConfigError
from nodus.messages import Generate, Train
from nodus.scheduler import Scheduler, drive
from nodus.simulate import config_from_args, simulate


def _continuous(max_lead):
    return Scheduler({j: 3 for j in "ab"}, [(0, ["a"]), (0, ["b"])], stagger=False, merge_trains=True,
                     max_lead=max_lead)


def _step_of(gen: Generate) -> dict[str, int]:
    return {r.job_id: r.step for r in gen.requests}


@pytest.mark.parametrize("max_lead", [None, 0, 1])
def test_a_fast_job_waits_at_its_lead_bound_until_the_slow_one_trains(max_lead):
    """Job a's generations come back at once, b's never (yet): a trains and publishes, and generates
    again only while it is at most max_lead steps ahead of b (b still at version 0)."""
    s, b = _continuous(max_lead), ScriptedBackend()
    finish = functools.partial(b.answer, s)
    gen_a, gen_b = s.start()
    fast_steps = []
    actions = finish(gen_a)
    while actions:  # drive a alone, holding b's generation back
        nxt = []
        for a in actions:
            if isinstance(a, Generate):
                fast_steps.append(_step_of(a)["a"])
            nxt += finish(a)
        actions = nxt
    # a's generations of steps 1 and 2 go only as far as the bound lets them past b (at version 0).
    assert fast_steps == {None: [1, 2], 0: [], 1: [1]}[max_lead]
    held = [g for g in s._groups if g.state == "leading"]
    assert [g.jobs for g in held] == ([] if max_lead is None else [["a"]])
    # b's generation lands and trains (a has nothing queued): the end of b's train releases a's
    # next step, and b's publish b's own.
    (train_b,) = finish(gen_b)
    assert isinstance(train_b, Train) and [r.job_id for r in train_b.batches] == ["b"]
    after_train = finish(train_b)
    pub_b = after_train[0]
    released = after_train[1:] + finish(pub_b)
    steps = sorted((j, st) for g in released if isinstance(g, Generate) for j, st in _step_of(g).items())
    want = {None: [("b", 1)], 0: [("a", 1), ("b", 1)], 1: [("a", 2), ("b", 1)]}[max_lead]
    assert steps == want
    assert [_step_of(g) for g in after_train[1:]] == ([] if max_lead is None else [{"a": want[0][1]}])
    spans = _drive_rest(s, b, released)
    assert s.done() and not audit_on_policy(spans) and not job_overlaps(spans)


def _drive_rest(s, b, pending):
    b.queue.clear()
    actions = pending
    while True:
        for a in actions:
            {Generate: b.generate, Train: b.train}.get(type(a), b.publish)(a)
        if s.done():
            return s.spans
        actions = s.on_result(b.wait())


def test_a_finished_job_holds_no_one_back():
    """The least advanced job counts only while it is under way: once b has run its steps, a is
    released however far ahead of b's last version it would be."""
    s = Scheduler({"a": 4, "b": 1}, [(0, ["a"]), (0, ["b"])], stagger=False, merge_trains=True, max_lead=0)
    spans = drive(s, ScriptedBackend())
    assert s.done()
    assert max(sp.attrs["new_version"] for sp in spans if sp.phase == "train" and sp.job == "a") == 4


def test_negative_lead_is_refused():
    with pytest.raises(ValueError, match="max_lead=-1"):
        _continuous(-1)


@pytest.mark.parametrize("policy", ["shared-sync", "dedicated", "timeslice"])
def test_max_lead_needs_a_policy_whose_jobs_run_apart(policy):
    with pytest.raises(ConfigError, match=f"arm.max_lead=0 with policy='{policy}'"):
        config_from_args(jobs=4, steps=2, policy=policy, groups=2 if policy == "timeslice" else None,
                         sharing="none" if policy != "shared-sync" else "mps", max_lead=0)


def _sim(tmp_path, name, **kw):
    out = tmp_path / name
    cfg = config_from_args(jobs=8, steps=6, policy="continuous", sharing="mps", seed=1, **kw)
    return simulate(cfg, str(out)), out


def test_simulated_lead_bound_keeps_jobs_in_step_and_ends_them_together(tmp_path):
    """Unbounded, the short-response jobs of the 8-job workload run ahead and end well before the
    others; with max_lead 0 no job generates step s before every job of its stack trained s - 1,
    and the jobs end closer together."""
    free, free_dir = _sim(tmp_path, "free")
    bound, bound_dir = _sim(tmp_path, "lead0", max_lead=0)
    spans = [json.loads(x) for x in (bound_dir / "spans.jsonl").read_text().splitlines()]
    trained = {}  # (job, version) -> when the train making it ended
    for sp in spans:
        if sp["phase"] == "train":
            trained[(sp["job"], sp["attrs"]["new_version"])] = sp["end_s"]
    jobs = {sp["job"] for sp in spans}
    for sp in spans:
        step = sp["attrs"].get("step") if sp["phase"] == "generate" else None
        if step:
            assert sp["start_s"] >= max(trained[(j, step)] for j in jobs) - 1e-9
    finish = {name: [j["finish_s"] for j in run["per_job"].values()] for name, run in
              (("free", free), ("bound", bound))}
    spread = {k: max(v) - min(v) for k, v in finish.items()}
    assert spread["bound"] < 0.5 * spread["free"]
    assert json.loads((bound_dir / "summary.json").read_text())["arm"]["max_lead"] == 0
    assert "max_lead" not in json.loads((free_dir / "summary.json").read_text())["arm"]


def test_cli_max_lead_flag(capsys):
    from nodus.cli import main

    assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "continuous", "--max-lead", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arm"]["max_lead"] == 1
    assert main(["sim", "--jobs", "4", "--steps", "2", "--policy", "shared-sync", "--max-lead", "1"]) != 0
    assert "arm.max_lead=1 with policy='shared-sync'" in capsys.readouterr().err


def test_gpu_arm_spec_lead():
    assert parse_arm("continuous+mps:cg:lead0")[6] == {"trainer_graphs": True, "max_lead": 0}
    with pytest.raises(SystemExit, match="continuous or overlap arm only"):
        parse_arm("shared-sync+mps:lead1")


def test_table_label_names_the_lead_bound():
    base = {"policy": "continuous", "sharing": "mps", "groups": 1}
    assert arm_label({**base, "max_lead": 0}) == arm_label(base) + "+lead0"
    assert "+lead" not in arm_label(base)
