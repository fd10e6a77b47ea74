"""Jobs that arrive after the start (jobs[].arrive_s): they join their group at a step boundary,
stay strictly on-policy, and are billed and slowed from their arrival."""

import pytest

from factories import ScriptedBackend, create_config
from nodus.accounting import audit_on_policy, job_overlaps
from nodus.config import ConfigError, build_config
from nodus.messages import Generate
from nodus.runner import dedicated_of
from nodus.scheduler import Scheduler, drive
from nodus.simulate import config_from_args, simulate


def _generates(backend) -> list[Generate]:
    return [a for a in backend.log if isinstance(a, Generate)]


def test_a_late_job_joins_its_groups_first_generation_after_it_arrives():
    """Shared-sync, one group: b arrives at 2.5 s. Each action takes 1 s (generate 0-1, train 1-2,
    publish 2-3), so b is left out of the generation at 0 and joins the one at 3, at its step 0
    beside a's step 1."""
    s = Scheduler({"a": 3, "b": 2}, [(0, ["a", "b"])], stagger=False, arrivals={"b": 2.5})
    b = ScriptedBackend()
    spans = drive(s, b)
    gens = _generates(b)
    assert [[(r.job_id, r.step) for r in g.requests] for g in gens] == [
        [("a", 0)], [("a", 1), ("b", 0)], [("a", 2), ("b", 1)]]
    assert all(g.not_before_s is None for g in gens)
    assert s.jobs["a"].version == 3 and s.jobs["b"].version == 2
    assert audit_on_policy(spans) == [] and job_overlaps(spans) == []


def test_a_group_none_of_whose_jobs_has_arrived_waits_for_the_first():
    s = Scheduler({"a": 1, "b": 1, "c": 1}, [(0, ["a"]), (0, ["b", "c"])], stagger=False,
                  arrivals={"b": 7.0, "c": 9.0})
    (ga, gb) = s.start()
    assert [r.job_id for r in ga.requests] == ["a"] and ga.not_before_s is None
    # Group 1 waits for b (7 s) and takes only b; c (9 s) joins a later generation.
    assert gb.not_before_s == 7.0 and [r.job_id for r in gb.requests] == ["b"]


def test_a_job_left_alone_in_its_group_waits_for_the_late_one_and_every_step_runs():
    """a finishes before b arrives: the group's next generation waits for b (not_before_s) and b
    runs all its steps."""
    s = Scheduler({"a": 1, "b": 2}, [(0, ["a", "b"])], stagger=False, arrivals={"b": 50.0})
    b = ScriptedBackend()
    drive(s, b)
    gens = _generates(b)
    assert [r.job_id for r in gens[0].requests] == ["a"]
    assert gens[1].not_before_s == 50.0 and [(r.job_id, r.step) for r in gens[1].requests] == [("b", 0)]
    assert s.jobs["b"].version == 2 and s.done()


def test_staggered_groups_start_in_order_of_arrival():
    """Overlap: the group whose jobs arrive first starts; the other group's start waits for its
    first generation to end (the stagger), not the other way round."""
    s = Scheduler({"a": 2, "b": 2}, [(0, ["a"]), (0, ["b"])], stagger=True, arrivals={"a": 30.0})
    (first,) = s.start()
    assert [r.job_id for r in first.requests] == ["b"] and first.not_before_s is None


def test_timeslice_runs_a_stacks_jobs_in_order_of_arrival():
    s = Scheduler({"a": 1, "b": 1}, [(0, ["a"]), (0, ["b"])], concurrent=False, arrivals={"a": 5.0})
    b = ScriptedBackend()
    drive(s, b)
    assert [g.requests[0].job_id for g in _generates(b)] == ["b", "a"]


def test_a_resumed_job_is_under_way_at_once_whatever_its_arrival():
    """A run resumed from checkpoints (start_versions) starts a job that had begun before at once;
    one that had not yet begun still waits for its arrival."""
    s = Scheduler({"a": 3, "b": 3, "c": 3}, [(0, ["a", "b", "c"])], stagger=False,
                  arrivals={"b": 40.0, "c": 40.0}, start_versions={"b": 1})
    (g,) = s.start()
    assert [(r.job_id, r.step) for r in g.requests] == [("a", 0), ("b", 1)] and g.not_before_s is None


def test_arrivals_of_unknown_jobs_or_negative_times_are_errors():
    with pytest.raises(ValueError, match="in no group.*'z'"):
        Scheduler({"a": 1}, [(0, ["a"])], arrivals={"z": 1.0})
    with pytest.raises(ValueError, match="seconds >= 0"):
        Scheduler({"a": 1}, [(0, ["a"])], arrivals={"a": -1.0})


