"""experiments/gpu_arms.py's arm specs: NAME[:jN][:gG][:sS][:mN][:wait|:free]."""

import pytest

from experiments.gpu_arms import parse_arm


def test_arm_specs_name_their_own_job_count_and_groups():
    assert parse_arm("overlap+mps") == ("overlap+mps", None, None, None, None, None, {})
    assert parse_arm("shared-sync:j4") == ("shared-sync", 4, None, None, None, None, {})
    assert parse_arm(" overlap+mps:j16:g3") == ("overlap+mps", 16, 3, None, None, None, {})
    assert parse_arm("overlap:g4:j16:s1:s3") == ("overlap", 16, 4, [1, 3], None, None, {})
    assert parse_arm("overlap+mps:m32768:s2") == ("overlap+mps", None, None, [2], 32768, None, {})
    assert parse_arm("overlap+mps:wait:s1") == ("overlap+mps", None, None, [1], None, True, {})
    assert parse_arm("overlap+mps:free") == ("overlap+mps", None, None, None, None, False, {})
    # cpuN: torch's CPU threads in the arm's trainer (a trainer setting: the trainers restart).
    assert parse_arm("overlap+mps:lowpri:cpu2:s1") == (
        "overlap+mps", None, None, [1], None, None, {"trainer_priority": "below-normal", "trainer_cpu_threads": 2})
    assert parse_arm("dedicated:cpu0")[-1] == {"trainer_cpu_threads": 0}  # torch's default, one per CPU
    # kN: the run config's arm.stacks (engine + trainer stacks splitting the jobs).
    assert parse_arm("shared-sync+mps:k2:sp4")[-1] == {"stacks": 2, "share_prompts": 4}
    with pytest.raises(SystemExit, match="'k0' is not"):
        parse_arm("overlap+mps:k0")
    with pytest.raises(SystemExit, match="'cpu02' is not"):
        parse_arm("overlap+mps:cpu02")


def test_runs_on_an_engine_with_other_than_one_adapter_slot_per_job_are_named_so():
    from experiments.gpu_arms import slots_key

    assert slots_key(16, 8) == "-ls16" and slots_key(4, 2) == "-ls4" and slots_key(4, 8) == "-ls4"
    assert slots_key(8, 8) == "" and slots_key(16, 16) == ""
    # --engine-slots: every engine of the call gets them, fewer than an arm's jobs too (that arm's
    # engine.max_loras).
    from experiments.gpu_arms import pool_slots

    arms = [parse_arm(a) for a in ("overlap+mps:j16", "dedicated", "shared-sync:j4")]
    assert pool_slots(None, arms, [8]) == 16 and pool_slots(16, arms[1:], [8]) == 16
    # Arms that all name their job count leave --jobs (default 8) out: session 21's fit call of
    # 2- and 4-job arms had 8 slots from it.
    small = [parse_arm(a) for a in ("dedicated:j4", "overlap+mps:j2")]
    assert pool_slots(None, small, [8]) == 4 and pool_slots(None, small + [parse_arm("shared-sync")], [8, 2]) == 8
    assert pool_slots(4, arms[1:], [2, 8]) == 4
    with pytest.raises(SystemExit, match="--engine-slots 0: an engine needs at least 1 adapter slot"):
        pool_slots(0, arms, [8])
    # Each arm's config names the call's slots, so an overlap arm is not sized to its groups
    # (nodus.runner.size_engine_slots), which would start it an engine of its own.
    from experiments.gpu_arms import engine_section
    from nodus.simulate import config_from_args

    for n in (8, 16):
        cfg = config_from_args({"engine": engine_section(16, 1024)}, jobs=n, steps=1, policy="overlap", groups=2)
        assert (cfg.engine.max_loras, cfg.engine.cuda_graph_max_tokens) == (16, 1024)
    assert engine_section(4, None) == {"max_loras": 4}


def test_arm_specs_name_their_own_trainer_settings():
    assert parse_arm("overlap+mps:cg:lowpri:t50:s1")[3:] == (
        [1], None, None, {"trainer_graphs": True, "trainer_priority": "below-normal", "trainer_thread_pct": 50})
    assert parse_arm("dedicated:nocg")[-1] == {"trainer_graphs": False}
    # The audit's cadence: a setting of the run loop (aN: every N-th step; a0: none).
    assert parse_arm("shared-sync+mps:cg:a4")[-1] == {"trainer_graphs": True, "audit_logprobs": True, "audit_every": 4}
    assert parse_arm("shared-sync+mps:a0")[-1] == {"audit_logprobs": False}
    # rK: the first K responses of each prompt audited (a run-loop setting as well).
    assert parse_arm("overlap+mps:cg:r1")[-1] == {"trainer_graphs": True, "audit_logprobs": True, "audit_responses": 1}
    assert parse_arm("overlap+mps:a4:r2")[-1] == {"audit_logprobs": True, "audit_every": 4, "audit_responses": 2}
    # np: the engine loads published adapters into pageable host memory (a run-loop setting).
    assert parse_arm("overlap+mps:cg:lowpri:np:free")[-2:] == (
        False, {"trainer_graphs": True, "trainer_priority": "below-normal", "publish_pinned": False})
    # flat: the trainer hands each version to the engines as a flat file (a trainer setting).
    assert parse_arm("shared-sync+mps:cg:flat:k2")[-1] == {"trainer_graphs": True, "adapter_format": "flat",
                                                          "stacks": 2}
    # spK: the run config's trainer.share_prompts (each prompt's responses K to a row).
    assert parse_arm("overlap+mps:cg:sp4:s2")[3:] == ([2], None, None, {"trainer_graphs": True, "share_prompts": 4})


