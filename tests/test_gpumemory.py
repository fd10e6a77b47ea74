"""nodus.gpumemory: one memory model for both backends. The simulator fits a default trainer
micro-batch to its profile's GPU exactly as the real backend fits it to the GPU it runs on."""

import pytest

from nodus.config import STACKS_TRAINER_PROFILE, build_config
from nodus.gpumemory import GPU_MEMORY_GIB, fitted_microbatch, microbatch_that_fits, trainer_gib_estimate


def _cfg(stacks=2, mb=None, profile=STACKS_TRAINER_PROFILE, steps=20):
    return build_config({"jobs": [{"task": "sorting", "steps": steps} for _ in range(8)], "profile": profile,
                         "arm": {"policy": "shared-sync", "stacks": stacks, "sharing": "mps" if stacks > 1 else "none"},
                         **({"trainer": {"max_tokens_per_microbatch": mb}} if mb else {})})


def test_the_estimate_goes_through_the_measured_sizes():
    """experiments/results/h100/session49/trainer_memory.json: peaks of 19.34 and 34.56 GiB reserved at
    4096 and 8192 tokens, plus ~0.5 GiB of context; above session 29's captures failing at 58.1 GiB
    at 16k."""
    assert trainer_gib_estimate(4096) == pytest.approx(19.34 + 0.5, abs=0.1)
    assert trainer_gib_estimate(8192) == pytest.approx(34.56 + 0.5, abs=0.1)
    assert trainer_gib_estimate(16384) > 58.1
    assert trainer_gib_estimate(8192, graphed=False) == trainer_gib_estimate(1024, graphed=False)


def test_fitted_microbatch_halves_the_default_until_it_fits():
    h200, h100 = GPU_MEMORY_GIB["NVIDIA H200"], GPU_MEMORY_GIB["NVIDIA H100 80GB HBM3"]
    assert fitted_microbatch(16384, 1, h200) == 16384
    assert fitted_microbatch(16384, 2, h200) == 8192
    assert fitted_microbatch(16384, 3, h200) == 4096
    assert fitted_microbatch(16384, 1, h100) == 8192
    assert fitted_microbatch(16384, 2, h100) == 2048  # at the default engine share, 0.45
    assert fitted_microbatch(16384, 2, h100, engine_memory=0.35) == 4096
    assert fitted_microbatch(16384, 2, None) == 16384  # memory unknown: as asked
    assert fitted_microbatch(16384, 2, (10.0, 12.0)) == 16384  # nothing fits: as asked (the start warns)
    assert microbatch_that_fits(10.0, 12.0, 0.45, 2, 16384) is None


def test_the_simulator_fits_a_default_micro_batch_per_cluster_as_the_real_backend_does():
    """A two-stack arm at the default micro-batch on an H200 profile trains at 8192 in the simulator,
    its one-stack dedicated baseline at 16384: the sizes real.backend.fit_microbatch gives those
    clusters on an H200 at the same engine share."""
    from real.backend import RealOptions, fit_microbatch
    from sim import backend_factory

    make = backend_factory(STACKS_TRAINER_PROFILE)
    arm = make(_cfg(), 2)
    assert arm.cfg.trainer.max_tokens_per_microbatch == 8192 and make.fitted == {2: 8192}
    base = make(_cfg(stacks=1), 1)
    assert base.cfg.trainer.max_tokens_per_microbatch == 16384 and make.fitted == {2: 8192}
    real = RealOptions(device="cuda", trainer_graphs=True)  # engine_memory 0.45, the default
    h200 = GPU_MEMORY_GIB["NVIDIA H200"]
    assert fit_microbatch(_cfg(), real, 2, mem=h200).trainer.max_tokens_per_microbatch == 8192
    assert fit_microbatch(_cfg(stacks=1), real, 1, mem=h200).trainer.max_tokens_per_microbatch == 16384
    # A size the config sets stays; an eager profile (no graphs to fit) keeps the default.
    assert make(_cfg(mb=16384), 2).cfg.trainer.max_tokens_per_microbatch == 16384
    eager = backend_factory("h200-qwen3-0.6b")
    assert eager(_cfg(profile="h200-qwen3-0.6b"), 2).cfg.trainer.max_tokens_per_microbatch == 16384
    assert eager.fitted == {}


def test_a_simulated_run_reports_the_fitted_micro_batch():
    from nodus.simulate import render_table, simulate

    s = simulate(_cfg(steps=3))
    assert s["trainer_microbatch_fitted"] == {"2": 8192}
    text = render_table(s)
    assert "Trainer micro-batch fitted to NVIDIA H200" in text and "8192 tokens on 2 stacks" in text
    pinned = simulate(_cfg(mb=8192, steps=3))
    assert "trainer_microbatch_fitted" not in pinned
    assert pinned["steps_per_gpu_hour"] == pytest.approx(s["steps_per_gpu_hour"])  # the same micro-batch priced


def test_a_calibrated_profile_carries_its_gpus_memory_and_the_simulator_fits_to_it(tmp_path):
    """A GPU the table does not know: nodus calibrate records its free and total memory
    (environment.gpu_memory_gib) and the fit uses that; without either, nothing is fitted."""
    import json

    from nodus.gpumemory import profile_gpu_memory
    from sim import backend_factory
    from sim.profile import load_profile, profile_dict

    prof = profile_dict(STACKS_TRAINER_PROFILE)
    prof["environment"]["gpu"] = "NVIDIA Some80GB"
    (tmp_path / "unknown.json").write_text(json.dumps(prof))
    prof["environment"]["gpu_memory_gib"] = [77.2, 79.65]
    (tmp_path / "measured.json").write_text(json.dumps(prof))
    assert profile_gpu_memory(load_profile(str(tmp_path / "measured.json")).profile.environment) == (77.2, 79.65)
    measured = backend_factory(str(tmp_path / "measured.json"))
    assert measured(_cfg(profile=str(tmp_path / "measured.json")), 2).cfg.trainer.max_tokens_per_microbatch == 2048
    unknown = backend_factory(str(tmp_path / "unknown.json"))
    assert unknown(_cfg(profile=str(tmp_path / "unknown.json")), 2).cfg.trainer.max_tokens_per_microbatch == 16384
    prof["environment"]["gpu_memory_gib"] = [77.2]
    (tmp_path / "bad.json").write_text(json.dumps(prof))
    with pytest.raises(Exception, match="gpu_memory_gib"):
        load_profile(str(tmp_path / "bad.json"))


def test_the_driver_version_is_read_from_nvidia_smi(monkeypatch):
    """nodus calibrate's environment header names the driver (#5: GPU, driver, vLLM and torch
    versions); None where nvidia-smi cannot tell (no GPU, or it fails)."""
    import subprocess
    import shutil

    from nodus import gpumemory

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="580.159.04\n", stderr="")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert gpumemory.gpu_driver() == "580.159.04"
    assert calls == [["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader,nounits"]]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9, "", "no GPU"))
    assert gpumemory.gpu_driver() is None
    from calibration.measure import environment

    assert environment("cpu")["driver"] is None  # off a GPU nothing asks nvidia-smi
