"""nodus validate: the simulator scored against recorded runs (here: runs the simulator recorded,
so replaying their lengths must reproduce them)."""

import json
from pathlib import Path

import pytest

from calibration.validate import error_stats, kendall_tau, validate
from nodus.cli import main
from nodus.config import DEFAULT_PROFILE, ConfigError
from nodus.simulate import config_from_args, simulate


def test_error_stats_and_kendall_tau_on_known_values():
    e = error_stats([110, 90, 100], [100, 100, 100])
    assert e["mape"] == pytest.approx(0.2 / 3) and e["worst"] == pytest.approx(0.1) and e["bias"] == pytest.approx(0)
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1], [1]) is None


def test_machine_calibrated_predictions_leave_each_run_out_of_its_own_factor():
    from calibration.validate import machine_calibrated, render_markdown

    def row(machine, measured, simulated):
        return {"machine": machine, "measured": {"steps_per_gpu_hour": measured},
                "replay": {"steps_per_gpu_hour": simulated}, "sampled": {"steps_per_gpu_hour": simulated}}

    # Machine a runs 10% over the simulator on both runs: exact once its speed is known. Machine b's
    # runs are 10% and 20% under it: each is priced with the other's factor (80 -> 90, 90 -> 80).
    # Machine c has one run and a run has no machine: both left out.
    rows = [row("a", 110, 100), row("a", 220, 200), row("b", 90, 100), row("b", 80, 100),
            row("c", 5, 5), row(None, 50, 100)]
    mc = machine_calibrated(rows)
    assert mc["machines"] == 2 and mc["replay"]["n"] == 4
    assert mc["replay"]["mape"] == pytest.approx((0 + 0 + 10 / 90 + 10 / 80) / 4)
    assert mc["replay"]["worst"] == pytest.approx(10 / 80)
    assert mc["factors"] == pytest.approx({"a": 1.1, "b": 0.85})
    assert machine_calibrated([row("a", 110, 100), row("b", 90, 100)]) is None  # no machine of two runs
    text = render_markdown({"profile": "p", "fit_max_jobs": 4, "rows": [],
                            **{f"{sp}_{m}": {"mape": None, "worst": None, "bias": None, "n": 0, "kendall_tau": None}
                               for sp in ("heldout", "all") for m in ("replay", "sampled")},
                            "heldout_machine_calibrated": mc})
    assert "With the machine's speed known" in text and "| replay | 5.9% | 12.5% |" in text


def test_discordant_pairs_name_what_tau_counts_against_the_simulator():
    from calibration.validate import discordant_pairs

    # Measured a > b > c > d; simulated b over a (reversed) and c level with d (a tie counts against).
    pairs = discordant_pairs(["a", "b", "c", "d"], [100, 110, 90, 90], [120, 100, 95, 90])
    assert [(d["higher"], d["lower"]) for d in pairs] == [("a", "b"), ("c", "d")]  # largest measured gap first
    assert pairs[0]["measured"] == pytest.approx(0.2) and pairs[0]["simulated"] == pytest.approx(100 / 110 - 1)
    assert pairs[1]["simulated"] == 0
    assert kendall_tau([100, 110, 90, 90], [120, 100, 95, 90]) == pytest.approx((6 - 2 * 1 - 1) / 6)
    assert discordant_pairs(["a", "b"], [1, 2], [10, 20]) == [] and discordant_pairs(["a", "b"], [1, 2], [5, 5]) == []


def test_replaying_a_recorded_run_reproduces_it(tmp_path):
    runs = []
    for jobs, policy in ((2, "shared-sync"), (8, "overlap")):
        out = tmp_path / f"{policy}{jobs}"
        simulate(config_from_args(jobs=jobs, steps=3, policy=policy, sharing="mps"), out)
        runs.append(out)
    rep = validate(runs, profile=DEFAULT_PROFILE)  # the profile the runs were simulated on
    assert rep["heldout_mape_replay"] == pytest.approx(0, abs=1e-9)  # same lengths, same model
    assert rep["heldout_replay"]["n"] == 1 and rep["all_replay"]["n"] == 2
    assert rep["kendall_tau"] is None  # one held-out run: no ranking
    assert rep["all_replay"]["kendall_tau"] == 1.0
    assert rep["heldout_mape_sampled"] < 0.2
    # Replayed, every phase and busy fraction is reproduced too.
    for name, e in rep["all_replay_components"].items():
        assert e["n"] == 2 and e["mape"] == pytest.approx(0, abs=1e-9), name


