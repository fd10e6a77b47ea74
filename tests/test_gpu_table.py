"""experiments/gpu_table.py on runs the simulator recorded: ratios against the first dedicated
run, the second one as A/A, and the simulator's replay beside each point."""

import json

import pytest

from nodus.simulate import config_from_args, simulate



def _simulated(tmp_path, arms, diagnostics=None, **common) -> list[str]:
    """Simulated run folders under ``tmp_path``, one per (name, config arguments) of ``arms`` (each
    with ``common`` too); ``diagnostics``: written into each summary, as a real run records them."""
    runs = []
    for name, kw in arms:
        out = tmp_path / name
        simulate(config_from_args(**common, **kw), out)
        if diagnostics is not None:
            summary = json.loads((out / "summary.json").read_text())
            summary["diagnostics"] = diagnostics
            (out / "summary.json").write_text(json.dumps(summary))
        runs.append(str(out))
    return runs


def test_gpu_table_ratios_aa_and_sim_beside(tmp_path):
    from experiments.gpu_table import main

    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("ded-aa", dict(policy="dedicated", sharing="none")),
                                 ("ovl", dict(policy="overlap", groups=2, sharing="mps"))), jobs=4, steps=3, seed=2)
    table = main(runs + ["--out", str(tmp_path / "t" / "table")])
    ded, ovl = table["arms"]["dedicated/none/g1/4jobs"]["2"], table["arms"]["overlap/mps/g2/4jobs"]["2"]
    assert ded["ratio_vs_dedicated"] == 1.0 and ded["slowdown_vs_alone"] is None
    measured = json.loads((tmp_path / "ovl" / "summary.json").read_text())["steps_per_gpu_hour"]
    base = json.loads((tmp_path / "ded" / "summary.json").read_text())["steps_per_gpu_hour"]
    assert ovl["ratio_vs_dedicated"] == pytest.approx(measured / base)
    # Runs the simulator recorded, replayed on the same profile: the prediction is the measurement.
    assert ovl["sim_steps_per_gpu_hour"] == pytest.approx(measured, rel=1e-9)
    assert table["aa"]["4-s2"]["rel_diff"] == pytest.approx(0.0)  # the simulator is deterministic
    assert ded["repeats"] == [runs[0], runs[1]]  # both dedicated runs: one row, phase times their mean
    assert ovl["slowdown_vs_alone"]["min"] > 1.0
    assert all((tmp_path / "t" / f"table.{ext}").is_file() for ext in ("json", "md", "png"))


def _dedicated_beside_overlap(tmp_path, ded_jobs: int, shared_jobs: int, steps: int, seed: int):
    """A simulated dedicated run and an overlap + MPS run of another job count, tabulated: (the
    table, the dedicated run's per-job summaries, the overlap run's summary)."""
    from experiments.gpu_table import main

    ded, ovl = tmp_path / "ded", tmp_path / "ovl"
    simulate(config_from_args(jobs=ded_jobs, steps=steps, seed=seed, policy="dedicated", sharing="none"), ded)
    simulate(config_from_args(jobs=shared_jobs, steps=steps, seed=seed, policy="overlap", groups=2, sharing="mps"),
             ovl)
    table = main([str(ded), str(ovl), "--out", str(tmp_path / "t")])
    return (table, json.loads((ded / "summary.json").read_text())["per_job"],
            json.loads((ovl / "summary.json").read_text()))


def test_gpu_table_takes_a_smaller_runs_baseline_from_a_larger_dedicated_run(tmp_path):
    """A 2-job shared run next to a 4-job dedicated run only: the baseline is the dedicated run's
    first two jobs (their steps over their GPU-seconds alone), for measured and simulated alike."""
    table, ded, ovl = _dedicated_beside_overlap(tmp_path, ded_jobs=4, shared_jobs=2, steps=3, seed=5)
    two = [ded[j] for j in ovl["per_job"]]
    base = 3600 * sum(d["steps"] for d in two) / sum(d["finish_s"] for d in two)
    row = table["arms"]["overlap/mps/g2/2jobs"]["5"]
    assert row["ratio_vs_dedicated"] == pytest.approx(ovl["steps_per_gpu_hour"] / base)
    assert row["sim_ratio_vs_dedicated"] == pytest.approx(row["ratio_vs_dedicated"], rel=1e-9)
    assert row["slowdown_vs_alone"]["min"] > 1.0


def test_gpu_table_takes_a_larger_runs_baseline_by_task(tmp_path):
    """16 shared jobs beside an 8-job dedicated run: jobs 8-15 have no dedicated run, each stands
    in with the dedicated job of its task (same length model); the row says so."""
    table, ded, ovl = _dedicated_beside_overlap(tmp_path, ded_jobs=8, shared_jobs=16, steps=2, seed=3)
    by_task = {d["task"]: j for j, d in sorted(ded.items(), reverse=True)}  # ids job0-7: one per task
    assert len(by_task) == 8
    stand_in = [by_task[d["task"]] for d in ovl["per_job"].values()]
    base = 3600 * sum(ded[j]["steps"] for j in stand_in) / sum(ded[j]["finish_s"] for j in stand_in)
    row = table["arms"]["overlap/mps/g2/16jobs"]["3"]
    assert row["baseline_by_task"] is True
    assert row["ratio_vs_dedicated"] == pytest.approx(ovl["steps_per_gpu_hour"] / base)
    assert table["arms"]["dedicated/none/g1"]["3"]["baseline_by_task"] is False