@pytest.mark.parametrize("bad, says", [("overlapp", "unknown arm 'overlapp'"), ("overlap:x4", "'x4' is not jN"),
                                       ("overlap:j0", "'j0' is not jN"), ("overlap:j", "'j' is not jN"),
                                       ("overlap:m128", "'m128' is not jN.*>= 256"),
                                       ("overlap+mps:t0", "'t0' is not jN.*tN"), ("overlap+mps:t101", "'t101'"),
                                       ("overlap+mps:ax", "'ax' is not jN.*aN"),
                                       ("overlap+mps:r0", "'r0' is not jN.*rK"),
                                       ("overlap+mps:spx", "'spx' is not jN.*spK"),
                                       ("overlap+mps:sp\u00b2", "is not jN.*spK")])
def test_bad_arm_specs_are_clear_errors(bad, says):
    with pytest.raises(SystemExit, match=says):
        parse_arm(bad)


@pytest.mark.parametrize("flag, says", [("--engine-thread-pct=150", "engine_thread_pct"),
                                        ("--trainer-thread-pct=0", "trainer_thread_pct"),
                                        ("--engine-slots=0", "--engine-slots 0: an engine needs at least 1 adapter")])
def test_bad_mps_thread_percentages_stop_before_any_work(tmp_path, monkeypatch, flag, says):
    import sys

    from experiments import gpu_arms

    monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(tmp_path / "out"), flag,
                                      "--model-dir", str(tmp_path / "model")])
    with pytest.raises(SystemExit, match=says):
        gpu_arms.main()
    assert not (tmp_path / "model").exists() and not (tmp_path / "out").exists()


def test_packing_prompts_without_the_graphed_trainer_stops_before_any_work():
    from experiments.gpu_arms import check_share_prompts

    check_share_prompts([parse_arm("overlap+mps:cg:sp4"), parse_arm("dedicated")], 0, False)
    check_share_prompts([parse_arm("overlap+mps"), parse_arm("dedicated:sp0")], 4, True)
    with pytest.raises(SystemExit, match="arm dedicated packs prompts .share_prompts=4. without the graphed trainer"):
        check_share_prompts([parse_arm("overlap+mps:cg"), parse_arm("dedicated")], 4, False)
    with pytest.raises(SystemExit, match="--share-prompts -1"):
        check_share_prompts([], -1, True)


def test_rounds_repeat_each_block_of_processes_in_turn():
    """--rounds 2: arms sharing one set of processes run A B A B (same-call repeats), blocks of
    other processes after them; rounds < 1 is a clear error."""
    from experiments.gpu_arms import interleave_rounds, parse_arm

    order = [parse_arm(a) for a in ("dedicated", "shared-sync", "overlap+mps", "shared-sync+mps")]
    got = [(sp[0], r) for sp, r in interleave_rounds(order, 2)]
    assert got == [("dedicated", 1), ("shared-sync", 1), ("dedicated", 2), ("shared-sync", 2),
                   ("overlap+mps", 1), ("shared-sync+mps", 1), ("overlap+mps", 2), ("shared-sync+mps", 2)]
    assert [r for _, r in interleave_rounds(order, 1)] == [1] * 4
    # Arms on two stacks (kN) need other processes: a block of their own.
    two = order[2:] + [parse_arm("shared-sync+mps:k2")]
    assert [(sp[0], sp[6], r) for sp, r in interleave_rounds(two, 2)][-2:] == [
        ("shared-sync+mps", {"stacks": 2}, 1), ("shared-sync+mps", {"stacks": 2}, 2)]
    # Two-stack arms of 8 and 16 jobs need engines of other sizes: blocks of their own too.
    sized = [parse_arm(a) for a in ("shared-sync+mps:k2", "shared-sync+mps:k2:j16", "overlap+mps:k2:j8")]
    assert [(sp[0], sp[1], r) for sp, r in interleave_rounds([sized[0], sized[2], sized[1]], 2, 8)] == [
        ("shared-sync+mps", None, 1), ("overlap+mps", 8, 1), ("shared-sync+mps", None, 2), ("overlap+mps", 8, 2),
        ("shared-sync+mps", 16, 1), ("shared-sync+mps", 16, 2)]
    with pytest.raises(SystemExit, match="--rounds 0"):
        interleave_rounds(order, 0)


