"""Capacity plans: how many GPUs a fleet of jobs needs, packed n to a GPU on an arm, and for how long.

``nodus plan --total-jobs J [--steps S]`` deals the jobs (the config's jobs, or the reference
workload's, repeated to J) to GPUs n at a time, in order, for each packing n (1: a GPU per job)
and each shared arm; the last GPU takes the rest. Each distinct GPU load is simulated for its jobs'
steps (S each, or each job's own ``steps`` from the config; ``--sim-steps N`` with S: N steps,
projected to S by the load's steady pace, start and drain paid once;
``nodus.accounting.projected_steps_per_gpu_hour``). A GPU is billed until its last job ends.
Per option: the GPUs, the hours until every job is done (the slowest GPU), each job's mean hours,
the GPU-hours, steps per GPU-hour and the GPU-hours against a GPU per job; with ``--deadline-h``
and ``--max-gpus``, which options meet them, and the one that costs fewest GPU-hours, with the
profile's held-out error as its error bar (options closer than that are a tie to the simulator).
Jobs are taken as submitted together, or ``--arrive-every S`` apart. ``--gpus G``: a fixed fleet
of G GPUs for every option, job i dealt to GPU i mod G; a GPU runs at most n of its jobs at once
(``arm.max_active``) and the rest queue for a slot (n = 1: one after another, each alone, chained
from its one-job simulation); each option reports its jobs' mean and longest wait to start, which
``--max-wait-h`` limits.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from nodus.accounting import summarize
from nodus.config import SHARINGS, ConfigError, default_jobs, planning_profile, with_default_packing
from nodus.outdir import make_out_dir, write_json
from nodus.runner import run_spans
from nodus.simulate import config_from_args, error_bar_line, parse_list

PLAN_POLICIES = ("shared-sync", "overlap", "continuous")  # the shared arms a plan weighs by default
MIN_PROJECTION_STEPS = 3  # --sim-steps: a steady pace needs a job's first and a later generation


def arm_name(policy: str, groups: int, sharing: str, stacks: int) -> str:
    if policy == "dedicated":
        return "dedicated"
    return (f"{policy}{f' g={groups}' if policy == 'overlap' else ''} {sharing}"
            f"{f' k{stacks}' if stacks > 1 else ''}")


def arm_fits(policy: str, groups: int, stacks: int, jobs: int) -> bool:
    """Whether ``jobs`` jobs can run the arm: every group of every stack needs a job."""
    if policy == "dedicated":
        return True
    per = groups if policy == "overlap" else 1
    return jobs >= stacks * per and (policy != "overlap" or groups >= 2)


def _gpu_arm(arm: tuple, jobs: int) -> tuple:
    """The arm a GPU of ``jobs`` jobs runs: ``arm``, or, for a last GPU too small for it, one
    stack of shared-sync (a job alone: its own dedicated-style loop)."""
    policy, groups, sharing, stacks = arm
    if arm_fits(policy, groups, stacks, jobs):
        return arm
    return ("shared-sync", 1, sharing, 1)


def _simulate_load(task: tuple) -> dict:
    """One GPU load: (base config dict, template indices, arm, steps, sim_steps, arrivals, cap) ->
    its billed seconds from its first job's arrival, steps, each job's finish and first generation
    (in load order, from the same start), projected to ``steps`` when ``sim_steps`` is fewer, and
    the profile's flags. ``arrivals``: each job's arrival from the first's; ``cap``: at most that
    many jobs under way (``arm.max_active``), None for no cap."""
    from sim import backend_factory

    base, templates, load, (policy, groups, sharing, stacks), steps, sim_steps, arrivals, cap = task
    # A job's seed is its template's (run seed x 1000 + template index, as RunConfig.resolved gives
    # the templates' config): the same draws alone on a GPU and packed with others.
    data = dict(base, jobs=[{"seed": base["seed"] * 1000 + t, **templates[t], "id": f"job{i}",
                             **({"arrive_s": arrivals[i]} if arrivals[i] else {})}
                            for i, t in enumerate(load)])
    n = sim_steps or steps  # None: each job's own steps
    cfg = config_from_args(data, policy=policy, groups=groups, sharing=sharing, steps=n,
                           stacks=stacks if stacks > 1 else None, max_active=cap)
    make = backend_factory(cfg.profile)
    cfg = with_default_packing(cfg, make.cost.profile.train.step_mode == "graphed")  # as nodus sim packs rows
    (spans,) = run_spans(cfg, make)  # one run: a shared GPU's, or a dedicated GPU's one job
    s = summarize([spans])
    gpu_s = s["gpu_seconds"]
    per_job = [s["per_job"][f"job{i}"] for i in range(len(load))]
    finish, start = [d["finish_s"] for d in per_job], [d["start_s"] for d in per_job]
    if sim_steps:
        pace = s["pace"]
        if not pace:
            raise ConfigError(f"--sim-steps {n}: the simulated load has no steady pace to project "
                              f"{steps} steps from; simulate more steps")
        per_s = pace["pace_steps_per_gpu_hour"] / 3600 / pace["jobs"]  # one job's steps a second
        gpu_s = pace["ramp_gpu_s"] + steps / per_s
        finish = [t + (steps - n) / per_s for t in finish]
    done = len(finish) * steps if sim_steps else s["steps"]
    return {"gpu_s": gpu_s, "steps": done, "finish_s": finish, "start_s": start, "flags": sorted(make.cost.flags),
            "microbatch": dict(make.fitted)}  # the default micro-batch fitted to the profile's GPU (stacks -> tokens)


def _one_at_a_time(alone: list[dict], arrivals: tuple) -> dict:
    """A GPU of a fixed fleet that runs its jobs one after another, each alone (the dedicated arm
    on ``--gpus G``): job k starts at its arrival or at job k-1's end, whichever is later, and runs
    as it does alone (``alone[k]``: its one-job load). Billed from its first job's arrival to its
    last job's end, idle gaps included."""
    t, finish, start = 0.0, [], []
    for x, a in zip(alone, arrivals):
        t0 = max(t, a)
        start.append(t0 + x["start_s"][0])
        t = t0 + x["gpu_s"]
        finish.append(t0 + x["finish_s"][0])
    return {"gpu_s": t, "steps": sum(x["steps"] for x in alone), "finish_s": finish, "start_s": start,
            "flags": sorted({f for x in alone for f in x["flags"]}),
            "microbatch": {k: v for x in alone for k, v in x.get("microbatch", {}).items()}}