def test_arm_label_names_changed_mps_settings():
    from experiments.gpu_table import arm_label

    arm = {"policy": "overlap", "sharing": "mps", "groups": 2}
    assert arm_label(arm) == "overlap/mps/g2"
    controls = {"trainer_priority": "below-normal", "engine_thread_pct": None, "trainer_thread_pct": 60}
    assert arm_label(arm, {"diagnostics": [{"sharing_controls": controls}]}) == "overlap/mps/g2+lowpri+t60"
    # Each prompt's responses packed K to a row (trainer.share_prompts): its own arm, not a repeat.
    assert arm_label(arm, None, {"share_prompts": 4}) == "overlap/mps/g2+sp4"
    assert arm_label(arm, None, {"share_prompts": 0}) == "overlap/mps/g2"
    default = {"trainer_priority": "normal", "engine_thread_pct": None, "trainer_thread_pct": None}
    assert arm_label(arm, {"diagnostics": [{"sharing_controls": default}]}) == "overlap/mps/g2"
    core = {"sharing_controls": default, "engine_core_process": True}
    assert arm_label(arm, {"diagnostics": [core]}) == "overlap/mps/g2+ep"
    assert arm_label(arm, {"diagnostics": [dict(core, cuda_graph_max_tokens=1024)]}) == "overlap/mps/g2+ep+gm1024"
    # An engine with more adapter slots than the run's jobs (started for a larger arm): +ls<N>.
    wide = {"jobs": 8, "diagnostics": [dict(core, cuda_graph_max_tokens=1024, engine_max_loras=16)]}
    assert arm_label(arm, wide) == "overlap/mps/g2+ep+gm1024+ls16"
    assert arm_label(arm, {"jobs": 16, "diagnostics": [dict(core, engine_max_loras=16)]}) == "overlap/mps/g2+ep"
    # Adapters published into pageable host memory (:np): right after +freed, before the rest.
    unpinned = {"sharing_controls": controls, "publish_pinned": False}
    assert arm_label(arm, {"diagnostics": [unpinned]}) == "overlap/mps/g2+np+lowpri+t60"
    freed = dict(arm, trainer_waits_for_publish=False)
    assert arm_label(freed, {"diagnostics": [unpinned]}) == "overlap/mps/g2+freed+np+lowpri+t60"
    assert arm_label(arm, {"diagnostics": [dict(unpinned, publish_pinned=True)]}) == "overlap/mps/g2+lowpri+t60"
    # The trainers' CPU threads capped (RealOptions.trainer_cpu_threads): +cpu<N>; a trainer on
    # torch's own (None recorded, or runs before the field) carries no label.
    graphed = {"workers": {"trainer0": {"step_mode": "graphed", "compiled": ["RMSNorm"], "cpu_threads": 2}}}
    assert arm_label(arm, {"diagnostics": [graphed]}) == "overlap/mps/g2+cg+cpu2"
    graphed["workers"]["trainer0"]["cpu_threads"] = None
    assert arm_label(arm, {"diagnostics": [graphed]}) == "overlap/mps/g2+cg"
    # Session 28's call c recorded torch's own count itself (no torch_threads beside it): no cap.
    graphed["workers"]["trainer0"]["cpu_threads"] = 16
    assert arm_label(arm, {"diagnostics": [dict(graphed, host={"cpus": 16})]}) == "overlap/mps/g2+cg"
    # Since, a count recorded beside torch_threads is a cap asked for, whatever the host's CPUs.
    graphed["workers"]["trainer0"].update(cpu_threads=16, torch_threads=16)
    assert arm_label(arm, {"diagnostics": [dict(graphed, host={"cpus": 16})]}) == "overlap/mps/g2+cg+cpu16"
    # The engines' CPU threads capped (RealOptions.engine_cpu_threads): +ecpu<N>.
    engine_capped = {"workers": {"engine0": {"cpu_threads": 1, "torch_threads": 1}, **graphed["workers"]}}
    assert arm_label(arm, {"diagnostics": [dict(engine_capped, host={"cpus": 16})]}) == "overlap/mps/g2+cg+cpu16+ecpu1"
    # Two stacks' trainers, one whose capture failed (it trained eager): +cg1of2, not a graphed run.
    two = {"workers": {"trainer0": {"step_mode": "graphed", "compiled": ["RMSNorm"]},
                       "trainer1": {"step_mode": "eager", "compiled": ["RMSNorm"], "graph_error": "OutOfMemoryError"}}}
    assert arm_label(arm, {"diagnostics": [two]}) == "overlap/mps/g2+cg1of2"
    two["workers"]["trainer0"]["step_mode"] = "eager"
    assert arm_label(arm, {"diagnostics": [two]}) == "overlap/mps/g2"


def test_gpu_table_splits_the_ratio_into_batching_overlap_and_mps(tmp_path):
    """The ladder dedicated -> shared-sync -> overlap -> overlap + MPS: each factor is one arm
    over the arm that differs from it in one thing, and their product is the total ratio."""
    from experiments.gpu_table import main

    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("sync", dict(policy="shared-sync", sharing="none")),
                                 ("ovl", dict(policy="overlap", groups=2, sharing="none")),
                                 ("ovl-mps", dict(policy="overlap", groups=2, sharing="mps"))), jobs=4, steps=3, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    f = table["factors"]["4"]["1"]
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"]
           for k in ("ded", "sync", "ovl", "ovl-mps")}
    assert f["batching"] == pytest.approx(sph["sync"] / sph["ded"])
    assert f["overlap"] == pytest.approx(sph["ovl"] / sph["sync"])
    assert f["batching"] * f["overlap"] * f["mps_with_overlap"] == pytest.approx(f["total"])
    assert "mps_without_overlap" not in f  # no shared-sync + MPS run
    assert "Where the ratio comes from" in (tmp_path / "t.md").read_text()


def test_learning_guard_joins_the_table():
    """A `nodus compare` report's verdicts, per compared arm, with the criteria that failed."""
    from experiments.gpu_table import _render_learning, learning_guard

    ci = {"mean": -0.02, "lo": -0.06, "hi": 0.01, "n": 128, "resample": "(job, seed) clusters"}
    report = {"baseline": "dedicated/none/g1", "arms": [
        {"arm": "dedicated/none/g1", "vs_baseline": None},
        {"arm": "overlap/mps/g2", "vs_baseline": {
            "seeds": [1, 2], "ratios": [2.2, 3.1], "acc_diff": ci, "reward_diff": ci,
            "gate": {"pass": False, "criteria": {"ratio_every_seed": {"pass": True},
                                                 "acc_ci_lower": {"pass": False}}}}}]}
    guard = learning_guard(report, "compare.json")
    assert list(guard["arms"]) == ["overlap/mps/g2"]
    assert guard["arms"]["overlap/mps/g2"]["failed"] == ["acc_ci_lower"]
    text = "\n".join(_render_learning(guard))
    assert "FAIL (acc_ci_lower)" in text and "-0.020 [-0.060, +0.010]" in text


def test_runs_under_a_prefix_are_simulated_on_their_own_profile(tmp_path):
    """Runs made on another host go to that host's profile: replaying a run the simulator
    recorded on profile B is exact on B, not on the default profile."""
    from experiments.gpu_table import main
    from sim.profile import load_profile

    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["train"]["per_microbatch"]["a_s"] *= 3  # a slower host's trainer
    other = tmp_path / "hostb.json"
    other.write_text(json.dumps(prof))
    simulate(config_from_args(jobs=2, steps=2, seed=4, policy="dedicated", sharing="none", profile=str(other)),
             tmp_path / "hostb" / "ded")
    simulate(config_from_args(jobs=2, steps=2, seed=4, policy="overlap", groups=2, sharing="mps",
                              profile=str(other)), tmp_path / "hostb" / "ovl")
    runs = [str(tmp_path / "hostb" / "ded"), str(tmp_path / "hostb" / "ovl")]
    table = main(runs + ["--out", str(tmp_path / "t"), "--run-profile", f"{tmp_path / 'hostb'}={other}",
                         "--note", "seed 4 ran on host B"])
    row = table["arms"]["overlap/mps/g2/2jobs"]["4"]
    measured = json.loads((tmp_path / "hostb" / "ovl" / "summary.json").read_text())["steps_per_gpu_hour"]
    assert row["sim_profile"] == str(other)
    assert row["sim_steps_per_gpu_hour"] == pytest.approx(measured, rel=1e-9)
    default = main(runs + ["--out", str(tmp_path / "t2")])["arms"]["overlap/mps/g2/2jobs"]["4"]
    assert default["sim_steps_per_gpu_hour"] != pytest.approx(measured, rel=1e-3)
    assert "- seed 4 ran on host B" in (tmp_path / "t.md").read_text()
    with pytest.raises(SystemExit):
        main(runs + ["--out", str(tmp_path / "t3"), "--run-profile", "no-equals-sign"])