def test_one_invocation_runs_every_arm_on_the_largest_graph_size_any_arm_gets():
    """Arms of 8 and 16 jobs share one engine: the 16-job shared arm's 1024-token graphs for all;
    8-job arms alone, or 16-job dedicated arms (a job at a time), keep vLLM's default."""
    from experiments.gpu_arms import invocation_graph_size, parse_arm
    from nodus.config import default_jobs

    from experiments.gpu_arms import engine_section, largest_arm

    def size(arms, counts=(8,), slots=None):
        specs = [parse_arm(a) for a in arms.split(",")]
        call_slots = slots or largest_arm(specs, list(counts))  # as gpu_arms: --engine-slots, else this

        def workload(n):
            return {"jobs": [j.model_dump(exclude_none=True) for j in default_jobs(n)],
                    "engine": engine_section(call_slots, None)}
        return invocation_graph_size(specs, list(counts), workload)

    assert size("dedicated,shared-sync+mps,overlap+mps:j16") == 1024
    # --engine-slots 8: a step holds at most 8 jobs' 512 sequences, inside vLLM's default graphs.
    assert size("dedicated,shared-sync+mps,overlap+mps:j16", slots=8) is None
    assert size("dedicated,shared-sync+mps", (8, 16)) == 1024
    assert size("dedicated,shared-sync+mps,overlap+mps") is None
    assert size("dedicated:j16,timeslice:j16") is None
    assert size("overlap:j1:g2,shared-sync:j1") is None  # an arm skips a count with more groups than jobs


def test_each_arm_is_simulated_on_the_shipped_profile_of_its_trainer():
    """gpu_arms' simulated figure beside a run: the profile asked for, else the shipped one whose
    trainer (train.step_mode) is the arm's: each default profile exists and describes that trainer."""
    from experiments.gpu_arms import sim_profile
    from nodus.config import DEFAULT_PROFILES
    from sim.profile import profile_dict, profile_step_mode

    assert sim_profile(None, True) == DEFAULT_PROFILES["graphed"] != sim_profile(None, False)
    assert sim_profile("mine.json", True) == "mine.json"
    for mode, name in DEFAULT_PROFILES.items():
        assert profile_step_mode(profile_dict(name)) == mode
    # A graphed arm co-running at a trainer priority: the graphed profile fitted at that priority.
    from nodus.config import GRAPHED_NORMAL_PRIORITY_PROFILE

    low = profile_dict(sim_profile(None, True, "below-normal"))["sharing"]["controls"]
    normal = profile_dict(sim_profile(None, True, "normal"))
    assert low == {"trainer_priority": "below-normal"}
    assert sim_profile(None, True, "normal") == GRAPHED_NORMAL_PRIORITY_PROFILE
    assert profile_step_mode(normal) == "graphed" and not (normal["sharing"].get("controls") or {})
    assert sim_profile(None, False, "normal") == DEFAULT_PROFILES["eager"]
    # Stacks under MPS on the graphed trainer: the shipped stacks profile (nodus sim's choice too).
    from nodus.config import STACKS_PROFILE

    assert sim_profile(None, True, "below-normal", stacks_mps=True) == STACKS_PROFILE
    # A graphed dedicated arm on the H200: the stacks profile, whose engine scale is the newer one.
    assert sim_profile(None, True, dedicated=True) == STACKS_PROFILE
    assert sim_profile(None, False, dedicated=True) == DEFAULT_PROFILES["eager"]
    assert sim_profile("mine.json", True, "below-normal", stacks_mps=True) == "mine.json"


def test_an_arm_on_an_h100_is_simulated_on_the_h100s_profiles():
    """On an 80 GB card (by its total memory, as --gpu-memory or nvidia-smi give it) a graphed arm
    is priced by the H100's shipped profiles; an H200, an eager arm or a profile asked for keep the
    choice above. Session 73's H100 runs: the H100 stacks profile replays two-stack continuous over
    shared-sync, as measured; the H200 stacks profile the other way round."""
    from experiments.gpu_arms import sim_profile
    from nodus.config import DEFAULT_PROFILES, H100_ONESTACK_PROFILE, H100_STACKS_PROFILE, STACKS_PROFILE
    from sim.profile import profile_dict

    h100, h200 = 79.6, 140.4
    assert sim_profile(None, True, "below-normal", stacks_mps=True, gpu_total_gib=h100) == H100_STACKS_PROFILE
    assert sim_profile(None, True, "below-normal", gpu_total_gib=h100) == H100_ONESTACK_PROFILE
    assert sim_profile(None, True, gpu_total_gib=h100) == H100_ONESTACK_PROFILE  # one stack, no MPS
    # A dedicated arm: the stacks profile, so a stacked arm's ratio is over one of the same profile.
    assert sim_profile(None, True, gpu_total_gib=h100, dedicated=True) == H100_STACKS_PROFILE
    assert sim_profile(None, True, "below-normal", stacks_mps=True, gpu_total_gib=h200) == STACKS_PROFILE
    assert sim_profile(None, True, gpu_total_gib=h200) == DEFAULT_PROFILES["graphed"]
    assert sim_profile(None, False, gpu_total_gib=h100) == DEFAULT_PROFILES["eager"]
    assert sim_profile("mine.json", True, stacks_mps=True, gpu_total_gib=h100) == "mine.json"
    for name in (H100_STACKS_PROFILE, H100_ONESTACK_PROFILE):
        assert "h100" in profile_dict(name)["environment"]["gpu"].lower()