def test_validate_cli_and_bad_folder(tmp_path, capsys):
    out = tmp_path / "r"
    simulate(config_from_args(jobs=2, steps=2), out)
    assert main(["validate", str(out), "--out", str(tmp_path / "v")]) == 0
    assert (tmp_path / "v" / "validation.json").is_file() and (tmp_path / "v" / "validation.png").is_file()
    with pytest.raises(ConfigError, match="not a recorded run"):
        validate([tmp_path], profile="h200-qwen3-0.6b")
    # The spelling, `--runs DIR...`, names the same folders; naming none is a clear error.
    capsys.readouterr()
    assert main(["validate", "--runs", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["all_replay"]["n"] == 1
    assert main(["validate", "--profile", DEFAULT_PROFILE]) == 2
    assert "validate needs at least one run folder" in capsys.readouterr().err


def test_extrapolated_predictions_are_flagged_in_the_report(tmp_path):
    from calibration.validate import render_markdown
    from sim.profile import load_profile

    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["train"]["max_profiled_tokens"] = 1000  # every real micro-batch is larger
    path = tmp_path / "narrow.json"
    path.write_text(json.dumps(prof))
    out = tmp_path / "run"
    simulate(config_from_args(jobs=2, steps=2), out)
    rep = validate([out], profile=str(path))
    assert any("train micro-batch tokens" in f for f in rep["rows"][0]["outside_profile"])
    md = render_markdown(rep)
    assert "outside the profiled region" in md and "train micro-batch tokens" in md


def test_annotation_carries_the_machine_calibrated_error(tmp_path):
    from calibration.validate import annotate_profile
    from nodus.simulate import error_bar_line
    from sim.profile import load_profile

    rep = {"rows": [{"heldout": True, "arm": None}], "heldout_replay": {"mape": 0.07, "bias": 0.017, "worst": 0.171,
                                                                      "kendall_tau": 0.0},
           "heldout_machine_calibrated": {"machines": 5, "replay": {"mape": 0.04, "bias": 0.002, "worst": 0.109, "n": 20}},
           "heldout_per_config": {"replay": {"mape": 0.055, "worst": 0.101, "bias": 0.001, "n": 9, "kendall_tau": 0.61,
                                             "kendall_tau_resolved": 1.0, "pairs_resolved": 13, "pairs": 36}}}
    out = tmp_path / "p.json"
    annotate_profile(DEFAULT_PROFILE, rep, out)
    v = load_profile(str(out)).validation()
    assert (v["machine_mape"], v["machine_runs"], v["machines"]) == (0.04, 20, 5)
    assert (v["configs"], v["config_tau"], v["config_tau_resolved"], v["config_pairs_resolved"]) == (9, 0.61, 1.0, 13)
    line = error_bar_line(v)
    assert "MAPE 7.0%" in line and "With the machine's speed known" in line and "20 runs on 5 machines): MAPE 4.0%" in line
    assert "each of 9 configurations' mean: MAPE 5.5%, worst 10.1%, Kendall tau 0.61 (1.00 over the 13 of 36 pairs" in line


def test_annotated_profile_carries_its_error_bar_into_every_report(tmp_path, capsys):
    runs = []
    for jobs, policy in ((1, "dedicated"), (8, "overlap")):
        out = tmp_path / f"{policy}{jobs}"
        simulate(config_from_args(jobs=jobs, steps=2, policy=policy, sharing="mps"), out)
        runs.append(str(out))
    annotated = tmp_path / "annotated.json"
    assert main(["validate", *runs, "--annotate", str(annotated), "--report-path", "reports/v.md"]) == 0
    v = json.loads(annotated.read_text())["validation"]
    assert v["heldout_runs"] == 1 and v["heldout_mape"] == pytest.approx(0, abs=1e-9)
    assert v["configurations"] == ["8 jobs overlap g=2 mps"] and v["report"] == "reports/v.md"
    assert v["arms"] == {"overlap g=2 mps": {"runs": 1, "configurations": 1, "mape": pytest.approx(0, abs=1e-9),
                                             "bias": pytest.approx(0, abs=1e-9), "worst": pytest.approx(0, abs=1e-9)}}
    capsys.readouterr()
    assert main(["sim", "--jobs", "2", "--steps", "2", "--profile", str(annotated)]) == 0
    out = capsys.readouterr().out
    assert "against 1 held-out real runs: steps per GPU-hour MAPE 0.0%" in out
    assert "Of the held-out runs, this arm's: overlap g=2 mps: 1 run(s), MAPE 0.0%, bias +0.0%, worst 0.0%." in out
    # An arm no held-out run ran: the one MAPE is not its error bar, and the report says so.
    assert main(["sim", "--jobs", "2", "--steps", "2", "--policy", "shared-sync", "--sharing", "none",
                 "--profile", str(annotated)]) == 0
    out = capsys.readouterr().out
    assert ("No held-out run of shared-sync g=1 none is behind that error bar (its arms: overlap g=2 mps): the "
            "prediction for that arm has no error bar on this profile.") in out and "this arm's" not in out
    # Another existing file is never overwritten; the annotated profile itself may be.
    other = tmp_path / "other.json"
    other.write_text("{}")
    assert main(["validate", *runs, "--annotate", str(other)]) != 0
    assert "not the profile being annotated" in capsys.readouterr().err
    assert main(["validate", *runs, "--profile", str(annotated), "--annotate", str(annotated)]) == 0


def test_noise_floor_and_per_configuration_errors_on_known_values():
    """Two seeds of one configuration measured 90 and 110 (mean 100): each run lies 10% from the
    mean, the floor under any per-run MAPE; a prediction of 100 for both is 10% off per run and
    exact against the configuration's mean."""
    from calibration.validate import measurement_noise, per_config_errors

    def row(meas, pred, seed, policy="overlap"):
        out = {"arm": {"policy": policy, "groups": 2, "sharing": "mps"}, "jobs": 8, "seed": seed,
               "measured": {"steps_per_gpu_hour": meas}}
        return {**out, "replay": {"steps_per_gpu_hour": pred}, "sampled": {"steps_per_gpu_hour": pred}}

    rows = [row(90, 100, 1), row(110, 100, 2), row(50, 60, 1, policy="shared-sync")]
    noise = measurement_noise(rows)
    assert noise["mape_floor"] == pytest.approx(0.10) and noise["max_spread"] == pytest.approx(0.20)
    assert noise["configs"] == 1 and noise["runs"] == 2  # the single shared-sync run has no spread
    pc = per_config_errors(rows)
    assert pc["replay"]["n"] == 2 and pc["runs_per_config"] == [2, 1]
    assert pc["replay"]["mape"] == pytest.approx((0.0 + 0.2) / 2)  # 100 vs 100; 60 vs 50
    assert pc["replay"]["kendall_tau"] == pytest.approx(1.0)
    assert measurement_noise(rows[2:])["mape_floor"] is None


def test_tau_over_resolved_pairs_counts_only_configurations_measurably_apart():
    """Three configurations of three runs: A and C both measure 100 (level: not apart), B 150 (apart
    from both by far more than two standard errors). Tau over resolved pairs counts (A, B) and
    (C, B) alone; the plain tau also counts (A, C), ordered by the simulator's noise."""
    from calibration.validate import resolved_tau

    runs = [[100, 102, 98], [150, 152, 148], [101, 99, 100]]
    meas = [100.0, 150.0, 100.0]
    out = resolved_tau([90, 160, 95], meas, runs)
    assert out["pairs_resolved"] == 2 and out["pairs"] == 3 and out["kendall_tau_resolved"] == pytest.approx(1.0)
    # relative deviations from each mean: A 0, ±0.02; B 0, ±2/150; C ±0.01, 0; over 6 degrees of freedom
    assert out["pooled_run_spread"] == pytest.approx(((2 * 0.02 ** 2 + 2 * (2 / 150) ** 2 + 2 * 0.01 ** 2) / 6) ** 0.5)
    assert resolved_tau([90, 80, 95], meas, runs)["kendall_tau_resolved"] == pytest.approx(-1.0)
    # 1% apart with a 2% spread over 3 runs each: not resolved, so no tau at all
    close = resolved_tau([1, 2], [100.0, 101.0], [[98, 100, 102], [99, 101, 103]])
    assert close["pairs_resolved"] == 0 and close["kendall_tau_resolved"] is None
    # single runs and no pool: no standard error, no pair resolved
    assert resolved_tau([1, 2], [100.0, 200.0], [[100], [200]])["pairs_resolved"] == 0


def test_the_held_out_error_on_unflagged_runs_is_given_apart():
    """Three held-out runs, one flagged by the host monitor (predicted 20% high, as a contended host's
    run is) and one fitted run: the unflagged error counts the two clean held-out runs alone, the
    flagged one its own; the fitted run is in neither, and the report shows both."""
    from calibration.validate import render_markdown, unflagged_errors

    def row(run, meas, pred, held=True):
        return {"run": run, "heldout": held, "measured": {"steps_per_gpu_hour": meas},
                "replay": {"steps_per_gpu_hour": pred}, "sampled": {"steps_per_gpu_hour": pred}}

    rep = {"rows": [row("a", 100, 105), row("b", 100, 97), row("c", 100, 120), row("fit", 100, 150, held=False)],
           "host_monitor": {"flagged": [{"run": "c", "why": {"steal": 0.2}}]}, "host": {"flagged": []}, "gpu": {}}
    u = unflagged_errors(rep)
    assert u["flagged_runs"] == ["c"]
    assert u["unflagged"]["replay"]["n"] == 2 and u["unflagged"]["replay"]["mape"] == pytest.approx(0.04)
    assert u["unflagged"]["replay"]["bias"] == pytest.approx(0.01)
    assert u["flagged"]["sampled"]["n"] == 1 and u["flagged"]["sampled"]["bias"] == pytest.approx(0.20)
    assert unflagged_errors({**rep, "host_monitor": {}})["flagged_runs"] == []
    md_rep = {"profile": "p", "fit_max_jobs": 4, "rows": [], "heldout_unflagged": u,
              **{f"{s}_{m}": {"mape": None, "worst": None, "bias": None, "n": 0, "kendall_tau": None}
                 for s in ("heldout", "all") for m in ("replay", "sampled")}}
    md = render_markdown(md_rep)
    assert "the runs no monitor flagged" in md and "| unflagged | replay | 4.0% | 5.0% | +1.0% | 2 |" in md


def test_runs_at_another_micro_batch_size_are_another_configuration():
    from calibration.validate import config_key, config_label

    arm = {"policy": "overlap", "groups": 2, "sharing": "mps"}
    a, b = ({"arm": arm, "jobs": 8, "mb_tokens": mb} for mb in (16384, 32768))
    assert config_key(a) != config_key(b)
    assert config_label(a) == "8 jobs overlap g=2 mps" and config_label(b) == "8 jobs overlap g=2 mps mb=32768"


def test_runs_that_packed_prompts_are_another_configuration(tmp_path):
    """trainer.share_prompts changes the trainer's work: such a run is not a repeat of the plain
    arm in the per-configuration errors or the noise floor, and the report names it; validate
    simulates it packed."""

    from calibration.validate import config_key, config_label, validate
    from nodus.config import DEFAULT_PROFILES
    from nodus.simulate import config_from_args, simulate

    arm = {"policy": "overlap", "groups": 2, "sharing": "mps"}
    plain, packed, one = ({"arm": arm, "jobs": 8, "mb_tokens": 16384, "share_prompts": k} for k in (0, 4, 1))
    assert config_key(plain) != config_key(packed) and config_key(plain) == config_key(one)
    assert config_label(packed) == "8 jobs overlap g=2 mps sp4" and config_label(one) == "8 jobs overlap g=2 mps"
    for share in (0, 4):
        cfg = config_from_args({"trainer": {"share_prompts": share}}, jobs=2, steps=2, policy="overlap", groups=2,
                               sharing="mps", profile=DEFAULT_PROFILES["graphed"])
        simulate(cfg, tmp_path / f"sp{share}")
    rep = validate([tmp_path / "sp0", tmp_path / "sp4"], DEFAULT_PROFILES["graphed"])
    rows = {r["run"].rsplit("/", 1)[-1]: r for r in rep["rows"]}
    assert (rows["sp0"]["share_prompts"], rows["sp4"]["share_prompts"]) == (0, 4)
    for name in ("sp0", "sp4"):  # each run's own configuration, predicted as it was simulated
        assert rows[name]["replay"]["steps_per_gpu_hour"] == pytest.approx(
            json.loads((tmp_path / name / "summary.json").read_text())["steps_per_gpu_hour"], rel=1e-6)
    assert any("share_prompts=4" in f for f in rows["sp4"]["outside_profile"])


def test_runs_recorded_before_the_trainer_stopped_waiting_for_publish_replay_that_scheduler(tmp_path):
    """A run folder whose config has no arm.trainer_waits_for_publish came from the scheduler that
    held the trainer until each publish ended: validate simulates it that way, newer runs as recorded."""

    from calibration.validate import load_recorded, recorded_configs
    from nodus.simulate import config_from_args, simulate

    rd = tmp_path / "run"
    cfg0 = config_from_args(jobs=4, steps=2, policy="overlap", groups=2, sharing="mps")
    simulate(cfg0.model_copy(update={"arm": cfg0.arm.model_copy(update={"trainer_waits_for_publish": False})}), rd)
    cfg, _, spans = load_recorded(rd)
    assert cfg["arm"]["trainer_waits_for_publish"] is False
    assert recorded_configs(rd, cfg, spans, "h200-qwen3-0.6b")[0]["arm"]["trainer_waits_for_publish"] is False
    old = json.loads(json.dumps(cfg))
    del old["arm"]["trainer_waits_for_publish"]
    for c in recorded_configs(rd, old, spans, "h200-qwen3-0.6b"):
        assert c["arm"]["trainer_waits_for_publish"] is True


def test_annotate_a_shipped_profile_named_by_name_writes_its_own_file(tmp_path, monkeypatch):
    """`nodus validate --profile NAME --annotate <that profile's file>` annotates it in place; any
    other existing file is refused."""
    import importlib.resources
    import shutil

    import pytest

    from calibration.validate import annotate_profile

    shipped = importlib.resources.files("calibration") / "profiles" / "h200-qwen3-0.6b.json"
    (tmp_path / "profiles").mkdir()
    mine = tmp_path / "profiles" / "mine.json"
    shutil.copy(str(shipped), mine)
    monkeypatch.setattr(importlib.resources, "files", lambda pkg: tmp_path)
    rep = {"rows": [], "heldout_replay": {"mape": 0.1, "bias": 0.01, "worst": 0.2, "kendall_tau": 0.5}}
    annotate_profile("mine", rep, mine, report="r.md")
    assert json.loads(mine.read_text())["validation"]["heldout_mape"] == 0.1
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(FileExistsError, match="not the profile being annotated"):
        annotate_profile("mine", rep, other)


def test_stacks_in_lockstep_are_their_own_configuration():
    # Session 38 validated lockstep and free two-stack runs in one report: they are two
    # configurations, not one mean over both.
    from calibration.validate import config_key, config_label

    arm = {"policy": "shared-sync", "groups": 1, "sharing": "mps", "stacks": 2}
    free = {"jobs": 8, "arm": arm, "mb_tokens": 16384}
    lock = {"jobs": 8, "arm": dict(arm, lockstep=True), "mb_tokens": 16384}
    assert config_key(lock) != config_key(free)
    assert config_key(free) == config_key({**free, "arm": dict(arm, lockstep=False)})
    assert config_label(lock) == "8 jobs shared-sync g=1 mps stacks=2 lockstep"
    assert config_label(free) == "8 jobs shared-sync g=1 mps stacks=2"


def test_a_freed_trainer_is_its_own_configuration():
    from calibration.validate import config_key, config_label

    arm = {"policy": "overlap", "groups": 2, "sharing": "mps"}
    waited = {"jobs": 8, "arm": arm, "mb_tokens": 16384}
    freed = {"jobs": 8, "arm": dict(arm, trainer_waits_for_publish=False), "mb_tokens": 16384}
    assert config_label(freed) == "8 jobs overlap g=2 mps freed"
    assert config_label(waited) == "8 jobs overlap g=2 mps"
    assert config_key(freed) != config_key(waited)
    assert config_key(waited) == config_key({**waited, "arm": dict(arm, trainer_waits_for_publish=True)})
    sync = {"policy": "shared-sync", "groups": 1, "sharing": "mps", "trainer_waits_for_publish": False}
    assert config_label({"jobs": 8, "arm": sync, "mb_tokens": 16384}) == "8 jobs shared-sync g=1 mps"


def test_runs_at_other_mps_settings_are_another_configuration():
    from calibration.validate import config_key, config_label
    from calibration.run_settings import run_controls

    plain = {"diagnostics": [{"sharing_controls": {"engine_thread_pct": None, "trainer_thread_pct": None,
                                                   "trainer_priority": "normal"}}]}
    capped = {"diagnostics": [{"sharing_controls": {"engine_thread_pct": None, "trainer_thread_pct": 50,
                                                    "trainer_priority": "normal"}}]}
    assert run_controls(plain) == {} and run_controls({"diagnostics": [{"sharing_controls": {}}]}) == {}
    assert run_controls(capped) == {"trainer_thread_pct": 50}
    arm = {"policy": "overlap", "groups": 2, "sharing": "mps"}
    a = {"arm": arm, "jobs": 8, "mb_tokens": 16384, "controls": run_controls(plain)}
    b = {"arm": arm, "jobs": 8, "mb_tokens": 16384, "controls": run_controls(capped)}
    assert config_key(a) != config_key(b) and config_key(a) == config_key({**a, "controls": None})
    assert config_label(b) == "8 jobs overlap g=2 mps trainer_thread_pct=50"
    # A CUDA-graphed trainer is its own configuration too, and one the profile does not model.
    from calibration.run_settings import unmodelled_controls

    graphed = {"diagnostics": [dict(plain["diagnostics"][0], workers={
        "engine0": {}, "trainer0": {"lora_layout": "masked", "step_mode": "graphed"}})]}
    eager = {"diagnostics": [dict(plain["diagnostics"][0], workers={"trainer0": {"step_mode": "eager"}})]}
    assert run_controls(graphed) == {"trainer_step_mode": "graphed"} and run_controls(eager) == {}
    c = {"arm": arm, "jobs": 8, "mb_tokens": 16384, "controls": run_controls(graphed)}
    assert config_key(c) != config_key(a) and config_label(c).endswith("trainer_step_mode=graphed")
    assert unmodelled_controls(c["controls"]) and unmodelled_controls(b["controls"]) == []
    # Against a profile measured with the graphed trainer (calibrate --trainer-graphs) it is the
    # other way round: the graphed run is modelled, an eager one is not.
    assert unmodelled_controls(c["controls"], "graphed") == []
    assert unmodelled_controls(b["controls"], "graphed") == [
        "the trainer ran eager; the profile's trainer terms are the graphed step's"]
    # An engine with more adapter slots than the run's jobs (a larger arm's, in one gpu_arms call) is
    # another engine: its own configuration, which no profile models; as many slots as jobs is none.
    wide = {"jobs": 8, "diagnostics": [dict(plain["diagnostics"][0], engine_max_loras=16)]}
    assert run_controls(wide) == {"engine_max_loras": 16}
    assert run_controls({"jobs": 8, "diagnostics": [dict(plain["diagnostics"][0], engine_max_loras=8)]}) == {}
    assert run_controls({"diagnostics": [dict(plain["diagnostics"][0], engine_max_loras=8)]}) == {}  # jobs unknown
    w = {"arm": arm, "jobs": 8, "mb_tokens": 16384, "controls": run_controls(wide)}
    assert config_key(w) != config_key(a)
    # Against the profile's engine (environment.engine_max_loras) where it records one, else the jobs.
    assert unmodelled_controls(w["controls"], run_slots=8) == [
        "the engine had 16 adapter slots, more than the run's jobs (started for a larger arm of the invocation); "
        "the profile does not say which engine it measured"]
    assert unmodelled_controls(w["controls"], profile_slots=16, run_slots=8) == []
    assert unmodelled_controls({}, profile_slots=16, run_slots=8) == [
        "the engine had 8 adapter slots; the profile's engine terms were measured with 16 "
        "(environment.engine_max_loras)"]
    assert unmodelled_controls({}, run_slots=8) == [] and unmodelled_controls({}, profile_slots=8, run_slots=8) == []
    # The trainers' CPU threads capped below the host's CPUs: a control of the run (its own
    # configuration), named against a profile measured with other threads.
    # An engine per stack with one slot per job of its own stack (arm.stack_jobs): no slot control.
    stacked = {"jobs": 8, "arm": {"stacks": 2, "stack_jobs": [4, 4]}, "diagnostics": [{"engine_max_loras": 4}]}
    assert run_controls(stacked) == {}
    assert run_controls(dict(stacked, arm={})) == {"engine_max_loras": 4}
    capped = {"diagnostics": [{"host": {"cpus": 16}, "workers": {"trainer0": {"cpu_threads": 2}}}]}
    assert run_controls(capped) == {"trainer_cpu_threads": 2}
    capped["diagnostics"][0]["workers"]["trainer0"]["cpu_threads"] = 16  # session 28 call c's record of no cap
    assert run_controls(capped) == {}
    assert unmodelled_controls({"trainer_cpu_threads": 2}, profile_cpu_threads=2) == []
    assert unmodelled_controls({"trainer_cpu_threads": 2}) == [
        "the trainer ran 2 CPU threads; the profile's train terms were measured with torch's own CPU thread count "
        "(environment.trainer_cpu_threads): beside the engine under MPS, a trainer capped at 2 trained in "
        "half the time of one on 16 (session 28)"]
    assert "the trainer ran torch's own CPU thread count; the profile's train terms were measured with 2 " \
        "CPU threads" in unmodelled_controls({}, profile_cpu_threads=2)[0]
    # The engines' CPU threads capped (RealOptions.engine_cpu_threads): a control, flagged against
    # every profile (none records an engine cap).
    engine_capped = {"diagnostics": [{"workers": {"engine0": {"cpu_threads": 1, "torch_threads": 1},
                                                  "trainer0": {"cpu_threads": None}}}]}
    assert run_controls(engine_capped) == {"engine_cpu_threads": 1}
    assert unmodelled_controls({"engine_cpu_threads": 1}) == [
        "the engine's torch CPU threads were capped (--engine-cpu-threads): the profile's engine terms were "
        "measured on torch's own count"]
    # Two stacks' trainers, one of whose graph capture failed (it trained eager): a mixed step mode,
    # named against a graphed profile; a dedicated run records its one trainer once a job.
    mixed = {"diagnostics": [{"workers": {"trainer0": {"step_mode": "graphed"},
                                          "trainer1": {"step_mode": "eager", "graph_error": "OutOfMemoryError"}}}]}
    assert run_controls(mixed) == {"trainer_step_mode": "graphed 1 of 2"}
    assert unmodelled_controls(run_controls(mixed), profile_step_mode="graphed") == [
        "the trainer ran graphed 1 of 2; the profile's trainer terms are the graphed step's"]
    per_job = {"diagnostics": [{"workers": {"trainer0": {"step_mode": "graphed"}}}] * 3}
    assert run_controls(per_job) == {"trainer_step_mode": "graphed"}
    # Fewer slots than jobs (engine.max_loras, which the simulator admits by): a configuration of its
    # own, named only against a profile measured with other slots.
    narrow = {"jobs": 16, "diagnostics": [dict(plain["diagnostics"][0], engine_max_loras=8)]}
    assert run_controls(narrow) == {"engine_max_loras": 8}
    assert unmodelled_controls({"engine_max_loras": 8}, run_slots=8) == []
    assert unmodelled_controls({"engine_max_loras": 8}, profile_slots=16, run_slots=8, run_jobs=16) == [
        "the engine had 8 adapter slots; the profile's engine terms were measured with 16 "
        "(environment.engine_max_loras)"]
    # A config asking more slots than jobs (engine.max_loras 16 for 8 jobs): more than its jobs, named.
    assert unmodelled_controls({"engine_max_loras": 16}, run_slots=16, run_jobs=8) == [
        "the engine had 16 adapter slots, more than the run's jobs (started for a larger arm of the invocation); "
        "the profile does not say which engine it measured"]
    tuned = {"diagnostics": [dict(plain["diagnostics"][0], engine_args={"specialize_active_lora": True})]}
    assert run_controls(tuned) == {"engine_args": "specialize_active_lora=True"}
    assert unmodelled_controls(run_controls(tuned))
    # Tuned LoRA kernel configs, through the environment or the shipped ones the engine reported:
    # "tuned" kernels, unmodelled by a profile of vLLM's default kernels and modelled by a tuned one.
    kernels = {"diagnostics": [dict(plain["diagnostics"][0], engine_env={"VLLM_TUNED_CONFIG_FOLDER": "/tmp/x"})]}
    assert run_controls(kernels) == {"lora_kernels": "tuned"}
    shipped = {"diagnostics": [dict(plain["diagnostics"][0], workers={
        "engine0": {"lora_kernel_configs": {"source": "shipped", "folder": "real/lora_configs", "gpu": "NVIDIA H200"}},
        "trainer0": {"step_mode": "eager"}})]}
    assert run_controls(shipped) == {"lora_kernels": "tuned"}
    assert unmodelled_controls(run_controls(shipped)) == [
        "the engine ran tuned LoRA kernel configs; the profile's engine terms are the default kernels' "
        "(real/lora_kernels.py; --no-tuned-lora-kernels runs vLLM's)"]
    assert unmodelled_controls(run_controls(shipped), "eager", "tuned") == []
    assert unmodelled_controls(run_controls(eager), "eager", "tuned")  # a default-kernel run, tuned profile
    other = {"diagnostics": [dict(plain["diagnostics"][0], engine_env={"VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
                                                                       "VLLM_TUNED_CONFIG_FOLDER": "/tmp/x"})]}
    assert run_controls(other) == {"lora_kernels": "tuned", "engine_env": "VLLM_ATTENTION_BACKEND"}
    # vLLM's core in a process of its own: another configuration, outside a profile of one process.
    core = {"diagnostics": [dict(plain["diagnostics"][0], engine_core_process=True)]}
    off = {"diagnostics": [dict(plain["diagnostics"][0], engine_core_process=False)]}
    assert run_controls(core) == {"engine_core_process": True} and run_controls(off) == {}
    # The engine's CUDA graphs past vLLM's default sizes: another configuration, one the simulator
    # models (from the run's config), so not outside the profile.
    graphs = {"diagnostics": [dict(plain["diagnostics"][0], cuda_graph_max_tokens=1024)]}
    assert run_controls(graphs) == {"cuda_graph_max_tokens": 1024} and unmodelled_controls(run_controls(graphs)) == []
    assert unmodelled_controls(run_controls(core)) == [
        "the engine's core ran in a process of its own (--engine-core-process): the profile's engine terms "
        "are one process's"]
    # Adapters published into pageable host memory: another configuration, outside the profile.
    unpinned = {"diagnostics": [dict(plain["diagnostics"][0], publish_pinned=False)]}
    pinned = {"diagnostics": [dict(plain["diagnostics"][0], publish_pinned=True)]}
    assert run_controls(unpinned) == {"publish_pinned": False} and run_controls(pinned) == {}
    assert unmodelled_controls(run_controls(unpinned)) == [
        "the engine loaded published adapters into pageable host memory (publish_pinned false, :np): the "
        "profile's publish is vLLM's pinned one"]
    # Adapters handed over as flat files: another configuration, outside the profile (PEFT's is the default).
    flat = {"diagnostics": [dict(plain["diagnostics"][0], adapter_format="flat")]}
    peft = {"diagnostics": [dict(plain["diagnostics"][0], adapter_format="safetensors")]}
    assert run_controls(flat) == {"adapter_format": "flat"} and run_controls(peft) == {}
    assert unmodelled_controls(run_controls(flat)) == [
        "the trainer handed adapters to the engine as flat files (:flat): the profile's train and publish "
        "terms include the PEFT safetensors save and load"]
    # ... but inside a profile of that handoff (environment.adapter_format, nodus fit on flat runs),
    # where a PEFT-folder run is the one outside.
    assert unmodelled_controls(run_controls(flat), profile_adapter_format="flat") == []
    assert unmodelled_controls(run_controls(peft), profile_adapter_format="flat") == [
        "the trainer handed adapters to the engine as safetensors files; the profile's train and publish terms "
        "include the flat handoff's save and load (environment.adapter_format)"]
    # The engine's logprobs on fewer steps than every one: another configuration, outside the profile.
    # Or on fewer responses: another configuration too. The table labels name the same settings.
    from calibration.run_settings import audit_label

    for audit, says, label in (({"logprobs": False, "every": 1}, "off", "a0"),
                               ({"logprobs": True, "every": 4}, "every 4 steps", "a4"),
                               ({"logprobs": True, "every": 1, "responses": 1}, "1 response a prompt", "r1"),
                               ({"logprobs": True, "every": 4, "responses": 2}, "every 4 steps, 2 responses a prompt",
                                "a4r2")):
        run = {"diagnostics": [dict(plain["diagnostics"][0], audit=audit)]}
        assert run_controls(run) == {"audit": says} and unmodelled_controls(run_controls(run))
        assert audit_label(audit) == label
    default = {"logprobs": True, "every": 1, "responses": None}
    assert run_controls({"diagnostics": [dict(plain["diagnostics"][0], audit=default)]}) == {}
    assert audit_label(default) == audit_label({}) == ""


def test_host_probe_times_fixed_work_and_slow_hosts_are_flagged(tmp_path):
    from calibration.run_health import HOST_SLOW, host_flags, run_host_probe
    from nodus.outdir import host_probe

    p = host_probe(str(tmp_path))
    assert p["cpu_loop_s"] > 0 and p["file_rw_s"] > 0 and list(tmp_path.iterdir()) == []  # no file left
    summary = {"diagnostics": [{"host_probe": {"start": dict(p, cpu_loop_s=0.05), "end": dict(p, cpu_loop_s=0.08)}},
                               {"host_probe": {"start": dict(p, cpu_loop_s=0.06)}}]}
    assert run_host_probe(summary)["cpu_loop_s"] == pytest.approx(0.08)  # the slowest of the run's probes
    assert run_host_probe({"diagnostics": [{}]}) is None
    rows = [{"run": f"r{i}", "host_probe": {"cpu_loop_s": 0.05, "file_rw_s": 0.02}} for i in range(4)]
    rows.append({"run": "slow", "host_probe": {"cpu_loop_s": 0.05, "file_rw_s": 0.02 * (HOST_SLOW + 0.5)}})
    rows.append({"run": "old", "host_probe": None})
    f = host_flags(rows)
    assert f["runs_with_probe"] == 5 and f["runs"] == 6 and f["median"]["file_rw_s"] == pytest.approx(0.02)
    assert [x["run"] for x in f["flagged"]] == ["slow"]
    assert f["flagged"][0]["slower"] == {"file_rw_s": pytest.approx(HOST_SLOW + 0.5)}
    assert host_flags([{"run": "old", "host_probe": None}])["flagged"] == []


def test_validate_report_names_runs_on_a_slowed_host(tmp_path):
    """Recorded runs whose summaries carry host probes: the report gives the median and names the
    run whose probe was slower than the threshold; the simulator's errors are unchanged by it."""

    from calibration.validate import render_markdown

    runs = []
    for seed, rw in ((1, 0.02), (2, 0.021), (3, 0.06)):
        out = tmp_path / f"ovl{seed}"
        simulate(config_from_args(jobs=8, steps=2, policy="overlap", sharing="mps", seed=seed), out)
        s = json.loads((out / "summary.json").read_text())
        s["diagnostics"] = [{"host_probe": {"start": {"cpu_loop_s": 0.05, "file_rw_s": rw}}}]
        (out / "summary.json").write_text(json.dumps(s))
        runs.append(out)
    rep = validate(runs, profile=DEFAULT_PROFILE)
    assert [Path(f["run"]).name for f in rep["host"]["flagged"]] == ["ovl3"]
    text = render_markdown(rep)
    assert "Host probe" in text and "ovl3 (file_rw_s 2.9x)" in text
    assert rep["heldout_mape_replay"] == pytest.approx(0, abs=1e-9)


def test_validate_and_the_gpu_table_name_runs_whose_engine_compiled_while_measured(tmp_path):
    """A run whose engine JIT-compiled kernels inside its measured window (run seconds >= 0; the
    warm-up's come before 0) is named with its compiles, in the validation report and the GPU
    table; a run that recorded none is not, and one recorded without the record (None) counts
    neither way."""

    from calibration.validate import render_markdown
    from calibration.run_health import run_jit_compiles
    from experiments.gpu_table import build, render

    runs = []
    for seed, jit in ((1, []), (2, [{"t_s": -3.0, "kernel": "_topk"}, {"t_s": 6.4, "kernel": "_lora_expand_kernel"},
                                    {"t_s": 6.8, "kernel": "_lora_shrink_kernel"}]), (3, None)):
        out = tmp_path / f"ovl{seed}"
        simulate(config_from_args(jobs=8, steps=2, policy="overlap", sharing="mps", seed=seed), out)
        s = json.loads((out / "summary.json").read_text())
        s["diagnostics"] = [{"engine_jit_compiles": jit}]
        (out / "summary.json").write_text(json.dumps(s))
        runs.append(out)
    assert run_jit_compiles(json.loads((runs[1] / "summary.json").read_text())) == [
        "_lora_expand_kernel", "_lora_shrink_kernel"]
    rep = validate(runs, profile=DEFAULT_PROFILE)
    assert rep["jit"]["runs_recorded"] == 2
    assert rep["jit"]["flagged"] == [{"run": str(runs[1]), "label": "ovl2", "compiles": 2,
                                      "kernels": ["_lora_expand_kernel", "_lora_shrink_kernel"]}]
    assert "ovl2 (2: _lora_expand_kernel, _lora_shrink_kernel)" in render_markdown(rep)
    table = build(runs, DEFAULT_PROFILE)
    assert [Path(f["run"]).name for f in table["jit"]["flagged"]] == ["ovl2"]
    assert "ovl2 (2: _lora_expand_kernel, _lora_shrink_kernel)" in render(table)


def test_each_phase_alone_and_beside_the_other():
    from calibration.validate import corun_phase_means

    def span(phase, group, start, end, job="j"):
        return {"phase": phase, "group": group, "gpu": 0, "start_s": start, "end_s": end, "job": job}

    spans = [span("generate", 0, 0.0, 1.0), span("generate", 0, 0.0, 1.2, "k"),  # one action: 0-1.2 s, alone
             span("train", 0, 1.2, 3.2), span("generate", 1, 1.2, 3.05),  # side by side (0.925 of the train)
             span("train", 1, 3.2, 4.0),  # beside generate 0 for 0.7 of 0.8 s: neither alone nor beside
             span("generate", 0, 3.3, 4.3)]  # beside train 1 for 0.7 of 1.0 s: neither
    c = corun_phase_means(spans)
    assert c["generate"] == {"alone": pytest.approx(1.2), "beside": pytest.approx(1.85), "n_alone": 1, "n_beside": 1}
    assert c["train"] == {"alone": None, "beside": pytest.approx(2.0), "n_alone": 0, "n_beside": 1}
    # Three groups: two others' generations overlapping each other beside one train count once.
    three = [span("train", 0, 0.0, 2.0), span("generate", 1, 0.0, 1.5), span("generate", 2, 0.5, 2.0)]
    assert corun_phase_means(three)["train"]["n_beside"] == 1
    gap = [span("train", 0, 0.0, 2.0), span("generate", 1, 0.0, 0.9), span("generate", 2, 0.1, 1.0)]
    assert corun_phase_means(gap)["train"] == {"alone": None, "beside": None, "n_alone": 0, "n_beside": 0}
    # Two runs of one row: each mean weighted by its actions.
    from experiments.gpu_table import _merge_corun

    m = _merge_corun(c, corun_phase_means(three))
    assert m["train"] == {"alone": None, "n_alone": 0, "beside": pytest.approx(2.0), "n_beside": 2}
    assert m["generate"]["n_beside"] == 3 and m["generate"]["beside"] == pytest.approx((1.85 + 1.5 + 1.5) / 3)
    # A group's own phases never count as beside each other.
    assert corun_phase_means([span("generate", 0, 0, 1), span("train", 0, 0.5, 1.5)])["train"]["n_alone"] == 1


def _monitored_runs(tmp_path, key: str, monitors: dict) -> list:
    """8-job overlap + MPS runs simulated per seed, each summary's diagnostics holding ``key``:
    that seed's monitor summary (none where it is None)."""

    runs = []
    for seed, mon in monitors.items():
        out = tmp_path / f"ovl{seed}"
        simulate(config_from_args(jobs=8, steps=2, policy="overlap", sharing="mps", seed=seed), out)
        s = json.loads((out / "summary.json").read_text())
        s["diagnostics"] = [{key: mon} if mon else {}]
        (out / "summary.json").write_text(json.dumps(s))
        runs.append(out)
    return runs


def _gpu_monitor(busy_mhz: float, power_cap: float = 0.0, idle: float = 0.0) -> dict:
    """A GPU monitor's summary (nodus.gpumon.summarise) of 20 samples: ``idle`` of them idle, the
    rest busy at ``busy_mhz``, ``power_cap`` of all of them held down by the software power cap."""
    from nodus.gpumon import reason_bits, summarise

    n_idle, n_cap = round(20 * idle), round(20 * power_cap)
    rows = [(345.0, 2619.0, 80.0, 700.0, 35.0, 0.0, 0x1)] * n_idle
    rows += [(busy_mhz, 2619.0, 690.0, 700.0, 70.0, 99.0, 0x4 if i < n_cap else 0) for i in range(20 - n_idle)]
    return {"available": True, "interval_s": 0.2, "seconds": 4.0,
            "gpus": {"0": summarise(rows, 1980.0, reason_bits(object()))}}


def test_validate_and_the_gpu_table_name_runs_on_a_slowed_gpu(tmp_path):
    """Runs whose summaries carry the real backend's GPU monitor: one whose busy SM clock lies more
    than 5% under the runs' median, and one whose power cap held the clocks in 30% of its samples,
    are named in the report and the GPU table; idle samples (gpu_idle) flag nothing. Runs without a
    monitor (every run before session 26) are said to have none."""
    from calibration.validate import render_markdown
    from calibration.run_health import gpu_flags, run_gpu_monitor
    from experiments.gpu_table import build, render

    m = run_gpu_monitor({"diagnostics": [{"gpu_monitor": _gpu_monitor(1900, idle=0.5)},
                                         {"gpu_monitor": _gpu_monitor(1700, power_cap=0.3)},
                                         {"gpu_monitor": {"available": False, "why": "no pynvml"}}]})
    assert m["busy_sm_clock_mhz"] == 1700 and m["throttle"] == {"sw_power_cap": pytest.approx(0.3)}  # the worst
    assert m["power_limit_w"] == 700 and m["max_sm_clock_mhz"] == 1980
    assert run_gpu_monitor({"diagnostics": [{}]}) is None
    assert run_gpu_monitor({"diagnostics": [{"gpu_monitor": {"available": False, "why": "no pynvml"}}]}) == {
        "available": False, "why": "no pynvml"}

    runs = _monitored_runs(tmp_path, "gpu_monitor", {1: _gpu_monitor(1900, idle=0.5),
                                                      2: _gpu_monitor(1890, power_cap=0.3), 3: _gpu_monitor(1600),
                                                      4: None})
    rep = validate(runs, profile=DEFAULT_PROFILE)
    g = rep["gpu"]
    assert g["runs_with_monitor"] == 3 and g["runs"] == 4 and g["median_busy_sm_clock_mhz"] == pytest.approx(1890)
    assert [(Path(f["run"]).name, f["why"]) for f in g["flagged"]] == [
        ("ovl2", {"sw_power_cap": pytest.approx(0.3)}), ("ovl3", {"busy_sm_clock": pytest.approx(1600 / 1890)})]
    text = render_markdown(rep)
    assert "GPU monitor" in text and "3 of 4 runs" in text and "median SM clock while busy 1890 MHz" in text
    assert "ovl2 (sw_power_cap in 30% of samples)" in text and "ovl3 (busy SM clock 1600 MHz, 0.85x the median)" in text
    assert rep["heldout_mape_replay"] == pytest.approx(0, abs=1e-9)  # flagged, never dropped
    table = build(runs, DEFAULT_PROFILE)
    assert [Path(f["run"]).name for f in table["gpu"]["flagged"]] == ["ovl2", "ovl3"]
    assert "Runs on a slowed GPU" in render(table) and "ovl3 (busy SM clock 1600 MHz" in render(table)
    # Within 5% of the median and no slowdown reason: nothing flagged; no monitor at all: said so.
    assert gpu_flags([{"run": "a", "gpu_monitor": run_gpu_monitor({"diagnostics": [{"gpu_monitor": _gpu_monitor(c)}]})}
                      for c in (1900, 1850, 1810)])["flagged"] == []
    old = gpu_flags([{"run": "old", "gpu_monitor": None}])
    assert old["flagged"] == [] and "no run records one (recorded before session 26)" in render_markdown(
        dict(rep, gpu=old))
    cpu = gpu_flags([{"run": "cpu", "gpu_monitor": {"available": False, "why": "the run uses no GPU"}}])
    assert "GPU monitor: 1 of 1 runs have no figures from it: the run uses no GPU." in render_markdown(
        dict(rep, gpu=cpu))
    # A run whose sampling stopped early is flagged with why; runs without figures are named beside the others.
    part = dict(_gpu_monitor(1890), stopped_early="NVML call failed after 3 samples (RuntimeError: lost)")
    mixed = gpu_flags([{"run": name, "gpu_monitor": run_gpu_monitor({"diagnostics": [{"gpu_monitor": mon}]})}
                       for name, mon in (("a", _gpu_monitor(1890)), ("b", part))]
                      + [{"run": "c", "gpu_monitor": {"available": False, "why": "no pynvml"}}])
    assert [f["run"] for f in mixed["flagged"]] == ["b"] and "stopped_early" in mixed["flagged"][0]["why"]
    text = render_markdown(dict(rep, gpu=mixed))
    assert "b (sampling stopped early: NVML call failed after 3 samples" in text
    assert "1 of 3 runs have no figures from it: no pynvml." in text


def test_generations_by_size_and_what_ran_beside_them():
    from calibration.validate import generations_by_size

    def span(phase, group, start, end, job="j", n=64, step=0):
        return {"phase": phase, "group": group, "gpu": 0, "start_s": start, "end_s": end, "job": job,
                "attrs": {"n_sequences": n, "step": step}}

    spans = [span("generate", 0, 0.0, 1.0), span("generate", 0, 0.0, 1.4, "k"),  # 128 sequences alone, 1.4 s
             span("train", 0, 1.4, 3.4), span("generate", 1, 1.4, 3.2, n=256),  # 256 beside a train step
             span("generate", 0, 3.4, 4.0, step=1), span("generate", 0, 3.4, 4.2, "k", step=1),  # 128 alone, 0.8 s
             span("train", 1, 4.2, 5.0),  # group 1's own train: beside nothing of group 1's
             span("train", 0, 4.6, 5.4, step=1), span("generate", 1, 4.2, 5.2, n=256, step=1)]  # 0.6 of 1.0 s: neither
    g = generations_by_size(spans)
    assert g == {"128/alone": {"s": pytest.approx(1.1), "n": 2}, "256/beside": {"s": pytest.approx(1.8), "n": 1}}


def test_a_size_the_profile_prices_short_shows_in_the_size_table(tmp_path):
    """Runs simulated on one profile, validated on another whose large decode steps are cheaper:
    the large generations come out short in the table, the small ones not."""

    from calibration.validate import render_markdown
    from sim.profile import load_profile

    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    fast = json.loads(json.dumps(prof))
    for curve in fast["decode"]["curves"]:  # a 512-sequence decode step at half the price
        curve["step_s"] = [s * 0.5 if b >= 512 else s for b, s in zip(curve["batch"], curve["step_s"])]
    (tmp_path / "slow.json").write_text(json.dumps(prof))
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    runs = []
    for jobs in (1, 8):
        out = tmp_path / f"j{jobs}"
        simulate(config_from_args(jobs=jobs, steps=2, policy="dedicated" if jobs == 1 else "shared-sync",
                                  profile=str(tmp_path / "slow.json")), out)
        runs.append(out)
    same = {(g["sequences"], g["side"]): g["error"]
            for g in validate(runs, str(tmp_path / "slow.json"))["generation_sizes"]}
    assert all(abs(e) < 0.02 for e in same.values()) and (512, "alone") in same
    rep = validate(runs, str(tmp_path / "fast.json"))
    err = {(g["sequences"], g["side"]): g for g in rep["generation_sizes"]}
    assert err[(512, "alone")]["error"] < -0.1 and err[(512, "alone")]["heldout_runs"] == 1
    assert abs(err[(64, "alone")]["error"]) < 0.02
    assert "Generations by size" in render_markdown(rep)


def test_generations_of_stacks_by_how_much_another_stacks_generation_ran_beside():
    from calibration.validate import (beside_engines_errors, beside_engines_share, beside_engines_table,
                                      generations_beside_engines)

    def gen(stack, start, end, step, job="j"):
        return {"phase": "generate", "group": stack, "stack": stack, "gpu": 0, "start_s": start, "end_s": end,
                "job": job, "attrs": {"n_sequences": 64, "step": step}}

    spans = [gen(0, 0.0, 2.0, 0), gen(0, 0.0, 1.9, 0, "k"), gen(1, 0.0, 2.0, 0),  # together throughout
             {"phase": "train", "group": 0, "stack": 0, "gpu": 0, "start_s": 2.0, "end_s": 3.0, "job": "j",
              "attrs": {"step": 0}},
             gen(1, 2.0, 4.0, 1), gen(0, 3.0, 5.0, 1),  # half of each beside the other: partly
             gen(1, 5.0, 6.0, 2),  # beside no other stack's generation
             {**gen(1, 6.0, 7.0, 3), "gpu": 1}, gen(0, 6.0, 7.0, 2)]  # another GPU's generation is not beside
    g = generations_beside_engines(spans)
    assert g == {(0, 0, ("step", 0)): (2.0, "throughout"), (0, 1, ("step", 0)): (2.0, "throughout"),
                 (0, 1, ("step", 1)): (2.0, "partly"), (0, 0, ("step", 1)): (2.0, "partly"),
                 (0, 1, ("step", 2)): (1.0, "not"), (1, 1, ("step", 3)): (1.0, "not"),
                 (0, 0, ("step", 2)): (1.0, "not")}
    # Of the 11 generation seconds, 6 ran beside another stack's generation.
    assert beside_engines_share(spans) == pytest.approx(6 / 11) and beside_engines_share([]) is None
    # Paired with a replay's actions by key; one the replay did not run is left out.
    replayed = {(0, 0, ("step", 0)): 3.0, (0, 1, ("step", 0)): 2.6, (0, 1, ("step", 1)): 2.0,
                (0, 1, ("step", 2)): 0.5}
    e = beside_engines_errors(g, replayed)
    assert e == {"throughout": {"n": 2, "measured_s": 4.0, "simulated_s": pytest.approx(5.6)},
                 "partly": {"n": 1, "measured_s": 2.0, "simulated_s": 2.0},
                 "not": {"n": 1, "measured_s": 1.0, "simulated_s": 0.5}}
    rows = [{"arm": {"sharing": "mps"}, "heldout": True, "beside_engines": e},
            {"arm": {"sharing": "mps"}, "heldout": False, "beside_engines": {"partly": e["partly"]}}, {"arm": {}}]
    t = beside_engines_table(rows)
    assert [(x["beside"], x["runs"], x["heldout_runs"], x["actions"]) for x in t] == [
        ("throughout", 1, 1, 2), ("partly", 2, 1, 2), ("not", 1, 1, 1)]
    assert [x["error"] for x in t] == pytest.approx([0.4, 0.0, -0.5])


def test_two_engines_rate_mispriced_shows_in_the_generations_beside_engines(tmp_path):
    """Two-stack runs simulated on one profile, validated on one whose two engines together are
    slower: the generations beside another stack's throughout come out long, those beside it in part
    less so, those beside none hardly."""

    from calibration.validate import render_markdown
    from nodus.config import DEFAULT_PROFILE
    from sim.profile import profile_dict, write_profile

    truth = profile_dict(DEFAULT_PROFILE)
    truth["sharing"].update(mps_engines=0.8, mps_stacks_trainer=0.9, mps_stacks_engine=0.6)
    slow = json.loads(json.dumps(truth))
    slow["sharing"]["mps_engines"] = 0.5
    for name, prof in (("truth.json", truth), ("slow.json", slow)):
        write_profile(prof, tmp_path / name, "test")
    runs = []
    for seed, offset in ((1, False), (2, True)):
        out = tmp_path / f"k2-s{seed}"
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  offset_stacks=offset, share_prompts=0, profile=str(tmp_path / "truth.json")), out)
        runs.append(out)
    same = {x["beside"]: x["error"] for x in validate(runs, str(tmp_path / "truth.json"))["generations_beside_engines"]}
    assert same and all(abs(e) < 0.01 for e in same.values())
    rep = validate(runs, str(tmp_path / "slow.json"))
    err = {x["beside"]: x["error"] for x in rep["generations_beside_engines"]}
    # (a generation "not" beside one may have up to a tenth of it beside one)
    assert err["throughout"] > 0.3 and err["throughout"] > err["partly"] > err["not"] and abs(err["not"]) < 0.1
    assert "another stack generating beside" in render_markdown(rep)
    # A run of one stack has no such table.
    one = tmp_path / "one"
    simulate(config_from_args(jobs=2, steps=2, policy="shared-sync", sharing="mps",
                              profile=str(tmp_path / "truth.json")), one)
    assert validate([one], str(tmp_path / "truth.json"))["generations_beside_engines"] == []


