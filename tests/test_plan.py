"""nodus plan: GPUs, hours and GPU-hours for a fleet of jobs packed N to a GPU, from the simulator."""

import json
import math

import pytest

from nodus.accounting import summarize
from nodus.config import ConfigError, default_jobs
from nodus.plan import plan, plan_table
from nodus.runner import run_spans
from nodus.simulate import config_from_args, simulate
from sim import backend_factory


def _row(result, per_gpu, arm):
    return next(r for r in result["rows"] if r["per_gpu"] == per_gpu and r["arm"] == arm)


def _sim_gpu_s(templates, policy, steps, groups=None):
    """The billed seconds of each GPU of one load, simulated directly: (template index, JobSpec)
    pairs, each job seeded by its template (run seed 1)."""
    jobs = [{**j.model_dump(exclude_none=True), "id": f"job{i}", "seed": 1000 + t}
            for i, (t, j) in enumerate(templates)]
    cfg = config_from_args({"jobs": jobs}, policy=policy, groups=groups, steps=steps,
                           sharing="none" if policy == "dedicated" else "mps")
    return [summarize([r])["gpu_seconds"] for r in run_spans(cfg, backend_factory(cfg.profile))]


def test_a_plan_deals_the_jobs_to_gpus_and_bills_each_until_its_last_job_ends():
    """5 jobs 4 to a GPU: one GPU of templates 0-3 on the arm, and a last GPU of template 4 alone
    (too few for overlap's 2 groups: it runs shared-sync, and the row says so)."""
    r = plan(total_jobs=5, steps=3, per_gpu="1,4", policies="overlap,shared-sync", workers=1)
    tpl = list(enumerate(default_jobs(8)))
    ov = _row(r, 4, "overlap g=2 mps")
    assert ov["gpus"] == 2 and ov["last_gpu"] == "shared-sync mps"
    full = _sim_gpu_s(tpl[:4], "overlap", 3, groups=2)[0]
    last = _sim_gpu_s(tpl[4:5], "shared-sync", 3)[0]
    assert ov["gpu_hours"] == pytest.approx((full + last) / 3600)
    assert ov["hours"] == pytest.approx(max(full, last) / 3600)
    assert ov["steps_per_gpu_hour"] == pytest.approx(5 * 3 / (full + last) * 3600)
    ded = _row(r, 1, "dedicated")
    alone = [_sim_gpu_s([t], "dedicated", 3)[0] for t in tpl[:5]]  # each job's own GPU and engine
    assert ded["gpus"] == 5 and ded["gpu_hours"] == pytest.approx(sum(alone) / 3600)
    assert ded["hours"] == pytest.approx(max(alone) / 3600) and ded["gpu_hours_vs_dedicated"] == 1.0
    assert ov["gpu_hours_vs_dedicated"] == pytest.approx(ov["gpu_hours"] / ded["gpu_hours"])
    # rows cheapest first; the best is the cheapest (no limits given)
    assert [x["gpu_hours"] for x in r["rows"]] == sorted(x["gpu_hours"] for x in r["rows"])
    assert (r["best"]["per_gpu"], r["best"]["arm"]) == (r["rows"][0]["per_gpu"], r["rows"][0]["arm"])


def test_templates_repeat_to_the_total_and_equal_loads_are_simulated_once():
    r = plan(total_jobs=16, steps=2, per_gpu="8", policies="shared-sync", workers=1)
    # 16 jobs of 8 templates, 8 a GPU: both GPUs carry templates 0-7 (one load), and each dedicated
    # job's load is one of the 8 templates
    assert _row(r, 8, "shared-sync mps")["gpus"] == 2 and _row(r, 1, "dedicated")["gpus"] == 16
    assert r["loads_simulated"] == 1 + 8


def test_a_deadline_and_a_fleet_pick_the_cheapest_option_within_both():
    free = plan(total_jobs=8, steps=3, per_gpu="1,2,8", policies="shared-sync", workers=1)
    ded, two, eight = (_row(free, n, a) for n, a in ((1, "dedicated"), (2, "shared-sync mps"), (8, "shared-sync mps")))
    assert eight["gpu_hours"] < two["gpu_hours"] < ded["gpu_hours"]  # packing saves GPU-hours
    assert eight["hours"] > two["hours"] > ded["hours"] * 0.99  # and costs wall time
    # a deadline between 2- and 8-a-GPU's hours rules out 8 a GPU: 2 a GPU is the cheapest left
    limited = plan(total_jobs=8, steps=3, per_gpu="1,2,8", policies="shared-sync", workers=1,
                   deadline_h=(two["hours"] + eight["hours"]) / 2)
    assert limited["best"]["per_gpu"] == 2 and not _row(limited, 8, "shared-sync mps")["meets"]
    # ...and a fleet of fewer GPUs than that needs rules out everything
    none = plan(total_jobs=8, steps=3, per_gpu="1,2,8", policies="shared-sync", workers=1,
                deadline_h=(two["hours"] + eight["hours"]) / 2, max_gpus=3)
    assert none["best"] is None
    text = plan_table(none)
    assert "No option is within" in text and "Soonest on 3 GPUs or fewer: 8 jobs a GPU" in text


