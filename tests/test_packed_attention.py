"""The packed rows' attention term (train.packed_pair_per_token): its feature, its price in the
simulator, and its fit from trainer benches (nodus fit-packed)."""

from __future__ import annotations

import json

import pytest

from calibration.packed_attention import bench_points, fit, fit_to_file
from nodus.cli import main
from nodus.config import DEFAULT_PROFILES, ConfigError
from nodus.microbatch import packed_pairs_per_microbatch, plan_microbatches, step_rows
from sim.profile import load_profile, profile_dict, what_if

GRAPHED = DEFAULT_PROFILES["graphed"]
LENGTHS = [[120, [150, 90, 60, 200, 30, 110, 75, 140] * 2], [70, [40, 300, 55, 80, 95, 20, 160, 60] * 2]]


def test_packed_pairs_is_rows_times_longest_squared_per_microbatch():
    rows = [[10, 30], [20]]
    assert packed_pairs_per_microbatch(rows, 1000) == [3 * 30 ** 2]  # one micro-batch of 3 rows padded to 30
    assert packed_pairs_per_microbatch(rows, 60) == [2 * 30 ** 2, 1 * 10 ** 2]  # (30, 20) then (10)
    assert [len(mb) for mb in plan_microbatches(rows, 60)] == [2, 1]


def test_cost_model_prices_pairs_in_units_of_the_per_token_term(tmp_path):
    prof = profile_dict(GRAPHED)
    prof["train"]["packed_pair_per_token"] = 4e-4
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    cost = load_profile(str(path))
    b = prof["train"]["per_microbatch"]["b_s_per_unit"]
    base = cost.train_s([8000, 4000], adapters=2)
    assert cost.has_packed_attention
    assert cost.train_s([8000, 4000], adapters=2, packed_pairs=[10 ** 7]) == pytest.approx(base + b * 4e-4 * 1e7)
    # a what-if of the train terms moves the pair term with the per-token term
    half = tmp_path / "half.json"
    half.write_text(json.dumps(what_if(prof, {"train": 0.5})))
    assert load_profile(str(half)).train_s([8000, 4000], 2, packed_pairs=[10 ** 7]) == pytest.approx(
        0.5 * cost.train_s([8000, 4000], 2, packed_pairs=[10 ** 7]))
    prof["train"]["packed_pair_per_token"] = None
    path.write_text(json.dumps(prof))
    none = load_profile(str(path))
    assert not none.has_packed_attention and none.train_s([8000, 4000], 2, packed_pairs=[10 ** 7]) == pytest.approx(base)


