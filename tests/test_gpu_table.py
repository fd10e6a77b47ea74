"""experiments/gpu_table.py on runs the simulator recorded: ratios against the first dedicated
run, the second one as A/A, and the simulator's replay beside each point."""

import json

import pytest

from nodus.simulate import config_from_args, simulate


def test_gpu_table_ratios_aa_and_sim_beside(tmp_path):
    from experiments.gpu_table import main

    runs = []
    for name, kw in (("ded", dict(policy="dedicated", sharing="none")),
                     ("ded-aa", dict(policy="dedicated", sharing="none")),
                     ("ovl", dict(policy="overlap", groups=2, sharing="mps"))):
        out = tmp_path / name
        simulate(config_from_args(jobs=4, steps=3, seed=2, **kw), out)
        runs.append(str(out))
    table = main(runs + ["--out", str(tmp_path / "t" / "table")])
    ded, ovl = table["arms"]["dedicated/none/g1/4jobs"]["2"], table["arms"]["overlap/mps/g2/4jobs"]["2"]
    assert ded["ratio_vs_dedicated"] == 1.0 and ded["slowdown_vs_alone"] is None
    measured = json.loads((tmp_path / "ovl" / "summary.json").read_text())["steps_per_gpu_hour"]
    base = json.loads((tmp_path / "ded" / "summary.json").read_text())["steps_per_gpu_hour"]
    assert ovl["ratio_vs_dedicated"] == pytest.approx(measured / base)
    # Runs the simulator recorded, replayed on the same profile: the prediction is the measurement.
    assert ovl["sim_steps_per_gpu_hour"] == pytest.approx(measured, rel=1e-9)
    assert table["aa"]["4-s2"]["rel_diff"] == pytest.approx(0.0)  # the simulator is deterministic
    assert ovl["slowdown_vs_alone"]["min"] > 1.0
    assert all((tmp_path / "t" / f"table.{ext}").is_file() for ext in ("json", "md", "png"))