def test_sim_steps_projects_long_jobs_by_the_steady_pace():
    full = plan(total_jobs=4, steps=24, per_gpu="4", policies="shared-sync", workers=1)
    proj = plan(total_jobs=4, steps=24, per_gpu="4", policies="shared-sync", workers=1, sim_steps=8)
    a, b = _row(full, 4, "shared-sync mps"), _row(proj, 4, "shared-sync mps")
    assert proj["sim_steps"] == 8 and b["gpu_hours"] == pytest.approx(a["gpu_hours"], rel=0.03)
    assert b["gpu_hours"] != a["gpu_hours"]  # projected, not simulated
    # as many simulated steps as asked: no projection
    assert plan(total_jobs=2, steps=4, per_gpu="2", policies="shared-sync", workers=1, sim_steps=9)["sim_steps"] is None


def test_bad_plans_are_clear_errors():
    with pytest.raises(ConfigError, match="--total-jobs 0"):
        plan(total_jobs=0)
    with pytest.raises(ConfigError, match="--policies: \\['timeslice'\\]"):
        plan(total_jobs=4, policies="timeslice")
    with pytest.raises(ConfigError, match="--sim-steps 2: at least 3"):
        plan(total_jobs=4, sim_steps=2)
    with pytest.raises(ConfigError, match="--deadline-h -1"):
        plan(total_jobs=4, deadline_h=-1.0)
    with pytest.raises(ConfigError, match="--max-gpus 0"):
        plan(total_jobs=4, max_gpus=0)
    with pytest.raises(ConfigError, match="--per-gpu 0,2"):
        plan(total_jobs=4, per_gpu="0,2")
    with pytest.raises(ConfigError, match="arrive_s: nodus plan deals the jobs itself; give their spacing"):
        plan({"jobs": [{"task": "gsm8k"}, {"task": "modular", "arrive_s": 5}]}, total_jobs=4)
    with pytest.raises(ValueError, match="not a known task"):
        plan({"jobs": [{"task": "nope"}]}, total_jobs=2)