def test_train_steps_of_stacks_by_how_much_another_stacks_train_step_ran_beside(tmp_path):
    """Lockstep two-stack runs simulated on a profile whose two trainers together are slow
    (sharing.mps_trainers), validated on one with the many-clients rule: their train steps beside the
    other stack's throughout come out short, in their own table; validated on the truth, right."""

    from calibration.validate import beside_engines_share, render_markdown, trains_beside_trainers
    from nodus.config import DEFAULT_PROFILE
    from sim.profile import profile_dict, write_profile

    def step(phase, stack, start, end, n):
        return {"phase": phase, "group": stack, "gpu": 0, "start_s": start, "end_s": end, "job": "j",
                "attrs": {"step": n}}

    spans = [step("train", 0, 0.0, 1.0, 0), step("train", 1, 0.0, 1.0, 0),  # together throughout
             step("train", 0, 2.0, 3.0, 1), step("train", 1, 2.5, 3.5, 1),  # half beside: partly
             step("generate", 1, 4.0, 5.0, 2), step("train", 0, 4.0, 5.0, 2)]  # beside a generation only
    assert trains_beside_trainers(spans) == {
        (0, 0, ("step", 0)): (1.0, "throughout"), (0, 1, ("step", 0)): (1.0, "throughout"),
        (0, 0, ("step", 1)): (1.0, "partly"), (0, 1, ("step", 1)): (1.0, "partly"), (0, 0, ("step", 2)): (1.0, "not")}
    assert beside_engines_share(spans, "train") == pytest.approx(3 / 5)

    truth = profile_dict(DEFAULT_PROFILE)
    truth["sharing"].update(mps_engines=0.7, mps_stacks_trainer=0.9, mps_stacks_engine=0.7, mps_trainers=0.3)
    rule = json.loads(json.dumps(truth))
    rule["sharing"]["mps_trainers"] = None
    for name, prof in (("truth.json", truth), ("rule.json", rule)):
        write_profile(prof, tmp_path / name, "test")
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"k2-lock-s{seed}"
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  lockstep=True, share_prompts=0, profile=str(tmp_path / "truth.json")), out)
        runs.append(out)
    same = validate(runs, str(tmp_path / "truth.json"))["trains_beside_trainers"]
    assert [x["beside"] for x in same] == ["throughout"] and abs(same[0]["error"]) < 0.01
    rep = validate(runs, str(tmp_path / "rule.json"))
    err = {x["beside"]: x["error"] for x in rep["trains_beside_trainers"]}
    assert err["throughout"] < -0.2
    assert "another stack training beside" in render_markdown(rep)