def test_without_a_profile_each_run_is_simulated_on_its_shipped_profile(tmp_path):
    """No --profile: each run on the shipped profile its recorded GPU, trainer and stacks call for
    (``run_profile``), the header naming each; --profile still prices every run on one."""
    from experiments.gpu_table import main
    from nodus.config import DEFAULT_PROFILE, H100_ONESTACK_PROFILE, H100_STACKS_PROFILE

    h100 = [{"gpu": {"name": "NVIDIA H100 80GB HBM3", "total_gib": 79.6},
             "sharing_controls": {"trainer_priority": "below-normal"}, "workers": {"trainer0": {"step_mode": "graphed"}}}]
    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("k2", dict(policy="shared-sync", sharing="mps", stacks=2)),
                                 ("ovl", dict(policy="overlap", groups=2, sharing="mps"))),
                      diagnostics=h100, jobs=4, steps=2, seed=1, profile=H100_STACKS_PROFILE)
    table = main(runs + ["--out", str(tmp_path / "t")])
    by_policy = {label.split("/")[0]: seeds["1"] for label, seeds in table["arms"].items()}
    assert by_policy["shared-sync"]["sim_profile"] == H100_STACKS_PROFILE == by_policy["dedicated"]["sim_profile"]
    assert by_policy["overlap"]["sim_profile"] == H100_ONESTACK_PROFILE
    assert table["shipped_profiles"] == {H100_ONESTACK_PROFILE: 1, H100_STACKS_PROFILE: 2}
    assert f"each run's shipped profile (`{H100_ONESTACK_PROFILE}`: 1 run, " in (tmp_path / "t.md").read_text()
    one = main(runs + ["--out", str(tmp_path / "t2"), "--profile", DEFAULT_PROFILE])
    assert {r["1"]["sim_profile"] for r in one["arms"].values()} == {DEFAULT_PROFILE} and "shipped_profiles" not in one


def test_a_folder_that_is_no_run_is_refused_by_name(tmp_path, capsys):
    from experiments.gpu_table import main

    with pytest.raises(SystemExit) as err:
        main([str(tmp_path), "--out", str(tmp_path / "t")])
    assert err.value.code == 2 and f"'{tmp_path}' is not a recorded run" in capsys.readouterr().err


def test_a_run_at_another_micro_batch_size_is_its_own_row():
    from experiments.gpu_table import arm_label

    arm = {"policy": "overlap", "sharing": "mps", "groups": 2}
    assert arm_label(arm, None, {"max_tokens_per_microbatch": 16384}) == "overlap/mps/g2"
    assert arm_label(arm, None, {"max_tokens_per_microbatch": 32768}) == "overlap/mps/g2+mb32k"
    assert arm_label(arm, None, {"max_tokens_per_microbatch": 5000}) == "overlap/mps/g2+mb5000"


def test_a_run_whose_trainer_was_freed_before_the_publish_is_its_own_row():
    from experiments.gpu_table import arm_label

    arm = {"policy": "overlap", "sharing": "mps", "groups": 2}
    assert arm_label(dict(arm, trainer_waits_for_publish=False)) == "overlap/mps/g2+freed"
    assert arm_label(dict(arm, trainer_waits_for_publish=True)) == "overlap/mps/g2"
    assert arm_label(arm) == "overlap/mps/g2"  # recorded before the field: it waited, the default


def test_timelines_draw_a_seeds_ladder_arms_on_one_axis(tmp_path):
    from experiments.gpu_table import main, plot_timelines

    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("ovl-mps", dict(policy="overlap", groups=2, sharing="mps"))), jobs=8, steps=2, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t"), "--timelines", "1"])
    assert table["timelines"] == {"1": "t_timelines_s1.png"} and (tmp_path / "t_timelines_s1.png").stat().st_size > 0
    assert "t_timelines_s1.png" in (tmp_path / "t.md").read_text()
    assert plot_timelines(table, "1", tmp_path / "x.png") == ["dedicated/none/g1", "overlap/mps/g2"]
    with pytest.raises(SystemExit):
        main(runs + ["--out", str(tmp_path / "u"), "--timelines", "7"])  # no run on seed 7


def test_the_table_names_runs_on_a_slowed_host(tmp_path):
    """Runs whose summaries carry the real backend's host probe: the one whose probe took 2x the
    median is named under the table (and kept in it); without probes nothing is named."""
    from experiments.gpu_table import build, render

    runs = []
    for name, loop in (("ded", 0.05), ("ss", 0.05), ("ovl", 0.10)):
        out = tmp_path / name
        policy = {"ded": "dedicated", "ss": "shared-sync", "ovl": "overlap"}[name]
        simulate(config_from_args(jobs=4, steps=2, seed=1, policy=policy, sharing="none"), out)
        runs.append(out)
    assert build(runs, "h200-xeon16-20261130-qwen3-0.6b")["host"]["flagged"] == []
    for out, loop in zip(runs, (0.05, 0.05, 0.10)):
        s = json.loads((out / "summary.json").read_text())
        s["diagnostics"] = [{"host_probe": {"start": {"cpu_loop_s": loop, "file_rw_s": 0.02},
                                            "end": {"cpu_loop_s": loop, "file_rw_s": 0.02}}}]
        (out / "summary.json").write_text(json.dumps(s))
    table = build(runs, "h200-xeon16-20261130-qwen3-0.6b")
    assert [f["run"] for f in table["host"]["flagged"]] == [str(runs[2])]
    assert "overlap/none/g2/4jobs" in table["arms"]  # named, not dropped
    assert "Runs on a slowed host" in render(table) and "ovl (cpu_loop_s 2.0x)" in render(table)


def test_an_arm_with_a_code_setting_is_measured_over_the_dedicated_run_with_it():
    """+cg arms over the +cg dedicated run (like with like); MPS-only settings never need one."""
    from experiments.gpu_table import best_flags, label_flags

    assert label_flags("overlap/mps/g2+lowpri+cg") == {"+lowpri", "+cg"}
    assert label_flags("dedicated/none/g1") == frozenset()
    present = {frozenset({"+cg"}), frozenset({"+cg", "+ea"})}
    assert best_flags(present, label_flags("overlap/mps/g2+lowpri+cg"), None) == {"+cg"}
    assert best_flags(present, label_flags("overlap/mps/g2+cg+ea"), None) == {"+cg", "+ea"}
    assert best_flags(present, label_flags("overlap/mps/g2"), None) is None  # no plain dedicated run
    assert best_flags(present | {frozenset()}, label_flags("overlap/mps/g2+lk"), None) == frozenset()
    # A dedicated row with a setting is measured over the plain dedicated run, if there is one.
    assert best_flags(present | {frozenset()}, frozenset({"+cg"}), frozenset()) == frozenset()
    assert best_flags(present, frozenset({"+cg"}), frozenset()) is None


