"""`nodus sim`, `nodus sweep` and `nodus report` as Python functions.

The simulator backend is imported lazily, so `import nodus` needs neither simpy nor torch.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from nodus.config import (AUTO_SHARE_PROMPTS, POLICIES, SHARINGS, AuditSpec, ConfigError, RunConfig, build_config,
                          default_jobs, packed_rows, planning_profile, size_engine_graphs, stacks_of)
from nodus.outdir import git_commit, make_out_dir, write_json
from nodus.runner import late_arrivals, run_arm, run_spans, size_engine_slots
from nodus.accounting import summarize
from nodus.timeline import plot_gantt, plot_learning_curves, read_jsonl, stored, write_chrome_trace, write_jsonl


def config_from_args(config: dict | None = None, *, jobs: int | None = None, policy: str | None = None,
                     groups: int | None = None, sharing: str | None = None, steps: int | None = None,
                     seed: int | None = None, profile: str | None = None,
                     share_prompts: int | None = None, stacks: int | None = None,
                     lockstep: bool | None = None, offset_stacks: bool | None = None,
                     hold_apart: float | None = None, arrive_every: float | None = None,
                     max_active: int | None = None, max_lead: int | None = None) -> RunConfig:
    """A config file's dict (or the embedded default) with command-line overrides applied; a new
    run's adapter slots sized to its largest group, for overlap (``nodus.runner.size_engine_slots``),
    and its engine graphs to the sequences those slots can hold (``size_engine_graphs``)."""
    data = dict(config or {})
    if jobs is not None:
        if "jobs" in data:
            raise ConfigError(f"--jobs {jobs} and the config's jobs list both set the jobs; use one")
        data["jobs"] = [j.model_dump(exclude_none=True) for j in default_jobs(jobs)]
    data.setdefault("jobs", [j.model_dump(exclude_none=True) for j in default_jobs(8)])
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps {steps}: steps must be >= 1")
        data["jobs"] = [{**j, "steps": steps} for j in data["jobs"]]
    if arrive_every is not None:  # job i arrives i x S seconds after the start, in the jobs' order
        if not arrive_every >= 0 or arrive_every == float("inf"):
            raise ConfigError(f"--arrive-every {arrive_every}: seconds between arrivals, a number >= 0")
        if any(j.get("arrive_s") for j in data["jobs"]):
            raise ConfigError(f"--arrive-every {arrive_every:g} and the config's jobs[].arrive_s both set arrivals; "
                              "use one")
        data["jobs"] = [{**j, **({"arrive_s": i * arrive_every} if i and arrive_every else {})}
                        for i, j in enumerate(data["jobs"])]
    arm = dict(data.get("arm", {}))
    for key, val in (("policy", policy), ("groups", groups), ("sharing", sharing), ("stacks", stacks),
                     ("lockstep", lockstep), ("offset_stacks", offset_stacks), ("hold_apart", hold_apart),
                     ("max_active", max_active), ("max_lead", max_lead)):
        if val is not None:
            arm[key] = val
    if hold_apart:  # stacks held apart start apart
        arm["offset_stacks"] = True
    if "policy" not in arm and len(data["jobs"]) == 1:
        arm["policy"] = "shared-sync"  # one job cannot be split into phase-offset groups
    if arm.get("policy") in ("shared-sync", "dedicated", "continuous") and groups is None:
        arm.setdefault("groups", 1)  # (continuous: a group per job; the field is unused)
    data["arm"] = arm
    if seed is not None:
        data["seed"] = seed
    if share_prompts is not None:
        if share_prompts < 0:
            raise ConfigError(f"--share-prompts {share_prompts}: responses a row holds, an integer >= 0 (0: none)")
        data["trainer"] = {**data.get("trainer", {}), "share_prompts": share_prompts}
    if profile is not None:
        data["profile"] = profile
    return size_engine_graphs(size_engine_slots(build_config(data)))  # the slots bound the sequences


def simulate(cfg: RunConfig, out: str | Path | None = None, machine: dict | None = None) -> dict:
    """Run one arm in the simulator (plus its dedicated baseline); write a run folder if `out`.
    ``machine``: a machine's speed (``calibration.validate.machine_factor``) to scale the prediction
    to (``scale_to_machine``)."""
    from sim import backend_factory

    out_dir = make_out_dir(out) if out is not None else None
    make = backend_factory(cfg.profile)
    summary, runs = run_arm(cfg, make)
    summary["backend"] = "sim"
    summary["profile"] = {"source": make.cost.source, "environment": make.cost.profile.environment.model_dump()}
    summary["assumptions"] = make.cost.assumptions()
    summary["profile_validation"] = make.cost.validation()
    summary["outside_profile"] = sorted(make.cost.flags)
    if make.fitted:  # the default micro-batch fitted to the profile's GPU, as the real backend fits it
        summary["trainer_microbatch_fitted"] = {str(k): v for k, v in sorted(make.fitted.items())}
    if machine:
        summary = scale_to_machine(summary, machine)
    if out_dir is not None:
        write_run(out_dir, cfg, summary, runs)
    return summary


def scale_to_machine(summary: dict, machine: dict) -> dict:
    """A simulated summary at one machine's speed (``calibration.validate.machine_factor``): its
    steps/GPU-h and steady pace times the factor of the machine's runs of the arm's own kind
    (dedicated or shared, ``calibration.validate.run_kind``; all the runs where none is of that kind,
    said under ``machine.kind_missing``), the unscaled figure and the factor used kept under
    ``machine``. With runs of both kinds, the dedicated baseline is scaled by the dedicated runs'
    factor and the ratios vs dedicated by the shared over the dedicated factor (on the H200's held-out
    runs with the same machine's dedicated run of their seed: the ratio 5.9% off as simulated, 5.1%
    so scaled, bias -2.2% -> +0.0%; 24 runs, 7 machines; ``calibration.validate.machine_kinds``);
    otherwise the ratios stay as simulated."""
    from calibration.validate import run_kind

    kinds = machine.get("kinds") or {}
    kind = run_kind(summary["arm"]["policy"])
    own = kinds.get(kind)
    f = own["factor"] if own else machine["factor"]
    info = dict(machine, factor=f, kind=kind, unscaled_steps_per_gpu_hour=summary["steps_per_gpu_hour"])
    if not own:
        info["kind_missing"] = kind
    out = dict(summary, steps_per_gpu_hour=summary["steps_per_gpu_hour"] * f, machine=info)
    if (summary.get("pace") or {}).get("pace_steps_per_gpu_hour"):
        out["pace"] = dict(summary["pace"], pace_steps_per_gpu_hour=summary["pace"]["pace_steps_per_gpu_hour"] * f)
    if kind == "shared" and own and "dedicated" in kinds:
        r = f / kinds["dedicated"]["factor"]
        info["ratio_factor"] = r
        if summary.get("dedicated_steps_per_gpu_hour"):
            out["dedicated_steps_per_gpu_hour"] = summary["dedicated_steps_per_gpu_hour"] * kinds["dedicated"]["factor"]
        for key in ("ratio_vs_dedicated", "pace_ratio_vs_dedicated"):
            if summary.get(key) is not None:
                out[key] = summary[key] * r
    return out


def write_run(out_dir: Path, cfg: RunConfig, summary: dict, runs) -> None:
    write_json(out_dir / "config.json", cfg.model_dump(mode="json"))
    # Which code made the run: a profile fitted on it names it (nodus fit).
    write_json(out_dir / "summary.json", {**summary, "git_commit": summary.get("git_commit") or git_commit()})
    write_jsonl(runs, out_dir / "spans.jsonl")
    render_run(out_dir)


def render_run(out_dir: Path) -> None:
    """What a run folder's summary.json and spans.jsonl give: table.md, trace.json (Perfetto),
    gantt.png and learning_curves.png (`nodus report` redraws a recorded run's from them)."""
    summary = json.loads((out_dir / "summary.json").read_text())
    runs = read_jsonl(out_dir / "spans.jsonl")
    write_chrome_trace(runs, out_dir / "trace.json")
    from nodus.compare import config_share_prompts

    share = config_share_prompts(out_dir / "config.json")
    (out_dir / "table.md").write_text(render_table(summary, share) + "\n")
    arm = summary["arm"]
    title = (f"{summary['jobs']} jobs, {arm['policy']} groups={arm['groups']} sharing={arm['sharing']}"
             + (f" stacks={arm['stacks']}" if stacks_of(arm) > 1 else "")
             + (f" share_prompts={share}" if packed_rows(share) else ""))
    plot_gantt(runs[0], out_dir / "gantt.png", title=title + (" (GPU 0 of dedicated)" if len(runs) > 1 else ""))
    plot_learning_curves(summary["per_job"], out_dir / "learning_curves.png", title=title)


def trainer_graph_failures(summary: dict) -> list[str]:
    """Each trainer of a real run whose CUDA-graph capture failed, so that it trained eager, as
    'trainerN: why' (e.g. out of memory beside a second stack's engine and trainer, session 29:
    the run goes on, and is no graphed run); [] when none did (or none was asked to capture)."""
    failed: dict[str, str] = {}  # a dedicated run records its one trainer once a job: the first error each
    for d in summary.get("diagnostics", []):
        for name, w in sorted(((d.get("workers") or {}) if isinstance(d, dict) else {}).items()):
            if name.startswith("trainer") and w.get("graph_error"):
                failed.setdefault(name, w["graph_error"].splitlines()[0][:120])
    return [f"{name}: {why}" for name, why in failed.items()]


def render_table(s: dict, share_prompts: int = 0) -> str:
    """A run's summary as a table; ``share_prompts`` (the run config's trainer.share_prompts) names a
    trainer that packed each prompt's responses into rows."""
    arm = s["arm"]
    share = packed_rows(share_prompts)
    packed = f", each prompt's responses {share} to a row" if share else ""
    lines = [
        f"| {s['jobs']} jobs, {arm['policy']} (groups {arm['groups']}, sharing {arm['sharing']}{packed}"
        f"{', ' + str(arm['stacks']) + ' stacks' if stacks_of(arm) > 1 else ''}"
        f"{', at most ' + str(arm['max_active']) + ' under way' if arm.get('max_active') else ''}) | value |",
        "|---|---|",
        f"| optimizer steps per GPU-hour | {s['steps_per_gpu_hour']:.1f} |",
    ]
    if s.get("ratio_vs_dedicated") is not None:
        lines += [f"| dedicated GPU per job | {s['dedicated_steps_per_gpu_hour']:.1f} |",
                  f"| ratio vs dedicated | {s['ratio_vs_dedicated']:.3f}x |"]
    lines += [
        f"| rollout tokens per GPU-second | {s['rollout_tokens_per_gpu_s']:.0f} |",
        f"| GPU-seconds (window, drain included) | {s['gpu_seconds']:.1f} |",
    ]
    pace = s.get("pace") or {}
    if pace:  # the window split into the jobs' steady pace and what starting and draining them cost
        ratio = s.get("pace_ratio_vs_dedicated")
        lines += [f"| steady pace: steps per GPU-hour once every job is under way"
                  f"{' (ratio vs dedicated)' if ratio else ''} | {pace['pace_steps_per_gpu_hour']:.1f}"
                  f"{f' ({ratio:.3f}x)' if ratio else ''} |",
                  f"| GPU-seconds of start and drain (the window less its steps at that pace) | "
                  f"{pace['ramp_gpu_s']:.1f} |"]
    lines += [
        f"| busy: engine / trainer / GPU | {s['busy']['engine']:.2f} / {s['busy']['trainer']:.2f} / {s['busy']['gpu']:.2f} |",
        f"| stale rollouts | {s['stale_rollouts']} |",
    ]
    graphs = [d for d in s.get("diagnostics", []) if isinstance(d, dict) and d.get("graph_max_tokens")]
    if graphs:  # the simulator's engine: a step past its CUDA graphs runs without them (~5x on the H200)
        lines.append(f"| engine CUDA graphs up to (tokens a step) / steps past them | "
                     f"{max(d['graph_max_tokens'] for d in graphs)} / {sum(d['graphless_steps'] for d in graphs)} |")
    # Adapters one decode step holds (nodus.runner.size_engine_slots): the simulator's, or the real engine's.
    slots = [n for d in s.get("diagnostics", [])
             if isinstance(d, dict) and (n := d.get("adapter_slots") or d.get("engine_max_loras"))]
    if slots:
        lines.append(f"| engine adapter slots (adapters one decode step holds) | {max(slots)} |")
    evals = [d["eval"]["accuracy"] for d in s["per_job"].values() if d.get("eval")]
    if evals:
        lines.append(f"| final eval accuracy, mean over jobs | {sum(evals) / len(evals):.3f} |")
    rewards = [d["rewards"] for d in s["per_job"].values() if d.get("rewards")]
    if rewards:
        first = sum(r[0] for r in rewards) / len(rewards)
        last = sum(r[-1] for r in rewards) / len(rewards)
        lines.append(f"| mean training reward, first / last step | {first:.3f} / {last:.3f} |")
    late = [d for d in s["per_job"].values() if "arrive_s" in d]
    if late:  # jobs[].arrive_s, arm.max_active: each joined a generation after it arrived (and got a slot)
        waits = [d["wait_s"] for d in late if d.get("wait_s") is not None]
        lines.append(f"| jobs arriving after the start / seconds a job waited to start, mean / max | "
                     f"{sum(1 for d in late if d['arrive_s'])} / "
                     + (f"{sum(waits) / len(waits):.1f} / {max(waits):.1f} |" if waits else "- |"))
    slow = [d.get("slowdown_vs_alone") for d in s["per_job"].values() if d.get("slowdown_vs_alone")]
    if slow:
        since = " (from its arrival)" if late else ""
        lines.append(f"| per-job slowdown vs alone{since}: min / max | {min(slow):.2f}x / {max(slow):.2f}x |")
    out = "\n".join(lines)
    m = s.get("machine")
    if m:
        kinds = m.get("kinds") or {}
        own = kinds.get(m.get("kind"))
        which = (f"its {own['runs']} {m['kind']} run(s)'" if own else
                 f"its runs' (none {m.get('kind', 'of this kind')}: a dedicated run's host-bound speed and a shared "
                 "arm's GPU-bound one differ by machine, so this factor is the weaker one)")
        if m.get("ratio_factor"):
            ratios = ("the ratios vs dedicated times the shared over the dedicated runs' factor, "
                      f"{m['ratio_factor']:.3f}.")
        else:
            why = "a dedicated arm" if m.get("kind") == "dedicated" else "no runs of both kinds"
            ratios = f"the ratios vs dedicated are unscaled ({why})."
        out += (f"\n\nScaled to the machine of {m['runs']} measured run(s) ({m['machine']}): {which} measured over "
                f"simulated steps/GPU-h, {m['factor']:.3f}, times the steps/GPU-h and the pace above (unscaled "
                f"{m['unscaled_steps_per_gpu_hour']:.1f}); {ratios}")
    if s.get("assumptions"):
        out += "\n\nProfile: " + s["profile"]["source"] + ". Assumptions used (not yet measured):\n"
        out += "\n".join(f"- {a['id']}: {a['what']}" for a in s["assumptions"])
    v = s.get("profile_validation")
    if (v and v.get("heldout_mape") is not None) or s.get("backend") == "sim":
        out += "\n\n" + error_bar_line(v, [s["arm"]] if s.get("arm") else None)
    if s.get("outside_profile"):
        out += "\n\nOutside the profiled region: " + "; ".join(s["outside_profile"])
    fitted = s.get("trainer_microbatch_fitted")
    if fitted:
        gpu = (s.get("profile") or {}).get("environment", {}).get("gpu", "the profile's GPU")
        out += ("\n\nTrainer micro-batch fitted to " + gpu + ", as the real backend fits it (the default's graphed "
                "trainers would not fit beside the engines): " + ", ".join(
                    f"{v} tokens on {k} stack{'s' if k != '1' else ''}" for k, v in fitted.items())
                + " (set trainer.max_tokens_per_microbatch to choose).")
    eager = trainer_graph_failures(s)
    if eager:
        out += ("\n\nTrained eager: the CUDA-graph capture failed (" + "; ".join(eager) + "). Lower "
                "trainer.max_tokens_per_microbatch or --engine-memory to fit the graphs.")
    return out


# -- sweep ------------------------------------------------------------------------------------

def sweep_arms(jobs: int, policies: list[str], groups: list[int], sharings: list[str]) -> list[tuple[str, int, str]]:
    """The (policy, groups, sharing) arms a sweep runs for a job count; groups >= 2 apply to
    overlap (phase groups) and timeslice (stacks); a group count above the job count is skipped;
    shared-sync and continuous run once per sharing mode."""
    arms = []
    for p in policies:
        if p == "dedicated":
            arms.append(("dedicated", 1, "none"))
        elif p in ("shared-sync", "continuous"):  # no group count (continuous: a group per job)
            arms += [(p, 1, s) for s in sharings]
        else:
            arms += [(p, g, s) for g in groups if 2 <= g <= jobs for s in sharings]
    return arms


def stacked_arms(jobs: int, arms: list[tuple[str, int, str]], stacks: list[int]) -> list[tuple[str, int, str, int]]:
    """Each arm on each stack count (arm.stacks): dedicated and timeslice (whose stacks are its
    groups) once, on one; the shared arms (shared-sync, overlap, continuous) on each count in
    ``stacks`` where every stack gets its groups' jobs (N x groups for overlap, N for the others, at
    most the job count)."""
    out = []
    for policy, groups, sharing in arms:
        if policy not in ("shared-sync", "overlap", "continuous"):
            out.append((policy, groups, sharing, 1))
            continue
        for k in stacks:
            if k * (groups if policy == "overlap" else 1) <= jobs:
                out.append((policy, groups, sharing, k))
    return out


def _sweep_task(args) -> dict:
    jobs, seed, (policy, groups, sharing, stacks), steps, profile, share, audit, arrive_every = args
    cfg = config_from_args(jobs=jobs, policy=policy, groups=groups, sharing=sharing, steps=steps,
                           seed=seed, profile=profile, share_prompts=share, stacks=stacks if stacks > 1 else None,
                           arrive_every=arrive_every)
    if audit is not None:
        cfg = cfg.model_copy(update={"audit": AuditSpec(**audit)})
    from sim import backend_factory

    t0 = time.perf_counter()
    make = backend_factory(profile)
    s = summarize(run_spans(cfg, make), late_arrivals=late_arrivals(cfg))
    return {"jobs": jobs, "seed": seed, "policy": policy, "groups": groups, "sharing": sharing, "stacks": stacks,
            "share_prompts": share, "outside_profile": sorted(make.cost.flags),
            "steps_per_gpu_hour": s["steps_per_gpu_hour"], "rollout_tokens_per_gpu_s": s["rollout_tokens_per_gpu_s"],
            # The jobs' steady pace and the window's start and drain (nodus.accounting.pace_of).
            "pace_steps_per_gpu_hour": (s["pace"] or {}).get("pace_steps_per_gpu_hour"),
            "ramp_gpu_s": (s["pace"] or {}).get("ramp_gpu_s"),
            "busy_engine": s["busy"]["engine"], "busy_trainer": s["busy"]["trainer"], "busy_gpu": s["busy"]["gpu"],
            "stale_rollouts": s["stale_rollouts"], "wall_s": time.perf_counter() - t0}


def parse_list(text: str, cast, name: str, choices=None) -> list:
    """A command line's comma-separated values (``--name``), each cast; errors name the flag."""
    try:
        vals = [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{name} {text!r}: expected a comma-separated list") from None
    if not vals:
        raise ConfigError(f"--{name} is empty")
    if choices is not None:
        bad = [v for v in vals if v not in choices]
        if bad:
            raise ConfigError(f"--{name}: unknown {bad}; choose from {', '.join(choices)} or 'all'")
    return vals


def sweep(jobs: str = "2,4,8,16", groups: str = "1,2,4", policies: str = "all", sharing: str = "none,mps",
          seeds: str = "1,2,3", steps: int = 20, profile: str | None = None, workers: int | None = None,
          out: str | Path | None = None, progress: bool = True, share_prompts: str | None = None,
          stacks: str = "1", audit: AuditSpec | None = None, arrive_every: float | None = None,
          gpu: str = "h200") -> dict:
    """Every arm for every job count, seed and ``share_prompts`` (the trainer's responses a packed
    row, ``trainer.share_prompts``; 0: plain rows; None: ``AUTO_SHARE_PROMPTS`` on a graphed profile,
    0 on an eager one, as ``nodus sim``); ratios are against the dedicated arm of the same job count,
    seed and trainer setting (the job alone trains the same way). Writes sweep.csv, sweep.json and
    sweep.png into `out`. ``stacks``: the engine + trainer stack counts (arm.stacks) each shared
    arm runs on, where its jobs fill them (``stacked_arms``). ``audit``: every run's audit
    (RunConfig.audit, the dedicated baseline's too; None: the full audit). ``arrive_every``: job i
    of every shared run arrives i x that many seconds after the start (``config_from_args``).
    ``profile`` None: the shipped profile for ``gpu`` (``planning_profile``: on the H200
    ``STACKS_PROFILE`` where several stacks run under MPS, as ``nodus sim`` and ``nodus plan`` pick
    it, else ``DEFAULT_PROFILE``; on the H100 its own stacks or one-stack profile)."""
    job_list = parse_list(jobs, int, "jobs")
    if min(job_list) < 1:
        raise ConfigError(f"--jobs {jobs}: every job count must be >= 1")
    group_list = parse_list(groups, int, "groups")
    pol = list(POLICIES) if policies == "all" else parse_list(policies, str, "policies", POLICIES)
    if "dedicated" not in pol:
        pol = ["dedicated"] + pol  # ratios need the baseline
    shr = list(SHARINGS) if sharing == "all" else parse_list(sharing, str, "sharing", SHARINGS)
    seed_list = parse_list(seeds, int, "seeds")
    stack_list = sorted(set(parse_list(stacks, int, "stacks")))
    if min(stack_list) < 1:
        raise ConfigError(f"--stacks {stacks}: every stack count must be >= 1")
    if profile is None:
        profile = planning_profile(gpu, max(stack_list) > 1 and "mps" in shr)
    from sim.profile import load_profile

    cost = load_profile(profile)  # fails fast on a bad profile, before forking workers
    if share_prompts is None:
        share_prompts = str(AUTO_SHARE_PROMPTS if cost.profile.train.step_mode == "graphed" else 0)
    share_list = parse_list(share_prompts, int, "share-prompts")
    if min(share_list) < 0:
        raise ConfigError(f"--share-prompts {share_prompts}: responses a row holds, integers >= 0 (0: none)")
    share_list = sorted({packed_rows(k) for k in share_list})
    validation = cost.validation()
    if max(share_list) > 1 and cost.profile.train.step_mode == "eager":
        raise ConfigError(f"--share-prompts {share_prompts}: packed rows run on the graphed trainer only, and profile "
                          f"{profile!r} describes the eager one (train.step_mode): sweep a graphed profile")
    out_dir = make_out_dir(out) if out is not None else None
    audit_dict = audit.model_dump() if audit is not None else None
    if arrive_every is not None:  # a bad value fails here, before forking workers
        config_from_args(jobs=1, arrive_every=arrive_every)
    tasks = [(n, sd, arm, steps, profile, sp, audit_dict, arrive_every)
             for n in job_list for sd in seed_list for sp in share_list
             for arm in stacked_arms(n, sweep_arms(n, pol, group_list, shr), stack_list)]
    tasks.sort(key=lambda t: -t[0] * (t[2][1] if t[2][0] == "overlap" else 1))  # big runs first
    rows, t0 = [], time.perf_counter()
    workers = workers or min(os.cpu_count() or 1, 8)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futs = [pool.submit(_sweep_task, t) for t in tasks]
        for i, f in enumerate(as_completed(futs), 1):
            rows.append(f.result())
            if progress:
                _progress(i, len(tasks), time.perf_counter() - t0)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    base = {(r["jobs"], r["seed"], r["share_prompts"]): r["steps_per_gpu_hour"] for r in rows
            if r["policy"] == "dedicated"}
    for r in rows:
        r["ratio_vs_dedicated"] = r["steps_per_gpu_hour"] / base[(r["jobs"], r["seed"], r["share_prompts"])]
    rows.sort(key=lambda r: (r["jobs"], r["share_prompts"], POLICIES.index(r["policy"]), r["groups"], r["sharing"],
                             r["stacks"], r["seed"]))
    flags = sorted({f for r in rows for f in r.pop("outside_profile")})
    result = {"profile": profile, "profile_validation": validation, "steps": steps, "seeds": seed_list,
              "share_prompts": share_list, "stacks": stack_list, "audit": (audit or AuditSpec()).model_dump(),
              **({"arrive_every_s": arrive_every} if arrive_every else {}),
              "outside_profile": flags,
              "rows": rows, "best": best_arms(rows, (validation or {}).get("heldout_mape")),
              "wall_s": time.perf_counter() - t0, "workers": workers}
    if out_dir is not None:
        write_json(out_dir / "sweep.json", result)
        with open(out_dir / "sweep.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        render_sweep(out_dir)
    return result


def _progress(i: int, n: int, elapsed: float) -> None:
    """A bar redrawn in place on a terminal; a line per tenth of the runs in a log."""
    width = 30
    done = int(width * i / n)
    line = f"sweep [{'#' * done}{'.' * (width - done)}] {i}/{n} runs {elapsed:5.1f}s"
    if sys.stderr.isatty():
        print("\r" + line, end="", file=sys.stderr, flush=True)
    elif i == n or i % max(1, n // 10) == 0:
        print(line, file=sys.stderr, flush=True)


def arm_label(r: dict) -> str:
    g = f" g={r['groups']}" if r["policy"] in ("overlap", "timeslice") else ""
    share = packed_rows(r.get("share_prompts"))
    sp = f" +sp{share}" if share else ""
    k = f" k{r['stacks']}" if (r.get("stacks") or 1) > 1 else ""
    return (f"{r['policy']}{g} {r['sharing']}{k}" if r["policy"] != "dedicated" else "dedicated") + sp


def arm_error_text(validation: dict | None, arms: list[dict]) -> str:
    """Whether a profile's error bar covers the shared arms simulated (``arms``: summaries' ``arm``
    dicts): each arm's own held-out error where the annotation has it, and the arms none of its
    held-out runs ran, whose predictions it does not vouch for ('' without a validation, or where
    every arm is a dedicated one)."""
    from calibration.validate import arm_key, heldout_arms

    v = validation or {}
    if v.get("heldout_mape") is None:
        return ""
    keys = sorted({arm_key(a) for a in arms if a.get("policy") != "dedicated"})
    have = set(heldout_arms(v))
    per = v.get("arms") or {}
    parts = []
    for k in keys:
        e = per.get(k)
        if e and e.get("mape") is not None:
            parts.append(f"{k}: {e['runs']} run(s), MAPE {e['mape']:.1%}, bias {e['bias']:+.1%}, worst "
                         f"{e['worst']:.1%}")
    missing = [k for k in keys if k not in have]
    text = (("Of the held-out runs, this arm's: " if len(keys) == 1 else "Of the held-out runs, by arm: ")
            + "; ".join(parts) + ".") if parts else ""
    if missing:
        text += ((" " if text else "") + f"No held-out run of {', '.join(missing)} is behind that error bar (its "
                 f"arms: {', '.join(sorted(have)) or 'none recorded'}): the prediction for "
                 + ("that arm" if len(missing) == 1 else "those arms") + " has no error bar on this profile.")
    return text


def error_bar_line(validation: dict | None, arms: list[dict] | None = None) -> str:
    """What a prediction on this profile is worth: its held-out error against real runs, and, given
    the arms simulated (summaries' ``arm`` dicts), whether that error covers them
    (``arm_error_text``)."""
    v = validation or {}
    st = v.get("stacks") or {}
    stacks = ""
    if st:
        stacks = (f" Two stacks' engines (sharing.mps_engines): fitted on {st['runs']} two-stack run(s)"
                  + (f", each predicted from the others {st['left_out_mape']:.1%} off on average (worst "
                     f"{st['left_out_worst']:.1%})" if st.get("left_out_mape") is not None else "")
                  + (f"; on a new day (each of its {st['days']} days' runs predicted from the others') "
                     f"{st['day_mape']:.1%} (worst {st['day_worst']:.1%})" if st.get("day_mape") is not None else "")
                  + "; one configuration's runs are no error bar for others (nodus fit-stacks).")
    tr = v.get("stacks_trainer") or {}
    if tr:
        stacks += (f" A lone trainer beside engines of stacks (sharing.mps_stacks_trainer {tr['rate']:.3f}): fitted on "
                   f"{tr['runs']} run(s)" + (f", each predicted from the others {tr['left_out_mape']:.1%} off (worst "
                                             f"{tr['left_out_worst']:.1%})" if tr.get("left_out_mape") is not None else "")
                   + (" with the two engine rates (nodus fit-stacks --rate phases"
                      + (" --tie-engines: an engine goes at one rate beside another engine or this trainer"
                         if tr.get("tie_engines") else "") + ")."
                      if tr.get("fitted_on") == "phases" else " (nodus fit-stacks --rate trainer)."))
    if v.get("heldout_mape") is None:
        return "This profile carries no validation against real runs (nodus validate --annotate)." + stacks
    line = (f"This profile against {v.get('heldout_runs', 0)} held-out real runs: steps per GPU-hour "
            f"MAPE {v['heldout_mape']:.1%}, bias {v['heldout_bias']:+.1%}, worst {v['heldout_worst']:.1%}"
            + (f" ({v['report']})" if v.get("report") else "") + ".")
    if v.get("machine_mape") is not None:
        line += (f" With the machine's speed known (its other configurations measured; {v.get('machine_runs', 0)} "
                 f"runs on {v.get('machines', 0)} machines): MAPE {v['machine_mape']:.1%}, bias "
                 f"{v['machine_bias']:+.1%}, worst {v['machine_worst']:.1%}.")
    if v.get("config_mape") is not None:
        tau = "-" if v.get("config_tau") is None else f"{v['config_tau']:.2f}"
        line += (f" Against each of {v.get('configs', 0)} configurations' mean: MAPE {v['config_mape']:.1%}, worst "
                 f"{v['config_worst']:.1%}, Kendall tau {tau}")
        if v.get("config_pairs_resolved"):
            line += (f" ({v['config_tau_resolved']:.2f} over the {v['config_pairs_resolved']} of "
                     f"{v.get('config_pairs', 0)} pairs the measurements tell apart)")
        elif v.get("config_pairs_resolved") == 0:
            line += f" (the measurements tell no pair of the {v.get('config_pairs', 0)} apart)"
        line += "."
    if v.get("ratio_mape") is not None:
        line += (f" Its ratio over dedicated on {v.get('ratio_pairs', 0)} same-machine pairs: MAPE "
                 f"{v['ratio_mape']:.1%}, bias {v['ratio_bias']:+.1%}, worst {v['ratio_worst']:.1%}.")
    if v.get("across_days_mape") is not None:
        line += (f" On {v.get('across_days_runs', 0)} runs of other days: MAPE {v['across_days_mape']:.1%}, "
                 f"bias {v['across_days_bias']:+.1%}, worst {v['across_days_worst']:.1%}"
                 + (f" ({v['across_days_report']})" if v.get("across_days_report") else "") + ".")
    cover = arm_error_text(v, arms or [])
    return line + (" " + cover if cover else "") + stacks


def sweep_table(rows: list[dict], validation: dict | None = None, best: list[dict] | None = None,
                outside: list[str] | None = None) -> str:
    """Mean ratio vs dedicated over seeds: one row per arm, one column per job count; the best arm
    per job count under it (``best``: ``best_arms``' answer, computed when not given); with the
    profile's error bar under that when `validation` is given, and where the runs went outside the
    profile (``outside``: the sweep's ``outside_profile``)."""
    lines = _mean_table(rows, "ratio_vs_dedicated", "{:.3f}x")
    if len({packed_rows(r.get("share_prompts")) for r in rows}) > 1 and all("steps_per_gpu_hour" in r for r in rows):
        # Ratios of two trainer settings divide by two baselines: the steps themselves compare them.
        lines += ["", "Steps per GPU-hour (each trainer setting's ratios are over its own dedicated arm):", "",
                  *_mean_table(rows, "steps_per_gpu_hour", "{:.0f}")]
    best = best_arms(rows, (validation or {}).get("heldout_mape")) if best is None else best
    if best:
        lines += ["", "Best per job count: " + "; ".join(
            f"{b['jobs']} jobs {b['arm']} ({b['ratio']:.3f}x"
            + (f", next {b['next']} {b['next_gap']:+.1%}" if b["next"] else "")
            + (", within the profile's error" if b["within_error"] else "") + ")" for b in best) + "."]
    if validation is not None:
        lines += ["", error_bar_line(validation, rows)]
        if any(packed_rows(r.get("share_prompts")) for r in rows):
            lines.append("That error is of runs with plain rows, not of packed rows (+spK): on the H200 (session 20) "
                         "their train step beside a generation took longer than the profile prices it.")
    if outside:
        lines += ["", "Outside the profiled region: " + "; ".join(outside)]
    return "\n".join(lines)


def _mean_table(rows: list[dict], field: str, fmt: str) -> list[str]:
    """Markdown lines: one row per arm, one column per job count, the mean of ``field`` over seeds."""
    jobs = sorted({r["jobs"] for r in rows})
    by: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        by.setdefault(arm_label(r), {}).setdefault(r["jobs"], []).append(r[field])
    lines = ["| arm | " + " | ".join(f"{n} jobs" for n in jobs) + " |", "|---" * (len(jobs) + 1) + "|"]
    for label, d in by.items():
        cells = [fmt.format(sum(d[n]) / len(d[n])) if n in d else "-" for n in jobs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def best_arms(rows: list[dict], error: float | None = None) -> list[dict]:
    """Per job count (and trainer setting, ``share_prompts``: its ratios have their own baseline),
    the shared arm with the highest mean ratio to dedicated, the runner-up and how far below it is
    (``next_gap``, relative); ``within_error``: the gap is smaller than ``error`` (the profile's
    held-out MAPE), so the simulator cannot tell the two apart."""
    means: dict[tuple[int, int], dict[str, list[float]]] = {}
    for r in rows:
        if r["policy"] != "dedicated":
            key = (r["jobs"], packed_rows(r.get("share_prompts")))
            means.setdefault(key, {}).setdefault(arm_label(r), []).append(r["ratio_vs_dedicated"])
    out = []
    for n, sp in sorted(means):
        ranked = sorted(((sum(v) / len(v), k) for k, v in means[(n, sp)].items()), reverse=True)
        (top, arm), nxt = ranked[0], ranked[1] if len(ranked) > 1 else None
        gap = nxt[0] / top - 1 if nxt else None
        out.append({"jobs": n, "share_prompts": sp, "arm": arm, "ratio": top, "next": nxt[1] if nxt else None,
                    "next_gap": gap, "within_error": gap is not None and error is not None and -gap < error})
    return out


def render_sweep(out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads((out_dir / "sweep.json").read_text())
    rows = result["rows"]
    (out_dir / "table.md").write_text(sweep_table(rows, result.get("profile_validation") or {}, result.get("best"),
                                                  result.get("outside_profile"))
                                      + "\n")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels = sorted({arm_label(r) for r in rows})
    for i, label in enumerate(labels):
        pts: dict[int, list[float]] = {}
        for r in rows:
            if arm_label(r) == label:
                pts.setdefault(r["jobs"], []).append(r["ratio_vs_dedicated"])
        xs = sorted(pts)
        mean = [sum(pts[x]) / len(pts[x]) for x in xs]
        err = [[m - min(pts[x]) for x, m in zip(xs, mean)], [max(pts[x]) - m for x, m in zip(xs, mean)]]
        # Past ten arms the default colours repeat: tell them apart by line style.
        ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=label, linestyle="-" if i < 10 else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["jobs"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("jobs sharing one GPU")
    ax.set_ylabel("steps per GPU-hour / dedicated")
    v = result.get("profile_validation") or {}
    bar = (f"; profile's held-out error {v['heldout_mape']:.0%}" if v.get("heldout_mape") is not None
           else "; profile not validated")
    ax.set_title(f"simulated, profile {result['profile']} ({len(result['seeds'])} seeds, min-max bars{bar})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_dir / "sweep.png", dpi=110)
    plt.close(fig)


def report(run_dir: str | Path) -> str:
    """Re-render a run or sweep folder's tables and plots; returns the table."""
    d = Path(run_dir)
    if (d / "sweep.json").is_file():
        render_sweep(d)
    elif (d / "summary.json").is_file() and stored(d / "spans.jsonl").is_file():
        render_run(d)
    else:
        raise ConfigError(f"{str(d)!r} is not a run folder (no summary.json + spans.jsonl, no sweep.json)")
    return (d / "table.md").read_text()