def _host_monitor(steal=0.0, other=0.2, mhz=2100.0, throttled=0.0, run_cores=1.5, hot=0.6) -> dict:
    """A host monitor's summary (nodus.hostmon) with the given figures."""
    return {"available": True, "seconds": 30.0, "samples": 60, "cpus": 16, "cores_busy": run_cores + other,
            "steal_frac": steal, "iowait_frac": 0.0, "run_cores": run_cores, "run_processes": 4,
            "other_cores": other, "busiest_thread": {"name": "VLLM::EngineCore", "core_frac": hot},
            "run_queue": {"mean": 2.0, "max": 5}, "cpu_mhz": {"mean": mhz, "min": mhz},
            "cgroup": {"periods": 300, "throttled_periods": round(300 * throttled), "throttled_frac": throttled,
                       "throttled_s": 0.0}}


def test_validate_and_the_gpu_table_name_runs_on_a_contended_host(tmp_path):
    """Runs whose summaries carry the host monitor: steal time, a quota-throttled cgroup, other
    processes' cores and a slow core clock each flag a run, named in the report and the GPU table;
    a run's several monitors (a dedicated arm's jobs) give its most contended figures."""
    from calibration.validate import render_markdown
    from calibration.run_health import host_monitor_flags, run_host_monitor
    from experiments.gpu_table import build, render

    m = run_host_monitor({"diagnostics": [{"host_monitor": _host_monitor(steal=0.01, hot=0.95)},
                                          {"host_monitor": _host_monitor(other=1.4, mhz=1900.0)},
                                          {"host_monitor": {"available": False, "why": "no /proc"}}]})
    assert m["steal_frac"] == 0.01 and m["other_cores"] == 1.4 and m["cpu_mhz"] == 1900.0
    assert m["busiest_thread"]["core_frac"] == 0.95 and m["cgroup_throttled_frac"] == 0.0
    assert run_host_monitor({"diagnostics": [{}]}) is None
    assert run_host_monitor({"diagnostics": [{"host_monitor": {"available": False, "why": "no /proc"}}]}) == {
        "available": False, "why": "no /proc"}

    runs = _monitored_runs(tmp_path, "host_monitor", {1: _host_monitor(hot=0.95), 2: _host_monitor(steal=0.05),
                                                       3: _host_monitor(throttled=0.2), 4: _host_monitor(other=2.5),
                                                       5: _host_monitor(mhz=1800.0), 6: None})
    rep = validate(runs, profile=DEFAULT_PROFILE)
    h = rep["host_monitor"]
    assert h["runs_with_monitor"] == 5 and h["runs"] == 6 and h["median"]["cpu_mhz"] == 2100.0
    assert [(Path(f["run"]).name, f["why"]) for f in h["flagged"]] == [
        ("ovl2", {"steal": 0.05}), ("ovl3", {"cgroup_throttled": 0.2}), ("ovl4", {"other_cores": 2.5}),
        ("ovl5", {"cpu_mhz": pytest.approx(1800 / 2100)})]
    text = render_markdown(rep)
    assert "Host monitor (/proc and the cgroup through each run; 5 of 6 runs have one)" in text
    assert "its busiest thread 60% of a core" in text and "ovl2 (steal 5% of the CPU time wanted)" in text
    assert "other processes on 1 core or more" in text
    # A thread near a full core is named apart, not flagged.
    assert [Path(o["run"]).name for o in h["one_thread"]] == ["ovl1"]
    assert ("A thread of the run on 90% of a core or more (its own host work paces it): "
            "ovl1 (VLLM::EngineCore, 95%)") in text
    assert "ovl3 (cgroup quota-throttled in 20% of periods)" in text and "ovl4 (other processes on 2.5 cores)" in text
    assert "ovl5 (core clock 0.86x the median)" in text
    assert rep["heldout_mape_replay"] == pytest.approx(0, abs=1e-9)  # flagged, never dropped
    table = build(runs, DEFAULT_PROFILE)
    assert [Path(f["run"]).name for f in table["host_monitor"]["flagged"]] == ["ovl2", "ovl3", "ovl4", "ovl5"]
    assert "On a contended host" in render(table)
    # Nothing flagged, one run near a full core and one whose cgroup was not read: the table names both.
    quiet = build(runs[:1], DEFAULT_PROFILE)
    assert quiet["host_monitor"]["flagged"] == [] and "ovl1 (VLLM::EngineCore, 95%)" in render(quiet)
    unread = host_monitor_flags([{"run": "u", "host_monitor": run_host_monitor({"diagnostics": [
        {"host_monitor": dict(_host_monitor(), cgroup_error="cgroup cpu.stat unreadable (PermissionError: no)")}]})}])
    assert "Throttling unknown (a cgroup unread): u (cgroup cpu.stat unreadable (PermissionError: no))" in (
        render_markdown(dict(rep, host_monitor=unread)))
    # Nothing contended: nothing flagged; runs from before the monitor: the report says nothing of it.
    clean = host_monitor_flags([{"run": "a", "host_monitor": run_host_monitor({"diagnostics": [
        {"host_monitor": _host_monitor(mhz=x)}]})} for x in (2100.0, 2050.0, 2000.0)])
    assert clean["flagged"] == [] and "No run on a contended host" in render_markdown(dict(rep, host_monitor=clean))
    old = host_monitor_flags([{"run": "old", "host_monitor": None}])
    assert "Host monitor" not in render_markdown(dict(rep, host_monitor=old))
    part = dict(_host_monitor(), stopped_early="a /proc read failed after 3 samples (OSError: gone)")
    mixed = host_monitor_flags([{"run": "b", "host_monitor": run_host_monitor({"diagnostics": [
        {"host_monitor": part}]})}, {"run": "c", "host_monitor": {"available": False, "why": "no /proc"}}])
    text = render_markdown(dict(rep, host_monitor=mixed))
    assert "b (sampling stopped early: a /proc read failed after 3 samples" in text
    assert "1 of 2 runs have no figures from it: no /proc." in text


