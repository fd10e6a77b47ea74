"""nodus fit: trainer and publish costs refitted from recorded runs. Runs the simulator recorded on
a known profile are the data, so the fit must give that profile's coefficients back."""

import json

import numpy as np
import pytest

from calibration.fit_runs import fit, generate_samples, nonneg_rel_lstsq, train_samples
from calibration.validate import validate
from nodus.cli import main
from nodus.config import ConfigError
from nodus.simulate import config_from_args, simulate
from sim.profile import load_profile


def _profile_with(tmp_path, name, **train):
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["train"]["per_microbatch"] = {"a_s": train["a"], "b_s_per_unit": train["b"]}
    prof["train"]["s_per_adapter"] = train["c"]
    prof["train"]["s_per_regroup_token"] = train.get("d", 0.0)
    prof["publish"]["save_s_per_adapter"] = train["save"]
    prof["decode"]["scale"] = train.get("decode_scale", 1.0)
    prof["train"]["extra_tokens_layout"] = train.get("layout", "padded")
    prof["publish"]["corun_factor"] = train.get("publish_factor", 1.0)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(prof))
    return str(path)


def test_nonneg_rel_lstsq_recovers_exact_and_clamps_negative():
    import numpy as np

    X = np.array([[1, 100.0], [1, 300.0], [2, 500.0], [1, 50.0]])
    y = X @ np.array([0.2, 0.01])
    assert nonneg_rel_lstsq(X, y) == pytest.approx([0.2, 0.01], rel=1e-9)
    # Data that wants a negative intercept gets 0 there, not a negative cost.
    y2 = X @ np.array([-0.05, 0.01]) + 0.0
    w = nonneg_rel_lstsq(X, np.abs(y2))
    assert w[0] >= 0 and w[1] > 0


def test_fit_recovers_the_profile_that_recorded_the_runs(tmp_path):
    truth = _profile_with(tmp_path, "truth", a=0.15, b=2e-5, c=0.01, save=0.05, decode_scale=1.25)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.01, save=0.2)
    annotated = json.loads(open(wrong).read())
    annotated["validation"] = {"heldout_mape": 0.2, "report": "the base's report"}
    wrong = tmp_path / "wrong-annotated.json"
    wrong.write_text(json.dumps(annotated))
    wrong = str(wrong)
    ded = tmp_path / "ded"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth), ded)
    shared = tmp_path / "shared"
    simulate(config_from_args(jobs=8, steps=3, policy="overlap", groups=2, sharing="mps", profile=truth), shared)
    samples, publish = train_samples(ded)
    assert len(samples) == 16 and all(s["adapters"] == 1 for s in samples)
    summary = json.loads((ded / "summary.json").read_text())
    host = {"cpu": "Some CPU", "cpus": 16, "dev_shm": True}  # a real run records its host
    summary["diagnostics"] = summary.get("diagnostics", []) + [{"host": host}]
    (ded / "summary.json").write_text(json.dumps(summary))
    prof = fit([ded, shared], base=wrong, fit_max_jobs=4)
    assert prof["environment"]["host"] == host  # the fitted costs are that host's
    f = prof["measurements"]["fit_runs"]
    assert f["runs"] == [str(ded)] and f["held_out"] == [str(shared)]  # 8 jobs on one GPU: held out
    assert prof["train"]["per_microbatch"]["a_s"] == pytest.approx(0.15, rel=1e-6)
    assert prof["train"]["per_microbatch"]["b_s_per_unit"] == pytest.approx(2e-5, rel=1e-6)
    assert "base profile" in f["train_fit"]["c_source"]  # one adapter per step: c not identifiable
    assert f["train_fit"]["at_zero"] == []  # a and b both pinned by the data
    # Run folders name the code that made them, and the fit keeps that provenance.
    assert f["run_commits"] == [json.loads((ded / "summary.json").read_text())["git_commit"]]
    assert f["run_commits"][0] not in (None, "unrecorded")
    assert prof["publish"]["save_s_per_adapter"] == pytest.approx(0.05, rel=1e-6)
    # The engine's decode steps on the runs' host: 1.25x the base's curves, from the dedicated
    # generations alone (one job, no MPS).
    assert prof["decode"]["scale"] == pytest.approx(1.25, rel=1e-6)
    assert f["decode_fit"]["mape_after"] == pytest.approx(0, abs=1e-9) and f["decode_fit"]["bias_before"] < -0.1
    assert "validation" not in prof  # the base's error bar is not the fit's
    # The day its costs are is the fitted runs': a base's note of its own day gives way.
    (day,) = [x for x in prof["assumptions"] if x["id"] == "host-day"]
    assert "fitted on 1 run(s) of one host on one day" in day["what"]
    onto_default = fit([ded], base="h200-xeon16-20261130-qwen3-0.6b")
    (day,) = [x for x in onto_default["assumptions"] if x["id"] == "host-day"]
    assert "session 8" not in day["what"] and "fitted on 1 run(s)" in day["what"]
    # The fitted profile predicts the held-out shared run it never saw.
    out = tmp_path / "fitted.json"
    out.write_text(json.dumps(prof))
    rep = validate([ded, shared], profile=str(out))
    assert rep["heldout_mape_replay"] == pytest.approx(0, abs=1e-6)
    assert rep["all_replay_components"]["train_s"]["mape"] == pytest.approx(0, abs=1e-6)


def test_fit_cli_refuses_too_few_steps_and_existing_out(tmp_path, capsys):
    shared = tmp_path / "shared"
    simulate(config_from_args(jobs=8, steps=2, policy="shared-sync"), shared)
    with pytest.raises(ConfigError, match="0 train steps"):
        fit([shared], base="h200-qwen3-0.6b")
    ded = tmp_path / "ded"
    simulate(config_from_args(jobs=2, steps=2, policy="dedicated", sharing="none"), ded)
    out = tmp_path / "p.json"
    assert main(["fit", str(ded), "--out", str(out)]) == 0
    out_text = capsys.readouterr().out
    assert "fitted on 1 run(s), 4 train steps" in out_text
    assert "sharing rates fitted: none" in out_text  # a dedicated run never co-runs nor uses MPS
    assert "publish beside a train step: x 1.00 kept from the base (0 publishes beside a train step, 4 alone)" \
        in out_text
    assert main(["fit", str(ded), "--out", str(out)]) != 0
    assert "never overwrites" in capsys.readouterr().err


def test_fit_on_two_to_four_job_runs_recovers_every_train_coefficient(tmp_path):
    """Shared steps of 2-4 jobs vary the adapter count and regroup rows: all four coefficients are
    identifiable, and the fit gives the recording profile's back; 8 jobs stay held out."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.05, d=4e-6, save=0.04)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, d=0.0, save=0.2)
    runs = []
    for jobs in (2, 3, 4, 8):
        out = tmp_path / f"sync{jobs}"
        simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="none", profile=truth,
                                  seed=jobs), out)
        runs.append(out)
    samples, _ = train_samples(runs[2])
    assert any(s["regroup_tokens"] > 0 for s in samples)
    prof = fit(runs, base=wrong)
    f = prof["measurements"]["fit_runs"]
    assert f["held_out"] == [str(runs[3])] and f["train_fit"]["c_source"] == "fitted"
    t = prof["train"]
    assert t["per_microbatch"]["a_s"] == pytest.approx(0.1, rel=1e-6)
    assert t["per_microbatch"]["b_s_per_unit"] == pytest.approx(1.5e-5, rel=1e-6)
    assert t["s_per_adapter"] == pytest.approx(0.05, rel=1e-6)
    assert t["s_per_regroup_token"] == pytest.approx(4e-6, rel=1e-6)


def test_extra_tokens_of_each_multi_adapter_layout():
    from nodus.microbatch import microbatch_costs

    rows = [[10, 10], [10]]  # job 0: two rows of 10 tokens, job 1: one; all in one micro-batch
    assert microbatch_costs(rows, 100, "padded") == ([30], 10)  # job 1 padded to 2 rows
    assert microbatch_costs(rows, 100, "masked") == ([30], 30)  # each row meets the other adapter
    assert microbatch_costs([[10, 10]], 100, "masked") == ([20], 0)  # one adapter: nothing extra
    with pytest.raises(ValueError, match="layout='bmm'"):
        microbatch_costs(rows, 100, "bmm")


def _mark_layout(run, layout):
    """A real run records its trainer's layout among its workers' diagnostics."""
    summary = json.loads((run / "summary.json").read_text())
    summary["diagnostics"] = [{"workers": {"trainer0": {"lora_layout": layout}}}]
    (run / "summary.json").write_text(json.dumps(summary))


def test_fit_on_masked_layout_runs_fits_its_extra_tokens_and_refuses_mixed_layouts(tmp_path):
    """The masked layout's extra work (tokens x other adapters of the micro-batch) is the term a
    masked trainer's runs pin; the profile records the layout, and the simulator charges it."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.05, d=2e-6, save=0.04, layout="masked")
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, d=0.0, save=0.2)
    runs = []
    for jobs in (2, 3, 4):
        out = tmp_path / f"sync{jobs}"
        simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="none", profile=truth,
                                  seed=jobs), out)
        _mark_layout(out, "auto" if jobs == 3 else "masked")  # auto takes the masked path
        runs.append(out)
    prof = fit(runs, base=wrong)
    t = prof["train"]
    assert t["extra_tokens_layout"] == "masked"
    assert t["s_per_regroup_token"] == pytest.approx(2e-6, rel=1e-6)
    assert t["s_per_adapter"] == pytest.approx(0.05, rel=1e-6)
    _mark_layout(runs[0], "padded")
    with pytest.raises(ConfigError, match="different multi-adapter layouts"):
        fit(runs, base=wrong)


