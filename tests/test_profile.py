"""Profiles: shipped one loads; missing or malformed files are clear errors; cost shapes."""

import json

import pytest

from nodus.config import ConfigError
from sim.profile import load_profile, shipped_profiles


def test_shipped_profile_loads_with_environment_and_assumptions():
    assert "h200-qwen3-0.6b" in shipped_profiles()
    cm = load_profile("h200-qwen3-0.6b")
    env = cm.profile.environment
    assert env.gpu == "NVIDIA H200" and env.vllm and env.date
    # Measured on the H200 by `nodus calibrate`, trainer, publish and the trainer's MPS co-run rate
    # refitted by `nodus fit` on runs of at most 4 jobs per GPU; what is still assumed is listed.
    assert env.git_commit and {"nodus calibrate"} <= set(env.sources) and any("nodus fit" in x for x in env.sources)
    assert {a["id"] for a in cm.assumptions()} >= {"sharing-constant", "sharing-partly-fitted"}
    fit = cm.profile.measurements["fit_runs"]
    assert fit["held_out"] == [] and fit["train_steps"] >= 40
    assert fit["sharing_fit"]["mps_corun.trainer"] == cm.profile.sharing.mps_corun.trainer
    assert {d["adapters"] for d in cm.profile.measurements["calibrate"]["decode"]} == {1, 8}
    # The first, provisional profile stays shipped under its own name.
    prov = load_profile("h200-qwen3-0.6b-provisional")
    assert prov.profile.measurements["trainer_bench"]["adapters"] == 8


def test_missing_and_malformed_profiles(tmp_path):
    with pytest.raises(ConfigError, match="neither a file nor a shipped profile"):
        load_profile("h100-nothing")
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "p.json"))
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_profile(str(p))
    good = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    del good["decode"]
    p.write_text(json.dumps(good))
    with pytest.raises(ConfigError, match="malformed at decode"):
        load_profile(str(p))


def test_decode_cost_grows_with_batch_and_adapters_and_flags_extrapolation():
    cm = load_profile("h200-qwen3-0.6b-provisional")
    assert cm.decode_step_s(64, 0, 0) < cm.decode_step_s(512, 0, 0)
    assert cm.decode_step_s(64, 0, 0) < cm.decode_step_s(64, 0, 1) <= cm.decode_step_s(64, 0, 4) <= cm.decode_step_s(64, 0, 8)
    assert cm.decode_step_s(512, 0, 8) == pytest.approx(0.010575691734374892)
    assert not cm.flags
    cm.decode_step_s(2048, 0, 16)
    assert cm.flags == {"decode batch up to 2048 > profiled 1024", "decode adapters up to 16 > profiled 8"}


def test_fit_linear_rel_stays_non_negative():
    from calibration.provisional import fit_linear_rel

    a, b = fit_linear_rel([1, 2, 4], [3.0, 5.0, 9.0])  # exactly 1 + 2x
    assert a == pytest.approx(1) and b == pytest.approx(2)
    a, b = fit_linear_rel([1, 2, 4], [5.0, 4.9, 4.8])  # falling: noise around a constant
    assert b == 0 and a == pytest.approx(4.9, rel=0.02)
    a, b = fit_linear_rel([100, 200, 400], [0.9, 2.1, 4.0])  # negative intercept: through the origin
    assert a == 0 and b > 0