def test_a_dedicated_run_on_a_larger_engine_is_the_baseline_of_arms_with_as_many_slots():
    """dedicated:j4 on the 8-job arms' engine (+ls8) is the 8-job arms' baseline, and of a 16-slot
    arm's (which prefers a dedicated run on its own 16 slots); never of an arm on fewer slots, and a
    dedicated run on fewer slots than its jobs never stands for a plain one."""
    from experiments.gpu_table import baseline_flags, best_flags, label_flags

    ded8 = label_flags("dedicated/none/g1+cg+cpu2+ls8+lk")
    eight = label_flags("overlap/mps/g2+sp4+lowpri+cg+cpu2+lk")
    assert best_flags({ded8}, eight, None) is None  # the slot setting alone kept them apart
    assert baseline_flags({(4, ded8)}, eight, 8) == ded8
    sixteen = label_flags("overlap/mps/g2+cg+cpu2+ls16+lk")
    assert baseline_flags({(4, ded8)}, sixteen, 8) == ded8
    ded16 = label_flags("dedicated/none/g1+cg+cpu2+ls16+lk")
    assert baseline_flags({(4, ded8), (4, ded16)}, sixteen, 8) == ded16  # its own engine first
    assert baseline_flags({(4, ded8), (4, ded16)}, eight, 8) == ded8  # never a larger engine
    assert baseline_flags({(4, ded8)}, label_flags("overlap/mps/g2+cg+cpu2+lk"), 4) is None
    assert baseline_flags({(4, ded8)}, label_flags("overlap/mps/g2+cg+cpu2+ls4+lk"), 8) is None
    # dedicated:j8 on 4 slots (+ls4, fewer than its jobs) is another engine: the plain j8 run stays the baseline.
    plain = label_flags("dedicated/none/g1+cg+cpu2+lk")
    ded_few = label_flags("dedicated/none/g1+cg+cpu2+ls4+lk")
    assert baseline_flags({(8, plain), (8, ded_few)}, eight, 8) == plain
    # A tie between a plain j16 (16 slots, one a job) and a j4 on 16 slots goes to the run of more
    # jobs, whatever other flags the two share (their text no longer decides it).
    for extra in ("", "+sp4"):
        j16 = label_flags(f"dedicated/none/g1+cg+cpu2+lk{extra}")
        j4 = label_flags(f"dedicated/none/g1+cg+cpu2+ls16+lk{extra}")
        arm = label_flags(f"overlap/mps/g2+cg+cpu2+lk{extra}")
        assert baseline_flags({(16, j16), (4, j4)}, arm, 16) == j16
    # 16 jobs in two stacks: each engine serves its 8 jobs on 8 slots (no +ls label), the engine of
    # dedicated:j16 on 8 slots; on one stack the same arm has 16 slots, and the 8-slot run is not its.
    ded16_8 = label_flags("dedicated/none/g1+cg+cpu2+ls8+lk")
    two = label_flags("shared-sync/mps/g1/k2+sp4+lowpri+cg+cpu2+lk")
    assert baseline_flags({(16, ded16_8)}, two, 16, stacks=2) == ded16_8
    assert baseline_flags({(16, ded16_8)}, two, 16) is None
    # 8 jobs in two stacks (4 slots each): the plain j8 run still fits; one on 4 slots fits nearer.
    assert baseline_flags({(8, plain)}, two, 8, stacks=2) == plain
    assert baseline_flags({(8, plain), (8, ded_few)}, two, 8, stacks=2) == ded_few
    # ... and so does the 16-job run on 8 slots (its first 8 jobs), as for 8 jobs on one 8-slot engine.
    assert baseline_flags({(16, ded16_8)}, two, 8, stacks=2) == ded16_8
    assert baseline_flags({(16, ded16_8)}, eight, 8) == ded16_8


def test_a_dedicated_run_at_the_micro_batch_its_gpu_fits_is_the_baseline_of_any_micro_batch():
    """On an H100 the dedicated trainer fits 8k-token micro-batches and two stacks' trainers 4k:
    the dedicated run at 8k is that arm's baseline (session 52 had no ratio for it); one at the arm's
    own size, then one at the default size, goes first; other settings still keep runs apart."""
    from experiments.gpu_table import baseline_flags, label_flags, microbatch_flag

    assert microbatch_flag("+mb8k") and microbatch_flag("+mb512") and not microbatch_flag("+ls8")
    ded8k = label_flags("dedicated/none/g1+flat+mb8k+cg+cpu2+gm512")
    stacks4k = label_flags("shared-sync/mps/g1/k2+flat+mb4k+sp4+lowpri+cg+cpu2+ecpu4+gm512")
    assert baseline_flags({(8, ded8k)}, stacks4k, 8, stacks=2) == ded8k
    ded = label_flags("dedicated/none/g1+flat+cg+cpu2+gm512")
    assert baseline_flags({(8, ded8k), (8, ded)}, stacks4k, 8, stacks=2) == ded  # the default size first
    ded4k = label_flags("dedicated/none/g1+flat+mb4k+cg+cpu2+gm512")
    assert baseline_flags({(8, ded8k), (8, ded), (8, ded4k)}, stacks4k, 8, stacks=2) == ded4k  # its own size
    # The H200's pair: the default-size (16k) dedicated run under an 8k two-stack arm, as before.
    stacks8k = label_flags("shared-sync/mps/g1/k2+flat+mb8k+sp4+lowpri+cg+cpu2+ecpu4+gm512")
    assert baseline_flags({(8, ded)}, stacks8k, 8, stacks=2) == ded
    # A dedicated run with a setting the arm lacks is still not its baseline, whatever its micro-batch.
    other = label_flags("dedicated/none/g1+flat+mb8k+cg+cpu4+gm512")
    assert baseline_flags({(8, other)}, stacks4k, 8, stacks=2) is None


def test_factors_within_a_code_setting(tmp_path):
    """Arms run with one code setting (+cg: the graphed trainer) get the ladder among themselves,
    over the dedicated run with that setting, keyed by job count and setting."""
    from experiments.gpu_table import main

    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("sync-mps", dict(policy="shared-sync", sharing="mps")),
                                 ("ovl-mps", dict(policy="overlap", groups=2, sharing="mps"))),
                      diagnostics=[{"workers": {"trainer0": {"step_mode": "graphed", "compiled": ["x"]}}}],
                      jobs=4, steps=3, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"]
           for k in ("ded", "sync-mps", "ovl-mps")}
    assert list(table["factors"]) == ["4+cg"]
    f = table["factors"]["4+cg"]["1"]
    assert f["overlap_with_mps"] == pytest.approx(sph["ovl-mps"] / sph["sync-mps"])
    assert f["total"] == pytest.approx(sph["ovl-mps"] / sph["ded"])
    assert "batching" not in f  # no shared-sync run without MPS
    # Each job's slowdown is over its own time alone in the dedicated run with the same setting.
    row = table["arms"]["overlap/mps/g2+cg/4jobs"]["1"]
    assert row["baseline_variant"] == "+cg" and 1.0 < row["slowdown_vs_alone"]["min"] <= row["slowdown_vs_alone"]["max"]

    from experiments.gpu_table import plot_timelines

    assert plot_timelines(table, "1+cg", tmp_path / "x.png") == []  # 4-job runs: the timelines draw 8-job arms
    table["arms"] = {k.removesuffix("/4jobs"): v for k, v in table["arms"].items()}
    assert plot_timelines(table, "1+cg", tmp_path / "x.png") == [
        "dedicated/none/g1+cg", "shared-sync/mps/g1+cg", "overlap/mps/g2+cg"]
    assert plot_timelines(table, "1", tmp_path / "y.png") == []  # no arm without the setting
    # Arms chosen by their labels, whatever their settings; a label the table lacks is not drawn.
    assert plot_timelines(table, "1=overlap/mps/g2+cg,dedicated/none/g1+cg,overlap/none/g2", tmp_path / "z.png") == [
        "overlap/mps/g2+cg", "dedicated/none/g1+cg"]