def test_fit_takes_only_runs_of_the_trainer_its_base_profile_describes(tmp_path):
    """Graphed-trainer runs refit a graphed base (nodus calibrate --trainer-graphs) and keep its
    step mode; against an eager base they are refused with a clear error, and the other way round."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.05, save=0.04)
    eager_base = _profile_with(tmp_path, "eager", a=0.01, b=1e-6, c=0.001, save=0.2)
    graphed = json.loads(open(eager_base).read())
    graphed["train"]["step_mode"] = "graphed"
    graphed_base = tmp_path / "graphed.json"
    graphed_base.write_text(json.dumps(graphed))
    runs = []
    for jobs in (2, 3, 4):
        out = tmp_path / f"cg{jobs}"
        simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="none", profile=truth,
                                  seed=jobs), out)
        summary = json.loads((out / "summary.json").read_text())
        summary["diagnostics"] = [{"workers": {"trainer0": {"lora_layout": "padded", "step_mode": "graphed"}}}]
        (out / "summary.json").write_text(json.dumps(summary))
        runs.append(out)
    prof = fit(runs, base=str(graphed_base))
    assert prof["train"]["step_mode"] == "graphed"
    assert prof["train"]["s_per_adapter"] == pytest.approx(0.05, rel=1e-6)
    with pytest.raises(ConfigError, match="trained graphed but the fitted profile's trainer is eager"):
        fit(runs, base=eager_base)
    # --trainer-mode graphed fits the graphed trainer's terms onto the eager base: the same terms,
    # the profile's trainer graphed, and the co-run rates it keeps named as the eager trainer's.
    onto = fit(runs, base=eager_base, trainer_mode="graphed")
    assert onto["train"]["step_mode"] == "graphed"
    assert onto["train"]["s_per_adapter"] == pytest.approx(0.05, rel=1e-6)
    kept = [x for x in onto["assumptions"] if x["id"] == "trainer-rates-from-base"]
    assert len(kept) == 1 and "measured the eager one" in kept[0]["what"] and "mps_corun.trainer" in kept[0]["what"]
    assert not [x for x in prof.get("assumptions", []) if x["id"] == "trainer-rates-from-base"]
    with pytest.raises(ConfigError, match="trained graphed but the fitted profile's trainer is eager .--trainer-mode"):
        fit(runs, base=str(graphed_base), trainer_mode="eager")
    with pytest.raises(ConfigError, match="--trainer-mode 'cuda'"):
        fit(runs, base=eager_base, trainer_mode="cuda")
    # Runs whose engine ran tuned LoRA kernels do not refit a profile of vLLM's default kernels.
    summary = json.loads((runs[0] / "summary.json").read_text())
    summary["diagnostics"][0]["workers"]["engine0"] = {"lora_kernel_configs": {"source": "shipped"}}
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="engine ran tuned LoRA kernel configs but the fitted profile's engine "
                                          "is the default kernels' .the base profile"):
        fit(runs, base=str(graphed_base))
    summary["diagnostics"][0]["workers"].pop("engine0")
    summary["diagnostics"][0]["audit"] = {"logprobs": True, "every": 4}
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="returned logprobs on fewer steps or responses .audit every 4 steps"):
        fit(runs, base=str(graphed_base))
    summary["diagnostics"][0]["audit"] = {"logprobs": True, "every": 1, "responses": 1}
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="fewer steps or responses .audit 1 response a prompt"):
        fit(runs, base=str(graphed_base))
    summary["diagnostics"][0].pop("audit")
    summary["diagnostics"][0]["engine_core_process"] = True
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="ran its core in a process of its own"):
        fit(runs, base=str(graphed_base))
    summary["diagnostics"][0].pop("engine_core_process")
    summary["diagnostics"][0]["publish_pinned"] = False
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="loaded published adapters into pageable host memory"):
        fit(runs, base=str(graphed_base))
    summary["diagnostics"][0].pop("publish_pinned")
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    cfg = json.loads((runs[0] / "config.json").read_text())
    cfg["trainer"]["share_prompts"] = 4
    (runs[0] / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"trained each prompt once \(trainer.share_prompts=4\)"):
        fit(runs, base=str(graphed_base))
    cfg["trainer"].pop("share_prompts")
    cfg["arm"]["stacks"] = 2
    (runs[0] / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="ran 2 engine \\+ trainer stacks"):
        fit(runs, base=str(graphed_base))
    cfg["arm"].pop("stacks")
    (runs[0] / "config.json").write_text(json.dumps(cfg))
    s0 = json.loads((runs[0] / "summary.json").read_text())
    s0["diagnostics"][0]["workers"]["engine0"] = {"cpu_threads": 1, "torch_threads": 1}
    (runs[0] / "summary.json").write_text(json.dumps(s0))
    with pytest.raises(ConfigError, match="engine ran 1 torch CPU threads \\(--engine-cpu-threads\\)"):
        fit(runs, base=str(graphed_base))
    s0["diagnostics"][0]["workers"].pop("engine0")
    (runs[0] / "summary.json").write_text(json.dumps(s0))
    # The trainers' CPU threads (capped below the host's CPUs, RealOptions.trainer_cpu_threads):
    # one setting per fit, recorded in the profile's environment.
    def cap(run_dir, n):
        s = json.loads((run_dir / "summary.json").read_text())
        s["diagnostics"][0]["workers"]["trainer0"]["cpu_threads"] = n
        s["diagnostics"][0]["host"] = {"cpus": 16}
        (run_dir / "summary.json").write_text(json.dumps(s))

    cap(runs[0], 2)
    with pytest.raises(ConfigError, match=r"trainers ran different CPU thread counts \(torch default: .*; 2: "):
        fit(runs, base=str(graphed_base))
    for r in runs[1:]:
        cap(r, 2)
    assert fit(runs, base=str(graphed_base))["environment"]["trainer_cpu_threads"] == 2
    for r in runs:
        cap(r, 16)  # the host's CPUs: torch's own count (how session 28's first such runs recorded it)
    assert fit(runs, base=str(graphed_base))["environment"]["trainer_cpu_threads"] is None


def _mark_tuned(run_dir, configs=None):
    """A run as a real one whose engine ran tuned LoRA kernel configs records it."""
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["diagnostics"] = summary.get("diagnostics", []) + [
        {"workers": {"engine0": {"lora_kernel_configs": configs or {"folder": "/x/lora_configs", "gpu": "NVIDIA H200",
                                                                     "source": "shipped"}}}}]
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_fit_onto_a_base_of_other_lora_kernels_fits_the_decode_scale_and_says_so(tmp_path):
    """Runs of the tuned LoRA kernels onto a base of vLLM's defaults (--lora-kernels tuned): the
    dedicated runs' generations give the decode scale, the profile records the runs' configs and
    names the curves' shape as the base's; without a dedicated run nothing re-describes the engine."""
    truth = _profile_with(tmp_path, "truth", a=0.15, b=2e-5, c=0.01, save=0.05, decode_scale=0.8)
    base = _profile_with(tmp_path, "base", a=0.01, b=1e-6, c=0.01, save=0.2)
    ded, shared = tmp_path / "ded", tmp_path / "shared"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth), ded)
    simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="none", profile=truth), shared)
    configs = {"folder": "/x/lora_configs", "gpu": "NVIDIA H200", "source": "shipped"}
    for rd in (ded, shared):
        _mark_tuned(rd, configs)
    with pytest.raises(ConfigError, match="ran tuned LoRA kernel configs but the fitted profile's engine is the "
                                          "default kernels' .the base profile.*--lora-kernels tuned"):
        fit([ded, shared], base=base, fit_max_jobs=8)
    prof = fit([ded, shared], base=base, lora_kernels="tuned")
    assert prof["decode"]["scale"] == pytest.approx(0.8, rel=1e-6)
    assert prof["environment"]["lora_kernel_configs"] == configs
    (kept,) = [x for x in prof["assumptions"] if x["id"] == "engine-curves-from-base"]
    assert kept["value"] == "default" and "ran the tuned LoRA kernel configs" in kept["what"]
    assert "(0.800, fitted on" in kept["what"]
    # The fitted profile now describes tuned runs: a refit on it needs no flag, takes no default-kernel
    # runs, and keeps saying where its curves came from, at the scale it fits.
    out = tmp_path / "tuned.json"
    out.write_text(json.dumps(prof))
    truth2 = _profile_with(tmp_path, "truth2", a=0.15, b=2e-5, c=0.01, save=0.05, decode_scale=0.7)
    ded2 = tmp_path / "ded2"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth2), ded2)
    _mark_tuned(ded2, configs)
    refit = fit([ded2, shared], base=str(out))
    assert refit["decode"]["scale"] == pytest.approx(0.7, rel=1e-6)
    (kept,) = [x for x in refit["assumptions"] if x["id"] == "engine-curves-from-base"]
    assert kept["value"] == "default" and "(0.700, fitted on" in kept["what"]
    plain = tmp_path / "plain"
    simulate(config_from_args(jobs=2, steps=3, policy="shared-sync", sharing="none", profile=truth), plain)
    with pytest.raises(ConfigError, match="ran default LoRA kernel configs but the fitted profile's engine is the tuned"
                                          ".*or --lora-kernels default to fit that engine"):
        fit([plain, ded], base=str(out))
    with pytest.raises(ConfigError, match="the runs mix two engines"):
        fit([plain, ded], base=base, lora_kernels="tuned")
    # Back to the kernels the curves were measured with: the assumption goes, the record too.
    back_ded = tmp_path / "back"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth), back_ded)
    back = fit([back_ded, plain], base=str(out), lora_kernels="default")
    assert not [x for x in back["assumptions"] if x["id"] == "engine-curves-from-base"]
    assert back["environment"]["lora_kernel_configs"] is None
    with pytest.raises(ConfigError, match="only dedicated runs' generations fit .*add a dedicated run"):
        fit([shared], base=base, lora_kernels="tuned")
    with pytest.raises(ConfigError, match="--lora-kernels 'fast'"):
        fit([ded], base=base, lora_kernels="fast")


def test_fit_recovers_mps_sharing_rates_from_overlapped_runs(tmp_path):
    """Overlap+MPS runs of 2 and 4 jobs beside a dedicated run: the fit splits each train step and
    each one-job generation into its time alone and beside the other side, and gives back the
    recording profile's MPS rates of trainer and engine with its train costs."""
    truth = _profile_with(tmp_path, "truth", a=0.12, b=2e-5, c=0.03, save=0.04)
    prof = json.loads(open(truth).read())
    prof["sharing"]["mps_alone"] = {"engine": 0.9, "trainer": 0.85}
    prof["sharing"]["mps_corun"] = {"engine": 0.62, "trainer": 0.55}
    open(truth, "w").write(json.dumps(prof))
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, save=0.2)
    runs = [tmp_path / "ded", tmp_path / "ded-mps"]
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth, seed=3), runs[0])
    # Dedicated under MPS: one-job generations alone in the MPS share, matched to the plain ones.
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="mps", profile=truth, seed=3), runs[1])
    for jobs in (2, 4):
        runs.append(tmp_path / f"ovl{jobs}")
        simulate(config_from_args(jobs=jobs, steps=4, policy="overlap", groups=2, sharing="mps", profile=truth,
                                  seed=3), runs[-1])
    samples, _ = train_samples(runs[2])
    assert any(s["corun_s"] > 0 for s in samples) and all(s["sharing"] == "mps" for s in samples)
    base = json.loads(open(wrong).read())
    base["sharing"]["mps_alone"] = {"engine": 0.5, "trainer": 0.3}
    open(wrong, "w").write(json.dumps(base))
    fitted = fit(runs, base=wrong)
    rates = fitted["measurements"]["fit_runs"]["sharing_fit"]
    assert rates["mps_corun.trainer"] == pytest.approx(0.55, rel=1e-6)
    assert rates["mps_alone.trainer"] == pytest.approx(0.85, rel=1e-6)  # the dedicated MPS run's steps
    assert fitted["sharing"]["mps_corun"]["trainer"] == pytest.approx(0.55, rel=1e-6)
    # The engine's MPS rates (the base had 0.5 alone): the overlap runs' generations outlast their
    # train steps, so the two groups' generations overlap; merged into episodes (each action's
    # requests submitted at its recorded offset) they bring the co-run time that fits
    # mps_corun.engine. Within an episode the alone replay's batch at each moment is not the run's
    # (the co-run slowed the first action before the second joined), hence the looser bound.
    f = fitted["measurements"]["fit_runs"]["engine_fit"]["mps"]
    assert f["corun_share"] > 0.3 and f["fitted"] == ["mps_alone.engine", "mps_corun.engine"]
    assert max(f["jobs_per_generation"]) > 2  # episodes of several groups' actions
    assert rates["mps_alone.engine"] == pytest.approx(0.9, rel=5e-3)
    assert rates["mps_corun.engine"] == pytest.approx(0.62, rel=0.05)
    assert f["mape_after"] < 0.03 < f["mape_before"]
    assert fitted["train"]["per_microbatch"]["a_s"] == pytest.approx(0.12, rel=1e-3)
    assert fitted["train"]["s_per_adapter"] == pytest.approx(0.03, rel=1e-3)
    assert any(a["id"] == "sharing-partly-fitted" for a in fitted["assumptions"])
    assert not any(a["id"] == "sharing-from-base" for a in fitted["assumptions"])