def _sim_json(capsys, *args) -> dict:
    assert main(["sim", "--jobs", "4", "--steps", "2", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_sim_prices_packed_attention_where_the_profile_has_it(tmp_path, capsys):
    """The shipped graphed profile carries the term: packed rows cost more than their tokens alone
    say (what the profile without the term predicts), and the report says the term is unchecked
    against runs; without the term it says the attention is unmodelled."""
    prof = profile_dict(GRAPHED)
    assert prof["train"]["packed_pair_per_token"] > 0
    prof["train"]["packed_pair_per_token"] = None
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(prof))
    plain = _sim_json(capsys, "--profile", GRAPHED, "--share-prompts", "0")
    priced = _sim_json(capsys, "--profile", GRAPHED, "--share-prompts", "4")
    unpriced = _sim_json(capsys, "--profile", str(bare), "--share-prompts", "4")
    assert unpriced["steps_per_gpu_hour"] > priced["steps_per_gpu_hour"]
    assert not any("packed micro-batch query-key pairs" in f for f in priced["outside_profile"])
    # a micro-batch past the largest the bench measured is flagged, as a micro-batch's tokens are
    prof = profile_dict(GRAPHED)
    prof["train"]["max_profiled_packed_pairs"] = 1000
    small = tmp_path / "small.json"
    small.write_text(json.dumps(prof))
    beyond = _sim_json(capsys, "--profile", str(small), "--share-prompts", "4")
    assert any(f.startswith("packed micro-batch query-key pairs up to ") and f.endswith("> profiled 1000")
               for f in beyond["outside_profile"])
    assert beyond["steps_per_gpu_hour"] == priced["steps_per_gpu_hour"]
    assert priced["steps_per_gpu_hour"] != plain["steps_per_gpu_hour"]
    assert any("priced from the trainer alone" in f for f in priced["outside_profile"])
    assert any("masked attention unmodelled" in f for f in unpriced["outside_profile"])


def _bench(path, a, b, c, share=(0, 2, 4, 8), jobs=(2, 1), mb=4096, noise=None, **extra):
    """A bench JSON whose step times follow t = a n_mb + b padded + c pairs exactly (or times noise)."""
    cases = []
    for n in jobs:
        lengths = LENGTHS[:n]
        variants = {}
        for k in share:
            rows = [step_rows(p * len(r), len(r), r, 8, k) for p, r in lengths]
            mbs = plan_microbatches(rows, mb)
            padded = sum(len(m) * max(rows[j][s] for j, s in m) for m in mbs)
            t = a * len(mbs) + b * padded + c * (sum(packed_pairs_per_microbatch(rows, mb)) if k > 1 else 0)
            t *= (noise or {}).get((n, k), 1.0)
            variants[str(k)] = {"median_s": t, "step_s": [t], "graph_error": None}
        cases.append({"jobs": n, "lengths": lengths, "variants": variants})
    path.write_text(json.dumps({"env": {"args": {"responses_per_prompt": 8, "mb_tokens": mb, **extra}},
                                "cases": cases}))
    return str(path)


def test_fit_recovers_a_known_pair_cost_and_leaves_configurations_out(tmp_path):
    bench = _bench(tmp_path / "b.json", a=0.05, b=1e-5, c=4e-9)
    r = fit([bench])
    assert r["packed_pair_per_token"] == pytest.approx(4e-4, rel=1e-6)
    assert r["max_profiled_packed_pairs"] == max(p["largest_microbatch_pairs"] for p in r["points"]) > 0
    w = r["models"]["with_pairs"]
    assert w["fit_mape"] < 1e-9 and w["loo_mape"] < 1e-9
    assert r["models"]["without_pairs"]["loo_mape"] > 0.01  # the pairs are what the plain model misses
    assert set(w["loo_by_config"]) == {f"{n} jobs, K={k}" for n in (2, 1) for k in (0, 2, 4, 8)}
    # a noisy point shows in its configuration's left-out error
    noisy = fit([_bench(tmp_path / "n.json", 0.05, 1e-5, 4e-9, noise={(2, 4): 1.2})])
    loo = noisy["models"]["with_pairs"]["loo_by_config"]
    assert abs(loo["2 jobs, K=4"]) == max(abs(v) for v in loo.values())
    # two bench files that err both ways on one configuration: its held-out error is their mean
    # absolute error, not a signed mean that cancels
    both = fit([_bench(tmp_path / "hi.json", 0.05, 1e-5, 4e-9, noise={(2, 4): 1.2}),
                _bench(tmp_path / "lo.json", 0.05, 1e-5, 4e-9, noise={(2, 4): 1 / 1.2})])["models"]["with_pairs"]
    assert both["loo_by_config"]["2 jobs, K=4"] > 0.1
    assert abs(both["loo_bias_by_config"]["2 jobs, K=4"]) < both["loo_by_config"]["2 jobs, K=4"] / 2


def test_fit_packed_writes_a_profile_and_a_report(tmp_path, capsys):
    bench = _bench(tmp_path / "b.json", a=0.05, b=1e-5, c=3e-9)
    out, report = tmp_path / "p.json", tmp_path / "rep" / "packed"
    assert main(["fit-packed", bench, "--base", GRAPHED, "--out", str(out), "--report", str(report)]) == 0
    said = capsys.readouterr().out
    assert "packed_pair_per_token = 0.0003" in said and "2 jobs, K=8" in said
    prof = json.loads(out.read_text())
    assert prof["train"]["packed_pair_per_token"] == pytest.approx(3e-4, rel=1e-6)
    assert prof["train"]["max_profiled_packed_pairs"] > 0
    assert prof["measurements"]["packed_attention"]["benches"] == [bench]
    assert "nodus fit-packed" in prof["environment"]["sources"][-1]
    assert load_profile(str(out)).has_packed_attention
    md = (tmp_path / "rep" / "packed.md").read_text()
    assert "leave-one-configuration-out" in md and "| 2 | 8 |" in md
    assert json.loads((tmp_path / "rep" / "packed.json").read_text())["ratios"]
    # never overwritten; an eager base is refused
    assert main(["fit-packed", bench, "--base", GRAPHED, "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert main(["fit-packed", bench, "--base", "h200-qwen3-0.6b", "--out", str(tmp_path / "e.json")]) == 2
    assert "eager trainer" in capsys.readouterr().err


def test_fit_packed_refuses_benches_that_cannot_fit(tmp_path):
    with pytest.raises(ConfigError, match="plain rows .share 0. and packed ones"):
        bench_points([_bench(tmp_path / "a.json", 0.05, 1e-5, 4e-9, share=(4, 8))])
    with pytest.raises(ConfigError, match="--tiny bench"):
        bench_points([_bench(tmp_path / "t.json", 0.05, 1e-5, 4e-9, tiny=True)])
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ConfigError, match="not a readable bench JSON"):
        bench_points([tmp_path / "x.json"])
    (tmp_path / "w.json").write_text(json.dumps({"cases": [{"jobs": 1}]}))
    with pytest.raises(ConfigError, match="a case without 'jobs' and 'variants'"):
        bench_points([tmp_path / "w.json"])
    (tmp_path / "y.json").write_text(json.dumps({"cases": [{"jobs": 1, "variants": {"0": {"median_s": 1}}}]}))
    with pytest.raises(ConfigError, match="records no lengths and the bench names no --lengths-from"):
        bench_points([tmp_path / "y.json"])
    # packed rows as cheap as their tokens: no positive pair cost, nothing written
    with pytest.raises(ConfigError, match="no positive per-pair cost"):
        fit([_bench(tmp_path / "z.json", 0.05, 1e-5, 0.0)])
    with pytest.raises(ConfigError, match="no positive"):
        fit_to_file([_bench(tmp_path / "z2.json", 0.05, 1e-5, 0.0)], GRAPHED, tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()


def test_fit_rebuilds_rows_of_a_recorded_bench_from_its_run(monkeypatch, tmp_path):
    """The committed session-18 benches predate the lengths field: their rows come from the run
    folder they name (from the repository root, wherever the fit runs), and the fit finds the pair
    term the shipped profiles carry."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    benches = [str(root / f"experiments/results/h200/session18/shared_prompts/shared_prompts_h200_{x}.json")
               for x in "ab"]
    monkeypatch.chdir(tmp_path)
    r = fit(benches)
    assert len(r["points"]) == 14
    for name in (GRAPHED, "h200-xeon16-graphed-qwen3-0.6b", "h200-xeon16-graphed-session14-qwen3-0.6b"):
        assert r["packed_pair_per_token"] == pytest.approx(profile_dict(name)["train"]["packed_pair_per_token"])
    assert r["models"]["with_pairs"]["loo_mape"] < r["models"]["without_pairs"]["loo_mape"]


def test_jobs_of_one_response_a_prompt_train_plain_rows_in_the_simulator(capsys):
    """The real trainer packs at most the most responses a job samples per prompt: with one each it
    trains plain rows, and the simulator prices (and flags) nothing packed."""
    from nodus.simulate import config_from_args, simulate

    got = {}
    for share in (0, 4):
        cfg = config_from_args({"trainer": {"share_prompts": share}}, jobs=2, steps=2, policy="shared-sync",
                               groups=1, sharing="mps", seed=1, profile=GRAPHED)
        cfg = cfg.model_copy(update={"jobs": [j.model_copy(update={"responses_per_prompt": 1}) for j in cfg.jobs]})
        got[share] = simulate(cfg)
    assert got[4]["steps_per_gpu_hour"] == got[0]["steps_per_gpu_hour"]
    assert not any("share_prompts" in f for f in got[4]["outside_profile"])


def test_crossday_leaves_packed_runs_out():
    from experiments.crossday import comparable

    row = {"controls": {"trainer_step_mode": "graphed", "lora_kernels": "tuned"}}
    assert comparable(row) and comparable({**row, "share_prompts": 1})
    assert not comparable({**row, "share_prompts": 4})