def test_timelines_of_arms_chosen_by_label(tmp_path):
    """--timelines SEED=ARM,ARM draws those arms of the table (two stacks beside the dedicated run of
    other settings, as session 31's), names the file by their count, and refuses a label the table
    does not have, naming the table's arms."""
    from experiments.gpu_table import main

    low = [{"sharing_controls": {"trainer_priority": "below-normal"}}]
    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),), steps=3, seed=1)
    runs += _simulated(tmp_path, (("k2", dict(policy="shared-sync", sharing="mps", stacks=2)),), diagnostics=low,
                       steps=3, seed=1)
    arms = "dedicated/none/g1,shared-sync/mps/g1/k2+lowpri"
    table = main(runs + ["--out", str(tmp_path / "t"), "--timelines", f"1={arms}"])
    assert table["timelines"] == {f"1={arms}": "t_timelines_s1_2arms.png"}
    assert (tmp_path / "t_timelines_s1_2arms.png").exists()
    md = (tmp_path / "t.md").read_text()
    assert "Timelines of seed 1's arms dedicated/none/g1, shared-sync/mps/g1/k2+lowpri" in md
    with pytest.raises(SystemExit):
        main(runs + ["--out", str(tmp_path / "u"), "--timelines", "1=dedicated/none/g1,overlap/mps/g2"])
    # Two choices of as many arms on one seed: two files.
    table = main(runs + ["--out", str(tmp_path / "v"), "--timelines", f"1={arms}",
                         "--timelines", "1=shared-sync/mps/g1/k2+lowpri,dedicated/none/g1"])
    assert sorted(table["timelines"].values()) == ["v_timelines_s1_2arms-2.png", "v_timelines_s1_2arms.png"]


def test_runs_with_settings_get_the_subset_baseline_and_the_aa_spread_too(tmp_path):
    """Every run of a day with tuned LoRA kernels (+lk, the H200 default): a 2-job arm beside only a
    4-job dedicated run (twice) gets the subset baseline of that +lk run, and the two dedicated runs
    give the A/A spread, as plain runs do."""
    from experiments.gpu_table import main

    runs = _simulated(tmp_path, (("ded", dict(jobs=4, policy="dedicated", sharing="none")),
                                 ("ded-aa", dict(jobs=4, policy="dedicated", sharing="none")),
                                 ("ovl", dict(jobs=2, policy="overlap", groups=2, sharing="mps"))),
                      diagnostics=[{"workers": {"engine0": {"lora_kernel_configs": {"source": "shipped"}},
                                                "trainer0": {"compiled": ["x"]}}}], steps=3, seed=5)
    table = main(runs + ["--out", str(tmp_path / "t")])
    ded = json.loads((tmp_path / "ded" / "summary.json").read_text())["per_job"]
    ovl = json.loads((tmp_path / "ovl" / "summary.json").read_text())
    two = [ded[j] for j in ovl["per_job"]]
    base = 3600 * sum(d["steps"] for d in two) / sum(d["finish_s"] for d in two)
    row = table["arms"]["overlap/mps/g2+lk/2jobs"]["5"]
    assert row["ratio_vs_dedicated"] == pytest.approx(ovl["steps_per_gpu_hour"] / base)
    assert row["baseline_variant"] == "+lk"
    assert table["aa"]["4-s5+lk"]["rel_diff"] == pytest.approx(0.0)
    assert table["arms"]["dedicated/none/g1+lk/4jobs"]["5"]["ratio_vs_dedicated"] == pytest.approx(1.0)


def test_a_low_priority_trainers_factors_are_over_arms_without_the_setting(tmp_path):
    """Overlap + MPS with the trainer at below-normal priority (+lowpri) beside shared-sync + MPS
    and dedicated runs at the default: the priority decides nothing where nothing co-runs, so the
    overlap arm's factors are over those runs, and no factor of theirs is repeated under +lowpri."""
    from experiments.gpu_table import main

    plain = [{"sharing_controls": {"trainer_priority": "normal"}}]
    low = [{"sharing_controls": {"trainer_priority": "below-normal"}}]
    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),
                                 ("sync", dict(policy="shared-sync", sharing="none")),
                                 ("sync-mps", dict(policy="shared-sync", sharing="mps"))),
                      diagnostics=plain, jobs=4, steps=3, seed=1)
    runs += _simulated(tmp_path, (("ovl-mps", dict(policy="overlap", groups=2, sharing="mps")),),
                       diagnostics=low, jobs=4, steps=3, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    assert "overlap/mps/g2+lowpri/4jobs" in table["arms"]
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"]
           for k in ("ded", "sync", "sync-mps", "ovl-mps")}
    f = table["factors"]
    assert set(f) == {"4", "4+lowpri"}
    assert f["4"]["1"] == {"batching": pytest.approx(sph["sync"] / sph["ded"]),
                           "mps_without_overlap": pytest.approx(sph["sync-mps"] / sph["sync"])}
    assert f["4+lowpri"]["1"] == {"overlap_with_mps": pytest.approx(sph["ovl-mps"] / sph["sync-mps"]),
                                  "total": pytest.approx(sph["ovl-mps"] / sph["ded"])}


def test_the_trainers_priority_names_a_configuration_only_where_engine_and_trainer_co_run():
    """A shared-sync or dedicated run at below-normal trainer priority (the pool keeps the running
    trainers' priority for them) is the same row and configuration as one at normal priority; an
    overlap run's priority is its own row and configuration."""
    from calibration.validate import config_key, config_label
    from experiments.gpu_table import arm_label

    low = {"diagnostics": [{"sharing_controls": {"trainer_priority": "below-normal"}}]}
    sync = {"policy": "shared-sync", "sharing": "mps", "groups": 1}
    ovl = {"policy": "overlap", "sharing": "mps", "groups": 2}
    assert arm_label(sync, low) == arm_label(sync, {}) == "shared-sync/mps/g1"
    assert arm_label(ovl, low) == "overlap/mps/g2+lowpri"
    row = (lambda arm, controls: {"arm": arm, "jobs": 8, "mb_tokens": 16384, "controls": controls})  # noqa: E731
    slow = {"trainer_priority": "below-normal"}
    assert config_key(row(sync, slow)) == config_key(row(sync, {}))
    assert config_label(row(sync, slow)) == "8 jobs shared-sync g=1 mps"
    assert config_key(row(ovl, slow)) != config_key(row(ovl, {}))
    assert config_label(row(ovl, slow)) == "8 jobs overlap g=2 mps trainer_priority=below-normal"