def test_fit_recovers_the_engines_corun_rates_from_multi_job_generations(tmp_path):
    """4 jobs in 2 groups, with MPS and without: every generation holds two jobs' requests, and
    train steps long enough that one group's generation ends before the other's starts. The fit
    takes each one's work as the simulator's alone time of exactly those requests, splits its
    seconds into alone and beside a train step, and gives back the recording profile's engine
    rates of both modes (the base's differ); the refitted profile replays the runs' generations."""
    truth = _profile_with(tmp_path, "truth", a=0.6, b=2e-5, c=0.03, save=0.04, decode_scale=1.2)
    prof = json.loads(open(truth).read())
    prof["sharing"]["none_corun"] = {"engine": 0.7, "trainer": 0.6}
    prof["sharing"]["mps_corun"] = {"engine": 0.8, "trainer": 0.55}
    # The engine's MPS share alone stays the base's: these runs' MPS generations are mostly beside
    # a train step (their alone time is under 15%), so the fit keeps it.
    prof["sharing"]["mps_alone"]["trainer"] = 0.85
    open(truth, "w").write(json.dumps(prof))
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, save=0.2)
    base = json.loads(open(wrong).read())["sharing"]
    assert base["none_corun"]["engine"] < 0.5 and base["mps_corun"]["engine"] < 0.6  # far from the truth
    runs = [tmp_path / "ded"]
    simulate(config_from_args(jobs=2, steps=3, policy="dedicated", sharing="none", profile=truth, seed=5), runs[0])
    for sharing in ("none", "mps"):
        runs.append(tmp_path / f"ovl4-{sharing}")
        simulate(config_from_args(jobs=4, steps=6, policy="overlap", groups=2, sharing=sharing, profile=truth,
                                  seed=5), runs[-1])
        gens = generate_samples(runs[-1])
        assert gens and all(len(g["requests"]) == 2 and g["actions"] == 1 for g in gens)
        assert any(g["corun_s"] > 0 for g in gens)
    fitted = fit(runs, base=wrong)
    f = fitted["measurements"]["fit_runs"]
    rates = f["sharing_fit"]
    assert rates["none_corun.engine"] == pytest.approx(0.7, rel=1e-6)
    assert rates["mps_corun.engine"] == pytest.approx(0.8, rel=1e-6)
    assert "mps_alone.engine" not in rates and f["engine_fit"]["mps"]["corun_share"] > 0.85
    assert fitted["sharing"]["none_corun"]["engine"] == pytest.approx(0.7, rel=1e-6)
    assert fitted["decode"]["scale"] == pytest.approx(1.2, rel=1e-6)  # the work's decode scale, from ded
    for mode in ("none", "mps"):
        e = f["engine_fit"][mode]
        assert e["jobs_per_generation"] == [2] and e["mape_before"] > 0.05
        assert e["mape_after"] == pytest.approx(0, abs=1e-6)
    entries = [a["what"] for a in fitted["assumptions"] if a["id"] == "sharing-partly-fitted"]
    assert len(entries) == 1  # this fit's, naming the rates it kept from the base with their values
    import datetime

    assert fitted["environment"]["date"] == datetime.date.today().isoformat()  # dated by the fit
    text = entries[0]
    assert "mps_alone.trainer 0.850" in text and "the others are the base profile's" in text
    assert "none_corun.engine 0.700" in text and "mps_corun.engine 0.800" in text
    out = tmp_path / "fitted.json"
    out.write_text(json.dumps(fitted))
    rep = validate(runs, profile=str(out))
    assert rep["all_replay_components"]["generate_s"]["mape"] == pytest.approx(0, abs=1e-3)


def test_refitted_corun_rates_replace_the_bases_by_batch_rates():
    """A base calibrated by engine batch, runs that refit the MPS co-run rate: the simulator would
    read the table before the constant, so the fit drops the table's MPS entries (and keeps the
    time-slicing ones it did not refit)."""
    from calibration.fit_runs import _drop_refitted_batch_rates

    sharing = {"corun_by_engine_batch": [
        {"batch": 64, "mps_corun": {"engine": 0.9, "trainer": 0.5}, "none_corun": {"engine": 0.5, "trainer": 0.5}},
        {"batch": 256, "mps_corun": {"engine": 0.7, "trainer": 0.9}}]}
    assert _drop_refitted_batch_rates(sharing, {"mps_corun.trainer": 0.6, "mps_alone.engine": 0.9}) == ["mps_corun"]
    assert sharing["corun_by_engine_batch"] == [{"batch": 64, "none_corun": {"engine": 0.5, "trainer": 0.5}}]
    assert _drop_refitted_batch_rates(sharing, {"mps_alone.trainer": 0.8}) == []
    assert _drop_refitted_batch_rates({}, {"mps_corun.trainer": 0.6}) == []


def _freed(jobs: int, profile: str, seed: int):
    return config_from_args({"arm": {"trainer_waits_for_publish": False}}, jobs=jobs, steps=4, policy="overlap",
                            groups=2, sharing="mps", profile=profile, seed=seed)


def _ded_and_freed_runs(tmp_path, truth: str) -> list:
    """A dedicated run and freed-trainer overlap runs of 2 and 4 jobs, recorded on ``truth``."""
    runs = [tmp_path / "ded"]
    simulate(config_from_args(jobs=2, steps=3, policy="dedicated", sharing="none", profile=truth), runs[0])
    for jobs in (2, 4):
        runs.append(tmp_path / f"freed{jobs}")
        simulate(_freed(jobs, truth, seed=jobs), runs[-1])
    return runs