def test_an_arms_ratio_is_over_the_dedicated_run_of_its_own_trainer():
    """arms.json's ratio_vs_dedicated: an arm with the graphed trainer (-cg) is measured over the
    graphed dedicated run, not the plain one; an MPS-only setting (-lowpri) needs no counterpart;
    the job count must match; an A/A repeat is never the baseline."""
    from experiments.gpu_arms import dedicated_key

    keys = ["dedicated", "dedicated-aa", "dedicated-cg", "dedicated-cg-j4", "overlap+mps-cg-lowpri"]
    assert dedicated_key("overlap+mps-cg-lowpri", keys) == "dedicated-cg"
    assert dedicated_key("overlap+mps-cg-lowpri-r2", keys) == "dedicated-cg"
    assert dedicated_key("shared-sync+mps", keys) == "dedicated"
    assert dedicated_key("overlap+mps-cg-lowpri-j4", keys) == "dedicated-cg-j4"
    assert dedicated_key("overlap+mps-cg-gm1024-lowpri-j16", keys) is None
    assert dedicated_key("dedicated-cg", keys) == "dedicated-cg"
    assert dedicated_key("overlap+mps-cg", ["dedicated-aa", "dedicated-gm1024"]) is None


def test_phase_seconds_count_each_shared_action_once():
    """A train step of two jobs is two spans of one interval: one action. Two stacks' steps at the
    same times are two; a dedicated run's per-job runs stay apart."""
    from experiments.gpu_arms import phase_seconds
    from nodus.messages import Span

    shared = [Span("a", 0, "train", 1.0, 2.0), Span("b", 0, "train", 1.0, 2.0), Span("a", 0, "publish", 2.0, 2.2),
              Span("b", 0, "publish", 2.0, 2.2), Span("c", 0, "train", 1.0, 1.5, stack=1),
              Span("a", 0, "generate", 0.0, 1.0)]
    assert phase_seconds([shared]) == pytest.approx({"generate": 1.0, "publish": 0.2, "train": 0.75})
    dedicated = [[Span("a", 0, "train", 1.0, 1.4)], [Span("b", 0, "train", 1.0, 1.4)], [Span("c", 0, "train", 0, 0.1)]]
    assert phase_seconds(dedicated) == pytest.approx({"train": 0.3})
    assert phase_seconds([]) == {}


def test_a_runs_progress_line_names_its_engine_step_and_busiest_thread():
    """gpu_arms' progress line: the engine step figures and the busiest thread's process, from the
    run's diagnostics; nothing for a run without them."""
    from experiments.gpu_arms import state_text

    summary = {"diagnostics": [{
        "engine_steps": {"summary": {"generations": 4, "steps": 400, "mean_step_ms": 4.6,
                                     "step_ms_per_generation": {"min": 3.2, "median": 4.6, "max": 5.1},
                                     "between_share": 0.1, "collect_share": 0.05, "gc_share": 0.012}},
        "host_monitor": {"available": True, "cores_busy": 7.3, "run_cores": 7.2, "other_cores": 0.05,
                         "steal_frac": 0.001, "busiest_thread": {"name": "python", "core_frac": 0.915, "pid": 7,
                                                                 "tid": 9, "process": "nodus-engine0: python -c x"}}}]}
    assert state_text(summary) == (", engine step 4.60 ms (generations 1.59x apart, GC 1.2%), "
                                   "busiest thread 92% of a core (nodus-engine0)")
    assert state_text({"diagnostics": [{}]}) == ""
    summary["diagnostics"][0]["host_monitor"]["steal_frac"] = 0.20  # session 45's dedicated runs
    assert state_text(summary).endswith("(nodus-engine0); CONTENDED HOST (steal 20% of the CPU time wanted): "
                                        "its ratios measure the host")


def _rows(out: str) -> list[list[str]]:
    """--plan's table rows, split into their cells."""
    return [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]


def _plan(monkeypatch, capsys, tmp_path, *argv):
    import sys

    from experiments import gpu_arms

    monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(tmp_path / "out"), "--model-dir",
                                      str(tmp_path / "model"), "--plan", *argv])
    gpu_arms.main()
    assert not (tmp_path / "model").exists() and not (tmp_path / "out").exists()  # nothing made
    return capsys.readouterr().out