def test_error_correlates_set_the_error_against_what_runs_recorded(tmp_path):
    """The simulator's error set against each recorded figure of the runs' state: over the
    held-out runs where there are enough, with a permutation p-value and the r over configuration
    means; figures on too few runs, with too few distinct values, or not finite are left out."""
    from calibration.validate import error_correlates, error_correlates_text, render_markdown
    from calibration.run_health import run_gpu_monitor

    def row(i, busy, err, held=True, probe=None, groups=2, measured=1000.0):
        return {"run": f"r{i}", "heldout": held, "jobs": 8, "arm": {"policy": "overlap", "groups": groups,
                                                                     "sharing": "mps"},
                "controls": {}, "mb_tokens": 16384, "share_prompts": None,
                "gpu_monitor": {"available": True, "busy_fraction": busy, "util_pct": 50.0},
                "host_probe": {"cpu_loop_s": probe} if probe is not None else None,
                "measured": {"steps_per_gpu_hour": measured},
                "replay": {"steps_per_gpu_hour": measured * (1 + err)}}

    # Held out: the error (simulated over measured, minus 1; measured varies) falls as the busy
    # share rises, the host probe's loop time rises with it less tightly; utilisation is the same
    # everywhere (left out). Two groups and three groups: two configurations. Not held out: two
    # runs that contradict the held-out ones, which must not count.
    spec = [(0.4, 0.20, 0.070), (0.5, 0.15, 0.072), (0.6, 0.10, 0.071), (0.7, 0.05, 0.075), (0.8, 0.0, 0.074),
            (0.9, -0.05, 0.078)]
    rows = [row(i, b, e, probe=p, groups=2 + i % 2, measured=800.0 + 100 * i) for i, (b, e, p) in enumerate(spec)]
    rows += [row(10, 0.4, -0.3, held=False, probe=0.07), row(11, 0.9, 0.4, held=False, probe=0.09)]
    rows.append(row(12, 0.5, 0.1, measured=0.0))  # no measured figure: unusable
    d = error_correlates(rows)
    assert d["split"] == "heldout" and d["runs"] == 6
    assert list(d["figures"]) == ["gpu_busy_share", "probe_loop_s"]
    busy = d["figures"]["gpu_busy_share"]
    assert busy["pearson_r"] == pytest.approx(-1.0) and busy["runs"] == 6 and busy["configurations"] == 2
    assert busy["p_value"] < 0.01 and "pearson_r_config_means" not in busy  # 2 configurations: too few
    loop = d["figures"]["probe_loop_s"]
    assert -1.0 < loop["pearson_r"] < -0.5 and loop["p_value"] > busy["p_value"]
    text = error_correlates_text(d)
    assert text.index("GPU busy share") < text.index("host probe loop s")  # strongest first
    assert "GPU busy share (samples over 50% utilisation) -1.00 (p = 0.00" in text
    assert "6 runs, 2 configurations" in text
    rep = validate(_monitored_runs(tmp_path, "gpu_monitor", {1: None}), profile=DEFAULT_PROFILE)
    assert rep["error_correlates"]["figures"] == {}  # one run, simulated on its own profile
    assert text not in render_markdown(rep) and text in render_markdown(dict(rep, error_correlates=d))
    # Fewer than 5 held-out runs: every usable validated run counts, and the line says so.
    mixed = [dict(r, heldout=i < 2) for i, r in enumerate(rows)]
    dm = error_correlates(mixed)
    assert dm["split"] == "all" and dm["runs"] == len(mixed) - 1
    assert "fit runs included" in error_correlates_text(dm)
    # Too few runs, too few distinct values, a value that is not finite: nothing to report.
    assert error_correlates(rows[:4])["figures"] == {} and error_correlates_text(error_correlates(rows[:4])) == ""
    flat = [row(i, 0.1 if i % 2 else 0.3, 0.01 * i) for i in range(6)]
    assert "gpu_busy_share" not in error_correlates(flat)["figures"]
    nan = [row(i, float("nan") if i == 0 else 0.1 * i, 0.01 * i) for i in range(6)]
    assert error_correlates(nan)["figures"]["gpu_busy_share"]["runs"] == 5
    # Configuration means, where 5 or more configurations have the figure.
    many = [row(i, 0.1 * (i % 6), 0.02 * (i % 6) + 0.001 * i, groups=2 + i % 6) for i in range(12)]
    m = error_correlates(many)["figures"]["gpu_busy_share"]
    assert m["configurations"] == 6 and m["pearson_r_config_means"] == pytest.approx(1.0, abs=1e-3)
    # The GPU monitor's busy share and utilisation per run, weighted by each GPU run's samples.
    g = lambda n, frac, util: {"samples": n, "busy": {"fraction": frac, "sm_clock_mhz": 1980.0},  # noqa: E731
                               "util_pct": {"mean": util}, "throttle": {}}
    mon = run_gpu_monitor({"diagnostics": [{"gpu_monitor": {"available": True, "gpus": {"0": g(30, 0.9, 70.0)}}},
                                           {"gpu_monitor": {"available": True, "gpus": {"0": g(10, 0.5, 30.0)}}}]})
    assert mon["busy_fraction"] == pytest.approx(0.8) and mon["util_pct"] == pytest.approx(60.0)