@pytest.mark.parametrize("policy,groups", [("shared-sync", 1), ("overlap", 2), ("continuous", 1), ("timeslice", 2)])
def test_simulated_late_jobs_start_after_they_arrive_and_are_billed_from_there(policy, groups):
    cfg = config_from_args(jobs=4, policy=policy, groups=groups, steps=4, arrive_every=15.0)
    s = simulate(cfg)
    alone = simulate(dedicated_of(cfg))["per_job"]  # the baseline the summary's slowdowns are over
    assert s["steps"] == 16 and s["stale_rollouts"] == 0
    for i in range(4):
        d = s["per_job"][f"job{i}"]
        assert d["steps"] == 4
        if i == 0:
            assert "arrive_s" not in d
            continue
        assert d["arrive_s"] == 15.0 * i
        assert d["start_s"] >= d["arrive_s"] - 1e-9 and d["wait_s"] == pytest.approx(d["start_s"] - d["arrive_s"])
        # slowed from its arrival: its time on the shared GPU over its time alone
        assert d["slowdown_vs_alone"] == pytest.approx((d["finish_s"] - d["arrive_s"]) / alone[f"job{i}"]["finish_s"])
    assert s["pace"] == {}  # the jobs were never all under way from the start: no steady pace


def test_arrivals_leave_the_dedicated_baseline_alone_and_cost_the_shared_gpu():
    """A dedicated job has its own GPU from its arrival, so the baseline is the same; the shared GPU
    is booked while it waits for the late jobs, so spreading arrivals lowers its steps/GPU-h."""
    together = simulate(config_from_args(jobs=4, policy="shared-sync", steps=4))
    apart = simulate(config_from_args(jobs=4, policy="shared-sync", steps=4, arrive_every=20.0))
    assert apart["dedicated_steps_per_gpu_hour"] == pytest.approx(together["dedicated_steps_per_gpu_hour"])
    assert apart["steps"] == together["steps"]
    assert apart["gpu_seconds"] > together["gpu_seconds"] + 20.0
    assert apart["steps_per_gpu_hour"] < together["steps_per_gpu_hour"]


def test_no_arrivals_and_all_at_zero_run_the_same():
    base = simulate(config_from_args(jobs=4, steps=3))
    zero = simulate(config_from_args(jobs=4, steps=3, arrive_every=0.0))
    cfg = create_config(jobs=4, steps=3, arrive_s=0.0)
    assert [j.arrive_s for j in cfg.jobs] == [0.0] * 4
    assert zero["steps_per_gpu_hour"] == pytest.approx(base["steps_per_gpu_hour"])
    assert zero["pace"] == base["pace"] != {}


def test_bad_arrivals_are_clear_errors():
    with pytest.raises(ValueError, match="first job arrives at 5 s.*shift the arrivals"):
        create_config(jobs=2, arrive_s=5.0)
    with pytest.raises(ValueError, match="arrive_s"):
        create_config(jobs=2, arrive_s=-1.0)
    with pytest.raises(ValueError, match="arrive_s"):
        create_config(jobs=2, arrive_s=float("inf"))
    lock = {"jobs": [{"task": "gsm8k"}, {"task": "modular", "arrive_s": 3.0}],
            "arm": {"policy": "shared-sync", "groups": 1, "stacks": 2, "lockstep": True}}
    with pytest.raises(ValueError, match="arrive_s with arm.lockstep"):
        build_config(lock)
    with pytest.raises(ConfigError, match="--arrive-every -1"):
        config_from_args(jobs=2, arrive_every=-1.0)
    with pytest.raises(ConfigError, match="both set arrivals"):
        config_from_args({"jobs": [{"task": "gsm8k"}, {"task": "modular", "arrive_s": 3.0}]}, arrive_every=5.0)


def test_nodus_sim_arrive_every_reports_the_waits(capsys):
    from nodus.cli import main

    assert main(["sim", "--jobs", "4", "--steps", "3", "--policy", "shared-sync", "--arrive-every", "10"]) == 0
    out = capsys.readouterr().out
    assert "| jobs arriving after the start / seconds a job waited to start, mean / max | 3 / " in out
    assert "per-job slowdown vs alone (from its arrival)" in out
    assert "steady pace" not in out
    assert main(["sim", "--jobs", "2", "--arrive-every", "nan"]) == 2
    assert "--arrive-every nan" in capsys.readouterr().err