def test_the_unpinned_publish_factor_pairs_runs_that_differ_only_in_it(tmp_path):
    from experiments.gpu_table import main

    low = {"sharing_controls": {"trainer_priority": "below-normal"}}
    arm = dict(policy="overlap", groups=2, sharing="mps")
    runs = _simulated(tmp_path, (("pinned", arm),), diagnostics=[low], jobs=4, steps=3, seed=1)
    runs += _simulated(tmp_path, (("np", arm),), diagnostics=[dict(low, publish_pinned=False)], jobs=4, steps=3,
                       seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    assert {"overlap/mps/g2+lowpri/4jobs", "overlap/mps/g2+np+lowpri/4jobs"} <= set(table["arms"])
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"] for k in ("pinned", "np")}
    assert table["factors"]["4+lowpri"]["1"]["publish_unpinned"] == pytest.approx(sph["np"] / sph["pinned"])


def test_the_flat_handoff_factor_pairs_two_stack_and_dedicated_runs_that_differ_only_in_it(tmp_path):
    from experiments.gpu_table import main

    runs = []
    for name, arm, flat in (("ded", dict(policy="dedicated", sharing="none"), False),
                            ("dedflat", dict(policy="dedicated", sharing="none"), True),
                            ("k2", dict(policy="shared-sync", sharing="mps", stacks=2), False),
                            ("k2flat", dict(policy="shared-sync", sharing="mps", stacks=2), True)):
        runs += _simulated(tmp_path, ((name, arm),), diagnostics=[{"adapter_format": "flat"} if flat else {}],
                           jobs=4, steps=4 if flat else 3, seed=1)  # (other steps: other figures)
    table = main(runs + ["--out", str(tmp_path / "t")])
    assert {"shared-sync/mps/g1/k2+flat/4jobs", "dedicated/none/g1+flat/4jobs"} <= set(table["arms"])
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"]
           for k in ("ded", "dedflat", "k2", "k2flat")}
    row = table["factors"]["4"]["1"]
    assert sph["k2flat"] != sph["k2"] and sph["dedflat"] != sph["ded"]
    assert row["flat_handoff"] == pytest.approx(sph["k2flat"] / sph["k2"])
    assert row["flat_handoff_dedicated"] == pytest.approx(sph["dedflat"] / sph["ded"])


def test_an_eight_job_arm_is_measured_over_a_four_job_dedicated_run_on_its_engine(tmp_path):
    """dedicated:j4 on the 8-job arms' engine (8 adapter slots, label +ls8) and an 8-job arm on that
    engine (one slot a job: no +ls) whose jobs share the dedicated run's four tasks: the arm's ratio
    is over the dedicated run, each job standing in for its task's (session 29's 8 jobs had 8 tasks,
    so its table still has no such ratio; before b143b25 the slot label alone kept them apart)."""
    from experiments.gpu_table import main

    tasks = ["gsm8k", "countdown", "modular", "linalg"]
    runs = []
    for name, n, kw in (("ded", 4, dict(policy="dedicated", sharing="none")),
                        ("ovl", 8, dict(policy="overlap", groups=2, sharing="mps"))):
        out = tmp_path / name
        simulate(config_from_args({"jobs": [{"task": tasks[i % 4]} for i in range(n)]}, steps=2, seed=1, **kw), out)
        summary = json.loads((out / "summary.json").read_text())
        summary["diagnostics"] = [{"engine_max_loras": 8, "workers": {"trainer0": {"compiled": ["x"]}}}]
        (out / "summary.json").write_text(json.dumps(summary))
        runs.append(str(out))
    table = main(runs + ["--out", str(tmp_path / "t")])
    assert list(table["arms"]) == ["dedicated/none/g1+ls8/4jobs", "overlap/mps/g2"]
    row = table["arms"]["overlap/mps/g2"]["1"]
    assert row["baseline_variant"] == "+ls8" and row["baseline_by_task"] is True
    assert row["ratio_vs_dedicated"] == pytest.approx(row["steps_per_gpu_hour"] / row["baseline_steps_per_gpu_hour"])
    assert row["ratio_vs_dedicated"] > 1.0


