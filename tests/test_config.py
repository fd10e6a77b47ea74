"""Config errors name the field and the value; defaults resolve deterministically."""

import pytest

from nodus.config import ConfigError, build_config, load_config
from nodus.simulate import config_from_args


def _err(data) -> str:
    with pytest.raises(ConfigError) as e:
        build_config(data)
    return str(e.value)


def test_unknown_key_is_an_error_naming_it():
    msg = _err({"jobs": [{"task": "gsm8k", "stepz": 3}]})
    assert "jobs.0.stepz" in msg and "unknown key" in msg


def test_unknown_top_level_key():
    assert "arms" in _err({"jobs": [{"task": "gsm8k"}], "arms": {}})


def test_zero_jobs():
    assert "jobs=0" in _err({"jobs": []})


def test_groups_more_than_jobs():
    msg = _err({"jobs": [{"task": "gsm8k"}] * 2, "arm": {"policy": "overlap", "groups": 3}})
    assert "arm.groups=3" in msg and "jobs=2" in msg


def test_overlap_needs_two_groups():
    assert "groups >= 2" in _err({"jobs": [{"task": "gsm8k"}] * 2, "arm": {"policy": "overlap", "groups": 1}})


def test_steps_below_one():
    msg = _err({"jobs": [{"task": "gsm8k", "steps": 0}]})
    assert "jobs.0.steps" in msg and "got jobs.0.steps=0" in msg


def test_unknown_task_and_policy():
    assert "task='gsm9k'" in _err({"jobs": [{"task": "gsm9k"}]})
    assert "arm.policy" in _err({"jobs": [{"task": "gsm8k"}], "arm": {"policy": "overlapp"}})


def test_duplicate_job_ids():
    assert "unique" in _err({"jobs": [{"task": "gsm8k", "id": "a"}, {"task": "sorting", "id": "a"}]})


def test_resolved_fills_ids_and_seeds():
    cfg = build_config({"jobs": [{"task": "gsm8k"}, {"task": "sorting", "seed": 7}], "seed": 3})
    assert [j.id for j in cfg.jobs] == ["job0", "job1"]
    assert [j.seed for j in cfg.jobs] == [3000, 7]


def test_cli_overrides_and_conflicts():
    cfg = config_from_args(jobs=4, policy="shared-sync", steps=5, seed=2)
    assert len(cfg.jobs) == 4 and cfg.arm.groups == 1 and all(j.steps == 5 for j in cfg.jobs)
    with pytest.raises(ConfigError, match="--jobs 4 and the config's jobs"):
        config_from_args({"jobs": [{"task": "gsm8k"}]}, jobs=4)
    with pytest.raises(ConfigError, match="--steps 0"):
        config_from_args(steps=0)