def test_fit_recovers_the_publish_corun_factor_from_freed_trainer_runs(tmp_path, capsys):
    """Freed-trainer runs recorded at factor 5: the publishes beside the other group's step take
    5x the save time. The fit takes the save time from the publishes alone and the factor from
    the ratio; runs with no publish beside a step keep the base's factor."""
    truth = _profile_with(tmp_path, "truth", a=0.12, b=2e-5, c=0.03, save=0.04, publish_factor=5.0)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, save=0.2, publish_factor=1.5)
    runs = _ded_and_freed_runs(tmp_path, truth)
    ded = runs[0]
    _, publish = train_samples(runs[2])
    assert {p["beside_train"] for p in publish} == {True, False}
    prof = fit(runs, base=wrong)
    assert prof["publish"]["save_s_per_adapter"] == pytest.approx(0.04, rel=1e-6)
    assert prof["publish"]["corun_factor"] == pytest.approx(5.0, rel=1e-6)
    f = prof["measurements"]["fit_runs"]
    assert f["publish_corun_factor"] == pytest.approx(5.0, rel=1e-6)
    n = f["publish_corun_samples"]
    assert n["beside_train"] > 0 and n["alone"] > n["beside_train"]
    assert n["beside_train_s_per_adapter"] == pytest.approx(0.2, rel=1e-6)
    # The same runs' trainer waiting for its publishes: no publish beside a step, the base's 1.5.
    only_alone = fit([ded], base=wrong)
    assert only_alone["publish"]["corun_factor"] == 1.5
    assert only_alone["measurements"]["fit_runs"]["publish_corun_factor"] is None
    out = tmp_path / "fitted.json"
    assert main(["fit", *map(str, runs), "--base", wrong, "--out", str(out)]) == 0
    assert "publish beside a train step x 5.00" in capsys.readouterr().out


def test_a_publish_is_beside_a_train_step_past_half_its_time(tmp_path):
    """Two publishes added to a recorded run across one train action's end: the one the step
    covers for 60% of its time counts as beside it, the one it covers for 40% as alone."""
    run = tmp_path / "freed"
    simulate(_freed(2, "h200-qwen3-0.6b", seed=1), run)
    spans = [json.loads(x) for x in (run / "spans.jsonl").read_text().splitlines()]
    t = next(s for s in spans if s["phase"] == "train")
    end = t["end_s"]
    others = [s for s in spans if s["phase"] == "train" and (s["start_s"], s["end_s"]) != (t["start_s"], end)]
    # This step alone covers the 0.1 s either side of its end.
    assert t["start_s"] < end - 0.1 and not any(s["start_s"] < end + 0.1 and s["end_s"] > end - 0.1 for s in others)
    added = [dict(t, phase="publish", group=9, start_s=end - 0.1 * share, end_s=end + 0.1 * (1 - share), attrs={})
             for share in (0.4, 0.6)]
    with open(run / "spans.jsonl", "a") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in added)
    _, publish = train_samples(run)
    mine = [p for p in publish if p["s_per_adapter"] == pytest.approx(0.1)]
    assert [p["beside_train"] for p in mine] == [True, False]  # by start: the 60% one first


def test_alone_generation_of_an_episode_counts_the_engines_busy_time_only(tmp_path):
    """Two actions of an episode: submitted together they share decode steps (less than the sum of
    their alone times); the second submitted long after the first ended, the idle gap between them
    is not work (the sum of the two, each from an idle engine)."""
    from calibration.fit_runs import _alone_generation_s

    prof = json.loads(open(_profile_with(tmp_path, "p", a=0.1, b=0.0, c=0.0, save=0.01)).read())
    a = {"job": "a", "prompts": 8, "prompt_tokens_each": 140, "lengths": tuple(range(40, 104)), "action": 0}
    b = {"job": "b", "prompts": 8, "prompt_tokens_each": 140, "lengths": tuple(range(60, 124)), "action": 1}

    def gen(*requests):
        return {"requests": list(requests), "max_num_seqs": 512, "max_loras": 2, "graph_max_tokens": 512}

    alone_a = _alone_generation_s(prof, gen(a), 1.0)
    alone_b = _alone_generation_s(prof, gen(b), 1.0)
    together = _alone_generation_s(prof, gen(dict(a, offset_s=0.0), dict(b, offset_s=0.0)), 1.0)
    apart = _alone_generation_s(prof, gen(dict(a, offset_s=0.0), dict(b, offset_s=100.0)), 1.0)
    assert max(alone_a, alone_b) < together < alone_a + alone_b
    assert apart == pytest.approx(alone_a + alone_b, rel=1e-9)


def test_graphless_steps_come_from_decode_rows_past_the_graph_sizes(tmp_path, capsys):
    """--graphless-from: per adapter count the largest measured batch past the CUDA-graph sizes,
    from a phase-profile measurement or a calibrated profile's rows; the fitted profile simulates
    a queue past max_num_seqs slower and says where the steps came from."""
    from calibration.fit_runs import graphless_points

    phase = tmp_path / "phase.json"
    phase.write_text(json.dumps({"decode": [
        {"batch": 512, "adapters": 8, "step_s": 0.0106}, {"batch": 768, "adapters": 8, "step_s": 0.05},
        {"batch": 1024, "adapters": 8, "step_s": 0.0546}, {"batch": 1024, "adapters": 1, "step_s": 0.0537}]}))
    assert graphless_points(phase) == (512, [{"adapters": 1, "batch": 1024, "step_s": 0.0537},
                                             {"adapters": 8, "batch": 1024, "step_s": 0.0546}])
    assert graphless_points(phase, 768) == (768, [{"adapters": 1, "batch": 1024, "step_s": 0.0537},
                                                  {"adapters": 8, "batch": 1024, "step_s": 0.0546}])
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"measurements": {"calibrate": {
        "decode": [{"batch": 256, "adapters": 1, "step_s": 0.01}], "graph_max_tokens": 256,
        "graphless": [{"batch": 512, "adapters": 1, "step_s": 0.04}]}}}))
    # The size the calibration recorded: its 512-sequence step was past that engine's graphs.
    assert graphless_points(cal) == (256, [{"adapters": 1, "batch": 512, "step_s": 0.04}])
    with pytest.raises(ValueError, match="CUDA graphs up to 256 tokens, not the 512 given"):
        graphless_points(cal, 512)
    with pytest.raises(ValueError, match="a CUDA-graph size is >= 1 token"):
        graphless_points(phase, 0)
    with pytest.raises(ValueError, match="no decode row past 2048 tokens"):
        graphless_points(phase, 2048)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"decode": [{"batch": 1024}]}))
    with pytest.raises(ValueError, match="without batch, adapters and step_s"):
        graphless_points(bad, 512)
    bad.write_text(json.dumps({"train": []}))
    with pytest.raises(ValueError, match="no decode rows"):
        graphless_points(bad, 512)

    ded = tmp_path / "ded"
    simulate(config_from_args(jobs=2, steps=2, policy="dedicated", sharing="none"), ded)
    out = tmp_path / "p.json"
    assert main(["fit", str(ded), "--out", str(out), "--graphless-from", str(phase)]) == 0
    prof = json.loads(out.read_text())
    assert prof["decode"]["graph_max_tokens"] == 512 and len(prof["decode"]["graphless"]) == 2
    note = next(a for a in prof["assumptions"] if a["id"] == "graphless-flat")
    assert "54.6 ms at batch 1024 with 8 adapters" in note["what"] and "phase.json" in note["what"]
    plain = tmp_path / "plain.json"
    assert main(["fit", str(ded), "--out", str(plain)]) == 0
    capsys.readouterr()
    # 16 jobs' 1024 sequences queue past max_num_seqs 512: each finished sequence's slot admits a
    # waiting one, and that step runs past vLLM's default 512-token graphs. 8 jobs' 512 never wait:
    # the same prediction. A new config sizes the graphs past that (1024) and runs no such step.
    vllm_default = {"engine": {"cuda_graph_max_tokens": 512}}
    sixteen = {p: simulate(config_from_args(vllm_default, jobs=16, steps=2, policy="shared-sync", sharing="none",
                                            profile=str(p)))
               for p in (out, plain)}
    assert sixteen[out]["steps_per_gpu_hour"] < 0.9 * sixteen[plain]["steps_per_gpu_hour"]
    sized = config_from_args(jobs=16, steps=2, policy="shared-sync", sharing="none", profile=str(out))
    assert sized.engine.cuda_graph_max_tokens == 1024
    assert simulate(sized)["steps_per_gpu_hour"] == pytest.approx(sixteen[plain]["steps_per_gpu_hour"], rel=1e-9)
    eight = {p: simulate(config_from_args(jobs=8, steps=2, policy="shared-sync", sharing="none", profile=str(p)))
             for p in (out, plain)}
    assert eight[out]["steps_per_gpu_hour"] == pytest.approx(eight[plain]["steps_per_gpu_hour"], rel=1e-9)
    assert main(["fit", str(ded), "--out", str(tmp_path / "x.json"), "--graphless-from", str(bad)]) != 0
    assert "no decode rows" in capsys.readouterr().err
    assert main(["fit", str(ded), "--out", str(tmp_path / "x.json"), "--graph-max-tokens", "768"]) != 0
    assert "give --graphless-from too" in capsys.readouterr().err