def test_a_plan_lists_each_run_with_the_processes_it_needs_and_its_estimate(tmp_path, monkeypatch, capsys):
    """--plan (no GPU, no model): the runs in order, with run keys as on the GPU host (--cpus: the
    engines' default thread cap for two stacks on 16 CPUs is 4), what each does to the processes
    and its estimated seconds. Session 31's call asked 16 jobs on two stacks after the 8-job arm: a
    new engine size (max_num_seqs), so new processes, which the limit stopped while they started."""
    from experiments.gpu_arms import PRIME_S, START_S

    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--seeds", "1,2", "--engine-slots", "8",
                "--cuda-graph-max-tokens", "512", "--arms",
                "shared-sync+mps:cg:lowpri:sp4:k2:m8192,shared-sync+mps:cg:lowpri:sp4:k2:m8192:cpu4:s1,"
                "shared-sync+mps:cg:lowpri:sp4:k2:m8192:j16:s1,dedicated:cg:s1")
    rows = _rows(out)
    got = [(r[1], r[2], r[5]) for r in rows]
    assert got == [
        ("dedicated-cg-gm512-cpu2-flat", "1", "start"),  # no MPS: the baseline first
        ("shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k", "1", "start"),
        ("shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k", "2", "reuse"),
        # another trainer setting: the engines kept, the trainers restarted and primed
        ("shared-sync+mps-cg-gm512-lowpri-cpu4-ecpu4-flat-sp4-k2-mb8k", "1", "restart trainers, priming"),
        ("shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k-j16", "1", "start"),
    ], out
    prime = [float(r[6]) for r in rows]
    assert prime[0] == START_S[0] + START_S[1] and prime[1] == START_S[0] + 2 * START_S[1] and prime[2] == 0
    assert prime[3] == PRIME_S
    ends = [float(r[8].rstrip(" |")) for r in rows]
    runs = [float(r[7]) for r in rows]
    for i in range(len(rows)):  # each run ends at the last one's end plus its priming and run (printed rounded)
        assert abs(ends[i] - (ends[i - 1] if i else 0.0) - prime[i] - runs[i]) <= 1.5, out
    assert f"about {ends[-1]:.0f} s" in out and "for 16 CPUs" in out


def test_a_deadline_skips_the_runs_that_would_not_end_before_it(tmp_path, monkeypatch, capsys):
    """--deadline S: a run after the first whose estimate (its start or priming step and the run)
    would end after S seconds is not begun, and later runs that fit still run (here the plan of session 31's first
    call, whose 16-job dedicated run the limit stopped after 154 s of it)."""
    argv = ("--cpus", "16", "--engine-slots", "8", "--cuda-graph-max-tokens", "512",
            "--arms", "dedicated:cg:s2,dedicated:cg:j16:s1,dedicated:cg:s3")
    out = _plan(monkeypatch, capsys, tmp_path, *argv)
    rows = _rows(out)
    assert [(r[1], r[2]) for r in rows] == [("dedicated-cg-gm512-cpu2-flat", "2"), ("dedicated-cg-gm512-ls8-cpu2-flat-j16", "1"),
                                           ("dedicated-cg-gm512-cpu2-flat", "3")]
    ends = [float(r[8].rstrip(" |")) for r in rows]
    run16, run8 = ends[1] - ends[0], ends[2] - ends[1]
    assert run16 > run8 + 20  # 16 jobs one at a time take about twice 8
    # Past the first run and room for an 8-job run after it, short of the 16-job one.
    deadline = ends[0] + (run8 + run16) / 2
    out = _plan(monkeypatch, capsys, tmp_path, *argv, "--deadline", str(deadline))
    rows = _rows(out)
    assert [(r[1], r[2]) for r in rows] == [("dedicated-cg-gm512-cpu2-flat", "2"), ("dedicated-cg-gm512-cpu2-flat", "3")], out
    assert "skipped by --deadline: dedicated-cg-gm512-ls8-cpu2-flat-j16 seed 1" in out
    # The first run begins whatever its estimate (nothing measured yet; the call is for it).
    out = _plan(monkeypatch, capsys, tmp_path, *argv, "--deadline", "10")
    rows = _rows(out)
    assert [(r[1], r[2]) for r in rows] == [("dedicated-cg-gm512-cpu2-flat", "2")] and out.count("skipped by") == 2


def test_estimates_take_the_invocations_own_measurements_over_the_h200_defaults():
    from experiments.gpu_arms import PRIME_S, START_S, WALL_OVER_SIM, Estimates

    est = Estimates()
    assert est.prime_s("start", "mps", 2) == START_S[0] + 2 * START_S[1] and est.prime_s("reuse", "mps", 1) == PRIME_S
    assert est.run_s("dedicated", 10.0) == WALL_OVER_SIM * 10.0
    est.primed("start", "none", 1, 150.0)
    est.primed("restart trainers", "none", 1, 40.0)
    est.ran("dedicated", 50.0, 85.0)
    est.ran("dedicated", 50.0, 60.0)  # a faster run later: the slowest one's factor stays
    assert est.prime_s("start", "none", 1) == 150.0 and est.prime_s("start", "none", 2) == START_S[0] + 2 * START_S[1]
    assert est.prime_s("start", "mps", 1) == START_S[0] + START_S[1]  # another sharing mode: not measured here
    assert est.prime_s("restart trainers", "mps", 1) == 40.0
    assert est.run_s("dedicated", 10.0) == pytest.approx(17.0)
    assert est.run_s("overlap+mps", 10.0) == pytest.approx(17.0)  # no run of its own yet: the largest factor