def test_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("jobs: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    ok = tmp_path / "ok.yaml"
    ok.write_text("jobs:\n  - task: gsm8k\n    steps: 2\narm: {policy: shared-sync, groups: 1, sharing: none}\n")
    assert config_from_args(load_config(ok)).jobs[0].steps == 2


def test_group_pins():
    jobs = [{"task": "gsm8k", "group": g} for g in (0, 1, 1)]
    cfg = build_config({"jobs": jobs, "arm": {"policy": "overlap", "groups": 2}})
    from nodus.runner import plan

    assert [g.jobs for g in plan(cfg)._groups] == [["job0"], ["job1", "job2"]]
    assert "pin every job" in _err({"jobs": [{"task": "gsm8k", "group": 0}, {"task": "gsm8k"}],
                                    "arm": {"policy": "overlap", "groups": 2}})
    assert "groups 0..1" in _err({"jobs": [{"task": "gsm8k", "group": 0}, {"task": "gsm8k", "group": 0}],
                                  "arm": {"policy": "overlap", "groups": 2}})


def test_a_new_overlap_run_gets_adapter_slots_for_its_largest_group():
    """One slot per job of the largest group (plan's groups, pinned ones too), at least FREE_SLOTS,
    not one per job: slots past 8 cost every decode step (H200, session 23); a set engine.max_loras
    and other policies are kept."""
    from nodus.runner import FREE_SLOTS
    from nodus.simulate import config_from_args

    def slots(data=None, **kw):
        return config_from_args(data, steps=1, **kw).engine.max_loras

    assert FREE_SLOTS == 8
    assert slots(jobs=16, policy="overlap", groups=2) == 8
    assert slots(jobs=32, policy="overlap", groups=2) == 16
    assert slots(jobs=32, policy="overlap", groups=3) == 11  # 11 + 11 + 10
    assert slots(jobs=16, policy="overlap", groups=4) == 8  # groups of 4, but no fewer than FREE_SLOTS
    assert slots(jobs=8) is None and slots(jobs=2) is None  # the embedded default: one slot per job
    for policy in ("shared-sync", "dedicated", "continuous"):
        assert slots(jobs=16, policy=policy) is None  # every job of a batch at once: one slot each
    assert slots(jobs=16, policy="timeslice", groups=2) is None
    assert slots({"engine": {"max_loras": 16}}, jobs=16, policy="overlap", groups=2) == 16
    pinned = {"jobs": [{"task": "gsm8k", "group": g} for g in [0] * 12 + [1] * 8],
              "arm": {"policy": "overlap", "groups": 2}}
    assert slots(pinned) == 12
    # The slots bound the sequences a step holds: 8 jobs' 512 fit vLLM's default graphs (the
    # configuration measured), where 16 slots' 1024 get 1024-token graphs (size_engine_graphs).
    assert config_from_args(jobs=16, steps=1, policy="overlap", groups=2).engine.cuda_graph_max_tokens is None
    assert config_from_args({"engine": {"max_loras": 16}}, jobs=16, steps=1, policy="overlap",
                            groups=2).engine.cuda_graph_max_tokens == 1024
    # The dedicated baseline drops the arm's slots (nodus.realrun.baseline_pool gives it one per
    # job) and keeps its graph size (an arm without MPS shares its engine with the baseline).
    from nodus.runner import dedicated_of

    sized = config_from_args(jobs=16, steps=1, policy="overlap", groups=2)
    assert dedicated_of(sized).engine.max_loras is None
    wide = config_from_args({"engine": {"max_loras": 16}}, jobs=16, steps=1, policy="overlap", groups=2)
    assert dedicated_of(wide).engine.cuda_graph_max_tokens == wide.engine.cuda_graph_max_tokens == 1024
    # The sized config runs: the simulator admits that many adapters a step, and says so; a real
    # run's table reads its engine's slots.
    from nodus.simulate import render_table, simulate

    row = "| engine adapter slots (adapters one decode step holds) | 8 |"
    summary = simulate(sized)
    assert row in render_table(summary)
    real = dict(summary, diagnostics=[{"engine_max_loras": 8, "engine_max_cpu_loras": 16}])
    assert row in render_table(real)
    # A recorded run replays as recorded: build_config sizes nothing.
    recorded = build_config({"jobs": [{"task": "gsm8k"}] * 16, "arm": {"policy": "overlap", "groups": 2}})
    assert recorded.engine.max_loras is None


def test_one_job_defaults_to_shared_sync_but_explicit_overlap_is_an_error():
    assert config_from_args(jobs=1).arm.policy == "shared-sync"
    with pytest.raises(ConfigError, match="groups >= 2|arm.groups=2 > jobs=1"):
        config_from_args(jobs=1, policy="overlap")


def test_stacks_split_a_shared_arm_and_bad_ones_name_the_problem():
    """arm.stacks: N engine + trainer stacks, each running the policy over its own jobs (balanced by
    predicted work); refused where it has no meaning or too few jobs, with pins."""
    from nodus.config import peak_engine_sequences
    from nodus.runner import n_stacks, plan, stack_jobs

    cfg = config_from_args(jobs=8, policy="overlap", groups=2, stacks=2).resolved()
    assert n_stacks(cfg) == 2 and sorted(len(ids) for ids in stack_jobs(cfg)) == [4, 4]
    sched = plan(cfg)
    assert [s for s, _ in sched.groups] == [0, 0, 1, 1]
    by_stack = {s: sorted(j for t, ids in sched.groups if t == s for j in ids) for s in (0, 1)}
    assert sorted(by_stack[0] + by_stack[1]) == sorted(j.id for j in cfg.jobs)
    assert by_stack == {s: sorted(ids) for s, ids in enumerate(stack_jobs(cfg))}
    # Each engine holds its own stack's jobs' sequences at most (4 jobs x 64, not 8 x 64).
    assert peak_engine_sequences(cfg) == 4 * 64
    assert peak_engine_sequences(config_from_args(jobs=8, policy="overlap", groups=2)) == 8 * 64
    sync = plan(config_from_args(jobs=4, policy="shared-sync", stacks=2).resolved())
    assert [s for s, _ in sync.groups] == [0, 1] and not sync.stagger
    assert n_stacks(config_from_args(jobs=4, policy="timeslice", groups=2)) == 2  # timeslice: its groups
    assert "arm.stacks=3 x 2 group(s) a stack > jobs=4" in _err(
        {"jobs": [{"task": "gsm8k"}] * 4, "arm": {"policy": "overlap", "groups": 2, "stacks": 3}})
    assert "timeslice's stacks are its groups" in _err(
        {"jobs": [{"task": "gsm8k"}] * 4, "arm": {"policy": "timeslice", "groups": 2, "stacks": 2}})
    assert "a dedicated job has its own GPU" in _err(
        {"jobs": [{"task": "gsm8k"}] * 4, "arm": {"policy": "dedicated", "groups": 1, "stacks": 2}})
    assert "pin each job's stack too" in _err({"jobs": [{"task": "gsm8k", "group": g} for g in (0, 1, 0, 1)],
                                               "arm": {"policy": "overlap", "groups": 2, "stacks": 2}})
    # Pins (a recorded run replayed in its own split): each job's stack, and its group within it.
    pins = [{"task": "gsm8k", "stack": st, "group": g} for st, g in ((1, 0), (0, 1), (1, 1), (0, 0))]
    pinned = build_config({"jobs": pins, "arm": {"policy": "overlap", "groups": 2, "stacks": 2}}).resolved()
    assert [(s, g) for s, g in plan(pinned).groups] == [(0, ["job3"]), (0, ["job1"]), (1, ["job0"]), (1, ["job2"])]
    assert "pin every job of each stack to one of groups 0..1" in _err(
        {"jobs": [dict(p, group=0) for p in pins], "arm": {"policy": "overlap", "groups": 2, "stacks": 2}})
    assert "jobs[].stack=[1]" in _err({"jobs": [{"task": "gsm8k", "stack": 1}] * 2,
                                       "arm": {"policy": "shared-sync", "stacks": 2}})
    assert "a stack pin needs arm.stacks > 1" in _err({"jobs": [{"task": "gsm8k", "stack": 0}] * 2,
                                                       "arm": {"policy": "shared-sync"}})
    # One heavy job: every stack still gets its groups (stacks x groups groups, then to stacks).
    skew = build_config({"jobs": [{"task": "gsm8k", "steps": st} for st in (12, 3, 3, 3)],
                         "arm": {"policy": "overlap", "groups": 2, "stacks": 2}}).resolved()
    assert sorted(len(g) for _, g in plan(skew).groups) == [1, 1, 1, 1]
    assert "arm.stacks" in _err({"jobs": [{"task": "gsm8k"}] * 2, "arm": {"policy": "shared-sync", "stacks": 0}})
    # Each engine gets slots for its own stack's jobs; a set engine.max_loras is kept.
    assert config_from_args(jobs=8, policy="overlap", groups=2, stacks=2).engine.max_loras == 4
    assert config_from_args(jobs=8, policy="shared-sync", stacks=2).engine.max_loras == 4
    assert config_from_args(jobs=8, policy="overlap", groups=2).engine.max_loras is None
    # Shared-sync on two stacks co-runs one stack's trainer beside the other's engine.
    from nodus.config import NO_CORUN_POLICIES, corun_key

    assert corun_key("shared-sync", 1) in NO_CORUN_POLICIES and corun_key("shared-sync", 2) not in NO_CORUN_POLICIES
    # Groups within a stack are overlap's only.
    assert "only overlap has groups within a stack" in _err(
        {"jobs": [{"task": "gsm8k", "stack": st, "group": 0} for st in (0, 1)],
         "arm": {"policy": "shared-sync", "stacks": 2}})