def test_scales_only_carries_the_base_to_a_faster_day_with_its_shape_and_rates(tmp_path, capsys):
    """A day whose host runs every train term 0.8x and every decode step 0.9x the base's: --scales-only
    on that day's dedicated runs gives those two factors back and keeps everything else (the per-adapter
    cost no dedicated run separates, the sharing rates), so the day's held-out shared run is predicted
    exactly; a shared run alone cannot scale the engine, and another trainer is refused."""
    base = _profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=1.0)
    day = _profile_with(tmp_path, "day", a=0.12, b=1.6e-5, c=0.032, save=0.03, decode_scale=0.9)
    ded, shared = tmp_path / "ded", tmp_path / "shared"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=day), ded)
    simulate(config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="mps", profile=day), shared)
    prof = fit([ded, shared], base=base, scales_only=True)
    t, f = prof["train"], prof["measurements"]["fit_runs"]
    assert f["train_fit"]["scale"] == pytest.approx(0.8, rel=1e-6)
    assert t["per_microbatch"]["a_s"] == pytest.approx(0.12, rel=1e-6)
    assert t["s_per_adapter"] == pytest.approx(0.032, rel=1e-6)  # the base's, scaled: not fitted
    assert prof["decode"]["scale"] == pytest.approx(0.9, rel=1e-6)
    assert prof["publish"]["save_s_per_adapter"] == pytest.approx(0.03, rel=1e-6)
    assert prof["sharing"] == json.loads(open(base).read())["sharing"]
    (note,) = [x for x in prof["assumptions"] if x["id"] == "day-scales"]
    assert "every train term x 0.800" in note["what"] and "1.000 -> 0.900" in note["what"]
    assert "0.0300 s per adapter" in note["what"]
    out = tmp_path / "carried.json"
    out.write_text(json.dumps(prof))
    assert validate([ded, shared], profile=str(out))["heldout_mape_replay"] == pytest.approx(0, abs=1e-6)
    # A full refit on the same dedicated runs cannot tell the per-adapter cost apart: it keeps the
    # base's 0.04 unscaled, and the 8-job run's train steps come out too long.
    full = tmp_path / "full.json"
    full.write_text(json.dumps(fit([ded], base=base)))
    assert validate([ded, shared], profile=str(full))["heldout_mape_replay"] > 0.002
    small = tmp_path / "small"
    simulate(config_from_args(jobs=2, steps=3, policy="shared-sync", sharing="none", profile=day), small)
    with pytest.raises(ConfigError, match="scales-only.*add a dedicated run of the day"):
        fit([small], base=base, scales_only=True)
    masked = _profile_with(tmp_path, "masked", a=0.15, b=2e-5, c=0.04, save=0.05, layout="masked")
    with pytest.raises(ConfigError, match="keeps the base's terms.*masked layout"):
        fit([ded], base=masked, scales_only=True)  # the runs' trainer: padded
    _mark_tuned(ded, {"folder": "/x/lora_configs", "gpu": "NVIDIA H200", "source": "shipped"})
    with pytest.raises(ConfigError,
                       match="keeps the base's terms.*LoRA kernels \\(default\\), not eager, padded / tuned"):
        fit([ded], base=base, scales_only=True, lora_kernels="tuned")
    assert main(["fit", str(ded), "--base", base, "--scales-only", "--lora-kernels", "tuned",
                 "--out", str(tmp_path / "cli.json")]) != 0
    ded2 = tmp_path / "ded2"
    simulate(config_from_args(jobs=2, steps=4, policy="dedicated", sharing="none", profile=day), ded2)
    assert main(["fit", str(ded2), "--base", base, "--scales-only", "--out", str(tmp_path / "cli.json")]) == 0
    assert "scales only: the base's train terms x 0.800" in capsys.readouterr().out


def test_fit_keeps_only_the_train_terms_that_predict_left_out_runs(tmp_path, capsys):
    """Runs recorded on a profile with no per-adapter cost: every subset holding the true terms
    predicts each left-out run exactly, so cross-validation keeps the fewest (a + b) and leaves c
    at 0, and says so; with a per-adapter cost (the test above) it keeps c."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.0, save=0.04)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.05, save=0.2)
    runs = []
    for jobs in (2, 3, 4):
        runs.append(tmp_path / f"sync{jobs}")
        simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="none", profile=truth,
                                  seed=jobs), runs[-1])
    for scheme, folds in (("runs", 3), ("extrapolate", 1)):  # 3 runs; or size 4 from sizes 2-3 (size 2 alone
        # cannot tell a per-adapter cost from a fixed one: no fold)
        prof = fit(runs, base=wrong, term_selection=scheme)
        t, f = prof["train"], prof["measurements"]["fit_runs"]["train_fit"]
        sel = f["term_selection"]
        assert sel["scheme"] == scheme and sel["folds"] == folds and sel["chosen"] == "a+b"
        assert sel["cv_mape"]["a+b"] == pytest.approx(0, abs=1e-9)
        assert sel["cv_mape"]["a"] > 0.01 and sel["cv_mape"]["b+c"] > 0.01  # a true term left out: an error
        assert t["s_per_adapter"] == 0.0 and "cross-validation" in f["c_source"]
        assert t["per_microbatch"]["a_s"] == pytest.approx(0.1, rel=1e-6)
        assert t["per_microbatch"]["b_s_per_unit"] == pytest.approx(1.5e-5, rel=1e-6)
    with pytest.raises(ConfigError, match="term selection 'loo'"):
        fit(runs, base=wrong, term_selection="loo")
    out = tmp_path / "fitted.json"
    assert main(["fit", *map(str, runs), "--base", wrong, "--out", str(out)]) == 0
    assert "train terms kept by cross-validation (leave-one-run-out, 3 folds): a+b" in capsys.readouterr().out
    assert main(["fit", *map(str, runs), "--base", wrong, "--term-selection", "extrapolate",
                 "--out", str(tmp_path / "extrapolate.json")]) == 0
    assert ("train terms kept by cross-validation (fitted on smaller steps, scored on larger ones, 1 folds): "
            "a+b") in capsys.readouterr().out


def test_extrapolating_term_selection_scores_each_size_from_the_smaller_steps():
    """The extrapolating folds fit every subset on the steps of fewer adapters than a size and score
    it on that size, on the same folds for every subset: only sizes whose smaller steps tell every
    term apart. Steps cost per token; their tokens grow with the adapters up to 2 and less past
    that, so a per-adapter term fits sizes 1-2 and misses size 4."""
    from calibration.fit_runs import _select_train_terms
    sizes = np.array([1, 1, 2, 2, 4, 4], dtype=float)
    tokens = np.array([1000, 1100, 2000, 2300, 3000, 3100], dtype=float)
    mb = np.ones(6)
    y = 4e-4 * tokens
    sharing = {"mps_alone": {"trainer": 1.0}, "mps_corun": {"trainer": 0.5}, "none_corun": {"trainer": 0.5}}
    feats = {"a": mb, "b": tokens, "c": sizes, "d": np.zeros(6)}
    run = np.array(["r1", "r1", "r2", "r2", "r4", "r4"])
    mode = np.array(["none"] * 6)
    zero = np.zeros(6)
    terms, sel = _select_train_terms(sharing, y, feats, ("a", "b", "c"), zero, mode, y, zero, run, "extrapolate")
    # Size 2 from size 1 alone is no fold (a and c are both 1 there): one fold, size 4 from sizes 1-2.
    assert sel["scheme"] == "extrapolate" and sel["folds"] == 1

    def by_hand(cols):
        X = np.stack(cols, 1)
        w = nonneg_rel_lstsq(X[sizes < 4], y[sizes < 4], scale=y[sizes < 4])
        return np.mean(np.abs(X[sizes == 4] @ w - y[sizes == 4]) / y[sizes == 4])
    assert sel["cv_mape"]["a"] == pytest.approx(by_hand([mb]), rel=1e-9)
    assert sel["cv_mape"]["a+c"] == pytest.approx(by_hand([mb, sizes]), rel=1e-9)
    assert terms == ("b",) and sel["cv_mape"]["b"] == pytest.approx(0, abs=1e-9)
    assert sel["cv_mape"]["a+c"] > 0.3  # ~0.43 s an adapter from sizes 1-2: ~1.7 s for size 4's ~1.22 s
    # A term that is 0 on the smallest steps (the masked layout's extra tokens of a 1-adapter step) is
    # scored on the same fold as the others, so a subset with it never wins on fewer folds.
    d = np.where(sizes > 1, tokens * (sizes - 1), 0.0)
    terms_d, sel_d = _select_train_terms(sharing, y, {**feats, "d": d}, ("a", "b", "d"), zero, mode, y, zero, run,
                                         "extrapolate")
    assert sel_d["folds"] == 1 and terms_d == ("b",)
    assert sel_d["cv_mape"]["b+d"] == pytest.approx(sel_d["cv_mape"]["b"], abs=1e-9)  # a tie: fewer terms win
    # Steps of one size, or smaller steps that never pin every term: the runs are left out instead.
    for c in (np.ones(6), np.array([1, 1, 1, 1, 4, 4], dtype=float)):
        _, fallback = _select_train_terms(sharing, y, {**feats, "c": c, "a": c}, ("a", "b", "c"), zero, mode, y,
                                          zero, run, "extrapolate")
        assert fallback["scheme"] == "runs" and fallback["folds"] == 3


def test_rank_scales_each_column_and_ignores_zero_ones():
    from calibration.fit_runs import _rank
    X = np.array([[1.0, 1e6, 0.0, -2.0], [2.0, 2.1e6, 0.0, -4.0], [3.0, 2.9e6, 0.0, -6.0]])
    assert _rank(X) == 2  # column 4 is -2x column 1; column 3 is zero; 1e6-scale column 2 still counts
    assert _rank(np.zeros((3, 2))) == 0


def test_fit_recovers_a_publishs_fixed_and_per_adapter_cost(tmp_path):
    """Publishes of 1 adapter (dedicated) and of 4 (shared-sync): the fixed part and the part per
    adapter are told apart, each run weighing the same; the simulator then charges a 16-adapter
    publish what the recording profile does, and a what-if scales both parts."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.01, save=0.02)
    prof = json.loads(open(truth).read())
    prof["publish"]["save_s_per_publish"] = 0.03
    open(truth, "w").write(json.dumps(prof))
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.05, save=0.2)
    runs = [tmp_path / "ded", tmp_path / "sync4"]
    simulate(config_from_args(jobs=2, steps=3, policy="dedicated", sharing="none", profile=truth, seed=2), runs[0])
    simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="none", profile=truth, seed=2), runs[1])
    _, publish = train_samples(runs[1])
    assert {p["adapters"] for p in publish} == {4} and publish[0]["s"] == pytest.approx(0.03 + 4 * 0.02, rel=1e-6)
    fitted = fit(runs, base=wrong)
    assert fitted["publish"]["save_s_per_publish"] == pytest.approx(0.03, rel=1e-6)
    assert fitted["publish"]["save_s_per_adapter"] == pytest.approx(0.02, rel=1e-6)
    f = fitted["measurements"]["fit_runs"]
    assert f["publish_s_per_publish"] == pytest.approx(0.03, rel=1e-6)
    from sim.profile import what_if

    assert what_if(fitted, {"publish": 2.0})["publish"]["save_s_per_publish"] == pytest.approx(0.06, rel=1e-6)
    # A profile from before the fixed part (no key) loads with none, and a what-if of it works.
    old = json.loads(open(wrong).read())
    old["publish"].pop("save_s_per_publish", None)
    from sim.profile import Profile

    assert Profile.model_validate(old).publish.save_s_per_publish == 0.0
    assert what_if(old, {"publish": 2.0})["publish"]["save_s_per_publish"] == 0.0