def test_estimates_file_carries_a_machines_starts_and_factors_to_the_next_call(tmp_path, monkeypatch, capsys):
    """--estimates: an invocation writes the starts and run factors it measures (each the slowest
    measured), the next one on the machine reads them, and a plan then fits what the H200 defaults
    would skip (session 43: a dedicated and a two-stack arm in one call). A file that is not one is
    refused by name."""
    import json
    from pathlib import Path

    from experiments.gpu_arms import START_S, WALL_OVER_SIM, Estimates

    path = tmp_path / "cache" / "est.json"
    est = Estimates(path)
    assert est.prime_s("start", "mps", 2) == START_S[0] + 2 * START_S[1] and not path.exists()
    est.primed("start", "mps", 2, 256.0)
    est.primed("start", "mps", 2, 179.0)  # a faster start later: the slowest stays
    est.primed("start", "none", 1, 133.0)
    est.ran("dedicated", 50.0, 60.0)
    est.primed("reuse", "none", 1, 20.0)  # a priming step on running processes: this invocation's only
    again = Estimates(path)
    assert again.prime_s("start", "mps", 2) == 256.0 and again.prime_s("start", "none", 1) == 133.0
    assert again.run_s("dedicated", 10.0) == pytest.approx(12.0) and again.prime == []
    assert json.loads(path.read_text())["start"] == {"mps/2": 256.0, "none/1": 133.0}
    assert Estimates(tmp_path / "none.json").run_s("x", 1.0) == WALL_OVER_SIM  # no file yet: the defaults

    arms = ["--cpus", "16", "--steps", "20", "--engine-slots", "8", "--cuda-graph-max-tokens", "512",
            "--deadline", "545", "--arms", "dedicated:cg:n5:s2,shared-sync+mps:cg:lowpri:sp4:k2:m8192:s2"]
    assert "skipped by --deadline: shared-sync+mps" in _plan(monkeypatch, capsys, tmp_path, *arms)
    path.write_text(json.dumps({"start": {"none/1": 133.0, "mps/2": 256.0},
                                "factor": {"dedicated": 1.0, "shared-sync+mps": 1.0}}))
    out = _plan(monkeypatch, capsys, tmp_path, *arms, "--estimates", str(path))
    assert "skipped" not in out and [r[1] for r in _rows(out)] == [
        "dedicated-cg-gm512-cpu2-flat-n5", "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k"], out
    # The figures session 43's machine measured (experiments/device_session.sh's ESTIMATES_SEED): a
    # dedicated and a two-stack run of one seed, 5 steps a job each, fit one call.
    seed = Path(__file__).resolve().parents[1] / "experiments/results/h200/session43/estimates.json"
    arms5 = [a.replace("k2:m8192:s2", "k2:m8192:n5:s2") for a in arms]
    out = _plan(monkeypatch, capsys, tmp_path, *arms5, "--estimates", str(seed))
    assert "skipped" not in out and float(_rows(out)[-1][-1].strip(" |")) < 545 - 45, out
    path.write_text("{}")
    with pytest.raises(SystemExit, match="not an estimates file"):
        _plan(monkeypatch, capsys, tmp_path, *arms, "--estimates", str(path))


def test_cpus_is_for_plans_only(tmp_path, monkeypatch):
    import sys

    from experiments import gpu_arms

    monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(tmp_path / "out"), "--cpus", "16"])
    with pytest.raises(SystemExit, match="--cpus is for --plan"):
        gpu_arms.main()
    monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(tmp_path / "out"), "--deadline", "0"])
    with pytest.raises(SystemExit, match="--deadline 0.0: give the seconds"):
        gpu_arms.main()


def test_two_stack_arms_of_one_job_count_run_together(tmp_path, monkeypatch, capsys):
    """A two-stack engine is sized for its stack's jobs, so a 16-job two-stack arm between two 8-job
    ones would start processes twice more; gpu_arms runs the 8-job ones together first, whatever the
    order asked."""
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--engine-slots", "8", "--cuda-graph-max-tokens", "512",
                "--arms", "shared-sync+mps:cg:lowpri:sp4:k2:m8192:s1,shared-sync+mps:cg:lowpri:sp4:k2:m8192:j16:s1,"
                "overlap+mps:cg:lowpri:sp4:k2:m8192:s1")
    rows = _rows(out)
    # (shared-sync on two stacks co-runs across them: the same trainer shape as overlap, no priming)
    assert [(r[1].split("-cg")[0], r[3], r[5]) for r in rows] == [
        ("shared-sync+mps", "8", "start"), ("overlap+mps", "8", "reuse"), ("shared-sync+mps", "16", "start")]


def test_a_start_without_a_priming_step_still_counts_and_restarted_trainers_prime(tmp_path, monkeypatch, capsys):
    """--no-prime: a run that starts processes still costs the start (inside the run). Trainers
    restarted for a setting already primed once (--rounds 2 alternating two trainer settings) are
    new processes: each restart primes again before its measured run."""
    from experiments.gpu_arms import START_S

    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--no-prime", "--arms", "dedicated:cg:s1")
    row = _rows(out)[0]
    assert row[5] == "start" and float(row[6]) == START_S[0] + START_S[1]
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--rounds", "2",
                "--arms", "shared-sync+mps:cg:s1,shared-sync+mps:cg:cpu4:s1")
    rows = _rows(out)
    assert [r[5] for r in rows] == ["start", "restart trainers, priming", "restart trainers, priming",
                                    "restart trainers, priming"], out