def plan(config: dict | None = None, *, total_jobs: int, steps: int | None = None, per_gpu: str = "1,2,4,8,16",
         policies: str = ",".join(PLAN_POLICIES), groups: str = "2", sharing: str = "mps", stacks: str = "1",
         profile: str | None = None, gpu: str = "h200", seed: int = 1, deadline_h: float | None = None,
         price_per_gpu_hour: float | None = None, arrive_every: float | None = None,
         max_gpus: int | None = None, gpus: int | None = None, max_wait_h: float | None = None,
         sim_steps: int | None = None, workers: int | None = None,
         out: str | Path | None = None, progress: bool = False) -> dict:
    """The options for ``total_jobs`` jobs of ``steps`` steps each (None: each job's own, its
    template's ``steps``; module docstring). ``config``: a
    config file's dict: its jobs are the templates (repeated in order to ``total_jobs``), its
    engine, trainer, audit and profile apply to every option; its arm is replaced by each option's.
    ``gpus``: a fixed fleet of that many GPUs for every option, the jobs dealt to them in turn, each
    GPU running at most n at once (the rest queue for a slot; ``arm.max_active``); n = 1 runs a
    GPU's jobs one after another, each alone. ``max_wait_h``: no job waits longer than that to start."""
    if total_jobs < 1:
        raise ConfigError(f"--total-jobs {total_jobs}: a plan needs at least one job")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: steps must be >= 1")
    if deadline_h is not None and not (deadline_h > 0 and math.isfinite(deadline_h)):
        raise ConfigError(f"--deadline-h {deadline_h}: hours, a number > 0")
    if price_per_gpu_hour is not None and not (price_per_gpu_hour > 0 and math.isfinite(price_per_gpu_hour)):
        raise ConfigError(f"--price {price_per_gpu_hour}: what a GPU-hour costs, a number > 0")
    if max_gpus is not None and max_gpus < 1:
        raise ConfigError(f"--max-gpus {max_gpus}: at least one GPU")
    if gpus is not None:
        if gpus < 1:
            raise ConfigError(f"--gpus {gpus}: a fleet of at least one GPU")
        if max_gpus is not None:
            raise ConfigError(f"--gpus {gpus} fixes the fleet; --max-gpus {max_gpus} limits the fleets a plan "
                              "chooses among: give one")
        if sim_steps is not None:
            raise ConfigError(f"--sim-steps {sim_steps} with --gpus: jobs queued for a slot have no steady pace to "
                              "project from; simulate every step")
    if max_wait_h is not None and not (max_wait_h >= 0 and math.isfinite(max_wait_h)):
        raise ConfigError(f"--max-wait-h {max_wait_h}: hours a job may wait to start, a number >= 0")
    if sim_steps is not None and not MIN_PROJECTION_STEPS <= sim_steps:
        raise ConfigError(f"--sim-steps {sim_steps}: at least {MIN_PROJECTION_STEPS} steps (a steady pace to "
                          "project from)")
    arrive_every = arrive_every or None  # checked with the config below (config_from_args)
    if sim_steps is not None and arrive_every:
        raise ConfigError(f"--sim-steps {sim_steps} with --arrive-every: jobs arriving apart have no steady pace "
                          "to project from; simulate every step")
    if sim_steps is not None and steps is None:
        raise ConfigError(f"--sim-steps {sim_steps} projects every job to --steps S: give --steps (one step count "
                          "for every job)")
    sim_steps = sim_steps if sim_steps is not None and sim_steps < steps else None
    packs = sorted(set(parse_list(per_gpu, int, "per-gpu")))
    if packs[0] < 1:
        raise ConfigError(f"--per-gpu {per_gpu}: jobs a GPU, integers >= 1")
    if gpus is not None:  # a fleet's GPU holds at most ceil(J / G) jobs: a larger cap never binds
        gpus = min(gpus, total_jobs)
        packs = sorted({min(n, math.ceil(total_jobs / gpus)) for n in packs})
    else:
        packs = [n for n in packs if n <= total_jobs] or [total_jobs]
    pols = parse_list(policies, str, "policies")
    bad = [p for p in pols if p not in PLAN_POLICIES]
    if bad:
        raise ConfigError(f"--policies: {bad} cannot pack jobs on a GPU here; choose from {', '.join(PLAN_POLICIES)} "
                          "(a GPU per job is --per-gpu 1)")
    shr = parse_list(sharing, str, "sharing")
    if any(s not in SHARINGS for s in shr):
        raise ConfigError(f"--sharing {sharing}: choose from {', '.join(SHARINGS)}")
    grp, stk = parse_list(groups, int, "groups"), parse_list(stacks, int, "stacks")
    if min(grp) < 2 or min(stk) < 1:
        raise ConfigError(f"--groups {groups} / --stacks {stacks}: overlap's groups >= 2, stacks >= 1")
    base = {k: v for k, v in (config or {}).items() if k not in ("jobs", "arm")}
    base["seed"] = seed
    if profile is not None:
        base["profile"] = profile
    if "profile" not in base:
        # As nodus sim: the GPU's shipped profile (stacks under MPS: the one with the stacks' rates).
        base["profile"] = planning_profile(gpu, max(stk) > 1 and "mps" in shr)
    templates = (config or {}).get("jobs") or [j.model_dump(exclude_none=True) for j in default_jobs(8)]
    # A plan deals the jobs itself: a template's group or stack pin (a recorded run's) is dropped.
    templates = [{k: v for k, v in t.items() if k not in ("group", "stack")} if isinstance(t, dict) else t
                 for t in templates]
    if any(t.get("arrive_s") for t in templates if isinstance(t, dict)):
        raise ConfigError("jobs[].arrive_s: nodus plan deals the jobs itself; give their spacing as --arrive-every S "
                          "(or simulate one GPU's arrivals with nodus sim)")
    from sim.profile import load_profile

    config_from_args(dict(base, jobs=templates), arrive_every=arrive_every)  # a bad one fails here, before forking
    validation = load_profile(base["profile"]).validation() or {}
    arms = [(p, g if p == "overlap" else 1, s, k) for p in pols for g in (grp if p == "overlap" else [1])
            for s in shr for k in stk]
    options = [(1, ("dedicated", 1, "none", 1))]
    options += [(n, a) for n in packs if n > 1 for a in dict.fromkeys(arms) if arm_fits(a[0], a[1], a[3], n)]
    # Each option's GPUs and their loads (template indices); equal loads are simulated once. A GPU:
    # its first job's arrival (its start), each job's arrival from that, and the load keys it is
    # simulated by (one, or each job's own when it runs them one at a time: "alone").
    T = len(templates)
    every = arrive_every or 0.0
    layouts, tasks = {}, {}

    def task(load: tuple, arm: tuple, arrivals: tuple, cap: int | None) -> tuple:
        key = (load, arm, arrivals, cap)
        tasks.setdefault(key, (base, templates, load, arm, steps, sim_steps, arrivals, cap))
        return key

    for n, arm in options:
        fleet = []
        if gpus is None:  # ceil(J / n) GPUs, n consecutive jobs each
            deal = [range(g * n, min((g + 1) * n, total_jobs)) for g in range(math.ceil(total_jobs / n))]
        else:  # G GPUs, job i to GPU i mod G
            deal = [range(g, total_jobs, gpus) for g in range(gpus)]
        for idx in deal:
            load = tuple(i % T for i in idx)
            arrivals = tuple((i - idx[0]) * every for i in idx)
            if gpus is not None and n == 1:  # one after another, each alone: a one-job load each
                keys = [task((t,), arm, (0.0,), None) for t in load]
                fleet.append({"start": idx[0] * every, "keys": keys, "arrivals": arrivals, "alone": True})
                continue
            cap = n if gpus is not None and len(load) > n else None
            key = task(load, _gpu_arm(arm, len(load)), arrivals, cap)
            fleet.append({"start": idx[0] * every, "keys": [key], "arrivals": arrivals, "alone": False})
        layouts[(n, arm)] = fleet
    t0 = time.perf_counter()
    results = {}
    workers = workers or min(os.cpu_count() or 1, 8)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futs = {key: pool.submit(_simulate_load, t) for key, t in tasks.items()}
        for i, (key, f) in enumerate(futs.items(), 1):
            results[key] = f.result()
            if progress:
                print(f"\rplan: {i}/{len(futs)} GPU loads simulated", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    rows = []
    for (n, arm), fleet in layouts.items():
        # Each GPU starts at its first job's arrival; a job's time and wait run from its own arrival.
        per = [_one_at_a_time([results[k] for k in g["keys"]], g["arrivals"]) if g["alone"] else results[g["keys"][0]]
               for g in fleet]
        gpu_s, steps_done = sum(x["gpu_s"] for x in per), sum(x["steps"] for x in per)
        finishes = [t - a for g, x in zip(fleet, per) for t, a in zip(x["finish_s"], g["arrivals"])]
        waits = [t - a for g, x in zip(fleet, per) for t, a in zip(x["start_s"], g["arrivals"])]
        until = max(g["start"] + x["gpu_s"] for g, x in zip(fleet, per))
        last = {key[1] for g in fleet for key in g["keys"]} - {arm}
        name = "dedicated, one at a time" if gpus is not None and arm[0] == "dedicated" else arm_name(*arm)
        rows.append({"per_gpu": n, "arm": name, "policy": arm[0], "groups": arm[1], "sharing": arm[2],
                     "stacks": arm[3], "gpus": len(per), "hours": until / 3600,
                     "mean_job_hours": sum(finishes) / len(finishes) / 3600, "gpu_hours": gpu_s / 3600,
                     "mean_wait_h": sum(waits) / len(waits) / 3600, "max_wait_h": max(waits) / 3600,
                     "steps": steps_done, "steps_per_gpu_hour": steps_done / gpu_s * 3600,
                     "outside_profile": sorted({f for x in per for f in x["flags"]}),
                     **({"last_gpu": arm_name(*next(iter(last)))} if last else {})})
    dedicated = next(r for r in rows if r["policy"] == "dedicated")
    for r in rows:
        r["gpu_hours_vs_dedicated"] = r["gpu_hours"] / dedicated["gpu_hours"]
        if price_per_gpu_hour is not None:
            r["cost"] = r["gpu_hours"] * price_per_gpu_hour
        r["meets"] = ((deadline_h is None or r["hours"] <= deadline_h)
                      and (max_gpus is None or r["gpus"] <= max_gpus)
                      and (max_wait_h is None or r["max_wait_h"] <= max_wait_h + 1e-12))
    rows.sort(key=lambda r: (r["gpu_hours"], r["hours"]))
    # Flags every option shares tell no option apart: a row keeps its own (``outside_profile``).
    common = set.intersection(*(set(r["outside_profile"]) for r in rows))
    for r in rows:
        r["outside_profile"] = [f for f in r["outside_profile"] if f not in common]
    fits = [r for r in rows if r["meets"]]
    error = validation.get("heldout_mape")
    best = None
    if fits:
        best = {"per_gpu": fits[0]["per_gpu"], "arm": fits[0]["arm"], "gpu_hours": fits[0]["gpu_hours"],
                "outside_profile": bool(fits[0]["outside_profile"])}
        if len(fits) > 1:
            gap = fits[1]["gpu_hours"] / fits[0]["gpu_hours"] - 1
            best.update(next=f"{fits[1]['per_gpu']} a GPU, {fits[1]['arm']}", next_gap=gap,
                        within_error=error is not None and gap < error)
    flags = sorted({f for v in results.values() for f in v["flags"]})
    # Where the config leaves the micro-batch at its default, each GPU load's trainers train at what
    # the real backend would fit to the profile's GPU (nodus.gpumemory): stacks -> tokens.
    fitted = {str(k): v for x in results.values() for k, v in sorted(x.get("microbatch", {}).items())}
    result = {"total_jobs": total_jobs, "steps": steps, "job_steps": dedicated["steps"], "arrive_every_s": arrive_every,
              "fleet_gpus": gpus, "max_wait_h": max_wait_h,
              "sim_steps": sim_steps, "profile": base["profile"],
              "deadline_h": deadline_h, "max_gpus": max_gpus, "price_per_gpu_hour": price_per_gpu_hour,
              "rows": rows, "best": best,
              "profile_validation": validation, "outside_profile": flags,
              "outside_profile_every_option": sorted(common), "trainer_microbatch_fitted": fitted,
              "loads_simulated": len(tasks), "wall_s": time.perf_counter() - t0, "workers": workers}
    if out is not None:
        out_dir = make_out_dir(out)
        write_json(out_dir / "plan.json", result)
        (out_dir / "plan.md").write_text(plan_table(result) + "\n")
    return result


def _hours(h: float) -> str:
    """A duration for the table: seconds under a minute, minutes under an hour, else hours."""
    return f"{h * 3600:.1f} s" if h < 1 / 60 else f"{h * 60:.1f} min" if h < 1 else f"{h:.2f} h"


def plan_table(result: dict) -> str:
    limits = [f"{result['deadline_h']:g} h" if result.get("deadline_h") else "",
              f"{result['max_gpus']} GPUs" if result.get("max_gpus") else "",
              f"a wait of {_hours(result['max_wait_h'])}" if result.get("max_wait_h") is not None else ""]
    limit = " and ".join(x for x in limits if x)
    priced = result.get("price_per_gpu_hour") is not None
    sim = (f"; simulated {result['sim_steps']} steps a job, projected by the steady pace" if result.get("sim_steps")
           else "")
    each = (f"{result['steps']} steps" if result.get("steps") else
            f"their own steps ({result['job_steps']} in all)")
    every = (f", arriving {result['arrive_every_s']:g} s apart (each GPU billed from its first job's arrival)"
             if result.get("arrive_every_s") else "")
    fleet = result.get("fleet_gpus")
    if fleet:
        every += (f", on a fleet of {fleet} GPUs (jobs dealt in turn; a GPU runs at most its jobs-a-GPU at once, "
                  "the rest queue; 1: one after another, each alone)")
    waits = bool(fleet or result.get("arrive_every_s"))
    lines = [f"{result['total_jobs']} jobs of {each}{every} on profile {result['profile']}{sim}:", "",
             "| jobs a GPU | arm | GPUs | until the last job ends | a job's mean time |"
             + (" mean / longest wait to start |" if waits else "") + " GPU-hours | steps per GPU-hour "
             f"| GPU-hours vs {'one at a time' if fleet else 'a GPU per job'} |" + (" cost |" if priced else "") + (f" within {limit} |" if limit else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if waits else "") + ("---|" if priced else "")
             + ("---|" if limit else "")]
    for r in result["rows"]:
        arm = (r["arm"] + (f" (last GPU {r['last_gpu']})" if r.get("last_gpu") else "")
               + (" *" if r.get("outside_profile") else ""))
        wait = f" {_hours(r['mean_wait_h'])} / {_hours(r['max_wait_h'])} |" if waits else ""
        lines.append(f"| {r['per_gpu']} | {arm} | {r['gpus']} | {_hours(r['hours'])} | {_hours(r['mean_job_hours'])} |"
                     f"{wait} {r['gpu_hours']:.3g} | {r['steps_per_gpu_hour']:.0f} | {r['gpu_hours_vs_dedicated']:.3f} |"
                     + (f" {r['cost']:,.2f} |" if priced else "")
                     + ((" yes |" if r["meets"] else " no |") if limit else ""))
    b = result.get("best")
    lines.append("")
    if b is None:
        rows = result["rows"]
        line = f"No option is within {limit}."
        if result.get("deadline_h") and result.get("max_gpus"):  # what each limit alone allows
            fleet = [r for r in rows if r["gpus"] <= result["max_gpus"]]
            fast = [r for r in rows if r["hours"] <= result["deadline_h"]]
            if fleet:
                r = min(fleet, key=lambda r: r["hours"])
                line += (f" Soonest on {result['max_gpus']} GPUs or fewer: {r['per_gpu']} jobs a GPU, {r['arm']}, "
                         f"{_hours(r['hours'])}.")
            if fast:
                r = min(fast, key=lambda r: (r["gpus"], r["gpu_hours"]))
                line += (f" Fewest GPUs within {result['deadline_h']:g} h: {r['gpus']} ({r['per_gpu']} jobs a GPU, "
                         f"{r['arm']}).")
        lines.append(line)
    else:
        line = (f"Fewest GPU-hours{' within ' + limit if limit else ''}: {b['per_gpu']} jobs a GPU, {b['arm']} "
                f"({b['gpu_hours']:.3g} GPU-hours"
                + (f", {b['gpu_hours'] * result['price_per_gpu_hour']:,.2f} at "
                   f"{result['price_per_gpu_hour']:g} a GPU-hour" if priced else "") + ")")
        if b.get("next"):
            line += (f"; next {b['next']}, {b['next_gap']:+.1%}"
                     + (", within the profile's error: the simulator cannot tell them apart" if b["within_error"]
                        else ""))
        if b.get("outside_profile"):
            line += "; it lies outside the profiled region (below), so its error may be larger"
        lines.append(line + ".")
    lines += ["", error_bar_line(result.get("profile_validation"), result["rows"])]
    fitted = result.get("trainer_microbatch_fitted")
    if fitted:
        lines += ["", "Trainer micro-batch fitted to the profile's GPU, as the real backend fits it (the default's "
                  "graphed trainers would not fit beside the engines): " + ", ".join(
                      f"{v} tokens on {k} stack{'s' if k != '1' else ''}" for k, v in sorted(fitted.items()))
                  + " (set trainer.max_tokens_per_microbatch in the config to choose)."]
    every = result.get("outside_profile_every_option") or []
    if every:
        lines += ["", "Outside the profiled region, every option: " + "; ".join(every)]
    own = [f for f in result.get("outside_profile") or [] if f not in every]
    if own:
        lines += ["", "Outside the profiled region, the rows marked *: " + "; ".join(own)]
    return "\n".join(lines)
