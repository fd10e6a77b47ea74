"""experiments/ab_pairs.py: a paired A/B of one run-loop setting within gpu_arms invocations."""

import json
import math

import pytest

from experiments import ab_pairs


def _run(folder, name, sph, train_s, publish_s=0.1, seed=1, step_ms=9.0):
    d = folder / name
    d.mkdir(parents=True)
    spans = []
    for step in range(3):
        t = 10.0 * step
        for job in ("job0", "job1"):  # a stack's jobs record one action each: merged, not counted twice
            spans += [{"phase": "generate", "stack": 0, "group": 0, "gpu": 0, "job": job, "start_s": t, "end_s": t + 2.0,
                       "attrs": {"step": step}},
                      {"phase": "train", "stack": 0, "group": 0, "gpu": 0, "job": job, "start_s": t + 2.0,
                       "end_s": t + 2.0 + train_s, "attrs": {"step": step}},
                      {"phase": "publish", "stack": 0, "group": 0, "gpu": 0, "job": job, "start_s": t + 5.0,
                       "end_s": t + 5.0 + publish_s, "attrs": {"step": step}}]
    (d / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    gens = [{"steps": 100, "step_s": step_ms / 10.0}, {"steps": 300, "step_s": 3 * step_ms / 10.0}]
    (d / "summary.json").write_text(json.dumps({
        "seed": seed, "steps_per_gpu_hour": sph, "pace": {"pace_steps_per_gpu_hour": sph * 1.01},
        "diagnostics": [{"engine_steps": {"generations": gens}, "host_monitor": {"steal_frac": 0.01}}]}))
    return d


def test_pairs_by_folder_and_name_and_reports_ratios(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    runs = [_run(a, "arm-r1-flat-k2-s1", 1100, 0.9, 0.07), _run(a, "arm-r1-k2-s1", 1000, 1.0, 0.1),
            _run(b, "arm-r1-flat-k2-s2", 1210, 0.95, 0.08, seed=2), _run(b, "arm-r1-k2-s2", 1100, 1.0, 0.1, seed=2),
            # the twin of this one is in another folder (another invocation): not paired
            _run(b, "arm-r1-flat-k2-s1", 5000, 0.5)]
    res = ab_pairs.compare(runs, "flat")
    assert [(p["folder"], p["seed"]) for p in res["pairs"]] == [("a", 1), ("b", 2)]
    first = res["pairs"][0]
    assert first["a"]["train_s"] == pytest.approx(1.0) and first["b"]["train_s"] == pytest.approx(0.9)
    assert first["b"]["publish_s"] == pytest.approx(0.07) and first["a"]["generate_s"] == pytest.approx(2.0)
    assert first["a"]["engine_step_ms"] == pytest.approx(1000 * (0.9 + 2.7) / 400)  # 9 ms: both generations' steps
    assert first["b_over_a"]["steps_per_gpu_hour"] == pytest.approx(1.1)
    s = res["summary"]["steps_per_gpu_hour"]
    assert s["b_over_a"] == pytest.approx(math.exp((math.log(1.1) + math.log(1.1)) / 2))
    assert s["pairs"] == 2 and s["b_higher"] == 2
    assert res["summary"]["train_s"]["b_over_a"] == pytest.approx(math.sqrt(0.9 * 0.95))
    assert res["unpaired"] == [str(runs[4])]
    md = ab_pairs.markdown(res)
    assert "| a | 1 | 1000 / 1100 |" in md and "Runs without a twin" in md


def test_no_pair_and_bad_variant_are_refused_by_name(tmp_path):
    runs = [_run(tmp_path / "a", "arm-k2-s1", 1000, 1.0)]
    with pytest.raises(SystemExit, match="ab_pairs: no pair: no run named with -flat-"):
        ab_pairs.main([str(r) for r in runs] + ["--variant", "flat"])
    with pytest.raises(ValueError, match="one name part"):
        ab_pairs.compare(runs, "flat-k2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a run folder"):
        ab_pairs.run_figures(tmp_path / "empty")


def test_writes_json_and_markdown(tmp_path):
    runs = [_run(tmp_path / "a", "x-flat-s1", 1050, 0.9), _run(tmp_path / "a", "x-s1", 1000, 1.0)]
    out = tmp_path / "rep" / "flat-ab"
    ab_pairs.main([str(r) for r in runs] + ["--variant", "flat", "--out", str(out)])
    res = json.loads((tmp_path / "rep" / "flat-ab.json").read_text())
    assert res["summary"]["steps_per_gpu_hour"]["b_over_a"] == pytest.approx(1.05)
    assert (tmp_path / "rep" / "flat-ab.md").read_text().startswith("Paired A/B of `flat`")


def test_pairs_two_policies_by_name_and_refuses_a_bad_pair(tmp_path):
    """--policies A,B: side B the runs of policy B, each with the run of policy A named the same in
    its folder (session 73's continuous against shared-sync on two stacks); a run of a third policy
    or without a twin stays unpaired; a policy that is none, or the same twice, is refused by name."""
    a = tmp_path / "arms"
    runs = [_run(a, "continuous+mps-cg-k2-s1", 1024, 0.5), _run(a, "shared-sync+mps-cg-k2-s1", 1000, 1.0),
            _run(a, "continuous+mps-cg-k2-aa-s1", 1030, 0.5), _run(a, "shared-sync+mps-cg-k2-aa-s1", 1000, 1.1),
            _run(a, "shared-sync+mps-cg-k2-s4", 1000, 1.0, seed=4), _run(a, "overlap+mps-cg-k2-s1", 990, 0.7)]
    res = ab_pairs.compare(runs, None, policies=ab_pairs.policy_pair("shared-sync,continuous"))
    assert [(p["a"]["run"], p["b"]["run"]) for p in res["pairs"]] == [
        ("shared-sync+mps-cg-k2-s1", "continuous+mps-cg-k2-s1"),
        ("shared-sync+mps-cg-k2-aa-s1", "continuous+mps-cg-k2-aa-s1")]
    assert res["summary"]["steps_per_gpu_hour"]["b_over_a"] == pytest.approx(math.sqrt(1.024 * 1.03))
    assert res["summary"]["steps_per_gpu_hour"]["b_higher"] == 2
    assert sorted(res["unpaired"]) == sorted(str(r) for r in runs[4:])
    assert ab_pairs.markdown(res).startswith("Paired A/B of `continuous over shared-sync`: side B the runs of "
                                             "`continuous`, side A their twins of `shared-sync`")
    for bad in ("shared-sync", "shared-sync,continous", "continuous,continuous"):
        with pytest.raises(ValueError, match="two different policies"):
            ab_pairs.policy_pair(bad)
    with pytest.raises(SystemExit, match="no pair: no run of policy overlap beside its twin of policy dedicated"):
        ab_pairs.main([str(r) for r in runs] + ["--policies", "dedicated,overlap"])