def _with_mps_settings(run, **settings):
    """Records MPS settings in a simulated run's diagnostics, as a real run records its own."""
    summary = json.loads((run / "summary.json").read_text())
    controls = {"engine_thread_pct": None, "trainer_thread_pct": None, "trainer_priority": "normal", **settings}
    summary["diagnostics"] = summary.get("diagnostics", []) + [{"sharing_controls": controls}]
    (run / "summary.json").write_text(json.dumps(summary))


def test_fit_records_the_mps_settings_of_its_rates_and_refuses_a_mix(tmp_path):
    """The trainer at below-normal MPS priority moves the co-run rates: the fitted profile says
    which settings its MPS rates are (sharing.controls); co-running runs of two settings are
    refused; a shared-sync run (nothing co-runs, so the priority decides nothing) joins either;
    validate flags an overlap run at another priority than the profile's, not a shared-sync one."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.01, save=0.04)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.05, save=0.2)
    runs = {}
    for name, policy, sharing in (("ded", "dedicated", "none"), ("sync", "shared-sync", "mps"),
                                  ("ovl", "overlap", "mps"), ("ovl-normal", "overlap", "mps")):
        runs[name] = tmp_path / name
        simulate(config_from_args(jobs=4, steps=3, policy=policy, groups=1 if policy != "overlap" else 2,
                                  sharing=sharing, profile=truth, seed=4), runs[name])
    _with_mps_settings(runs["sync"])
    _with_mps_settings(runs["ovl"], trainer_priority="below-normal")
    _with_mps_settings(runs["ovl-normal"])
    fitted = fit([runs["ded"], runs["sync"], runs["ovl"]], base=wrong)
    assert fitted["sharing"]["controls"] == {"trainer_priority": "below-normal"}
    with pytest.raises(ConfigError, match="different MPS settings.*trainer_priority=below-normal"):
        fit([runs["ded"], runs["ovl"], runs["ovl-normal"]], base=wrong)
    # The shipped profiles' rates are at the defaults.
    assert load_profile("h200-qwen3-0.6b").profile.sharing.controls == {}
    out = tmp_path / "fitted.json"
    out.write_text(json.dumps(fitted))
    rep = validate([runs["sync"], runs["ovl"], runs["ovl-normal"]], profile=str(out))
    flags = {r["run"].split("/")[-1]: r["outside_profile"] for r in rep["rows"]}
    assert flags["sync"] == [] and flags["ovl"] == []
    assert flags["ovl-normal"] == ["the run's MPS settings (the defaults) are not those the profile's MPS rates "
                                   "were fitted under (trainer_priority=below-normal, sharing.controls)"]
    # --scales-only keeps the base's rates: runs of other settings are refused.
    with pytest.raises(ConfigError, match="scales-only keeps the base's MPS rates"):
        fit([runs["ded"], runs["ovl"]], base=wrong, scales_only=True)


def test_publish_corun_factor_and_a_one_size_fit_keep_the_fixed_part(tmp_path):
    """Publishes of 0.03 s + 0.04 s per adapter, 5x slower beside a train step: the co-run factor
    is measured against the fitted cost of each publish's size (a per-adapter ratio would mix the
    sizes), and runs whose publishes are all of one size keep the base's split, scaled."""
    truth = _profile_with(tmp_path, "truth", a=0.12, b=2e-5, c=0.03, save=0.04, publish_factor=5.0)
    prof = json.loads(open(truth).read())
    prof["publish"]["save_s_per_publish"] = 0.03
    open(truth, "w").write(json.dumps(prof))
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.001, save=0.08, publish_factor=1.5)
    base = json.loads(open(wrong).read())
    base["publish"]["save_s_per_publish"] = 0.06  # the truth's split, twice the cost
    open(wrong, "w").write(json.dumps(base))
    runs = _ded_and_freed_runs(tmp_path, truth)
    ded = runs[0]
    fitted = fit(runs, base=wrong)
    assert fitted["publish"]["save_s_per_publish"] == pytest.approx(0.03, rel=1e-6)
    assert fitted["publish"]["save_s_per_adapter"] == pytest.approx(0.04, rel=1e-6)
    assert fitted["publish"]["corun_factor"] == pytest.approx(5.0, rel=1e-6)
    # The dedicated run alone: one adapter a publish, so the base's split (0.06 + 0.08 per adapter)
    # scaled to the measured 0.07 s: 0.03 + 0.04, not 0.07 per adapter.
    one = fit([ded], base=wrong)
    assert one["publish"]["save_s_per_publish"] == pytest.approx(0.03, rel=1e-6)
    assert one["publish"]["save_s_per_adapter"] == pytest.approx(0.04, rel=1e-6)


def test_runs_that_never_co_run_leave_the_bases_trainer_priority(tmp_path):
    """A base fitted with the trainer at below-normal priority, refitted on dedicated and
    shared-sync + MPS runs (nothing co-runs, so the priority decides nothing): --scales-only takes
    them, and a full fit keeps the base's priority in sharing.controls, since its co-run rates
    are still the base's. A thread limit the base did not have is a changed setting: the MPS
    rates kept from the base are then named in an assumption."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.01, save=0.04)
    wrong = _profile_with(tmp_path, "wrong", a=0.01, b=1e-6, c=0.05, save=0.2)
    base = json.loads(open(wrong).read())
    base["sharing"]["controls"] = {"trainer_priority": "below-normal"}
    open(wrong, "w").write(json.dumps(base))
    runs = [tmp_path / "ded", tmp_path / "sync", tmp_path / "sync-t50"]
    simulate(config_from_args(jobs=2, steps=3, policy="dedicated", sharing="none", profile=truth, seed=1), runs[0])
    for rd in runs[1:]:
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", profile=truth, seed=1), rd)
    _with_mps_settings(runs[1])
    _with_mps_settings(runs[2], trainer_thread_pct=50)
    fit(runs[:2], base=wrong, scales_only=True)  # accepted: no co-running run to disagree
    full = fit(runs[:2], base=wrong)
    assert "mps_alone.trainer" in full["measurements"]["fit_runs"]["sharing_fit"]
    assert full["sharing"]["controls"] == {"trainer_priority": "below-normal"}
    assert not any(a["id"] == "sharing-controls-mixed" for a in full["assumptions"])
    capped = fit([runs[0], runs[2]], base=wrong)
    assert capped["sharing"]["controls"] == {"trainer_priority": "below-normal", "trainer_thread_pct": 50}
    mixed = [a["what"] for a in capped["assumptions"] if a["id"] == "sharing-controls-mixed"]
    assert len(mixed) == 1 and "mps_corun.engine" in mixed[0] and "trainer_thread_pct=50" in mixed[0]


def test_calibrate_sharing_resets_the_profiles_mps_settings():
    """nodus calibrate-sharing measures at the default MPS settings: a profile whose rates were
    fitted under others gets sharing.controls {} once its MPS rates are measured, and an
    assumption when only some of them are."""
    from calibration.corun import apply_sharing

    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["sharing"]["controls"] = {"trainer_priority": "below-normal"}
    rates = {"engine": 0.8, "trainer": 0.6}
    both = apply_sharing(json.loads(json.dumps(prof)), {"rates": {"mps_alone": rates, "mps_corun": rates}})
    assert both["sharing"]["controls"] == {}
    assert not any(a["id"] == "sharing-controls-mixed" for a in both["assumptions"])
    part = apply_sharing(json.loads(json.dumps(prof)), {"rates": {"mps_corun": rates}})
    assert part["sharing"]["controls"] == {}
    assert any(a["id"] == "sharing-controls-mixed" for a in part["assumptions"])
    none_only = apply_sharing(json.loads(json.dumps(prof)), {"rates": {"none_corun": rates}})
    assert none_only["sharing"]["controls"] == {"trainer_priority": "below-normal"}


def _mark_slots(run_dir, slots):
    """A run as a real one that recorded its engine's adapter slots (engine_max_loras)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["diagnostics"] = [dict(d, engine_max_loras=slots) for d in summary.get("diagnostics") or [{}]]
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_fitted_decode_scale_records_the_runs_engine_slots(tmp_path):
    """The decode scale describes the fitted runs' engine: the profile records its adapter slots
    (environment.engine_max_loras, which nodus validate compares with each run's) when every run
    recorded the same; runs on other slots, or unrecorded, leave it unknown."""
    truth = _profile_with(tmp_path, "truth", a=0.15, b=2e-5, c=0.01, save=0.05, decode_scale=0.8)
    base = _profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.01, save=0.05)
    ded, shared = tmp_path / "ded", tmp_path / "shared"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=truth), ded)
    simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="none", profile=truth), shared)
    assert fit([ded, shared], base=base)["environment"]["engine_max_loras"] is None  # not recorded
    _mark_slots(ded, 8)
    _mark_slots(shared, 8)
    assert fit([ded, shared], base=base)["environment"]["engine_max_loras"] == 8
    _mark_slots(shared, 4)
    assert fit([ded, shared], base=base)["environment"]["engine_max_loras"] is None