def test_a_real_invocation_skips_a_run_past_its_deadline_and_records_it(tmp_path, monkeypatch):
    """The real path's --deadline (processes stood in by PlannedCluster, each run simulated): the
    first run begins; a later run needing a two-stack start (estimated at the H200's 400 s) past a
    100 s deadline is not begun, and arms.json lists it under 'skipped' beside the measured run."""
    import sys

    import nodus.runner
    import real.backend
    from experiments import gpu_arms
    from nodus.realrun import PlannedCluster
    from sim import backend_factory

    run_arm = nodus.runner.run_arm

    def simulated(cfg, pool, baseline=False):
        pool(cfg, nodus.runner.n_stacks(cfg))  # the pool's bookkeeping, as a real run does it
        return run_arm(cfg, backend_factory(cfg.profile), baseline=False)

    monkeypatch.setattr(nodus.runner, "run_arm", simulated)
    monkeypatch.setattr(real.backend, "Cluster", PlannedCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(out), "--model-dir", str(tmp_path / "model"),
                                      "--mode", "tasks", "--steps", "2", "--jobs", "4", "--deadline", "100",
                                      "--arms", "dedicated:s1,shared-sync+mps:k2:s1"])
    gpu_arms.main()
    import json

    res = json.loads((out / "arms.json").read_text())
    assert list(res["arms"]) == ["dedicated-flat"] and res["deadline_s"] == 100
    [skip] = res["skipped"]
    assert skip["arm"].startswith("shared-sync+mps") and skip["arm"].endswith("-k2") and skip["processes"] == "start"
    assert skip["prime_s"] == gpu_arms.START_S[0] + 2 * gpu_arms.START_S[1] and skip["elapsed_s"] < 100
    assert res["primed"][0]["processes"] == "start" and (out / "dedicated-flat-s1" / "summary.json").exists()


def test_an_ls_arm_runs_its_job_counts_on_one_two_stack_engine_each_primed(tmp_path, monkeypatch, capsys):
    """lsN: a two-stack arm's engines get N adapter slots whatever its jobs, so 2-, 4- and 8-job runs
    (a fit set and its held-out runs) share one cluster start; each job count's first run is primed
    (its engine steps carry more adapters than the smaller count's did), later seeds are not. Without
    it each job count's engine is sized to its stack's jobs: a start each."""
    a = "shared-sync+mps:cg:lowpri:sp4:k2:m8192"
    assert parse_arm(f"{a}:ls4:j2")[-1]["engine_slots"] == 4
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--engine-slots", "8", "--cuda-graph-max-tokens", "512",
                "--arms", f"{a}:ls4:j2:s1,{a}:ls4:j4:s1,{a}:ls4:j4:s2,{a}:ls4:s1")
    rows = _rows(out)
    assert [(r[1], r[2], r[5]) for r in rows] == [
        ("shared-sync+mps-cg-gm512-ls4-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k-j2", "1", "start"),
        ("shared-sync+mps-cg-gm512-ls4-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k-j4", "1", "reuse, priming"),
        ("shared-sync+mps-cg-gm512-ls4-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k-j4", "2", "reuse"),
        # 4 slots are an 8-job stack's own: the run key of every earlier 8-job two-stack run
        ("shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb8k", "1", "reuse, priming"),
    ], out
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--arms", f"{a}:j2:s1,{a}:j4:s1")
    assert [r[5] for r in _rows(out)] == ["start", "start"]
    import sys

    from experiments import gpu_arms

    for arms in ("dedicated:ls4", "shared-sync+mps:ls4", f"{a}:ls4:s1,shared-sync+mps:cg:ls4"):
        # refused before any run (the first arm here would otherwise start its cluster)
        monkeypatch.setattr(sys, "argv", ["gpu_arms.py", "--out", str(tmp_path / "o"), "--plan", "--arms", arms])
        with pytest.raises(SystemExit, match="ls4 sets a kN arm's engine adapter slots"):
            gpu_arms.main()


def test_a_plan_prices_each_arm_of_stacks_with_its_own_schedule(tmp_path, monkeypatch, capsys):
    """Held, offset and free stacks are one cluster's runs, each simulated with its own arm (session
    41's log gave all three the free stacks' prediction): their estimated seconds differ."""
    a = "shared-sync+mps:cg:lowpri:sp4:k2:m8192"
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--steps", "20", "--engine-slots", "8",
                "--cuda-graph-max-tokens", "512", "--arms", f"{a}:hold50:s1,{a}:off:s1,{a}:s1")
    rows = _rows(out)
    assert [r[1].rsplit("-k2-", 1)[1] for r in rows] == ["off-hold50-mb8k", "off-mb8k", "mb8k"]
    assert len({float(r[7]) for r in rows}) == 3, out


