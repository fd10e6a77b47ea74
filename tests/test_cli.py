"""The CLI end to end, as a user types it, and the import boundary of the core."""

import json
import subprocess
import sys

import pytest

from nodus.cli import main


def test_import_nodus_pulls_in_neither_simpy_nor_torch():
    code = ("import sys, nodus, nodus.config, nodus.scheduler, nodus.runner, nodus.accounting, "
            "nodus.timeline, nodus.simulate, nodus.cli, nodus.grouping, nodus.lengths; "
            "bad = [m for m in ('simpy', 'torch', 'vllm') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sim_json(capsys):
    assert main(["sim", "--jobs", "4", "--steps", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("steps_per_gpu_hour", "ratio_vs_dedicated", "stale_rollouts", "busy", "per_job", "assumptions"):
        assert k in d
    assert d["stale_rollouts"] == 0 and len(d["per_job"]) == 4


def test_sim_out_folder_refuses_overwrite_and_report_rerenders(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["sim", "--jobs", "2", "--steps", "2", "--out", str(out)]) == 0
    for f in ("config.json", "summary.json", "spans.jsonl", "trace.json", "gantt.png", "table.md"):
        assert (out / f).is_file(), f
    trace = json.loads((out / "trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert main(["sim", "--jobs", "2", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    (out / "gantt.png").unlink()
    (out / "trace.json").unlink()  # recorded runs under experiments/results keep only spans.jsonl
    assert main(["report", str(out)]) == 0
    assert (out / "gantt.png").is_file()
    assert json.loads((out / "trace.json").read_text()) == trace


def test_bad_input_exits_2_with_named_field(capsys):
    assert main(["sim", "--jobs", "2", "--groups", "3"]) == 2
    assert "arm.groups=3" in capsys.readouterr().err
    assert main(["sim", "--profile", "nope"]) == 2
    assert "profile='nope'" in capsys.readouterr().err
    assert main(["report", "/nonexistent"]) == 2
    assert main(["run", "--backend", "real", "--jobs", "1", "--engine-env", "NO_VALUE"]) == 2
    assert "--engine-env 'NO_VALUE': expected NAME=VALUE" in capsys.readouterr().err
    assert main(["run", "--backend", "real", "--jobs", "1", "--adapter-format", "flat", "--engine-core-process"]) == 2
    assert "adapter_format='flat' needs the engine core in the engine worker's process" in capsys.readouterr().err


def test_sim_share_prompts_on_a_graphed_profile_and_its_errors(capsys):
    from nodus.config import DEFAULT_PROFILES

    graphed = ["--jobs", "4", "--steps", "2", "--json", "--profile", DEFAULT_PROFILES["graphed"]]
    assert main(["sim", *graphed, "--share-prompts", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["sim", *graphed, "--share-prompts", "4"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert packed["steps_per_gpu_hour"] > plain["steps_per_gpu_hour"]
    assert any("trainer.share_prompts=4" in f for f in packed["outside_profile"])
    # Unset, a graphed profile packs 4 to a row (the graphed trainer's default) and says so.
    assert main(["sim", *graphed]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["steps_per_gpu_hour"] == packed["steps_per_gpu_hour"]
    assert "trainer.share_prompts=4, the graphed trainer's default" in out.err
    assert main(["sim", "--jobs", "2", "--share-prompts", "4"]) == 2  # the default profile: the eager trainer's
    assert "runs on the graphed trainer only" in capsys.readouterr().err
    assert main(["sim", "--jobs", "2", "--share-prompts", "-1"]) == 2
    assert "--share-prompts -1" in capsys.readouterr().err


def test_sweep_writes_csv_json_plot(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", "--jobs", "2,4", "--groups", "1,2", "--seeds", "1", "--steps", "2",
                 "--workers", "2", "--out", str(out)]) == 0
    d = json.loads((out / "sweep.json").read_text())
    assert {r["jobs"] for r in d["rows"]} == {2, 4}
    assert all(r["stale_rollouts"] == 0 for r in d["rows"])
    assert all(r["ratio_vs_dedicated"] == 1.0 for r in d["rows"] if r["policy"] == "dedicated")
    # Each row's steady pace beside its window (2 steps a job: one interval between generations).
    assert all(r["pace_steps_per_gpu_hour"] > 0 and r["ramp_gpu_s"] is not None for r in d["rows"])
    assert (out / "sweep.png").stat().st_size > 1000 and (out / "sweep.csv").is_file()
    # A planner reads the prediction with the profile's error bar beside it.
    assert d["profile_validation"]["heldout_mape"] > 0
    assert "held-out real runs: steps per GPU-hour MAPE" in (out / "table.md").read_text()
    assert "held-out real runs" in capsys.readouterr().out
    assert main(["sweep", "--policies", "bogus"]) == 2


def test_sweep_over_share_prompts_divides_each_setting_by_its_own_dedicated_arm(capsys):
    from nodus.config import DEFAULT_PROFILES

    args = ["sweep", "--jobs", "4", "--groups", "2", "--policies", "overlap", "--sharing", "mps", "--seeds", "1",
            "--steps", "2", "--workers", "1", "--json", "--profile", DEFAULT_PROFILES["graphed"]]
    assert main([*args, "--share-prompts", "0,4"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["share_prompts"] == [0, 4]
    by = {(r["policy"], r["share_prompts"]): r for r in d["rows"]}
    assert set(by) == {("dedicated", 0), ("dedicated", 4), ("overlap", 0), ("overlap", 4)}
    for sp in (0, 4):
        assert by[("dedicated", sp)]["ratio_vs_dedicated"] == 1.0
        assert by[("overlap", sp)]["ratio_vs_dedicated"] == pytest.approx(
            by[("overlap", sp)]["steps_per_gpu_hour"] / by[("dedicated", sp)]["steps_per_gpu_hour"])
    assert by[("dedicated", 4)]["steps_per_gpu_hour"] > by[("dedicated", 0)]["steps_per_gpu_hour"]
    assert [(b["share_prompts"], b["arm"]) for b in d["best"]] == [(0, "overlap g=2 mps"), (4, "overlap g=2 mps +sp4")]
    assert main([a for a in args if a != "--json"] + ["--share-prompts", "0,4"]) == 0
    table = capsys.readouterr().out
    assert "| overlap g=2 mps +sp4 |" in table and "Steps per GPU-hour (each trainer setting's ratios" in table
    # the simulator's caveats reach the sweep: the packed term is unvalidated, the error bar is plain rows'
    assert "Outside the profiled region: " in table and "trainer.share_prompts=4: packed rows" in table
    assert "That error is of runs with plain rows" in table
    assert any("share_prompts=4" in f for f in d["outside_profile"])
    assert main([*args, "--share-prompts", "0,1"]) == 0  # both train plain rows: one setting
    d = json.loads(capsys.readouterr().out)
    assert d["share_prompts"] == [0] and len(d["rows"]) == 2 and not d["outside_profile"]
    assert main([*args[:-2], "--share-prompts", "0,4"]) == 2  # the default (eager) profile
    assert "packed rows run on the graphed trainer only" in capsys.readouterr().err
    assert main([*args, "--share-prompts", "0,-1"]) == 2
    assert "--share-prompts 0,-1" in capsys.readouterr().err


def test_profiles_lists_each_shipped_profile_with_its_error_bar(capsys):
    import json as _json

    from sim.profile import shipped_profiles

    assert main(["profiles", "--json"]) == 0
    rows = {r["name"]: r for r in _json.loads(capsys.readouterr().out)}
    assert set(rows) == set(shipped_profiles())
    shipped = rows["h200-qwen3-0.6b"]
    assert shipped["gpu"] == "NVIDIA H200" and shipped["heldout_runs"] >= 1
    assert 0 < shipped["heldout_mape"] < 1 and shipped["report"].endswith(".md")
    # The shipped stacks profile carries its ratio over dedicated on held-out same-machine pairs.
    from nodus.config import STACKS_PROFILE

    stacks = rows[STACKS_PROFILE]
    assert stacks["ratio_pairs"] >= 10 and 0 < stacks["ratio_mape"] < 1
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "| h200-qwen3-0.6b |" in out and f"{stacks['ratio_mape']:.1%}, {stacks['ratio_bias']:+.1%} (" in out
    # Each shipped profile a planner picks by the question is marked with it.
    from nodus.config import DEFAULT_PROFILE, H100_STACKS_PROFILE

    assert f"| {DEFAULT_PROFILE} (default) |" in out and f"| {STACKS_PROFILE} (stacks or graphed dedicated on an H200) |" in out
    assert f"| {H100_STACKS_PROFILE} (stacks or graphed dedicated on an H100 80GB) |" in out
    # The arms behind each error bar: counted where the annotation has them, named from its
    # configurations where it predates that.
    # (Sessions 51-73: sessions 69 and 72 ran overlap + MPS on one stack, 2 runs and 1.)
    assert rows[H100_STACKS_PROFILE]["heldout_arms"]["overlap g=2 mps"] == 3
    assert rows[H100_STACKS_PROFILE]["heldout_arms"]["shared-sync g=1 mps stacks=2"] >= 30
    assert rows[H100_STACKS_PROFILE]["heldout_arms"]["continuous g=1 mps stacks=2"] == 4
    assert rows["h200-qwen3-0.6b"]["heldout_arms"]["timeslice g=2 none"] is None
    assert "overlap g=2 mps (3), overlap g=2 none (2)," in out


def test_sim_what_if_reports_the_hypothesis_and_bad_factors_are_clear_errors(capsys):
    from nodus.cli import main

    assert main(["sim", "--steps", "2", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(["sim", "--steps", "2", "--json", "--what-if", "train=0.5"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["steps_per_gpu_hour"] > base["steps_per_gpu_hour"]
    assert any("train x0.5" in a["what"] for a in fast["assumptions"])
    for bad in ("train", "train=-1", "train=x"):
        assert main(["sim", "--what-if", bad]) == 2
        assert "PHASE=FACTOR" in capsys.readouterr().err


def test_calibrate_sharing_from_a_log_without_model_or_gpu_and_its_errors(tmp_path, capsys):
    from calibration.corun import bucket_line

    def row(b, t, k=1.0):
        return {"batch": b, "tokens": t, "engine_alone_s": 1.0, "engine_corun_s": 2.0 * k,
                "trainer_alone_s": 1.0, "trainer_corun_s": 4.0}

    log = tmp_path / "sharing.log"
    log.write_text("INFO starting\n" + "\n".join([bucket_line("none", row(b, t, b / 64)) for b in (64, 256)
                                                  for t in (16384, 49152)] + [bucket_line("mps", row(64, 16384))]))
    out = tmp_path / "p.json"
    grid = ["--batches", "64,256", "--train-tokens", "16384,49152"]
    assert main(["calibrate-sharing", "--from-raw", str(log), "--out", str(out)] + grid) == 0
    said = capsys.readouterr().out
    assert "incomplete: 3 bucket(s) not measured: mps 64/49152, mps 256/16384, mps 256/49152" in said
    prof = json.loads(out.read_text())
    assert prof["measurements"]["sharing"]["from_raw"] == {"file": str(log), "format": "log"}
    assert [e["batch"] for e in prof["sharing"]["corun_by_engine_batch"]] == [64, 256]
    assert prof["sharing"]["corun_by_engine_batch"][1]["none_corun"]["engine"] == 0.125
    assert not (tmp_path / "p.raw.json").exists()  # nothing measured, no raw file
    # Errors: no model and no file; a file with nothing to read; a log off the flags' grid.
    assert main(["calibrate-sharing", "--out", str(tmp_path / "q.json")]) == 2
    assert "--model is required to measure (or --from-raw FILE" in capsys.readouterr().err
    (tmp_path / "empty.log").write_text("INFO nothing measured\n")
    q = ["--out", str(tmp_path / "q.json")]
    assert main(["calibrate-sharing", "--from-raw", str(tmp_path / "empty.log")] + q) == 2
    assert f"--from-raw '{tmp_path / 'empty.log'}': no bucket lines" in capsys.readouterr().err
    assert main(["calibrate-sharing", "--from-raw", str(log), "--batches", "64"] + q) == 2
    assert "none batch 256 / 16384 tokens is outside --modes none,mps --batches 64 --train-tokens 16384,49152: " \
           "give the measuring run's flags" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["calibrate-sharing", "--from-raw", str(tmp_path / "bad.json")] + q) == 2
    assert "bad.json': not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "q.json").exists()


def test_packing_default_follows_the_trainer_and_yields_to_the_config(tmp_path, capsys, monkeypatch):
    """Unset trainer.share_prompts: 4 with the graphed trainer (a graphed profile in the sim,
    --trainer-graphs on the real backend), 0 without; a config's or --share-prompts' value, 0
    included, is kept."""
    import nodus.realrun
    from nodus.config import AUTO_SHARE_PROMPTS, DEFAULT_PROFILES

    seen = []
    monkeypatch.setattr(nodus.realrun, "run", lambda cfg, **kw: seen.append(cfg) or {})
    cfg0 = tmp_path / "plain.yaml"
    cfg0.write_text("trainer:\n  share_prompts: 0\n")
    base = ["run", "--backend", "real", "--jobs", "2", "--json"]
    for argv, want, defaulted in ((base, 0, False), ([*base, "--trainer-graphs"], AUTO_SHARE_PROMPTS, True),
                                  ([*base, "--trainer-graphs", "--share-prompts", "0"], 0, False),
                                  (["run", str(cfg0), "--backend", "real", "--trainer-graphs", "--json"], 0, False),
                                  ([*base, "--trainer-graphs", "--share-prompts", "2"], 2, False)):
        assert main(argv) == 0, argv
        assert seen[-1].trainer.share_prompts == want, argv
        assert ("the graphed trainer's default" in capsys.readouterr().err) == defaulted, argv
    # Capped at the responses a job samples per prompt: none with one (plain rows), 2 with two.
    for r, want in ((1, 0), (2, 2)):
        one = tmp_path / f"r{r}.yaml"
        one.write_text(f"jobs:\n  - task: gsm8k\n    responses_per_prompt: {r}\n")
        assert main(["run", str(one), "--backend", "real", "--trainer-graphs", "--json"]) == 0
        assert seen[-1].trainer.share_prompts == want
        assert ("share_prompts=2, the graphed trainer's default" in capsys.readouterr().err) == (want == 2)
    # The sim backend of `nodus run` follows its profile (the eager default here: plain rows).
    assert main(["run", "--backend", "sim", "--jobs", "2", "--steps", "1", "--json"]) == 0
    assert seen[-1].trainer.share_prompts == 0
    capsys.readouterr()
    # The sim's eager default profile keeps plain rows; a graphed one packs, written to the run's config.
    assert main(["sim", "--jobs", "2", "--steps", "1", "--json", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["trainer"]["share_prompts"] == 0
    assert main(["sim", "--jobs", "2", "--steps", "1", "--json", "--profile", DEFAULT_PROFILES["graphed"],
                 "--out", str(tmp_path / "g")]) == 0
    assert json.loads((tmp_path / "g" / "config.json").read_text())["trainer"]["share_prompts"] == AUTO_SHARE_PROMPTS
    capsys.readouterr()
    # The sweep likewise: 4 on a graphed profile, 0 on an eager one, unless told.
    sw = ["sweep", "--jobs", "2", "--groups", "2", "--policies", "overlap", "--sharing", "mps", "--seeds", "1",
          "--steps", "1", "--workers", "1", "--json"]
    assert main([*sw, "--profile", DEFAULT_PROFILES["graphed"]]) == 0
    assert json.loads(capsys.readouterr().out)["share_prompts"] == [AUTO_SHARE_PROMPTS]
    assert main(sw) == 0
    assert json.loads(capsys.readouterr().out)["share_prompts"] == [0]


def test_a_sweep_over_stacks_under_mps_takes_the_shipped_stacks_profile_as_sim_and_plan_do(capsys):
    """`nodus sweep --stacks 1,2` with no profile chosen prices every run on STACKS_PROFILE (the one
    with the stacks' rates; the default profile has none and would flag every two-stack run) and
    says so; one stack, no MPS or --profile keep the default or the profile chosen."""
    import json

    from nodus.cli import main
    from nodus.config import DEFAULT_PROFILE, STACKS_PROFILE

    def sweep(*extra):
        assert main(["sweep", "--jobs", "4", "--groups", "1", "--policies", "shared-sync", "--seeds", "1",
                     "--steps", "1", "--workers", "1", "--json", *extra]) == 0
        out = capsys.readouterr()
        res = json.loads(out.out)
        flags = " ".join(res.get("outside_profile") or [])
        return res["profile"], out.err, flags

    profile, err, flags = sweep("--sharing", "mps", "--stacks", "1,2")
    assert profile == STACKS_PROFILE and f"profile {STACKS_PROFILE}" in err and "no two-engine rate" not in flags
    profile, err, flags = sweep("--sharing", "mps", "--stacks", "1,2", "--profile", DEFAULT_PROFILE)
    assert profile == DEFAULT_PROFILE and STACKS_PROFILE not in err and "no two-engine rate" in flags
    for extra in (("--sharing", "mps"), ("--sharing", "none", "--stacks", "2")):
        profile, err, _ = sweep(*extra)
        assert profile == DEFAULT_PROFILE and STACKS_PROFILE not in err


def test_sim_of_stacks_under_mps_takes_the_shipped_stacks_profile_unless_told(tmp_path, capsys):
    """`nodus sim --stacks 2` with no profile chosen prices the engines by the shipped profile that
    has a two-engine rate (nodus.config.STACKS_PROFILE) and says so; --profile and one stack keep
    their profile."""
    import json

    from nodus.cli import main
    from nodus.config import DEFAULT_PROFILE, STACKS_PROFILE

    def sim(*extra):
        assert main(["sim", "--jobs", "4", "--policy", "shared-sync", "--steps", "2", "--json", *extra]) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["profile"]["source"], out.err

    source, err = sim("--stacks", "2")
    assert STACKS_PROFILE in source and f"profile {STACKS_PROFILE}" in err
    source, err = sim("--stacks", "2", "--profile", DEFAULT_PROFILE)
    assert DEFAULT_PROFILE in source and STACKS_PROFILE not in err
    source, err = sim()
    assert STACKS_PROFILE not in source and STACKS_PROFILE not in err
    # A what-if scales that profile: the two-engine rate stays.
    out = tmp_path / "wi"
    sim("--stacks", "2", "--what-if", "train=0.5", "--out", str(out))
    assert json.loads((out / "what_if_profile.json").read_text())["sharing"]["mps_engines"] is not None


def test_gpu_h100_takes_the_h100s_shipped_profiles_in_sim_sweep_and_plan(capsys):
    """--gpu h100 with no profile chosen: the H100 80GB's own profiles (the graphed trainer's, the
    only one measured there), its stacks profile for stacks under MPS, else its one-stack one, said
    on stderr; --profile still wins, and a GPU without shipped profiles is refused."""
    import json

    from nodus.cli import main
    from nodus.config import DEFAULT_PROFILE, H100_ONESTACK_PROFILE, H100_STACKS_PROFILE, ConfigError, planning_profile

    def sim(*extra):
        assert main(["sim", "--jobs", "4", "--policy", "shared-sync", "--steps", "2", "--json", *extra]) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["profile"]["source"], out.err

    source, err = sim("--gpu", "h100")
    assert H100_ONESTACK_PROFILE in source and f"--gpu h100: profile {H100_ONESTACK_PROFILE}" in err
    assert H100_STACKS_PROFILE in sim("--gpu", "h100", "--stacks", "2", "--sharing", "mps")[0]
    assert DEFAULT_PROFILE in sim("--gpu", "h100", "--profile", DEFAULT_PROFILE)[0]
    assert main(["sweep", "--jobs", "4", "--groups", "1", "--policies", "shared-sync", "--seeds", "1", "--steps", "1",
                 "--workers", "1", "--sharing", "mps", "--stacks", "1,2", "--gpu", "h100", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["profile"] == H100_STACKS_PROFILE and "--gpu h100: every run on profile" in out.err
    assert main(["plan", "--total-jobs", "4", "--per-gpu", "1,2", "--steps", "2", "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == H100_ONESTACK_PROFILE
    with pytest.raises(SystemExit):
        main(["sim", "--gpu", "a100"])
    assert "invalid choice: 'a100'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--gpu 'a100': choose from h200, h100"):
        planning_profile("a100", False)


def test_run_hands_the_flat_adapter_format_by_default_and_peft_folders_beside_a_core_process(monkeypatch, capsys):
    """nodus run --backend real without --adapter-format: flat files (session 65's default), PEFT
    folders where vLLM's core runs in a process of its own (no flat loader there), either when asked."""
    import nodus.realrun

    seen = []
    monkeypatch.setattr(nodus.realrun, "run", lambda cfg, backend, opts, out, baseline: seen.append(opts) or {})
    base = ["run", "--backend", "real", "--jobs", "1", "--json"]
    for extra in ([], ["--engine-core-process"], ["--adapter-format", "safetensors"]):
        assert main(base + extra) == 0
    assert [o.adapter_format for o in seen] == ["flat", "safetensors", "safetensors"]