def test_decode_scale_only_refits_the_engine_scale_and_keeps_every_other_term(tmp_path, capsys):
    """Dedicated runs recorded at decode.scale 0.85 against a base at 1.25 (the stacks profiles'
    case: an engine scale from runs of other settings): --decode-scale-only gives 0.85 back, keeps
    the train terms, publish cost and sharing rates as they were, and the dedicated runs are then
    predicted exactly; a run that is not dedicated without MPS is refused by name, and the CLI says
    the old and new scale."""
    base = _profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=1.25)
    day = _profile_with(tmp_path, "day", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=0.85)
    ded, shared = tmp_path / "ded", tmp_path / "shared"
    simulate(config_from_args(jobs=4, steps=3, policy="dedicated", sharing="none", profile=day), ded)
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", profile=day), shared)
    from calibration.fit_runs import fit_decode_scale

    prof = fit_decode_scale([ded], base)
    was = json.loads(open(base).read())
    assert prof["decode"]["scale"] == pytest.approx(0.85, rel=1e-6)
    assert {k: prof[k] for k in ("train", "publish", "sharing", "prefill")} == \
        {k: was[k] for k in ("train", "publish", "sharing", "prefill")}
    d = prof["measurements"]["decode_scale_fit"]
    assert d["base_scale"] == 1.25 and d["bias_base"] > 0.1 and abs(d["bias_after"]) < 1e-6
    assert prof["environment"]["sources"][-1].endswith("decode.scale 1.250 -> 0.850")
    # A base fitted on another day says so; the refit adds the day of the engine's new scale, once.
    assert not [a for a in prof["assumptions"] if a["id"] == "host-day"]
    dated = json.loads(open(base).read())
    dated["assumptions"].append({"id": "host-day", "value": None, "what": "fitted on 2 run(s) of one host on one day"})
    (tmp_path / "dated.json").write_text(json.dumps(dated))
    again = fit_decode_scale([ded], str(tmp_path / "dated.json"))
    (tmp_path / "again.json").write_text(json.dumps(again))
    twice = fit_decode_scale([ded], str(tmp_path / "again.json"))
    day = [a["what"] for a in twice["assumptions"] if a["id"] == "host-day"]
    assert len(day) == 1 and day[0].startswith("fitted on 2 run(s) of one host on one day; the engine's scale")
    assert day[0].count("refitted since on 1 dedicated run(s) of ") == 1 and "--decode-scale-only" in day[0]
    out = tmp_path / "fitted.json"
    assert main(["fit", "--decode-scale-only", str(ded), "--base", base, "--out", str(out)]) == 0
    assert "decode steps x 0.850 (was 1.250" in capsys.readouterr().out
    assert validate([ded], profile=str(out))["all_replay"]["mape"] == pytest.approx(0, abs=1e-6)
    assert validate([ded], profile=base)["all_replay"]["mape"] > 0.05
    with pytest.raises(ConfigError, match=f"{shared.name} is a shared-sync run under mps sharing"):
        fit_decode_scale([ded, shared], base)
    assert main(["fit", "--decode-scale-only", str(ded), "--base", base, "--scales-only",
                 "--out", str(tmp_path / "x.json")]) != 0
    assert "drop --scales-only" in capsys.readouterr().err


def test_decode_scale_only_fits_runs_of_a_lighter_audit_on_a_base_that_prices_it(tmp_path):
    """Dedicated runs auditing one response a prompt (the reference protocol's audit) fit the engine
    scale on a base that prices the audit (decode.logprob_s_per_seq, nodus fit-audit): their
    generations are replayed with their own audit, so the scale they were recorded at comes back
    exactly (replayed as the full audit it would come back low). A base without the term refuses
    them by name."""
    def with_logprob(path, per_seq):
        prof = json.loads(open(path).read())
        prof["decode"]["logprob_s_per_seq"] = per_seq
        open(path, "w").write(json.dumps(prof))
        return path

    base = with_logprob(_profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=1.25), 4e-5)
    day = with_logprob(_profile_with(tmp_path, "day", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=0.85), 4e-5)
    unpriced = _profile_with(tmp_path, "unpriced", a=0.15, b=2e-5, c=0.04, save=0.05, decode_scale=1.25)
    ded = tmp_path / "ded"
    simulate(config_from_args({"audit": {"responses": 1}}, jobs=4, steps=3, policy="dedicated", sharing="none",
                              profile=day), ded)
    summary = json.loads((ded / "summary.json").read_text())
    summary["diagnostics"] = [{"audit": {"logprobs": True, "every": 1, "responses": 1}}]
    (ded / "summary.json").write_text(json.dumps(summary))
    from calibration.fit_runs import fit_decode_scale

    prof = fit_decode_scale([ded], base)
    assert prof["decode"]["scale"] == pytest.approx(0.85, rel=1e-6)
    # The same generations priced as the full audit need a smaller scale: the audit was priced.
    full = json.loads((ded / "config.json").read_text())
    full["audit"] = None
    (tmp_path / "full").mkdir()
    for f in ("summary.json", "spans.jsonl"):
        (tmp_path / "full" / f).write_text((ded / f).read_text())
    (tmp_path / "full" / "config.json").write_text(json.dumps(full))
    assert fit_decode_scale([tmp_path / "full"], base)["decode"]["scale"] < 0.84
    with pytest.raises(ConfigError, match="fewer steps or responses .audit 1 response a prompt.*does not price"):
        fit_decode_scale([ded], unpriced)


def _mark_handoff(run_dir, fmt):
    s = json.loads((run_dir / "summary.json").read_text())
    s["diagnostics"] = [dict((s.get("diagnostics") or [{}])[0], adapter_format=fmt)]
    (run_dir / "summary.json").write_text(json.dumps(s))


def test_runs_of_the_flat_handoff_fit_a_profile_of_that_handoff(tmp_path):
    """Runs whose trainers handed adapters over as flat files (:flat) fit a profile that says so
    (environment.adapter_format): its publish cost is theirs, validate stops naming the handoff on
    such runs and names it on PEFT-folder runs instead; one fit takes one handoff; scales alone
    onto a base of the other handoff say that they carried its train shape."""
    from real.flat_adapter import ADAPTER_FORMATS as RUN_FORMATS
    from sim.profile import ADAPTER_FORMATS

    assert ADAPTER_FORMATS == RUN_FORMATS  # a profile can describe every handoff a run can make
    base = _profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.04, save=0.05)
    day = _profile_with(tmp_path, "day", a=0.12, b=1.6e-5, c=0.032, save=0.02)
    ded, shared = tmp_path / "ded", tmp_path / "shared"
    simulate(config_from_args(jobs=4, steps=4, policy="dedicated", sharing="none", profile=day), ded)
    simulate(config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="mps", profile=day), shared)
    for r in (ded, shared):
        _mark_handoff(r, "flat")
    for scales_only in (False, True):
        prof = fit([ded, shared], base=base, scales_only=scales_only)
        assert prof["environment"]["adapter_format"] == "flat"
        assert prof["publish"]["save_s_per_adapter"] == pytest.approx(0.02, rel=1e-6)
        (carried,) = [x for x in prof["assumptions"] if x["id"] == "handoff-from-base"]
        assert carried["value"] == "safetensors" and "as flat files" in carried["what"]
    out = tmp_path / "flat.json"
    out.write_text(json.dumps(prof))
    # Refitted on flat runs, the profile still carries the base's train shape: the note stays.
    again = fit([ded], base=str(out), scales_only=True)
    assert [x["value"] for x in again["assumptions"] if x["id"] == "handoff-from-base"] == ["safetensors"]
    named = "handed adapters to the engine as flat files"
    on_base = validate([ded, shared], profile=base)["rows"]
    assert all(any(named in o for o in r["outside_profile"]) for r in on_base)
    on_flat = validate([ded, shared], profile=str(out))["rows"]
    assert not any("handed adapters" in o for r in on_flat for o in r["outside_profile"])
    _mark_handoff(shared, "safetensors")  # a PEFT-folder run against the flat profile: named
    (row,) = [r for r in validate([shared], profile=str(out))["rows"]]
    assert any("as safetensors files; the profile's train and publish terms include the flat handoff" in o
               for o in row["outside_profile"])
    with pytest.raises(ConfigError, match=r"different formats \(flat: .*ded; safetensors: .*shared\)"):
        fit([ded, shared], base=base, fit_max_jobs=8)