def test_engine_step_figures_reach_the_validated_rows_and_the_correlates(tmp_path):
    """real.stepstats' per-run summaries (one per GPU's run) pooled by run_engine_steps: the mean step
    weighted by steps, the spread from the fastest and slowest generations, the largest shares; a run
    without them has none, and error_correlates sets the mean step against the error."""
    from calibration.validate import error_correlates, validate
    from calibration.run_health import run_engine_steps

    def es(gens, steps, mean_ms, lo, hi, between, gc, collect=0.02):
        return {"summary": {"generations": gens, "steps": steps, "mean_step_ms": mean_ms,
                            "step_ms_per_generation": {"min": lo, "median": mean_ms, "max": hi},
                            "between_share": between, "collect_share": collect, "gc_share": gc}, "generations": []}

    two = {"diagnostics": [{"engine_steps": es(4, 300, 4.0, 3.5, 5.0, 0.05, 0.001)},
                           {"engine_steps": es(2, 100, 8.0, 7.0, 9.0, 0.10, 0.002)}, {}]}
    got = run_engine_steps(two)
    assert got["generations"] == 6 and got["steps"] == 400
    assert got["mean_step_ms"] == pytest.approx(5.0)  # (300 x 4 + 100 x 8) / 400
    assert got["step_ms_spread"] == pytest.approx(9.0 / 3.5)
    assert got["between_share"] == pytest.approx(0.10) and got["gc_share"] == pytest.approx(0.002)
    assert got["collect_share"] == pytest.approx(0.02)
    no_totals = {"diagnostics": [{"engine_steps": {"summary": {"generations": 2, "step_ms_per_generation": {
        "min": 4.0, "median": 5.0, "max": 6.0}, "step_max_ms": 9.0}}}]}  # records without cumulative totals
    assert run_engine_steps(no_totals)["mean_step_ms"] is None and run_engine_steps(no_totals)["step_ms_spread"] == 1.5
    assert run_engine_steps({"diagnostics": [{}]}) is None
    assert run_engine_steps({"diagnostics": [{"engine_steps": {"summary": {"generations": 0}}}]}) is None

    # Through validate: the figures land in each row; the correlates set them against the error.
    mons = {seed: es(4, 400, 3.0 + seed, 3.0, 4.0 + seed, 0.01 * seed, 0.0) for seed in range(1, 7)}
    runs = _monitored_runs(tmp_path, "engine_steps", mons)
    rep = validate(runs, DEFAULT_PROFILE)
    rows = {Path(r["run"]).name: r for r in rep["rows"]}
    assert rows["ovl3"]["engine_steps"]["mean_step_ms"] == pytest.approx(6.0)
    for r in rep["rows"]:  # simulated on the profile they are validated on: give the error a slope
        seed = int(Path(r["run"]).name[3:])
        r["replay"]["steps_per_gpu_hour"] = r["measured"]["steps_per_gpu_hour"] * (1 - 0.02 * seed)
    corr = error_correlates(rep["rows"])
    assert corr["figures"]["engine_step_ms"]["pearson_r"] == pytest.approx(-1.0)
    assert {"engine_step_ms", "engine_step_spread", "engine_between"} <= set(corr["figures"])
    assert "engine_gc" not in corr["figures"]  # the same everywhere: nothing to correlate
    assert corr["figures"]["engine_step_ms"]["runs"] == 6


