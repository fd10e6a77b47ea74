"""arm.max_active: at most N jobs under way at once; the rest queue (by arrival, then job order) and
start as running jobs end."""

import pytest

from factories import ScriptedBackend
from nodus.accounting import audit_on_policy
from nodus.config import build_config
from nodus.messages import Generate
from nodus.runner import run_spans
from nodus.scheduler import Scheduler, drive
from nodus.simulate import config_from_args, simulate
from sim import backend_factory


def _gens(backend):
    return [[(r.job_id, r.step) for r in a.requests] for a in backend.log if isinstance(a, Generate)]


def test_a_queued_job_joins_the_first_generation_after_a_running_job_ends():
    s = Scheduler({"a": 1, "b": 2, "c": 2}, [(0, ["a", "b", "c"])], stagger=False, max_active=2)
    b = ScriptedBackend()
    spans = drive(s, b)
    assert _gens(b) == [[("a", 0), ("b", 0)], [("b", 1), ("c", 0)], [("c", 1)]]
    assert audit_on_policy(spans) == [] and s.done()


def test_slots_go_in_order_of_arrival_then_job_across_groups():
    """continuous, one slot: each job waits for the one before it to end; b arrives before c, so b
    goes first although c's group comes first."""
    s = Scheduler({"a": 1, "c": 1, "b": 1}, [(0, ["a"]), (0, ["c"]), (0, ["b"])], stagger=False,
                  merge_trains=True, max_active=1, arrivals={"c": 0.5, "b": 0.2})
    b = ScriptedBackend()
    drive(s, b)
    assert _gens(b) == [[("a", 0)], [("b", 0)], [("c", 0)]]


def test_bad_caps_are_errors():
    with pytest.raises(ValueError, match="max_active=0"):
        Scheduler({"a": 1}, [(0, ["a"])], max_active=0)
    with pytest.raises(ValueError, match="arm.max_active=2 with policy='dedicated'"):
        build_config({"jobs": [{"task": "gsm8k"}], "arm": {"policy": "dedicated", "groups": 1, "max_active": 2}})
    with pytest.raises(ValueError, match="arm.max_active with arm.lockstep"):
        build_config({"jobs": [{"task": "gsm8k"}, {"task": "sorting"}],
                      "arm": {"policy": "shared-sync", "groups": 1, "stacks": 2, "lockstep": True, "max_active": 1}})
    with pytest.raises(ValueError, match="max_active"):
        config_from_args(jobs=2, max_active=0)


@pytest.mark.parametrize("policy,groups", [("shared-sync", 1), ("overlap", 2), ("continuous", 1)])
def test_a_capped_gpu_runs_at_most_that_many_jobs_and_reports_their_waits(policy, groups):
    cfg = config_from_args(jobs=8, policy=policy, groups=groups, steps=3, max_active=4)
    assert cfg.engine.max_loras == 4  # an adapter slot for each job under way
    s = simulate(cfg)
    assert s["steps"] == 24 and s["stale_rollouts"] == 0 and s["arm"]["max_active"] == 4
    # Under way: from a job's first generation to its last train (a slot frees as the train ends).
    (spans,) = run_spans(cfg, backend_factory(cfg.profile))
    first = {j: min(x.start_s for x in spans if x.job == j and x.phase == "generate") for j in s["per_job"]}
    last = {j: max(x.end_s for x in spans if x.job == j and x.phase == "train") for j in s["per_job"]}
    for j, t in first.items():  # at any job's start at most 4 are under way, itself included
        assert sum(1 for k in first if first[k] <= t + 1e-9 and last[k] > t + 1e-9) <= 4
    assert sorted(first.values())[4] >= min(last.values()) - 1e-9  # the fifth starts as the first ends
    assert all(d["arrive_s"] == 0.0 and d["wait_s"] == pytest.approx(d["start_s"]) for d in s["per_job"].values())
    assert s["pace"] == {}  # the jobs were never all under way together
    free = simulate(config_from_args(jobs=8, policy=policy, groups=groups, steps=3))
    assert s["dedicated_steps_per_gpu_hour"] == pytest.approx(free["dedicated_steps_per_gpu_hour"])


def test_nodus_sim_max_active_says_so(capsys):
    from nodus.cli import main

    assert main(["sim", "--jobs", "6", "--steps", "2", "--policy", "continuous", "--max-active", "2"]) == 0
    out = capsys.readouterr().out
    assert "(groups 1, sharing mps, at most 2 under way)" in out
    assert "| jobs arriving after the start / seconds a job waited to start, mean / max | 0 / " in out



@pytest.mark.parametrize("arrivals, first", [({"a": 1.0}, "b"), ({}, "a")])
def test_offset_stacks_start_with_the_stack_whose_job_is_first_in_the_queue(arrivals, first):
    """Offset stacks start one at a time, the next as the first one's first generation ends. A
    stack whose only job arrives later, and under one slot queues behind the other stack's job,
    must not start first: it could not generate, and would never cue the stack holding the job
    that can (hypothesis found it: two jobs, one slot, stack 0's job arriving at 1 s). With every
    job at once the queue is in job order and stack 0 starts, as before."""
    s = Scheduler({"a": 1, "b": 2}, [(0, ["a"]), (1, ["b"])], stagger=False, offset_stacks=True,
                  max_active=1, arrivals=arrivals)
    b = ScriptedBackend()
    spans = drive(s, b)
    assert s.done() and audit_on_policy(spans) == []
    assert _gens(b)[0] == [(first, 0)]