def test_an_arm_may_run_its_own_step_count(tmp_path, monkeypatch, capsys):
    """nN: this arm's steps a job over --steps, so one call runs 5-step dedicated runs beside 20-step
    two-stack runs (session 42's --steps 20 gave its dedicated run 20 steps: 220 s, and the deadline
    then skipped the two-stack runs). The run's key says so, and its estimate is the shorter run's."""
    assert parse_arm("dedicated:cg:n5:s3")[-1] == {"trainer_graphs": True, "steps": 5}
    with pytest.raises(SystemExit, match="'n0' is not jN.*nN"):
        parse_arm("dedicated:n0")
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--steps", "20", "--engine-slots", "8",
                "--cuda-graph-max-tokens", "512", "--arms", "dedicated:cg:n5:s1,dedicated:cg:s2")
    rows = _rows(out)
    assert [r[1] for r in rows] == ["dedicated-cg-gm512-cpu2-flat-n5", "dedicated-cg-gm512-cpu2-flat"], out
    five, twenty = (float(r[7]) for r in rows)
    assert 3 * five < twenty < 5 * five, out  # the run's own steps, and its fixed costs once


def test_an_arm_whose_graphed_trainers_would_not_fit_is_skipped_naming_the_micro_batch_that_fits(
        tmp_path, monkeypatch, capsys):
    """Session 49's H100 (77.2 of 79.2 GiB free): two stacks at 0.35 with 8k-token graphed trainers
    trained eager, 414 s of device time for a run that measured nothing of the arm. A plan for that
    GPU (--gpu-memory) skips it and names :m4096, and skips a dedicated run at the default 16k (one
    ~65 GiB trainer beside 27.7 GiB of engine), naming :m8192; the same arms at those sizes are
    planned; on an H200's memory all are; --allow-eager plans them anyway."""
    from experiments.gpu_arms import memory_skip

    why = memory_skip((77.2, 79.2), 0.35, 2, 8192, True)
    assert ":m4096 fits" in why and "train eager" in why
    assert memory_skip((77.2, 79.2), 0.35, 2, 4096, True) is None
    assert memory_skip((77.2, 79.2), 0.35, 2, 8192, False) is None  # an eager trainer: nothing to lose
    assert memory_skip(None, 0.35, 2, 8192, True) is None  # memory unknown: no check
    assert "no micro-batch fits" in memory_skip((20.0, 24.0), 0.8, 2, 8192, True)
    a = "shared-sync+mps:cg:lowpri:sp4:k2"
    argv = ("--cpus", "16", "--steps", "20", "--engine-slots", "8", "--cuda-graph-max-tokens", "512",
            "--arms", f"{a}:m8192:s1,{a}:m4096:s1,dedicated:cg:n5:s1,dedicated:cg:n5:m8192:s1")
    out = _plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "77.2,79.2")
    runs = [r[1] for r in _rows(out)]
    assert sorted(runs) == ["dedicated-cg-gm512-cpu2-flat-mb8k-n5", "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb4k"], out
    skips = [line for line in out.splitlines() if line.startswith("skipped by the memory check:")]
    assert len(skips) == 2, out
    assert any("k2-mb8k seed 1" in x and ":m4096 fits" in x for x in skips), out
    assert any("dedicated-cg-gm512-cpu2-flat-n5 seed 1" in x and ":m8192 fits" in x for x in skips), out
    assert len(_rows(_plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "139.8,140.4"))) == 4
    assert len(_rows(_plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "77.2,79.2", "--allow-eager"))) == 4
    # --shrink-to-fit runs each at the size that fits, named in its key, with a note; on an H200
    # nothing changes.
    out = _plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "77.2,79.2", "--shrink-to-fit")
    runs = [r[1] for r in _rows(out)]
    assert runs.count("shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb4k") == 2, out
    assert runs.count("dedicated-cg-gm512-cpu2-flat-mb8k-n5") == 2 and len(runs) == 4, out
    assert sum("(--shrink-to-fit)" in line for line in out.splitlines()) == 2, out
    assert "skipped by the memory check" not in out
    out = _plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "139.8,140.4", "--shrink-to-fit")
    assert "--shrink-to-fit)" not in out and len(_rows(out)) == 4
    with pytest.raises(SystemExit, match="--gpu-memory '80': give FREE,TOTAL"):
        _plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "80")
    with pytest.raises(SystemExit, match="free at most total"):
        _plan(monkeypatch, capsys, tmp_path, *argv, "--gpu-memory", "90,80")


def test_an_arm_with_its_own_seed_says_so_when_seeds_asks_another(tmp_path, monkeypatch, capsys):
    """An arm's :sN is its seed whatever --seeds says; session 63 asked --seeds 2 of an arm named
    :s1 and ran seed 1 again. The plan (and a run's log) now say so, before any run, naming the arm;
    an arm whose seeds --seeds includes, or a call without --seeds, gets no note."""
    arms = "shared-sync+mps:cg:lowpri:sp4:k2:m8192:r1:s1,dedicated:cg:s2"
    out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--engine-slots", "8", "--seeds", "2", "--arms", arms)
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert notes == ["note: arm shared-sync+mps:cg:lowpri:sp4:k2:m8192:r1:s1 names its own seed(s) 1 (:sN) and "
                     "runs those; --seeds 2 applies only to arms without one"], out
    assert sorted(r[2] for r in _rows(out)) == ["1", "2"]  # each arm on its own seed, as before
    for argv in (("--seeds", "1,2"), ()):
        out = _plan(monkeypatch, capsys, tmp_path, "--cpus", "16", "--engine-slots", "8", *argv, "--arms", arms)
        assert "note: " not in out, out