def test_validate_names_the_run_it_cannot_price(tmp_path):
    """A run with packed rows (the graphed trainer's default) on an eager profile: the error names
    the run folder and the setting."""
    from nodus.config import DEFAULT_PROFILES

    out = tmp_path / "packed"
    simulate(config_from_args(jobs=4, steps=2, policy="overlap", sharing="mps", share_prompts=4,
                              profile=DEFAULT_PROFILES["graphed"]), out)
    with pytest.raises(ConfigError, match=r"packed/config.json: trainer.share_prompts=4 runs on the graphed trainer"):
        validate([out], DEFAULT_PROFILE)


def test_validate_names_runs_of_one_folder_name_by_their_day(tmp_path):
    """Runs of one folder name recorded on two days (``DAY/arms/RUN``) keep their day in the report's
    tables and the plot; a run whose name no other shares keeps its name alone."""
    from calibration.validate import plot_validation, render_markdown, run_labels

    runs = []
    for day, seed in (("session1", 1), ("session2", 1), ("session2", 2)):
        out = tmp_path / day / "arms" / f"ovl-s{seed}"
        out.parent.mkdir(parents=True, exist_ok=True)
        simulate(config_from_args(jobs=8, steps=2, policy="overlap", sharing="mps", seed=seed), out)
        runs.append(out)
    rep = validate(runs, profile=DEFAULT_PROFILE)
    assert list(run_labels(rep).values()) == ["session1/arms/ovl-s1", "session2/arms/ovl-s1", "ovl-s2"]
    text = render_markdown(rep)
    assert "| session1/arms/ovl-s1 | 8 |" in text and "| session2/arms/ovl-s1 | 8 |" in text
    assert "| ovl-s2 | 8 |" in text
    plot_validation(rep, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 0
    # The flag lines too: a run on a slowed host named by its day
    from calibration.run_health import flagged_text, host_flags

    rows = [{"run": str(r), "host_probe": {"cpu_loop_s": 1.0 if i else 3.0}} for i, r in enumerate(runs)]
    assert flagged_text(host_flags(rows)) == "session1/arms/ovl-s1 (cpu_loop_s 3.0x)"


def test_sim_scaled_to_a_machine_by_its_recorded_runs(tmp_path, capsys, monkeypatch):
    """nodus sim --machine-runs: the prediction times one machine's measured over simulated
    steps/GPU-h on runs recorded there (session 41's second H200, two of its runs), simulating each
    run once (its replayed lengths); runs of two machines, or of none recorded, are refused by name
    before any simulation."""

    import calibration.validate as cv
    from calibration.validate import machine_factor
    from nodus.config import STACKS_PROFILE

    day = Path(__file__).resolve().parents[1] / "experiments/results/h200/session41"
    m2 = [str(day / "session41-m2/arms" / f"shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-{k}mb8k-s2")
          for k in ("", "off-")]
    simulated = []
    real_simulate = cv._simulate
    monkeypatch.setattr(cv, "_simulate", lambda cfg, src: simulated.append(src) or real_simulate(cfg, src))
    mf = machine_factor(m2, STACKS_PROFILE)
    assert simulated == [f"{r}/config.json" for r in m2]  # replayed lengths only: one simulation a run
    rep = validate(m2, STACKS_PROFILE)
    want = sum(r["measured"]["steps_per_gpu_hour"] / r["replay"]["steps_per_gpu_hour"] for r in rep["rows"]) / 2
    assert mf["runs"] == 2 and mf["factor"] == pytest.approx(want) and "80dd47ae" in mf["machine"]
    argv = ["sim", "--jobs", "8", "--steps", "3", "--policy", "shared-sync", "--stacks", "2", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--machine-runs", *m2]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert scaled["steps_per_gpu_hour"] == pytest.approx(plain["steps_per_gpu_hour"] * mf["factor"])
    assert scaled["machine"]["unscaled_steps_per_gpu_hour"] == pytest.approx(plain["steps_per_gpu_hour"])
    assert scaled["ratio_vs_dedicated"] == pytest.approx(plain["ratio_vs_dedicated"])
    out = tmp_path / "scaled"
    assert main(argv[:-1] + ["--machine-runs", *m2, "--out", str(out)]) == 0
    capsys.readouterr()
    written = json.loads((out / "summary.json").read_text())  # the run folder holds the scaled prediction
    assert written["steps_per_gpu_hour"] == pytest.approx(scaled["steps_per_gpu_hour"]) and written["git_commit"]
    assert f"measured over simulated steps/GPU-h, {mf['factor']:.3f}" in (out / "table.md").read_text()
    m1 = str(day / "arms/shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-mb8k-s1")
    simulated.clear()
    with pytest.raises(ConfigError, match="from 2 machines"):
        machine_factor([m1, m2[0]], STACKS_PROFILE)
    assert simulated == []  # refused before any simulation
    sim_run = tmp_path / "sim"
    simulate(config_from_args(jobs=2, steps=2, policy="shared-sync", sharing="mps"), sim_run)
    assert main(argv + ["--machine-runs", str(sim_run), "--out", str(tmp_path / "never")]) != 0
    assert "record no machine" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_ratio_over_dedicated_pairs_each_held_out_run_with_its_days_dedicated_run():
    """nodus validate's heldout_ratio: each held-out run over the dedicated run of its day, seed, job
    count and audit on its machine (session 43: seeds 2-3 had one; seed 1's two-stack run had
    none), measured against simulated; the annotation carries it into every prediction's error bar."""
    from calibration.validate import ratio_errors, render_markdown
    from nodus.config import STACKS_PROFILE

    day = Path(__file__).resolve().parents[1] / "experiments/results/h200/session43/arms"
    rep = validate(sorted(str(p) for p in day.iterdir() if p.is_dir()), STACKS_PROFILE)
    rt = rep["heldout_ratio"]
    rows = {Path(r["run"]).name: r for r in rep["rows"]}
    got = {Path(p["run"]).name: p for p in rt["pairs"]}
    assert sorted(got) == ["shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-mb8k-s2",
                           "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-mb8k-s3",
                           "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-off-mb8k-s2"]
    p, r, d = (got["shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-mb8k-s3"],
               rows["shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-sp4-k2-mb8k-s3"], rows["dedicated-cg-gm512-cpu2-n5-s3"])
    assert p["dedicated"] == [d["run"]] and r["day"] == "session43" and r["seed"] == 3
    # Call b's dedicated run of seed 3 began about 4 minutes after call a's two-stack run of seed 3 ended.
    assert p["minutes_apart"] == pytest.approx((d["started_unix_s"] - r["started_unix_s"]) / 60) and 3 < p["minutes_apart"] < 15
    assert p["measured"] == pytest.approx(7962.4 / 2919.1, rel=1e-4)
    assert p["replay"] == pytest.approx(r["replay"]["steps_per_gpu_hour"] / d["replay"]["steps_per_gpu_hour"])
    errs = [q["replay"] / q["measured"] - 1 for q in rt["pairs"]]
    assert rt["replay"]["n"] == 3 and rt["replay"]["bias"] == pytest.approx(sum(errs) / 3)
    assert "The ratio over dedicated (3 held-out runs" in render_markdown(rep)
    # Another machine's dedicated run of the same day is no baseline; an A/A pair's mean is.
    def row(run, policy, sph, machine, heldout=True):
        return {"run": run, "day": "d", "seed": 1, "jobs": 8, "audit": "", "machine": machine, "heldout": heldout,
                "started_unix_s": None,
                "arm": {"policy": policy}, **{m: {"steps_per_gpu_hour": sph} for m in ("measured", "replay", "sampled")}}
    assert ratio_errors([row("a", "shared-sync", 9000, "m1"), row("b", "dedicated", 3000, "m2", False)]) is None
    two = ratio_errors([row("a", "shared-sync", 9000, "m1"), row("b", "dedicated", 3000, "m1", False),
                        row("c", "dedicated", 2000, "m1", False)])
    assert two["pairs"][0]["measured"] == pytest.approx(3.6) and two["pairs"][0]["dedicated"] == ["b", "c"]
    assert two["pairs"][0]["minutes_apart"] is None  # runs that record no start


def test_annotation_carries_the_ratio_error(tmp_path):
    from calibration.validate import annotate_profile
    from nodus.simulate import error_bar_line
    from sim.profile import load_profile

    rep = {"rows": [{"heldout": True, "arm": None}], "heldout_replay": {"mape": 0.07, "bias": 0.0, "worst": 0.188,
                                                                      "kendall_tau": 0.0},
           "heldout_ratio": {"pairs": [], "replay": {"mape": 0.081, "bias": 0.033, "worst": 0.24, "n": 14}}}
    out = tmp_path / "p.json"
    annotate_profile(DEFAULT_PROFILE, rep, out)
    v = load_profile(str(out)).validation()
    assert (v["ratio_mape"], v["ratio_pairs"]) == (0.081, 14)
    assert "Its ratio over dedicated on 14 same-machine pairs: MAPE 8.1%, bias +3.3%, worst 24.0%" in error_bar_line(v)


def test_sim_scaled_to_a_machine_scales_each_kind_by_its_own_runs(capsys):
    """nodus sim --machine-runs with a machine's dedicated and shared runs (session 53's H100: a
    dedicated run host-bound, 23% above the H200 profile, two stacks GPU-bound, 9% above): a shared
    arm's steps/GPU-h times the shared runs' factor, its dedicated baseline times the dedicated runs',
    so its ratio times their quotient; a dedicated plan times the dedicated runs' factor; with
    dedicated runs only, a shared plan takes their factor and the table says it is the weaker one."""

    from calibration.validate import machine_factor
    from nodus.config import STACKS_PROFILE

    arms = Path(__file__).resolve().parents[1] / "experiments/results/h100/session53/m1/arms"
    ded = str(arms / "dedicated-cg-gm512-cpu2-flat-mb8k-n5-s3")
    shared = str(arms / "shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4-flat-sp4-k2-mb4k-s3")
    mf = machine_factor([ded, shared], STACKS_PROFILE)
    fd, fs = mf["kinds"]["dedicated"]["factor"], mf["kinds"]["shared"]["factor"]
    assert (mf["kinds"]["dedicated"]["runs"], mf["kinds"]["shared"]["runs"]) == (1, 1)
    assert fd == pytest.approx(mf["ratio"][ded]) and fs == pytest.approx(mf["ratio"][shared])
    assert fd > 1.15 and 1.0 < fs < 1.15  # the host lifts the dedicated run more than the GPU-bound stacks
    argv = ["sim", "--jobs", "8", "--steps", "3", "--policy", "shared-sync", "--stacks", "2", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--machine-runs", ded, shared]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert scaled["steps_per_gpu_hour"] == pytest.approx(plain["steps_per_gpu_hour"] * fs)
    assert scaled["dedicated_steps_per_gpu_hour"] == pytest.approx(plain["dedicated_steps_per_gpu_hour"] * fd)
    assert scaled["ratio_vs_dedicated"] == pytest.approx(plain["ratio_vs_dedicated"] * fs / fd)
    assert scaled["machine"]["kind"] == "shared" and "kind_missing" not in scaled["machine"]
    dedicated = ["sim", "--jobs", "8", "--steps", "3", "--policy", "dedicated", "--profile", STACKS_PROFILE, "--json"]
    assert main(dedicated) == 0
    plain_d = json.loads(capsys.readouterr().out)
    assert main(dedicated + ["--machine-runs", ded, shared]) == 0
    assert json.loads(capsys.readouterr().out)["steps_per_gpu_hour"] == pytest.approx(plain_d["steps_per_gpu_hour"] * fd)
    assert main(dedicated[:-1] + ["--machine-runs", ded, shared]) == 0  # the table: why its ratios stay as simulated
    assert "the ratios vs dedicated are unscaled (a dedicated arm)" in capsys.readouterr().out
    assert main(argv[:-1] + ["--machine-runs", ded]) == 0  # no shared run: the dedicated factor, said so
    text = capsys.readouterr().out
    assert "none shared" in text and "the weaker one" in text and f"{fd:.3f}" in text
    assert "the ratios vs dedicated are unscaled" in text


def test_machine_kinds_compares_a_machines_dedicated_factor_with_its_shared_one():
    """machine_kinds on one machine: a dedicated run 1.2x its simulation, two held-out shared runs
    1.1x theirs. The dedicated factor puts each shared run 9.1% high; the other shared run's factor
    is exact; the ratio over the dedicated run, simulated 1.0 against 110/120 measured, comes out
    exact times 1.1/1.2. A machine without a dedicated run is left out; none with both: None."""
    from calibration.validate import machine_kinds

    def row(policy, meas, sim, heldout, machine="m1", seed=1):
        return {"arm": {"policy": policy}, "measured": {"steps_per_gpu_hour": meas},
                "replay": {"steps_per_gpu_hour": sim}, "heldout": heldout, "machine": machine, "seed": seed}

    rows = [row("dedicated", 120, 100, False), row("shared-sync", 110, 100, True), row("overlap", 99, 90, True),
            row("shared-sync", 50, 100, True, machine="m2")]  # m2: no dedicated run, so not counted
    mk = machine_kinds(rows)
    assert mk["machines"] == 1 and mk["unscaled"]["n"] == 2
    assert mk["by_dedicated_factor"]["bias"] == pytest.approx(120 / 110 - 1)
    assert mk["by_other_shared_factor"]["mape"] == pytest.approx(0, abs=1e-12)
    assert mk["ratio_as_simulated"]["bias"] == pytest.approx(
        ((100 / 100) / (110 / 120) - 1 + (90 / 100) / (99 / 120) - 1) / 2)
    assert mk["ratio_by_factor_quotient"]["mape"] == pytest.approx(0, abs=1e-12)
    assert machine_kinds([r for r in rows if r["machine"] == "m2"]) is None


def test_targets_are_met_only_where_both_length_modes_meet_them():
    from calibration.validate import TARGETS, render_markdown, target_check

    def e(mape, worst, bias, tau, n=5):
        return {"mape": mape, "worst": worst, "bias": bias, "kendall_tau": tau, "n": n}

    rep = {"profile": "p", "fit_max_jobs": 4, "rows": [],
           "heldout_per_config": {"replay": {**e(0.036, 0.075, 0.005, 0.95), "kendall_tau_resolved": 1.0,
                                             "pairs_resolved": 15, "pairs": 45},
                                  "sampled": e(0.035, 0.081, -0.021, 0.89)},
           "heldout_replay": e(0.047, 0.134, -0.012, 0.17, n=81),
           "heldout_sampled": e(0.047, 0.137, -0.012, 0.16, n=81)}
    rep.update(all_replay=rep["heldout_replay"], all_sampled=rep["heldout_sampled"],
               all_per_config=rep["heldout_per_config"])
    check = target_check(rep)
    assert check["targets"] == TARGETS
    pc = check["per_configuration"]
    # The sampled worst case (8.1%) and bias (-2.1%) and tau (0.89) miss, so none of the three is met.
    assert pc["met"] == {"mape_replay": True, "mape_sampled": True, "worst": False, "bias": False,
                         "kendall_tau": False}
    assert pc["worst"] == 0.081 and pc["pairs_resolved"] == 15 and pc["kendall_tau_resolved"] == 1.0
    assert check["per_run"]["met"]["mape_replay"] is False and check["per_run"]["n"] == 81
    rep["targets"] = check
    md = render_markdown(rep)
    assert "| per configuration | 5 | 3.6% ✓ | 3.5% ✓ | 8.1% ✗ |" in md
    assert "1.00 (15 of 45 pairs)" in md and "| per run | 81 | 4.7% ✗ |" in md
    # A report without held-out runs has no target table; an older report without the key renders.
    assert target_check({"rows": []}) == {"targets": TARGETS}
    rep.pop("targets")
    assert "against the targets" not in render_markdown(rep)


def test_validate_reports_its_targets_on_recorded_runs(tmp_path):
    out = tmp_path / "run"
    simulate(config_from_args(jobs=8, steps=2), out)
    rep = validate([out], profile=DEFAULT_PROFILE)
    pr = rep["targets"]["per_run"]
    assert pr["n"] == 1 and pr["mape_replay"] == pytest.approx(0, abs=1e-6) and pr["met"]["mape_replay"] is True
    assert pr["met"]["kendall_tau"] is None  # one run: no pair to rank


def test_the_plot_keys_configurations_by_the_words_that_tell_them_apart(tmp_path):
    from calibration.validate import plot_validation, short_config_labels

    assert short_config_labels(["8 jobs overlap g=2 mps", "8 jobs overlap g=2 mps stacks=2 offset",
                                "16 jobs overlap g=2 mps"]) == ["8 jobs", "8 jobs stacks=2 offset", "16 jobs"]
    runs = []
    for jobs, seed in ((8, 1), (8, 2), (16, 1)):
        out = tmp_path / f"ovl-j{jobs}-s{seed}"
        simulate(config_from_args(jobs=jobs, steps=2, policy="overlap", sharing="mps", seed=seed), out)
        runs.append(out)
    rep = validate(runs, profile=DEFAULT_PROFILE)
    assert rep["heldout_per_config"]["replay"]["n"] == 2
    plot_validation(rep, tmp_path / "v.png")
    import matplotlib.image as mpimg

    # Two panels (runs, and the held-out configurations' means with their key) make a wide figure.
    h, w = mpimg.imread(tmp_path / "v.png").shape[:2]
    assert w > 1.5 * h


def test_a_configurations_arm_is_read_back_from_its_label():
    from calibration.validate import arm_key, arm_of_label, config_label
    from calibration.validate import heldout_arms

    arms = [{"policy": "overlap", "groups": 2, "sharing": "mps"},
            {"policy": "shared-sync", "groups": 1, "sharing": "mps", "stacks": 2, "offset_stacks": True,
             "hold_apart": 0.5},
            {"policy": "shared-sync", "groups": 1, "sharing": "mps", "stacks": 2, "lockstep": True},
            {"policy": "timeslice", "groups": 2, "sharing": "none", "stacks": 1}]
    for arm in arms:
        row = {"arm": arm, "jobs": 8, "mb_tokens": 4096, "audit": "r1", "controls": {"trainer_priority": "below-normal"}}
        assert arm_of_label(config_label(row)) == arm_key(arm)
    assert [arm_key(a) for a in arms] == ["overlap g=2 mps", "shared-sync g=1 mps stacks=2 offset hold=0.5",
                                          "shared-sync g=1 mps stacks=2 lockstep", "timeslice g=2 none"]
    assert arm_of_label("an old label") is None
    # An annotation written before per-arm errors: its arms come from its configurations' labels.
    assert set(heldout_arms({"configurations": ["16 jobs shared-sync g=1 mps stacks=2 mb=4096 sp4"]})) == {
        "shared-sync g=1 mps stacks=2"}


def _recorded_as(run: Path, *, gpu_gib: float | None, step_mode: str = "graphed",
                 priority: str = "below-normal") -> Path:
    """A simulated run folder made to read as a real run's: its diagnostics name the GPU's total
    memory, its trainer's step mode and its MPS priority, as the real backend records them."""
    summary = json.loads((run / "summary.json").read_text())
    summary["diagnostics"] = [{"gpu": {"name": "GPU", "total_gib": gpu_gib} if gpu_gib else None,
                               "sharing_controls": {"trainer_priority": priority},
                               "workers": {"trainer0": {"step_mode": step_mode}}}]
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_validate_without_a_profile_takes_the_shipped_one_that_describes_the_runs(tmp_path, capsys):
    """`nodus validate RUN...` without --profile: each run's shipped profile by its GPU (an H100
    80GB has its own), its trainer, its trainer's priority where it co-runs under MPS, and its
    stacks; an H200 day's one-stack graphed runs beside its stacks take the stacks profile; sets
    that need different profiles are refused by name (session 74: a day's folder on the eager
    default was refused for its packed rows)."""
    from calibration.run_settings import run_profile
    from nodus.cli import runs_profile
    from nodus.config import (DEFAULT_PROFILES, GRAPHED_NORMAL_PRIORITY_PROFILE, H100_ONESTACK_PROFILE,
                              H100_STACKS_PROFILE, STACKS_PROFILE)

    def run(name, **kw):
        out = tmp_path / name
        simulate(config_from_args(jobs=kw.pop("jobs", 2), steps=2, **kw), out)
        return out

    eager = run("eager")  # a simulated run records no trainer: the eager default
    ded = _recorded_as(run("ded", policy="dedicated"), gpu_gib=140.4)
    k2 = _recorded_as(run("k2", jobs=4, policy="shared-sync", sharing="mps", stacks=2), gpu_gib=140.4)
    k2_h100 = _recorded_as(run("k2-h100", jobs=4, policy="shared-sync", sharing="mps", stacks=2), gpu_gib=79.6)
    ovl = run("ovl", policy="overlap", sharing="mps")
    ovl_low, ovl_normal = (_recorded_as(ovl, gpu_gib=140.4), _recorded_as(run("ovl-n", policy="overlap", sharing="mps"),
                                                                          gpu_gib=None, priority="normal"))

    def profile(rd):
        return run_profile(json.loads((rd / "config.json").read_text()), json.loads((rd / "summary.json").read_text()))

    assert profile(eager) == DEFAULT_PROFILES["eager"]
    assert profile(ded) == STACKS_PROFILE  # an H200's graphed dedicated run: the stacks profile's newer engine
    assert profile(k2) == STACKS_PROFILE and profile(k2_h100) == H100_STACKS_PROFILE
    assert profile(_recorded_as(run("ded-h100", policy="dedicated"), gpu_gib=79.6)) == H100_STACKS_PROFILE
    assert profile(_recorded_as(run("ovl-h100", policy="overlap", sharing="mps"), gpu_gib=79.6)) == H100_ONESTACK_PROFILE
    assert profile(ovl_low) == DEFAULT_PROFILES["graphed"] and profile(ovl_normal) == GRAPHED_NORMAL_PRIORITY_PROFILE
    assert runs_profile([str(ded), str(k2)]) == STACKS_PROFILE  # an H200 day: the stacks profile
    assert runs_profile([str(ovl_low), str(k2)]) == STACKS_PROFILE  # one stack beside stacks too
    with pytest.raises(ConfigError, match=f"--profile {STACKS_PROFILE}: {k2}; --profile {H100_STACKS_PROFILE}"):
        runs_profile([str(k2), str(k2_h100)])
    capsys.readouterr()
    assert main(["validate", str(k2_h100), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["profile"] == H100_STACKS_PROFILE and "the shipped one for these runs" in out.err
    assert main(["validate", str(k2), str(k2_h100)]) == 2
    assert "take different shipped profiles" in capsys.readouterr().err


def test_sim_of_a_run_folder_simulates_its_configuration_on_its_shipped_profile(tmp_path, capsys):
    """`nodus sim RUN_DIR`: a real run's recorded configuration (whose config names the default
    profile, which priced nothing) on the run's shipped profile, the measured figure beside; with an
    option that changes the arm, the measured figure is its own run's; a simulated run's folder
    keeps the profile it was simulated on; a folder without a config is refused by name."""
    from nodus.config import H100_STACKS_PROFILE

    run = tmp_path / "k2"
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2), run)
    assert main(["sim", str(run), "--json"]) == 0  # a simulated run's folder: its own profile, no note
    out = capsys.readouterr()
    assert "the shipped one for the run" not in out.err
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("backend")  # as the real backend writes it
    (run / "summary.json").write_text(json.dumps(summary))
    _recorded_as(run, gpu_gib=79.6)
    assert main(["sim", str(run), "--json"]) == 0
    out = capsys.readouterr()
    assert H100_STACKS_PROFILE in json.loads(out.out)["profile"]["source"] and "the shipped one for the run" in out.err
    assert main(["sim", str(run)]) == 0
    assert f"measured in {run}: {summary['steps_per_gpu_hour']:.1f} steps per GPU-hour (this simulation " in \
        capsys.readouterr().out
    assert main(["sim", str(run), "--policy", "continuous"]) == 0
    assert "(its own configuration: the options above changed what is simulated)" in capsys.readouterr().out
    assert main(["sim", str(tmp_path)]) == 2
    assert "is a folder without config.json" in capsys.readouterr().err