def test_a_fit_names_the_gpu_its_runs_ran_on(tmp_path, monkeypatch):
    """Runs record their GPU (diagnostics' gpu, from nvidia-smi); a fit on runs of another GPU than
    its base's names theirs in the profile, so the simulator fits micro-batches to that card's
    memory, and says what stayed the base GPU's; runs of two GPUs are refused."""
    import subprocess
    from types import SimpleNamespace

    from nodus import outdir
    from nodus.gpumemory import fitted_microbatch, profile_gpu_memory
    from sim.profile import Profile

    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=0, stdout="NVIDIA H100 80GB HBM3, 81559\n"))
    card = outdir.gpu()
    assert card == {"name": "NVIDIA H100 80GB HBM3", "total_gib": 79.65}
    monkeypatch.undo()
    base = _profile_with(tmp_path, "base", a=0.15, b=2e-5, c=0.04, save=0.05)
    runs = []
    for jobs in (2, 3):
        out = tmp_path / f"r{jobs}"
        simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="none", profile=base,
                                  seed=jobs), out)
        s = json.loads((out / "summary.json").read_text())
        s["diagnostics"] = [dict((s.get("diagnostics") or [{}])[0], gpu=card)]
        (out / "summary.json").write_text(json.dumps(s))
        runs.append(out)
    prof = fit(runs, base=base)
    env = Profile.model_validate(prof).environment
    assert env.gpu == "NVIDIA H100 80GB HBM3" and env.gpu_memory_gib is None
    (note,) = [x for x in prof["assumptions"] if x["id"] == "gpu-from-base"]
    assert note["value"] == json.loads(open(base).read())["environment"]["gpu"] and "H100" in note["what"]
    # Two graphed stacks at 0.35 of the GPU for engines: 8k-token micro-batches fit an H200, 4k an H100.
    assert fitted_microbatch(16384, 2, profile_gpu_memory(env), engine_memory=0.35) == 4096
    assert fitted_microbatch(16384, 2, profile_gpu_memory(Profile.model_validate(json.loads(open(base).read()))
                                                          .environment), engine_memory=0.35) == 8192
    # A refit of that profile on H100 runs keeps the note of the H200's terms; one on H200 runs drops it.
    h100 = tmp_path / "h100.json"
    h100.write_text(json.dumps(prof))
    assert [x["value"] for x in fit(runs, base=str(h100))["assumptions"] if x["id"] == "gpu-from-base"] == [
        note["value"]]
    s = json.loads((runs[0] / "summary.json").read_text())
    s["diagnostics"][0]["gpu"] = {"name": "NVIDIA H200", "total_gib": 140.4}
    (runs[0] / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ConfigError, match=r"ran on different GPUs \(NVIDIA H100 80GB HBM3: .*r3; NVIDIA H200: .*r2\)"):
        fit(runs, base=base)
    s = json.loads((runs[1] / "summary.json").read_text())
    s["diagnostics"][0]["gpu"] = {"name": "NVIDIA H200", "total_gib": 140.4}
    (runs[1] / "summary.json").write_text(json.dumps(s))
    back = fit(runs, base=str(h100))
    assert back["environment"]["gpu"] == "NVIDIA H200" and not [x for x in back["assumptions"]
                                                               if x["id"] == "gpu-from-base"]


def _stretch(run_dir, factor_of):
    """Lengthens each span of a recorded run by ``factor_of(span, i)`` (its i-th of its phase on
    its GPU), moving every later span of that GPU on by what was added, as a slower phase would."""
    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    shift, seen = {}, {}
    for s in sorted(spans, key=lambda s: (s["gpu"], s["start_s"])):
        g = s["gpu"]
        i = seen[(g, s["phase"])] = seen.get((g, s["phase"]), -1) + 1
        extra = (s["end_s"] - s["start_s"]) * (factor_of(s, i) - 1)
        s["start_s"] += shift.get(g, 0.0)
        s["end_s"] += shift.get(g, 0.0) + extra
        shift[g] = shift.get(g, 0.0) + extra
    (run_dir / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))


def test_fitted_scales_give_the_runs_total_seconds_not_a_typical_action(tmp_path):
    """Steps per GPU-hour sees each phase's total seconds. Session 52's H100 dedicated run had
    publishes of two kinds (half near 0.03 s, half near 0.09 s) and generations slower per step the
    longer they ran: the median publish and a relative-error decode scale priced its own run 6.7%
    fast. A run so stretched (every third publish 4x; each generation by 1 + its responses' tokens
    over the run's most) is fitted to the mean publish and to the generations' total seconds."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.01, save=0.02)
    ded = tmp_path / "ded"
    simulate(config_from_args(jobs=2, steps=6, policy="dedicated", sharing="none", profile=truth, seed=3), ded)
    spans = [json.loads(line) for line in (ded / "spans.jsonl").read_text().splitlines()]
    most = max(sum(s["attrs"]["response_tokens"]) for s in spans if s["phase"] == "generate")

    def factor(s, i):
        if s["phase"] == "publish":
            return 4.0 if i % 3 == 2 else 1.0
        if s["phase"] == "generate":
            return 1.0 + sum(s["attrs"]["response_tokens"]) / most
        return 1.0

    _stretch(ded, factor)
    spans = [json.loads(line) for line in (ded / "spans.jsonl").read_text().splitlines()]
    pubs = [s["end_s"] - s["start_s"] for s in spans if s["phase"] == "publish"]
    assert np.median(pubs) < 0.8 * np.mean(pubs)  # the median is not the mean here
    fitted = fit([ded], base=truth)
    pub = fitted["publish"]
    assert pub["save_s_per_publish"] + pub["save_s_per_adapter"] == pytest.approx(np.mean(pubs), rel=1e-6)
    d = fitted["measurements"]["fit_runs"]["decode_fit"]
    assert d["total_after"] == pytest.approx(0, abs=1e-9) and d["total_before"] < -0.2
    out = tmp_path / "fitted.json"
    out.write_text(json.dumps(fitted))
    rep = validate([ded], profile=str(out))["rows"][0]
    measured, replay = rep["measured"]["phase_s"], rep["replay"]["phase_s"]
    assert replay["publish"] == pytest.approx(measured["publish"], rel=0.01)
    assert replay["generate"] == pytest.approx(measured["generate"], rel=0.02)


def test_step_floor_prices_small_batches_at_the_hosts_floor_and_large_ones_by_the_curves(tmp_path):
    """decode.step_floor_s: a step costs max(curves x scale, floor), so the floor moves a small
    batch's step and leaves a large one's; a what-if on decode moves both."""
    from sim.profile import CostModel, Profile, what_if

    prof = json.loads(open(_profile_with(tmp_path, "p", a=0.1, b=0.0, c=0.0, save=0.01, decode_scale=0.9)).read())
    plain = CostModel(Profile.model_validate(prof), "t")
    floored = CostModel(Profile.model_validate(dict(prof, decode=dict(prof["decode"], step_floor_s=0.006))), "t")
    assert plain.decode_step_s(64, 0.0, 1) < 0.006
    assert floored.decode_step_s(64, 0.0, 1) == pytest.approx(0.006)
    assert floored.decode_step_s(256, 0.0, 4) == plain.decode_step_s(256, 0.0, 4) > 0.006
    half = what_if(dict(prof, decode=dict(prof["decode"], step_floor_s=0.006)), {"decode": 0.5})
    assert half["decode"]["step_floor_s"] == pytest.approx(0.003)


def test_step_floor_fit_recovers_the_floor_and_scale_a_single_scale_cannot(tmp_path, capsys):
    """Runs recorded on a profile whose small batches sit on a host floor (6 ms, curves x 0.9): a
    dedicated run's 64-sequence generations pay the floor, a shared-sync run's 256-sequence ones the
    curves. The scale alone, fitted on the dedicated generations, prices the large ones long; `nodus
    fit --step-floor` gives both numbers back from the lone generations of the two sizes, and
    refuses runs of one size."""
    truth = _profile_with(tmp_path, "truth", a=0.1, b=1.5e-5, c=0.01, save=0.02, decode_scale=0.9)
    t = json.loads(open(truth).read())
    t["decode"]["step_floor_s"] = 0.006
    open(truth, "w").write(json.dumps(t))
    base = _profile_with(tmp_path, "base", a=0.1, b=1.5e-5, c=0.01, save=0.02)
    ded, sync = tmp_path / "ded", tmp_path / "sync"
    simulate(config_from_args(jobs=2, steps=4, policy="dedicated", sharing="none", profile=truth), ded)
    simulate(config_from_args(jobs=4, steps=4, policy="shared-sync", sharing="none", profile=truth), sync)
    scale_only = fit([ded, sync], base=base)
    assert scale_only["decode"]["scale"] > 1.0 and scale_only["decode"].get("step_floor_s", 0.0) == 0.0
    fitted = fit([ded, sync], base=base, step_floor=True)
    assert fitted["decode"]["step_floor_s"] == pytest.approx(0.006, rel=0.02)
    assert fitted["decode"]["scale"] == pytest.approx(0.9, rel=0.02)
    d = fitted["measurements"]["fit_runs"]["decode_fit"]
    assert [z["sequences"] for z in d["sizes"]] == [64, 256]
    assert abs(d["sizes"][1]["base"]["bias"]) > 0.03 and all(abs(z["fitted"]["bias"]) < 0.01 for z in d["sizes"])
    # The generations replay within a percent at the fitted floor, where the scale alone did not.
    for prof, worst in ((scale_only, 0.05), (fitted, 0.01)):
        out = tmp_path / f"p{worst}.json"
        out.write_text(json.dumps(prof))
        rep = validate([sync], profile=str(out))["rows"][0]
        err = rep["replay"]["phase_s"]["generate"] / rep["measured"]["phase_s"]["generate"] - 1
        assert (abs(err) < worst) == (prof is fitted)
    assert main(["fit", str(ded), str(sync), "--base", base, "--out", str(tmp_path / "cli.json"), "--step-floor"]) == 0
    assert "6.00 ms" in capsys.readouterr().out
    assert "--step-floor: each decode step max(curves x 0.900, 6.00 ms)" in fitted["environment"]["sources"][-1]
    (floor_note,) = [x for x in fitted["assumptions"] if x["id"] == "decode-step-floor"]
    assert "6.00 ms" in floor_note["what"] and "64, 256 sequences" in floor_note["what"]
    assert not any(x["id"] == "decode-step-floor" for x in scale_only["assumptions"])
    with pytest.raises(ConfigError, match="batch sizes at least 2x apart"):
        fit([ded], base=base, step_floor=True)
    # A plain fit keeps a base's floor and solves the scale with it in place; a floor the runs'
    # generations are faster than at any scale is refused, naming the fit that sets one.
    kept = fit([ded, sync], base=truth)
    assert kept["decode"]["step_floor_s"] == 0.006 and kept["decode"]["scale"] == pytest.approx(0.9, rel=0.02)
    t["decode"]["step_floor_s"] = 0.05
    high = tmp_path / "high.json"
    high.write_text(json.dumps(t))
    with pytest.raises(ConfigError, match="step floor .* --step-floor"):
        fit([ded], base=str(high))
    assert main(["fit", str(ded), "--base", base, "--out", str(tmp_path / "x.json"), "--decode-scale-only",
                 "--step-floor"]) != 0
    assert "drop --step-floor" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