def test_nodus_plan_cli_prints_the_table_and_writes_the_plan(tmp_path, capsys):
    from nodus.cli import main

    cfg = tmp_path / "fleet.yaml"
    cfg.write_text("jobs:\n  - {task: sorting, max_new_tokens: 64}\n  - {task: gsm8k}\n")
    out = tmp_path / "plan"
    assert main(["plan", str(cfg), "--total-jobs", "6", "--steps", "3", "--per-gpu", "1,3,6",
                 "--policies", "shared-sync", "--workers", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "6 jobs of 3 steps on profile" in text and "| 3 | shared-sync mps | 2 |" in text
    assert "Fewest GPU-hours: " in text
    saved = json.loads((out / "plan.json").read_text())
    assert {r["per_gpu"] for r in saved["rows"]} == {1, 3, 6} and (out / "plan.md").read_text().strip() == text.strip()
    assert math.isclose(sum(1 for r in saved["rows"] if r["policy"] == "dedicated"), 1)
    assert main(["plan", "--total-jobs", "4", "--deadline-h", "0"]) == 2
    assert "--deadline-h 0" in capsys.readouterr().err
    assert main(["plan", "--total-jobs", "4", "--steps", "2", "--per-gpu", "1,2", "--policies", "shared-sync",
                 "--gpus", "2", "--max-wait-h", "0.5", "--workers", "1"]) == 0
    assert "on a fleet of 2 GPUs" in capsys.readouterr().out
    assert main(["plan", "--total-jobs", "4", "--gpus", "2", "--max-gpus", "2"]) == 2
    assert "--gpus 2 fixes the fleet" in capsys.readouterr().err


def test_options_outside_the_profiled_region_are_marked_apart_from_what_every_option_shares():
    r = plan(total_jobs=16, steps=2, per_gpu="1,16", policies="shared-sync", workers=1)
    sixteen, ded = _row(r, 16, "shared-sync mps"), _row(r, 1, "dedicated")
    assert any("adapters up to 16 > profiled 8" in f for f in sixteen["outside_profile"])
    assert ded["outside_profile"] == [] and set(r["outside_profile_every_option"]) <= set(r["outside_profile"])
    text = plan_table(r)
    assert "| 16 | shared-sync mps * |" in text and "| 1 | dedicated |" in text
    assert "Outside the profiled region, the rows marked *: " in text


def test_without_steps_each_job_runs_its_own_and_sim_steps_needs_one_count():
    cfg = {"jobs": [{"task": "gsm8k", "steps": 4, "group": 0}, {"task": "sorting", "steps": 1, "group": 1}]}
    r = plan(cfg, total_jobs=4, per_gpu="1,4", policies="continuous", workers=1)  # a recorded run's pins dropped
    assert r["steps"] is None and r["job_steps"] == 4 + 1 + 4 + 1
    assert all(row["steps"] == 10 for row in r["rows"])
    four = _row(r, 4, "continuous mps")
    assert four["steps_per_gpu_hour"] == pytest.approx(10 / four["gpu_hours"])
    assert "4 jobs of their own steps (10 in all)" in plan_table(r)
    with pytest.raises(ConfigError, match="--sim-steps 3 projects every job to --steps S"):
        plan(cfg, total_jobs=4, sim_steps=3)


def test_a_price_a_gpu_hour_gives_each_option_its_cost():
    r = plan(total_jobs=4, steps=2, per_gpu="1,4", policies="shared-sync", workers=1, price_per_gpu_hour=3.5)
    assert all(row["cost"] == pytest.approx(row["gpu_hours"] * 3.5) for row in r["rows"])
    text = plan_table(r)
    assert "| cost |" in text and f"{r['rows'][0]['cost']:,.2f} |" in text and "at 3.5 a GPU-hour" in text
    with pytest.raises(ConfigError, match="--price 0"):
        plan(total_jobs=4, price_per_gpu_hour=0.0)


def test_arrivals_join_each_gpu_as_they_come_and_each_gpu_is_billed_from_its_first():
    """--arrive-every S: job i arrives i x S after the first; GPU g (jobs g*n ..) starts at its first
    job's arrival, so the last job ends at the latest GPU start plus its window, and a job's time
    runs from its own arrival. One GPU of all the jobs is nodus sim's run of them arriving S apart."""
    r = plan(total_jobs=8, steps=3, per_gpu="1,4,8", policies="continuous", workers=1, arrive_every=6.0)
    one = _row(r, 8, "continuous mps")
    whole = simulate(config_from_args(jobs=8, policy="continuous", steps=3, arrive_every=6.0))
    assert one["gpu_hours"] == pytest.approx(whole["gpu_seconds"] / 3600)
    assert one["hours"] == pytest.approx(whole["gpu_seconds"] / 3600)
    per_job = [d["finish_s"] - (d.get("arrive_s") or 0.0) for d in whole["per_job"].values()]
    assert one["mean_job_hours"] == pytest.approx(sum(per_job) / len(per_job) / 3600)
    four = _row(r, 4, "continuous mps")
    second = simulate(config_from_args({"jobs": [{**j.model_dump(exclude_none=True), "id": f"job{i}",
                                                  "seed": 1000 + 4 + i} for i, j in enumerate(default_jobs(8)[4:])]},
                                       policy="continuous", steps=3, arrive_every=6.0))
    assert four["hours"] >= (4 * 6.0 + second["gpu_seconds"]) / 3600 - 1e-9  # GPU 1 starts with job 4, at 24 s
    ded = _row(r, 1, "dedicated")
    assert ded["hours"] * 3600 > 7 * 6.0  # the last job arrives at 42 s and then runs
    assert "arriving 6 s apart (each GPU billed from its first job's arrival)" in plan_table(r)
    with pytest.raises(ConfigError, match="--sim-steps 3 with --arrive-every"):
        plan(total_jobs=4, steps=9, sim_steps=3, arrive_every=6.0)
    with pytest.raises(ConfigError, match="--arrive-every -1"):
        plan(total_jobs=4, arrive_every=-1.0)


def test_a_fixed_fleet_deals_jobs_in_turn_and_queues_them_beyond_each_gpus_slots():
    """--gpus G: job i to GPU i mod G, arriving i x S after the first; a GPU runs at most n at once
    (arm.max_active) and the rest wait. GPU 0 of the fleet is nodus sim's run of its jobs (0, G,
    2G, ..., arriving G x S apart) with that cap; n = 1 chains each job alone."""
    every, G = 1.0, 2
    r = plan(total_jobs=6, steps=3, per_gpu="1,2", policies="shared-sync", workers=1, gpus=G, arrive_every=every)
    two = _row(r, 2, "shared-sync mps")
    assert two["gpus"] == G and two["max_wait_h"] > 0  # job 4 waits for one of jobs 0 and 2 to end
    tpl = default_jobs(8)
    gpu = []
    for g in range(G):  # GPU g: jobs g, g+2, g+4, each its template's seed
        jobs = [{**tpl[i].model_dump(exclude_none=True), "id": f"job{k}", "seed": 1000 + i,
                 **({"arrive_s": k * G * every} if k else {})} for k, i in enumerate(range(g, 6, G))]
        gpu.append(simulate(config_from_args({"jobs": jobs}, policy="shared-sync", steps=3, max_active=2)))
    assert two["gpu_hours"] == pytest.approx(sum(x["gpu_seconds"] for x in gpu) / 3600)
    assert two["hours"] == pytest.approx(max(g * every + x["gpu_seconds"] for g, x in enumerate(gpu)) / 3600)
    waits = [d["start_s"] - (d.get("arrive_s") or 0.0) for x in gpu for d in x["per_job"].values()]
    assert two["max_wait_h"] == pytest.approx(max(waits) / 3600)
    assert two["mean_wait_h"] == pytest.approx(sum(waits) / len(waits) / 3600)
    # n = 1: each GPU's jobs one after another, each as alone; job k starts at max(its arrival,
    # the previous job's end), so with arrivals closer than a job's time the later ones wait
    one = _row(r, 1, "dedicated, one at a time")
    alone = [_sim_gpu_s([(i, tpl[i])], "dedicated", 3)[0] for i in range(6)]
    t_end = []
    for g in range(G):
        t = 0.0
        for k, i in enumerate(range(g, 6, G)):
            t = max(t, k * G * every) + alone[i]
        t_end.append(t)
    assert one["gpu_hours"] == pytest.approx(sum(t_end) / 3600)
    assert one["max_wait_h"] > 0 and one["gpu_hours_vs_dedicated"] == 1.0
    text = plan_table(r)
    assert "on a fleet of 2 GPUs" in text and "| mean / longest wait to start |" in text
    assert "GPU-hours vs one at a time" in text
    # a cap above a GPU's share (3 jobs) never binds: it is taken as 3
    assert {x["per_gpu"] for x in plan(total_jobs=6, steps=2, per_gpu="1,8", policies="shared-sync",
                                       workers=1, gpus=G)["rows"]} == {1, 3}


def test_a_wait_limit_picks_the_cheapest_option_whose_jobs_start_in_time_and_bad_fleets_are_errors():
    r = plan(total_jobs=8, steps=3, per_gpu="1,2,4", policies="shared-sync", workers=1, gpus=2, arrive_every=1.0,
             max_wait_h=0.0)
    one = _row(r, 1, "dedicated, one at a time")
    assert one["max_wait_h"] > 0 and not one["meets"]
    assert all(x["meets"] == (x["max_wait_h"] <= 1e-12) for x in r["rows"])
    assert "within a wait of 0.0 s" in plan_table(r)
    with pytest.raises(ConfigError, match="--gpus 0"):
        plan(total_jobs=4, gpus=0)
    with pytest.raises(ConfigError, match="--gpus 2 fixes the fleet"):
        plan(total_jobs=4, gpus=2, max_gpus=3)
    with pytest.raises(ConfigError, match="--sim-steps 3 with --gpus"):
        plan(total_jobs=4, steps=9, sim_steps=3, gpus=2)
    with pytest.raises(ConfigError, match="--max-wait-h -1"):
        plan(total_jobs=4, max_wait_h=-1.0)


def test_a_plan_prices_two_stacks_at_the_micro_batch_the_real_backend_fits_and_says_so():
    """Two stacks' default 16k micro-batch does not fit an H200 beside the engines (session 29 trained
    eager): the plan's two-stack loads train at 8192, as `nodus sim` and the real backend do, their
    row equals a direct simulation at 8192, and the table says so; one-stack loads keep 16384."""
    r = plan(total_jobs=8, steps=2, per_gpu="8", policies="shared-sync", stacks="1,2", workers=1)
    assert r["trainer_microbatch_fitted"] == {"2": 8192}
    assert "8192 tokens on 2 stacks" in plan_table(r)
    two = next(x for x in r["rows"] if x["stacks"] == 2 and x["per_gpu"] == 8)
    jobs = [{**j.model_dump(exclude_none=True), "id": f"job{i}", "seed": 1000 + i} for i, j in enumerate(default_jobs(8))]
    cfg = config_from_args({"jobs": jobs, "trainer": {"max_tokens_per_microbatch": 8192}}, policy="shared-sync",
                           steps=2, sharing="mps", stacks=2, profile=r["profile"])
    from nodus.plan import with_default_packing

    make = backend_factory(cfg.profile)
    cfg = with_default_packing(cfg, make.cost.profile.train.step_mode == "graphed")
    (spans,) = run_spans(cfg, make)
    assert make.fitted == {}  # set in the config: nothing fitted
    assert two["gpu_hours"] == pytest.approx(summarize([spans])["gpu_seconds"] / 3600)