def test_each_row_carries_its_engines_mean_step_and_the_table_shows_it(tmp_path):
    """A real run's engine steps (real.stepstats) beside its phase times: the mean step in ms and the
    slowest generation's over the fastest's; a repeat's row averages the means and keeps the widest
    spread; a run without them shows '-'."""
    from experiments.gpu_table import engine_step_text, main, render

    def steps(mean, lo, hi):
        return {"engine_steps": {"summary": {"generations": 5, "steps": 1285, "mean_step_ms": mean,
                                             "step_ms_per_generation": {"min": lo, "max": hi}}}}

    runs = _simulated(tmp_path, (("ded", dict(policy="dedicated", sharing="none")),), jobs=2, steps=2, seed=1)
    runs += _simulated(tmp_path, (("sync", dict(policy="shared-sync", sharing="mps")),),
                       diagnostics=[steps(8.0, 7.0, 9.1)], jobs=2, steps=2, seed=1)
    runs += _simulated(tmp_path, (("sync-r2", dict(policy="shared-sync", sharing="mps")),),
                       diagnostics=[steps(12.0, 10.0, 15.0)], jobs=2, steps=2, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    row = table["arms"]["shared-sync/mps/g1/2jobs"]["1"]
    assert [r["mean_step_ms"] for r in row["engine_steps"]] == [8.0, 12.0]
    assert engine_step_text(row["engine_steps"]) == "10.00 (1.50x)"
    assert [r["mean_step_ms"] for r in table["arms"]["dedicated/none/g1/2jobs"]["1"]["engine_steps"]] == [None]
    text = render(table)
    assert "| engine step ms |" in text and "| 10.00 (1.50x) |" in text
    ded = next(line for line in text.splitlines() if line.startswith("| dedicated/none/g1/2jobs | 1 |")
               and line.count("|") == 7)
    assert ded.endswith("| - |")
    # A row whose runs only partly recorded steps says so, and a table without any keeps its old columns.
    assert engine_step_text([{"mean_step_ms": 12.0, "step_ms_spread": 1.5}, {"mean_step_ms": None}]) == \
        "12.00 (1.50x) (1 of 2 runs)"
    for per in table["arms"].values():
        for d in per.values():
            d["engine_steps"] = [{"mean_step_ms": None}]
    assert "engine step ms" not in render(table)


def test_the_two_stacks_factor_pairs_one_and_two_stacks_with_the_same_settings(tmp_path):
    """shared-sync + MPS on two stacks (/k2, the trainers at below-normal priority: they co-run
    across the stacks) over one stack with the same settings (its priority decides nothing): the
    two_stacks factor, where the same day's one-stack run exists (session 31 had none)."""
    from experiments.gpu_table import main

    low = [{"sharing_controls": {"trainer_priority": "below-normal"}}]
    runs = _simulated(tmp_path, (("sync-mps", dict(policy="shared-sync", sharing="mps")),), jobs=4, steps=3, seed=1)
    runs += _simulated(tmp_path, (("sync-mps-k2", dict(policy="shared-sync", sharing="mps", stacks=2)),),
                       diagnostics=low, jobs=4, steps=3, seed=1)
    table = main(runs + ["--out", str(tmp_path / "t")])
    assert {"shared-sync/mps/g1/4jobs", "shared-sync/mps/g1/k2+lowpri/4jobs"} <= set(table["arms"])
    sph = {k: json.loads((tmp_path / k / "summary.json").read_text())["steps_per_gpu_hour"]
           for k in ("sync-mps", "sync-mps-k2")}
    assert table["factors"]["4+lowpri"]["1"] == {"two_stacks": pytest.approx(sph["sync-mps-k2"] / sph["sync-mps"])}


def test_an_arm_under_a_lighter_audit_is_measured_over_the_dedicated_run_of_its_audit(tmp_path):
    """An arm auditing one response a prompt (+r1) takes the day's dedicated run of that audit as its
    baseline; with only a full-audit dedicated run it is measured over that one, and the table says
    so (the ratio then holds what the audit gives dedicated too)."""
    from experiments.gpu_table import audit_flag, main

    r1 = {"audit": {"logprobs": True, "every": 1, "responses": 1}}
    arm = dict(policy="overlap", groups=2, sharing="mps")
    ded = dict(policy="dedicated", sharing="none")
    full_runs = _simulated(tmp_path / "a", (("ded", ded),), diagnostics=[{}], jobs=4, steps=3, seed=1)
    light_runs = _simulated(tmp_path / "a", (("ded-r1", ded), ("ovl-r1", arm)), diagnostics=[r1], jobs=4, steps=3,
                            seed=1)
    sph = lambda run: json.loads((tmp_path / "a" / run / "summary.json").read_text())["steps_per_gpu_hour"]  # noqa: E731
    table = main(full_runs + light_runs + ["--out", str(tmp_path / "t1")])
    row = table["arms"]["overlap/mps/g2+r1/4jobs"]["1"]
    assert row["baseline_variant"] == "+r1" and row["baseline_audit"] is None
    assert row["ratio_vs_dedicated"] == pytest.approx(sph("ovl-r1") / sph("ded-r1"))
    assert table["arms"]["dedicated/none/g1+r1/4jobs"]["1"]["baseline_audit"] is None  # that audit's own run
    assert "another audit" not in (tmp_path / "t1.md").read_text()
    table = main(full_runs + light_runs[1:] + ["--out", str(tmp_path / "t2")])
    row = table["arms"]["overlap/mps/g2+r1/4jobs"]["1"]
    assert row["baseline_audit"] == {"arm": "+r1", "dedicated": "the full audit"}
    assert row["ratio_vs_dedicated"] == pytest.approx(sph("ovl-r1") / sph("ded"))
    assert "overlap/mps/g2+r1/4jobs seed 1 (+r1 over a dedicated run with the full audit)" in (
        tmp_path / "t2.md").read_text()
    assert (audit_flag(frozenset({"+cg", "+a4r1"})), audit_flag(frozenset({"+cg", "+ls8"}))) == ("+a4r1", "")


def test_a_ratio_over_another_machines_dedicated_run_is_named(tmp_path):
    """Lent machines of one kind look alike, yet runs differ between them: an arm measured over a
    dedicated run from another machine (its GPU's UUID, else host name and boot id) is named in the
    table; one on the dedicated run's machine, or a run recorded before machines were, is not."""
    from calibration.run_health import run_machine
    from experiments.gpu_table import main

    def on(host=None, gpu=None):
        d = {"machine": {"hostname": host, "boot_id": "b"}} if host else {}
        if gpu:
            d["gpu_monitor"] = {"available": True, "gpus": {"0": {"uuid": gpu}}}
        return [d]

    arm = dict(policy="shared-sync", sharing="mps")
    ded = _simulated(tmp_path / "a", (("ded", dict(policy="dedicated", sharing="none")),), diagnostics=on("m1"),
                     jobs=2, steps=2, seed=1)
    same = _simulated(tmp_path / "b", (("sync", arm),), diagnostics=on("m1"), jobs=2, steps=2, seed=1)
    other = _simulated(tmp_path / "c", (("sync", arm),), diagnostics=on("m2"), jobs=2, steps=2, seed=1)
    unknown = _simulated(tmp_path / "d", (("sync", arm),), diagnostics=[{}], jobs=2, steps=2, seed=1)
    for runs, flagged in ((same, None), (other, {"arm": ["m2/b"], "dedicated": ["m1/b"]}), (unknown, None)):
        out = tmp_path / f"t-{runs[0].split('/')[-2]}"
        table = main(ded + runs + ["--out", str(out)])
        assert table["arms"]["shared-sync/mps/g1/2jobs"]["1"]["baseline_machine"] == flagged
        assert table["arms"]["dedicated/none/g1/2jobs"]["1"]["baseline_machine"] is None
        assert ("from another machine" in (out.parent / f"{out.name}.md").read_text()) == bool(flagged)
    # A repeat on another machine flags the row even where its first run shared the baseline's.
    (tmp_path / "e").mkdir()
    again = _simulated(tmp_path / "e", (("sync", arm),), diagnostics=on("m2"), jobs=2, steps=2, seed=1)
    row = main(ded + same + again + ["--out", str(tmp_path / "t-rep")])["arms"]["shared-sync/mps/g1/2jobs"]["1"]
    assert row["machines"] == ["m1/b", "m2/b"] and row["baseline_machine"] == {"arm": ["m1/b", "m2/b"],
                                                                               "dedicated": ["m1/b"]}
    # The host names the machine (two GPUs of one host are one machine); a GPU's UUID only where a
    # run recorded no host.
    assert run_machine({"diagnostics": on("m1", "GPU-9")}) == "m1/b"
    assert run_machine({"diagnostics": [{"gpu_monitor": {"gpus": {"0": {"uuid": "GPU-9"}}}}]}) == "GPU-9"
    assert run_machine({"diagnostics": on()}) is None


def test_runs_of_several_days_keep_to_their_day(tmp_path):
    """Runs from two day folders (``DAY/arms/RUN``): an arm's runs of one seed on two days are two
    rows, never one row's repeats (nor an A/A pair); each divides by its own day's dedicated run,
    and a seed whose day has no dedicated run gets no ratio, not another day's."""
    from experiments.gpu_table import main

    for day in ("session1", "session2"):
        (tmp_path / day / "arms").mkdir(parents=True)
    runs = _simulated(tmp_path, (("session1/arms/ded-s1", dict(policy="dedicated", sharing="none", seed=1)),
                                 ("session1/arms/ovl-s1", dict(policy="overlap", groups=2, sharing="mps", seed=1)),
                                 ("session1/arms/ded-s2", dict(policy="dedicated", sharing="none", seed=2)),
                                 ("session2/arms/ded-s1", dict(policy="dedicated", sharing="none", seed=1)),
                                 ("session2/arms/ovl-s1", dict(policy="overlap", groups=2, sharing="mps", seed=1)),
                                 ("session2/arms/ovl-s2", dict(policy="overlap", groups=2, sharing="mps", seed=2))),
                      jobs=4, steps=2)
    # Day 2's runs slower: another day's dedicated run would give another ratio.
    for run, factor in ((runs[3], 0.5), (runs[4], 0.8)):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        summary["steps_per_gpu_hour"] *= factor
        (tmp_path / run / "summary.json").write_text(json.dumps(summary))
    table = main(runs + ["--out", str(tmp_path / "t")])
    sph = {r: json.loads((tmp_path / r / "summary.json").read_text())["steps_per_gpu_hour"] for r in runs}
    assert table["days"] == ["session1", "session2"] and table["aa"] == {}
    day1, day2 = table["arms"]["overlap/mps/g2+@session1/4jobs"], table["arms"]["overlap/mps/g2+@session2/4jobs"]
    assert "repeats" not in day1["1"] and "repeats" not in day2["1"]
    assert day1["1"]["ratio_vs_dedicated"] == pytest.approx(sph[runs[1]] / sph[runs[0]])
    assert day2["1"]["ratio_vs_dedicated"] == pytest.approx(sph[runs[4]] / sph[runs[3]])
    assert day2["1"]["baseline_variant"] is None  # over its day's plain dedicated run, named as such
    assert day2["2"]["ratio_vs_dedicated"] is None  # seed 2's dedicated run is day 1's only
    assert table["arms"]["dedicated/none/g1+@session2/4jobs"]["1"]["ratio_vs_dedicated"] == 1.0
    # One day's folder: labels as ever.
    one = main(runs[:3] + ["--out", str(tmp_path / "t1")])
    assert one["days"] == [] and "overlap/mps/g2/4jobs" in one["arms"]


def test_a_smaller_arm_takes_its_subset_baseline_from_its_own_days_dedicated_run(tmp_path):
    """The subset baseline (a 2-job arm over the first jobs of a 4-job dedicated run) in day mode:
    each day's 2-job row divides by its own day's dedicated run. Day 2's dedicated jobs took twice as
    long, so its identical 2-job run gets twice the ratio. Runs outside a ``DAY/arms`` folder have
    no day."""
    from experiments.gpu_table import main, run_day

    for day in ("session1", "session2"):
        (tmp_path / day / "arms").mkdir(parents=True)
    runs = _simulated(tmp_path, (("session1/arms/ded", dict(policy="dedicated", sharing="none", jobs=4)),
                                 ("session1/arms/ovl", dict(policy="overlap", groups=2, sharing="mps", jobs=2)),
                                 ("session2/arms/ded", dict(policy="dedicated", sharing="none", jobs=4)),
                                 ("session2/arms/ovl", dict(policy="overlap", groups=2, sharing="mps", jobs=2))),
                      steps=2, seed=1)
    summary = json.loads((tmp_path / runs[2] / "summary.json").read_text())
    for d in summary["per_job"].values():
        d["finish_s"] *= 2
    (tmp_path / runs[2] / "summary.json").write_text(json.dumps(summary))
    table = main(runs + ["--out", str(tmp_path / "t")])
    day1 = table["arms"]["overlap/mps/g2+@session1/2jobs"]["1"]["ratio_vs_dedicated"]
    day2 = table["arms"]["overlap/mps/g2+@session2/2jobs"]["1"]["ratio_vs_dedicated"]
    assert day1 > 1.0 and day2 == pytest.approx(2 * day1)
    assert run_day(runs[0]) == "session1" and run_day(tmp_path / "ovl") is None
    assert run_day(tmp_path / "s1+rerun" / "arms" / "x") == "s1-rerun"  # '+' splits a label's settings


def test_each_ratio_says_how_many_minutes_apart_its_runs_began(tmp_path):
    """A dedicated baseline moved 11-25% on one machine within 15 minutes (session 43): each ratio
    row carries the minutes between its run's start and its dedicated runs' farthest start (the
    host probes' Unix times), and the table lists them; a run without recorded times gets None."""
    from experiments.gpu_table import main

    def at(t):
        return [{"machine": {"hostname": "m1", "boot_id": "b"},
                 "host_probe": {"start": {"unix_s": t, "cpu_loop_s": 0.05}, "end": {"unix_s": t + 60}}}]

    arm = dict(policy="shared-sync", sharing="mps")
    ded = _simulated(tmp_path / "a", (("ded", dict(policy="dedicated", sharing="none")),), diagnostics=at(1000.0),
                     jobs=2, steps=2, seed=1)
    late = _simulated(tmp_path / "b", (("sync", arm),), diagnostics=at(1000.0 + 12 * 60), jobs=2, steps=2, seed=1)
    table = main(ded + late + ["--out", str(tmp_path / "t")])
    assert table["arms"]["shared-sync/mps/g1/2jobs"]["1"]["minutes_from_baseline"] == pytest.approx(12.0)
    assert table["arms"]["dedicated/none/g1/2jobs"]["1"]["minutes_from_baseline"] is None
    assert "shared-sync/mps/g1/2jobs seed 1: 12." in (tmp_path / "t.md").read_text()
    untimed = _simulated(tmp_path / "c", (("sync", arm),), diagnostics=[{"machine": {"hostname": "m1", "boot_id": "b"}}],
                         jobs=2, steps=2, seed=1)
    table = main(ded + untimed + ["--out", str(tmp_path / "u")])
    assert table["arms"]["shared-sync/mps/g1/2jobs"]["1"]["minutes_from_baseline"] is None


def test_a_ratio_over_a_contended_dedicated_run_is_marked(tmp_path):
    """Session 45's machine stole 16-20% of the CPU time its dedicated runs wanted, and ratios over
    them read 3.54x and 5.01x: a ratio with a contended run behind it (its own, or a dedicated run it
    divides by) carries ``ratio_contended`` and is marked in its cell and listed under the table; a
    ratio over uncontended runs carries None and no mark."""
    from experiments.gpu_table import main

    def mon(steal):
        return [{"host_monitor": {"available": True, "cores_busy": 4.0, "run_cores": 3.8, "other_cores": 0.0,
                                  "steal_frac": steal, "steal_cores": 0.5 * steal, "cpu_mhz": {"mean": 2100.0}}}]

    arm = dict(policy="shared-sync", sharing="mps")
    quiet = _simulated(tmp_path / "q", (("ded", dict(policy="dedicated", sharing="none")), ("sync", arm)),
                       diagnostics=mon(0.01), jobs=2, steps=2, seed=1)
    table = main(quiet + ["--out", str(tmp_path / "t")])
    assert table["arms"]["shared-sync/mps/g1/2jobs"]["1"]["ratio_contended"] is None
    assert "contended host" not in (tmp_path / "t.md").read_text().split("\n\n")[1]
    stolen = _simulated(tmp_path / "s", (("ded", dict(policy="dedicated", sharing="none")),),
                        diagnostics=mon(0.20), jobs=2, steps=2, seed=1)
    table = main(stolen + quiet[1:] + ["--out", str(tmp_path / "u")])
    row = table["arms"]["shared-sync/mps/g1/2jobs"]["1"]
    assert row["ratio_contended"] == {"runs": [], "baseline": [{"run": stolen[0], "why": {"steal": 0.20}}]}
    assert table["arms"]["dedicated/none/g1/2jobs"]["1"]["ratio_contended"] is None  # no ratio of its own
    md = (tmp_path / "u.md").read_text()
    assert "(contended host)" in md
    assert "shared-sync/mps/g1/2jobs seed 1 (dedicated: steal 20% of the CPU time wanted)" in md
