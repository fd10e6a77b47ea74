"""The `nodus` command line: a thin layer over library functions (each callable from Python)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from nodus.config import (DEFAULT_PROFILE, DEFAULT_PROFILES, GPUS, H100_ONESTACK_PROFILE, H100_STACKS_PROFILE,
                          POLICIES, SHARINGS, STACKS_PROFILE, ConfigError, RunConfig, load_config, planning_profile,
                          stacks_under_mps)
from calibration.measure import DECODE_MODELS, DECODE_OUTLIER
from calibration.fit_runs import TERM_SELECTIONS
from sim.profile import ADAPTER_FORMATS, LORA_KERNELS, RATE_MAX, STEP_MODES


ARRIVE_EVERY_HELP = ("job i arrives i x S seconds after the start (jobs[].arrive_s) and joins its group's next "
                     "generation; each dedicated job has its GPU from its arrival")


GPU_HELP = ("the GPU the plan is for, where no profile is chosen: h200 (default: the default profile, the "
            "stacks profile for stacks under MPS) or h100 (an H100 80GB: its own profiles, the graphed trainer's, "
            "the only one measured there: its stacks profile for stacks under MPS, else its one-stack profile)")


def _add_arm_flags(p: argparse.ArgumentParser, config_help: str = "") -> None:
    p.add_argument("config", nargs="?",
                   help="YAML/JSON config file (default: the embedded 8-job workload)" + config_help)
    p.add_argument("--jobs", type=int, help="number of jobs (cycling through the task families)")
    p.add_argument("--policy", choices=POLICIES, help="arm policy (default overlap)")
    p.add_argument("--groups", type=int, help="overlap: phase-offset groups; timeslice: stacks (default 2)")
    p.add_argument("--sharing", choices=SHARINGS, help="GPU sharing controls (default mps)")
    p.add_argument("--stacks", type=int, metavar="N",
                   help="shared-sync / overlap / continuous: N engine + trainer stacks splitting the jobs, each "
                        "running the policy over its own (arm.stacks; default 1); two stacks under MPS are priced "
                        f"by a profile's two-engine rate: --profile {STACKS_PROFILE}")
    p.add_argument("--lockstep", action="store_true", default=None,
                   help="shared-sync on --stacks N >= 2: each stack's next generation waits until every stack "
                        "has published its step, the stacks generating and training together (arm.lockstep)")
    p.add_argument("--offset-stacks", action="store_true", default=None,
                   help="shared-sync on --stacks N >= 2: stack k > 0 starts when stack k-1's first generation "
                        "ends, generating while it trains; then each goes at its own pace (arm.offset_stacks)")
    p.add_argument("--hold-apart", type=float, metavar="F", default=None,
                   help="offset stacks held apart (sets --offset-stacks): a stack's next generation waits until "
                        "it starts F of its cycle after another stack's latest start, times 2 / stacks (0.5: "
                        "exactly out of step; arm.hold_apart, 0 < F <= 0.5)")
    p.add_argument("--steps", type=int, help="optimizer steps per job (default 20)")
    p.add_argument("--arrive-every", type=float, metavar="S", default=None, help=ARRIVE_EVERY_HELP)
    p.add_argument("--max-active", type=int, metavar="N", default=None,
                   help="at most N jobs under way at once (arm.max_active, a service's slots): later jobs queue, "
                        "by arrival, and start as running jobs end")
    p.add_argument("--max-lead", type=int, metavar="K", default=None,
                   help="continuous / overlap: a job (group) generates its next step only while it is at most K "
                        "steps ahead of the least advanced job under way in its stack (arm.max_lead; 0: each step "
                        "waits for every job's previous training step)")
    p.add_argument("--seed", type=int, help="run seed (default 1)")
    p.add_argument("--share-prompts", type=int, metavar="K",
                   help="trainer.share_prompts: each prompt's responses trained K to a row, the prompt once "
                        "(the graphed trainer: --trainer-graphs on the real backend, a graphed profile in the sim); "
                        "default: the config's, else 4 with the graphed trainer and 0 (a row per response) without")
    p.add_argument("--out", help="write config, summary, timeline and plots into this new folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


# The shipped profiles a planner picks by the question, marked so in `nodus profiles`.
# (nodus.config.shipped_profile picks among them by an arm's trainer, stacks and GPU.)
SHIPPED_ROLES = (("default", DEFAULT_PROFILE), ("stacks or graphed dedicated on an H200", STACKS_PROFILE),
                 ("graphed, one stack sharing on an H200", DEFAULT_PROFILES["graphed"]),
                 ("stacks or graphed dedicated on an H100 80GB", H100_STACKS_PROFILE),
                 ("one stack sharing on an H100 80GB", H100_ONESTACK_PROFILE))


def cmd_profiles(a: argparse.Namespace) -> int:
    from sim.profile import profile_summaries

    rows = profile_summaries()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    pct = (lambda x: "-" if x is None else f"{x:.1%}")
    print("| profile | GPU | host | date | held-out MAPE | bias | held-out runs | held-out arms (runs) | ratio over "
          "dedicated: MAPE, bias (pairs) | other days: MAPE (runs) | two stacks: left out (runs) | assumptions | report |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["name"] + "".join(f" ({role})" for role, prof in SHIPPED_ROLES if r["name"] == prof)
        days = f"{pct(r['across_days_mape'])} ({r['across_days_runs']})" if r["across_days_runs"] else "-"
        st = r.get("stacks") or {}
        stacks = (f"{pct(st.get('left_out_mape'))} ({st['runs']})"
                  + (f"; days {pct(st['day_mape'])} ({st['days']})" if st.get("day_mape") is not None else "")
                  if st else "-")
        ratio = (f"{pct(r['ratio_mape'])}, {r['ratio_bias']:+.1%} ({r['ratio_pairs']})"
                 if r.get("ratio_mape") is not None else "-")
        arms = ", ".join(k + ("" if n is None else f" ({n})") for k, n in r["heldout_arms"].items()) or "-"
        print(f"| {name} | {r['gpu']} | {r['host'] or 'not recorded'} | {r['date']} | {pct(r['heldout_mape'])} | "
              f"{pct(r['heldout_bias'])} | {r['heldout_runs']} | {arms} | {ratio} | {days} | {stacks} | "
              f"{r['assumptions']} | {r['report'] or '-'} |")
    print("\nA profile describes the host it was measured on, not only its GPU model: pick the one "
          "measured where the jobs will run (nodus sim --profile NAME). Held-out MAPE: on the runs of more jobs "
          "than it was fitted on that its report names; other days: on such runs of the days it was not fitted "
          "on, under the MPS settings its rates were fitted under (experiments/crossday.py). Ratio over "
          "dedicated: each held-out run over its day's and machine's dedicated run of its seed, simulated against "
          "measured (nodus validate; the figure a plan is booked on). Held-out arms: the arms those runs ran "
          "(runs where the annotation counts them): the held-out MAPE is theirs, and nodus sim prints a simulated "
          "arm's own or says it has none. Two stacks: the "
          "two-engine rate's fit (nodus fit-stacks), each run predicted from the others, where the profile has one, "
          "and each day's runs from the other days' (days); "
          "the other columns are the one-stack terms' (a fitted copy keeps its base's).")
    return 0


def what_if_factors(items: list[str]) -> dict[str, float]:
    """['train=0.5', 'decode=0.8'] -> {'train': 0.5, 'decode': 0.8}; malformed items are errors."""
    out: dict[str, float] = {}
    for item in items:
        phase, _, val = item.partition("=")
        try:
            factor = float(val)  # no '=' leaves val empty: a ValueError too
        except ValueError:
            factor = float("nan")
        if not factor > 0:
            raise ConfigError(f"--what-if {item!r}: expected PHASE=FACTOR with a factor > 0 (e.g. train=0.5)")
        out[phase] = factor
    return out


def profile_graphed(profile: str) -> bool:
    """Whether a profile's train terms describe the graphed trainer (train.step_mode); False for one
    that cannot be loaded (the simulation then names that error)."""
    from sim.profile import load_profile

    try:
        return load_profile(profile).profile.train.step_mode == "graphed"
    except Exception:  # noqa: BLE001 - reported by simulate
        return False


def default_packing(cfg, graphed: bool):
    """``nodus.config.with_default_packing``, saying on stderr when it packs the rows."""
    from nodus.config import AUTO_SHARE_PROMPTS, with_default_packing

    out = with_default_packing(cfg, graphed)
    if out is not cfg:
        k = out.trainer.share_prompts
        print(f"nodus: trainer.share_prompts={k}, the graphed trainer's default (each prompt's responses {k} to a "
              f"row, the prompt once; at most {AUTO_SHARE_PROMPTS}; --share-prompts 0: a row per response)",
              file=sys.stderr)
    return out


def recorded_run(path: str) -> tuple[dict, dict | None]:
    """A run folder given as ``nodus sim``'s CONFIG: its config.json, and its summary.json where the
    real backend wrote it (None for a simulated run's folder, whose config names the profile it was
    simulated on)."""
    rd = Path(path)
    if not (rd / "config.json").is_file():
        raise ConfigError(f"{path!r} is a folder without config.json: give a config file, or a run folder written by "
                          "nodus run --out or nodus sim --out")
    summary = json.loads((rd / "summary.json").read_text()) if (rd / "summary.json").is_file() else None
    return load_config(rd / "config.json"), (summary if summary and summary.get("backend") != "sim" else None)


def cmd_sim(a: argparse.Namespace) -> int:
    from nodus.simulate import config_from_args, render_table, simulate

    measured = None  # a real run's summary, where CONFIG is its folder
    if a.config and Path(a.config).is_dir():
        data, measured = recorded_run(a.config)
        if measured is not None:
            # The real backend records the default profile in its config, which priced nothing: the
            # run's own shipped profile (its GPU, trainer and stacks) unless one is named.
            from calibration.run_settings import run_profile

            data.pop("profile", None)
            if a.profile is None:
                a.profile = run_profile(data, measured)
                print(f"nodus: {a.config}: profile {a.profile}, the shipped one for the run (its GPU, trainer and "
                      "stacks; --profile to choose another)", file=sys.stderr)
    else:
        data = load_config(a.config) if a.config else None
    cfg = config_from_args(data, jobs=a.jobs, policy=a.policy,
                           groups=a.groups, sharing=a.sharing, steps=a.steps, seed=a.seed, profile=a.profile,
                           share_prompts=a.share_prompts, stacks=a.stacks, lockstep=a.lockstep,
                           offset_stacks=a.offset_stacks, hold_apart=a.hold_apart,
                           arrive_every=a.arrive_every, max_active=a.max_active,
                           max_lead=a.max_lead)
    if a.profile is None and "profile" not in (data or {}):
        # No profile chosen: the GPU's shipped one for the arm (stacks under MPS: the one with the
        # stacks' rates).
        stacks_mps = stacks_under_mps(cfg.arm.policy, cfg.arm.sharing, cfg.arm.stacks)
        chosen = planning_profile(a.gpu, stacks_mps)
        if a.gpu != "h200":
            print(f"nodus: --gpu {a.gpu}: profile {chosen}, the shipped one for "
                  + ("stacks under MPS" if stacks_mps else "one stack") + " there; --profile to choose another",
                  file=sys.stderr)
        elif stacks_mps:
            print(f"nodus: {cfg.arm.stacks} stacks under MPS: profile {chosen}, the shipped one with a "
                  "two-engine rate (sharing.mps_engines); --profile to choose another", file=sys.stderr)
        cfg = cfg.model_copy(update={"profile": chosen})
    profile = None
    if a.what_if:
        import tempfile

        from sim.profile import profile_dict, what_if

        prof = what_if(profile_dict(cfg.profile), what_if_factors(a.what_if))
        profile = str(Path(tempfile.mkdtemp(prefix="nodus-what-if-")) / "profile.json")
        Path(profile).write_text(json.dumps(prof, indent=1))
        cfg = cfg.model_copy(update={"profile": profile})
    cfg = audit_from_args(default_packing(cfg, profile_graphed(cfg.profile)), a)
    machine = None
    if a.machine_runs:  # before the simulation: bad runs fail before anything is written
        from calibration.validate import machine_factor

        machine = machine_factor(a.machine_runs, cfg.profile)
    summary = simulate(cfg, a.out, machine)
    if a.what_if and a.out:
        shutil.copy(profile, Path(a.out) / "what_if_profile.json")
    if a.json:
        print(json.dumps(summary, sort_keys=True, default=str))
    else:
        print(render_table(summary, cfg.trainer.share_prompts))
        if measured is not None and measured.get("steps_per_gpu_hour"):
            m = measured["steps_per_gpu_hour"]
            recorded = config_from_args(data)
            own = (not a.what_if and cfg.arm == recorded.arm and cfg.seed == recorded.seed
                   and [j.steps for j in cfg.jobs] == [j.steps for j in recorded.jobs]
                   and cfg.trainer == recorded.trainer and cfg.audit == recorded.audit)
            print(f"\nmeasured in {a.config}: {m:.1f} steps per GPU-hour"
                  + (f" (this simulation {summary['steps_per_gpu_hour'] / m - 1:+.1%}, its lengths sampled; "
                     "`nodus validate` replays the run's own)" if own else
                     " (its own configuration: the options above changed what is simulated)"))
        if a.out:
            print(f"\nwrote {a.out}/ (summary.json, spans.jsonl, trace.json for Perfetto, gantt.png)")
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    from nodus.simulate import sweep, sweep_table

    result = sweep(jobs=a.jobs, groups=a.groups, policies=a.policies, sharing=a.sharing, seeds=a.seeds,
                   steps=a.steps, profile=a.profile, workers=a.workers, out=a.out, share_prompts=a.share_prompts,
                   stacks=a.stacks, audit=audit_spec_from_args(a), arrive_every=a.arrive_every, gpu=a.gpu)
    if a.profile is None and a.gpu != "h200":
        print(f"nodus: --gpu {a.gpu}: every run on profile {result['profile']}, the shipped one there "
              "(--profile to choose)", file=sys.stderr)
    elif a.profile is None and result["profile"] == STACKS_PROFILE:
        print(f"nodus: stacks under MPS: every run on profile {STACKS_PROFILE}, the shipped one with the "
              "stacks' rates (--profile to choose)", file=sys.stderr)
    print(json.dumps(result, default=str) if a.json
          else sweep_table(result["rows"], result.get("profile_validation") or {}, result.get("best"),
                           result.get("outside_profile")))
    from nodus.config import AuditSpec

    audit = AuditSpec(**result["audit"]).words()
    print(f"{len(result['rows'])} runs in {result['wall_s']:.1f}s with {result['workers']} workers"
          + (f", audit: {audit}" if audit else "")
          + (f"; wrote {a.out}/ (sweep.csv, sweep.json, sweep.png)" if a.out else ""), file=sys.stderr)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from nodus.plan import plan, plan_table

    result = plan(load_config(a.config) if a.config else None, total_jobs=a.total_jobs, steps=a.steps,
                  per_gpu=a.per_gpu, policies=a.policies, groups=a.groups, sharing=a.sharing, stacks=a.stacks,
                  profile=a.profile, gpu=a.gpu, seed=a.seed, deadline_h=a.deadline_h, max_gpus=a.max_gpus,
                  price_per_gpu_hour=a.price, arrive_every=a.arrive_every, gpus=a.gpus, max_wait_h=a.max_wait_h,
                  sim_steps=a.sim_steps, workers=a.workers, out=a.out, progress=not a.json and sys.stderr.isatty())
    print(json.dumps(result, default=str) if a.json else plan_table(result))
    print(f"{result['loads_simulated']} GPU loads simulated in {result['wall_s']:.1f}s with {result['workers']} workers"
          + (f"; wrote {a.out}/ (plan.json, plan.md)" if a.out else ""), file=sys.stderr)
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from nodus.realrun import run
    from nodus.simulate import config_from_args, render_table

    cfg = config_from_args(load_config(a.config) if a.config else None, jobs=a.jobs, policy=a.policy,
                           groups=a.groups, sharing=a.sharing, steps=a.steps, seed=a.seed, profile=a.profile,
                           share_prompts=a.share_prompts, stacks=a.stacks, lockstep=a.lockstep,
                           offset_stacks=a.offset_stacks, hold_apart=a.hold_apart,
                           arrive_every=a.arrive_every, max_active=a.max_active,
                           max_lead=a.max_lead)
    cfg = default_packing(cfg, a.trainer_graphs if a.backend == "real" else profile_graphed(cfg.profile))
    cfg = audit_from_args(cfg, a)
    opts = None
    if a.backend == "real":
        from real.backend import RealOptions

        opts = RealOptions(model=a.model, mode=a.mode, device=a.device, dtype=a.dtype, load_format=a.load_format,
                           engine_memory=a.engine_memory, enforce_eager=a.enforce_eager,
                           audit_logprobs=cfg.audit.logprobs, audit_every=cfg.audit.every,
                           audit_responses=cfg.audit.responses, engine_thread_pct=a.engine_thread_pct,
                           trainer_thread_pct=a.trainer_thread_pct, trainer_priority=a.trainer_priority,
                           trainer_cpu_threads=a.trainer_cpu_threads, engine_cpu_threads=a.engine_cpu_threads,
                           engine_env=tuple(env_pairs(a.engine_env)),
                           engine_args=tuple(engine_arg_pairs(a.engine_arg)),
                           checkpoint_dir=a.checkpoint_dir, adapter_format=a.adapter_format,
                           adapters_out=a.adapters_out,
                           seeded_sampling=not a.unseeded, lora_layout=a.lora_layout,
                           trainer_compile=a.trainer_compile, trainer_graphs=a.trainer_graphs,
                           tuned_lora_kernels=a.tuned_lora_kernels, engine_core_process=a.engine_core_process)
    summary = run(cfg, backend=a.backend, opts=opts, out=a.out, baseline=not a.no_baseline)
    print(json.dumps(summary, sort_keys=True, default=str) if a.json
          else render_table(summary, cfg.trainer.share_prompts))
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from nodus.simulate import report

    print(report(a.run_dir))
    return 0


def cmd_tasks(a: argparse.Namespace) -> int:
    from nodus.tasks.catalog import tasks_list, tasks_sample

    if a.tasks_cmd == "sample":
        print(tasks_sample(a.task, n=a.n, seed=a.seed))
    elif a.tasks_cmd == "dataset":
        from nodus.config import DatasetSpec, JobSpec
        from nodus.tasks import get_task
        from nodus.tasks.base import solution_text
        from nodus.tasks.datasets import dataset_split

        job = JobSpec(task=a.task, dataset=DatasetSpec(train=a.train, eval=a.eval, eval_size=a.eval_size))
        train, held = dataset_split(job.dataset, job.task)
        print(f"{a.train}: {len(train)} training items, {len(held)} eval items"
              f" ({a.eval or f'the last {a.eval_size} of the training file'}), scored by {a.task}'s check")
        for it in train[:a.n]:
            print(f"--- prompt:\n{it.prompt}\n--- its answer as a completion "
                  f"(reward {get_task(a.task).reward(it, solution_text(it))}):\n{solution_text(it)}")
    else:
        print(tasks_list(as_json=a.json))
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from nodus.compare import compare_runs, render_compare_markdown

    rep = compare_runs(a.runs, baseline=a.baseline, aa_runs=a.aa_runs)
    print(json.dumps(rep, default=str) if a.json else render_compare_markdown(rep))
    return 0


def runs_profile(runs: list[str]) -> str:
    """The shipped profile that describes every one of ``runs`` (recorded run folders;
    ``calibration.run_settings.run_profile``); refused, naming each profile's runs, where they
    differ (runs of an H200 and an H100, or an H100's one-stack shared runs and its stacks, which the
    H100 stacks profile priced 14-46% high). An H200 day's graphed one-stack runs beside its stacks under
    MPS all take the stacks profile (its dedicated runs do anyway, ``shipped_profile``): it grew
    from the one-stack profile and prices one stack by the engine-and-trainer pair's rates, as #5's
    report scores them."""
    from calibration.run_settings import run_profile
    from calibration.validate import load_recorded

    by: dict[str, list[str]] = {}
    for rd in runs:
        cfg, summary, _ = load_recorded(Path(rd), spans=False)  # validate reads the spans
        by.setdefault(run_profile(cfg, summary), []).append(str(rd))
    if set(by) == {DEFAULT_PROFILES["graphed"], STACKS_PROFILE}:
        return STACKS_PROFILE
    if len(by) > 1:
        raise ConfigError("these runs take different shipped profiles: validate each set on its own or name one for "
                          "all with --profile (" + "; ".join(f"--profile {p}: {', '.join(r)}" for p, r in by.items())
                          + ")")
    return next(iter(by))


def cmd_validate(a: argparse.Namespace) -> int:
    from calibration.validate import plot_validation, render_markdown, validate
    from nodus.outdir import make_out_dir, write_json

    runs = [*a.runs, *a.more_runs]
    if not runs:
        raise ValueError("validate needs at least one run folder (written by nodus run --out), named before the "
                         "options or after --runs")
    if a.profile is None:
        a.profile = runs_profile(runs)
        print(f"nodus: profile {a.profile}, the shipped one for these runs (their GPU, trainer and stacks; "
              "--profile to choose another)", file=sys.stderr)
    rep = validate(runs, profile=a.profile, fit_max_jobs=a.fit_max_jobs)
    if a.out:
        out = make_out_dir(a.out)
        write_json(out / "validation.json", rep)
        (out / "validation.md").write_text(render_markdown(rep) + "\n")
        plot_validation(rep, out / "validation.png")
    if a.annotate:
        from calibration.validate import annotate_profile

        annotate_profile(a.profile, rep, a.annotate, report=a.report_path or (str(Path(a.out) / "validation.md")
                                                                              if a.out else None))
        print(f"wrote {a.annotate} (the profile with this validation's error bar)", file=sys.stderr)
    print(json.dumps(rep, default=str) if a.json else render_markdown(rep))
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def cmd_calibrate(a: argparse.Namespace) -> int:
    from calibration.measure import calibrate

    calibrate(a.model, a.out, base=a.base, batches=_ints(a.batches), adapter_counts=_ints(a.adapters),
              prompt_tokens=_ints(a.prompt_tokens), lengths=_ints(a.lengths),
              train_tokens=_ints(a.train_tokens) if a.train_tokens else None, device=a.device,
              enforce_eager=a.enforce_eager, repeats=a.repeats, trainer_graphs=a.trainer_graphs,
              tuned_lora_kernels=a.tuned_lora_kernels, engine_slots=a.engine_slots, decode_model=a.decode_model,
              from_raw=a.from_raw, adapter_format=a.adapter_format,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"wrote {a.out}; check it with: nodus validate RUN_DIR... --profile {a.out}")
    return 0


def cmd_calibrate_sharing(a: argparse.Namespace) -> int:
    from calibration.corun import RATES, calibrate_sharing

    # With --from-raw the measuring flags are unused; --modes/--batches/--train-tokens give a log's grid.
    prof = calibrate_sharing(a.model, a.base, a.out, modes=tuple(m for m in a.modes.split(",") if m),
                             from_raw=a.from_raw, batches=_ints(a.batches), train_tokens=_ints(a.train_tokens),
                             prompt=a.prompt_tokens, length=a.length, repeats=a.repeats, device=a.device,
                             engine_memory=a.engine_memory, enforce_eager=a.enforce_eager,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    m = prof["measurements"]["sharing"]
    r = m["rates"]
    print(" ".join(f"{k} engine {r[k]['engine']:.3f} trainer {r[k]['trainer']:.3f};" for k in RATES if k in r))
    for b in r.get("implausible", []):
        print(f"left out: {b['rate']}.{b['side']} {b['value']:.2f} at batch {b['batch']} / {b['tokens']} tokens "
              f"(faster than the profile's bound of {RATE_MAX:g}x alone: disturbed timings)")
    if not m["complete"]:
        print(f"incomplete: {len(m['missing'])} bucket(s) not measured: "
              + ", ".join(f"{b['mode']} {b['batch']}/{b['tokens']}" for b in m["missing"]))
    print(f"wrote {a.out}")
    return 0


def cmd_calibrate_engines(a: argparse.Namespace) -> int:
    from calibration.engines import BATCHES, MODES, calibrate_engines

    batches = _ints(a.batches) if a.batches else None
    prof = calibrate_engines(a.model, a.base, a.out, modes=tuple(m for m in a.modes.split(",") if m),
                             from_raw=a.from_raw, transplant=a.transplant, batches=batches or BATCHES,
                             only_batches=batches if a.from_raw else None,
                             prompt=a.prompt_tokens, length=a.length,
                             repeats=a.repeats, device=a.device, engine_memory=a.engine_memory,
                             enforce_eager=a.enforce_eager, beside=tuple(b for b in a.beside.split(",") if b),
                             microbatch_tokens=a.train_microbatch_tokens,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    m = prof["measurements"]["engines"]
    cols = [(k, what) for mode in MODES
            for k, what in ((mode, f"{mode} slowdown beside the other engine"),
                            (f"{mode}_beside_trainer", f"{mode} beside the other stack's trainer"),
                            (f"{mode}_trainer_beside", f"{mode} that trainer beside the engine"))]
    for e in prof["sharing"]["engines_by_batch"]:
        print(f"batch {e['batch']}: " + ", ".join(f"{what} {e[k]:.3f}" for k, what in cols if e.get(k)))
    fast = [(e["batch"], what) for e in prof["sharing"]["engines_by_batch"] for k, what in cols
            if e.get(k) is not None and e[k] < 1.0]
    if fast:
        print("faster beside than alone (disturbed timings? measure again): "
              + ", ".join(f"{what} at {b}" for b, what in fast))
    if m["missing"]:
        print(f"incomplete: {len(m['missing'])} bucket(s) not measured: "
              + ", ".join(f"{b['mode']} {b['batch']}" for b in m["missing"]))
    print(f"wrote {a.out}; check it with: nodus validate RUN_DIR... --profile {a.out}")
    return 0


def _fit_decode_scale_only(a: argparse.Namespace) -> int:
    from calibration.fit_runs import fit_decode_scale
    from sim.profile import refuse_existing, write_profile

    others = [flag for flag, on in (("--trainer-mode", a.trainer_mode), ("--lora-kernels", a.lora_kernels),
                                    ("--graphless-from", a.graphless_from), ("--scales-only", a.scales_only),
                                    ("--step-floor", a.step_floor))
              if on]
    if others:
        raise ConfigError(f"--decode-scale-only fits decode.scale alone: drop {', '.join(others)}")
    refuse_existing(a.out, "nodus fit")
    prof = fit_decode_scale(a.runs, a.base)
    write_profile(prof, a.out, "nodus fit")
    d = prof["measurements"]["decode_scale_fit"]
    print(f"decode steps x {d['scale']:.3f} (was {d['base_scale']:.3f}; {d['generations']} dedicated generations "
          f"of {len(d['runs'])} run(s): their error at the base's scale {d['mape_base']:.1%}, bias {d['bias_base']:+.1%}; "
          f"now {d['mape_after']:.1%}, {d['bias_after']:+.1%}; their total seconds {d['total_after']:+.1%}); "
          "every other term and rate kept from the base")
    print(f"wrote {a.out}; rates fitted at the old scale (nodus fit-stacks) move with it: fit them again on it, "
          f"then check it with: nodus validate RUN_DIR... --profile {a.out}")
    return 0


def cmd_fit(a: argparse.Namespace) -> int:
    from calibration.fit_runs import fit_to_file

    if a.decode_scale_only:
        return _fit_decode_scale_only(a)
    if a.graph_max_tokens is not None and a.graphless_from is None:
        raise ConfigError("--graph-max-tokens says which rows of --graphless-from are past the CUDA graphs: "
                          "give --graphless-from too")

    prof = fit_to_file(a.runs, a.base, a.out, fit_max_jobs=a.fit_max_jobs, trainer_mode=a.trainer_mode,
                       lora_kernels=a.lora_kernels, graphless_from=a.graphless_from,
                       graph_max_tokens=a.graph_max_tokens, scales_only=a.scales_only,
                       term_selection=a.term_selection, step_floor=a.step_floor)
    f = prof["measurements"]["fit_runs"]
    t = f["train_fit"]
    if t.get("scale") is not None:
        print(f"scales only: the base's train terms x {t['scale']:.3f} (their proportions and the sharing rates kept)")
    print(f"fitted on {len(f['runs'])} run(s), {f['train_steps']} train steps (held out: {len(f['held_out'])}): "
          f"train = {t['a_s_per_microbatch']:.4f} s/micro-batch + {t['b_s_per_padded_token'] * 1e6:.3f} us/padded token "
          f"+ {t['c_s_per_adapter']:.4f} s/adapter + {t['d_s_per_regroup_token'] * 1e6:.3f} us/extra token "
          f"({t.get('d_layout', 'padded')} layout) "
          f"(fit MAPE {t['mape']:.1%}, worst {t['worst']:.1%}); "
          + (f"publish {f.get('publish_s_per_publish') or 0.0:.4f} s + {f['publish_s_per_adapter']:.4f} s/adapter"
             if f["publish_s_per_adapter"] is not None
             else "publish kept from the base (no publish in the fitted runs)"))
    sel = t.get("term_selection")
    if sel and sel.get("cv_mape"):
        cv = sel["cv_mape"]
        how = ("fitted on smaller steps, scored on larger ones" if sel.get("scheme") == "extrapolate"
               else "leave-one-run-out")
        print(f"train terms kept by cross-validation ({how}, {sel['folds']} folds): {sel['chosen']} "
              f"(its error on left-out steps {cv[sel['chosen']]:.1%}; every term the runs vary: "
              f"{cv[max(cv, key=len)]:.1%})")
    n = f.get("publish_corun_samples") or {}
    print(f"publish beside a train step x {f['publish_corun_factor']:.2f} ({n['beside_train']} such publishes, "
          f"{n['alone']} alone)" if f.get("publish_corun_factor") is not None
          else f"publish beside a train step: x {prof['publish'].get('corun_factor', 1.0):.2f} kept from the base "
               f"({n.get('beside_train', 0)} publishes beside a train step, {n.get('alone', 0)} alone)")
    if t.get("at_zero"):
        print(f"note: fitted at 0: {', '.join(t['at_zero'])} — these runs do not vary that term apart from the "
              "others; runs of other sizes would pin it")
    d = f.get("decode_fit")
    if d and d.get("sizes"):  # --step-floor
        print(f"decode steps max(curves x {d['scale']:.3f}, {d['step_floor_s'] * 1e3:.2f} ms) "
              f"(was x {d['base_scale']:.3f}, floor {d['base_step_floor_s'] * 1e3:.2f} ms) "
              f"on {d['generations']} lone generations, bias by size: "
              + "; ".join(f"{z['sequences']} sequences ({z['generations']}) {z['base']['bias']:+.1%} -> "
                          f"{z['fitted']['bias']:+.1%} (MAPE {z['fitted']['mape']:.1%})" for z in d["sizes"]))
    elif d:
        print(f"decode steps x {d['scale']:.3f} (dedicated generations: {d['generations']}; their error "
              f"{d['mape_before']:.1%} -> {d['mape_after']:.1%}, "
              f"bias {d['bias_before']:+.1%} -> {d['bias_after']:+.1%}; "
              f"their total seconds {d['total_before']:+.1%} -> {d['total_after']:+.1%})")
    else:
        print("decode: kept from the base (no dedicated generations to fit it on)")
    rates = f.get("sharing_fit") or {}
    print("sharing rates fitted: " + (", ".join(f"{k} {v:.3f}" for k, v in sorted(rates.items()))
                                      if rates else "none (the runs leave every rate to the base profile)"))
    print(f"wrote {a.out}; check it with: nodus validate RUN_DIR... --profile {a.out}")
    return 0


def cmd_fit_packed(a: argparse.Namespace) -> int:
    from calibration.packed_attention import fit_to_file

    r = fit_to_file(a.benches, a.base, a.out, report=a.report)
    w, wo = r["models"]["with_pairs"], r["models"]["without_pairs"]
    print(f"packed_pair_per_token = {r['packed_pair_per_token']:.3g} (a packed query-key pair against a token's "
          f"forward and backward) from {len(r['points'])} bench points; leaving each configuration out: "
          f"{w['loo_mape']:.1%} (worst {w['loo_worst']:.1%}) against {wo['loo_mape']:.1%} "
          f"(worst {wo['loo_worst']:.1%}) without the term")
    for row in r["ratios"]:
        print(f"  {row['jobs']} jobs, K={row['share']}: packed/plain step measured {row['measured']:.3f}, "
              f"profile {row['profile_with']:.3f} (without the term {row['profile_without']:.3f})")
    print(f"wrote {a.out}" + (f", {a.report}.md and {a.report}.json" if a.report else ""))
    return 0


def cmd_fit_audit(a: argparse.Namespace) -> int:
    from calibration.audit import fit_to_file

    r = fit_to_file(a.runs, a.base, a.out, report=a.report)
    print(f"decode.logprob_s_per_seq = {r['logprob_s_per_seq'] * 1e6:.2f} us (a sequence returning its sampled "
          f"token's logprob, per decode step) from {len(r['rows'])} pair(s)"
          + (f"; leaving each pair out: {r['left_out_mape']:.1%} (worst {r['left_out_worst']:.1%}) on its ratio"
             if r["left_out_mape"] is not None else ""))
    for x in r["rows"]:
        print(f"  {x['light']}: lighter over full audit measured {x['measured_ratio']:.3f}, simulated "
              f"{x['predicted_ratio']:.3f} ({x['ratio_error']:+.1%})"
              + (f", left out {x['left_out']['error']:+.1%}" if x["left_out"] else "")
              + ("" if x["same_folder"] else f" (its full-audit run {x['full']} in another folder)"))
    print(f"wrote {a.out}" + (f", {a.report}.md and {a.report}.json" if a.report else ""))
    return 0


def cmd_fit_handoff(a: argparse.Namespace) -> int:
    from calibration.handoff import fit_to_file

    r = fit_to_file(a.runs, a.base, a.out, report=a.report)
    print(f"train.handoff_s_per_sequence = {r['handoff_s_per_sequence'] * 1e3:.4f} ms, train.handoff_s_per_audited = "
          f"{r['handoff_s_per_audited'] * 1e3:.4f} ms (the host's work from a generation's end to its train step's "
          f"start), times {r['handoff_stacks_factor']:.3f} with two stacks or more (train.handoff_stacks_factor), "
          f"from {len(r['rows'])} class(es) of {len(a.runs)} run(s): {r['mape']:.1%} off their median gaps"
          + (f", each run left out {r['left_out_mape']:.1%} (worst {r['left_out_worst']:.1%})"
             if r["left_out_mape"] is not None else "")
          + ("" if r["told_apart"] else "; the runs audit the same share of their sequences, so the whole gap "
                                        "went per sequence (give runs of another audit to tell the terms apart)"))
    print(f"wrote {a.out}" + (f", {a.report}.md and {a.report}.json" if a.report else ""))
    return 0


def cmd_fit_stacks(a: argparse.Namespace) -> int:
    from calibration.stacks import fit_to_file

    if a.rate == "phases":
        return _fit_stacks_phases(a)
    if a.trainers is not None:
        raise ConfigError(f"nodus fit-stacks: --{'fit' if a.trainers else 'no-fit'}-trainers is the phases fit's "
                          f"(the two-trainer rate fitted with the other stacks rates): use it with --rate phases, "
                          f"not --rate {a.rate}")
    if a.tie_engines:
        raise ConfigError(f"nodus fit-stacks: --tie-engines ties the engine's rate beside a lone trainer to the "
                          f"two-engine rate in the three-rate fit: use it with --rate phases, not --rate {a.rate}")
    r = fit_to_file(a.runs, a.base, a.out, report=a.report, rate_name=a.rate, left_out=not a.no_left_out)
    what = (f"each of two stacks' engines generating together; one engine alone under MPS {r['mps_alone_engine']:.3f}"
            if r["field"] == "mps_engines" else
            f"a lone trainer beside engines of several stacks; the pair's, fitted on one stack, {r['mps_corun_trainer']:.3f}")
    print(f"sharing.{r['field']} = {r[r['field']]:.3f} ({what}) from {len(r['rows'])} run(s)"
          + (f"; leaving each run out: {r['left_out_mape']:.1%} (worst {r['left_out_worst']:.1%}) against "
             f"{r['without_rate_mape']:.1%} without the rate" if r["left_out_mape"] is not None else ""))
    for x in r["rows"]:
        print(f"  {x['run']}: measured {x['measured']:.0f}, predicted {x['predicted']:.0f} ({x['error']:+.1%})"
              + (f", left out {x['left_out']['error']:+.1%}" if x["left_out"] else "")
              + f", without the rate {x['error_without_rate']:+.1%}")
    print(f"wrote {a.out}" + (f", {a.report}.md and {a.report}.json" if a.report else ""))
    return 0


def _fit_stacks_phases(a: argparse.Namespace) -> int:
    from calibration.stacks_phases import FIELDS, PHASES, WHAT, fit_to_file

    r = fit_to_file(a.runs, a.base, a.out, report=a.report, progress=True, tie_engines=a.tie_engines,
                    trainers=a.trainers)
    for f in FIELDS:
        tied = a.tie_engines and f == "mps_stacks_engine"
        if f == "mps_trainers" and not r["trainers_fitted"]:
            why = (f"the runs' trains hardly ran together: it moves their phase times {r['trainers_moved']:.2%}"
                   if r["trainers_moved"] is not None else "--no-fit-trainers")
            print(f"sharing.{f} not fitted ({why}); the base's: "
                  + ("none, the many-clients rule" if r[f] is None else f"{r[f]:.3f}"))
            continue
        print(f"sharing.{f} = {r[f]:.3f} ({WHAT[f]}{': tied to the two-engine rate' if tied else ''})")
    print(f"from {len(r['rows'])} run(s)' phase times: " + ", ".join(f"{ph} {r['phase_mape'][ph]:.1%}" for ph in PHASES)
          + f" mean absolute error, steps/GPU-h {r['mape']:.1%} (the base's rates: "
          + ", ".join(f"{ph} {r['base_phase_mape'][ph]:.1%}" for ph in PHASES) + f", {r['base_mape']:.1%})")
    for x in r["rows"]:
        e = x["phase_error"]
        beside = (f"; {x['beside_engines']:.0%} of its generation beside the other stack's"
                  if x.get("beside_engines") is not None else "")
        print(f"  {x['run']}: measured {x['measured']:.0f}, predicted {x['predicted']:.0f} ({x['error']:+.1%}); "
              f"generation {e['generate']:+.1%}, train {e['train']:+.1%}{beside}")
    print(f"wrote {a.out}" + (f", {a.report}.md and {a.report}.json" if a.report else ""))
    return 0


def _name_value(item: str, flag: str, what: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise ConfigError(f"{flag} {item!r}: expected NAME=VALUE{what}")
    return name, value


def env_pairs(items: list[str]) -> list[tuple[str, str]]:
    """NAME=VALUE strings (--engine-env) as pairs; anything else is a clear error."""
    return [_name_value(item, "--engine-env", "") for item in items]


def engine_arg_pairs(items: list[str]) -> list[tuple[str, object]]:
    """NAME=VALUE strings (--engine-arg) as pairs, the value read as JSON when it parses (true,
    16, 0.5, {"a": 1}) and as a string otherwise; anything else is a clear error."""
    out = []
    for item in items:
        name, value = _name_value(item, "--engine-arg", " (a vLLM LLM(...) argument)")
        try:
            out.append((name, json.loads(value)))
        except ValueError:
            out.append((name, value))
    return out


def _add_audit_flags(p: argparse.ArgumentParser) -> None:
    """The on-policy audit's flags (RunConfig.audit; given, they replace the config's fields)."""
    p.add_argument("--no-audit", action="store_true",
                   help="skip the logprob agreement audit (engine against trainer logprobs of the sampled tokens; "
                        "config audit.logprobs false)")
    p.add_argument("--audit-every", type=int, default=None, metavar="N",
                   help="audit every N-th step of each job (steps 0, N, 2N, ...): only then does the engine return "
                        "logprobs, whose handling is host work on every decode step; default: the config's "
                        "audit.every, 1 (every step)")
    p.add_argument("--audit-responses", type=int, default=None, metavar="K",
                   help="on an audited step, only the first K responses of each prompt return their logprobs and "
                        "are audited (the engine's logprob work follows the responses that ask); default: the "
                        "config's audit.responses, all. On the H200, K=1 at 8 responses a prompt ran 13-15%% faster "
                        "with two stacks (session 32)")


def audit_from_args(cfg: RunConfig, a: argparse.Namespace) -> RunConfig:
    """``cfg`` with the audit flags given (--no-audit, --audit-every, --audit-responses) in its
    ``audit``; a clear error for a value the audit cannot take."""
    audit = audit_spec_from_args(a, cfg.audit)
    return cfg if audit is cfg.audit else cfg.model_copy(update={"audit": audit})


def audit_spec_from_args(a: argparse.Namespace, base=None):
    """``base`` (an AuditSpec; default the full audit) with the audit flags given; ``base`` itself
    when none is."""
    from nodus.config import AuditSpec

    base = base if base is not None else AuditSpec()
    if a.audit_every is not None and a.audit_every < 1:
        raise ConfigError(f"--audit-every {a.audit_every}: audit every N-th step needs N >= 1 (--no-audit: none)")
    if a.audit_responses is not None and a.audit_responses < 1:
        raise ConfigError(f"--audit-responses {a.audit_responses}: the first K responses of each prompt need "
                          "K >= 1 (--no-audit: none)")
    upd = {k: v for k, v in (("logprobs", False if a.no_audit else None), ("every", a.audit_every),
                             ("responses", a.audit_responses)) if v is not None}
    return AuditSpec(**{**base.model_dump(), **upd}) if upd else base


def _bench_profile_args(p: argparse.ArgumentParser, base_help: str) -> None:
    """--model, --base and --out of the co-run benches (calibrate-sharing, calibrate-engines)."""
    p.add_argument("--model", help="local model folder (weights saved, e.g. random); needed unless --from-raw")
    p.add_argument("--base", default="h200-qwen3-0.6b", help=base_help)
    p.add_argument("--out", required=True, help="profile JSON to write (never overwritten); the raw timings "
                                                "go beside it as they come (OUT.raw.json)")


def _measuring_device_args(p: argparse.ArgumentParser) -> None:
    """--device and --enforce-eager of the measuring commands (calibrate and its co-run benches)."""
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--enforce-eager", action="store_true")


def _fit_out_args(p: argparse.ArgumentParser) -> None:
    """A fit's --base, --out and --report (fit-stacks, fit-audit, fit-handoff)."""
    p.add_argument("--base", default=DEFAULT_PROFILES["graphed"],
                   help="profile to copy (the one you will simulate with)")
    p.add_argument("--out", required=True, help="profile JSON to write (never overwritten)")
    p.add_argument("--report", default=None, metavar="PREFIX", help="write PREFIX.md and PREFIX.json")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nodus", description="Many LoRA GRPO jobs on one GPU: simulate, run, compare.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("sim", help="simulate one arm (and its dedicated baseline) on a profile")
    _add_arm_flags(p, "; or a run folder: a real run's configuration on its shipped profile (by its GPU, trainer "
                      "and stacks), its measured steps per GPU-hour printed beside")
    _add_audit_flags(p)
    p.add_argument("--profile", help="shipped profile name or profile JSON path (default " + DEFAULT_PROFILE + "; "
                                     "--gpu picks another)")
    p.add_argument("--gpu", choices=GPUS, default="h200", help=GPU_HELP)
    p.add_argument("--what-if", action="append", default=[], metavar="PHASE=FACTOR",
                   help="scale a phase's costs on the profile, hypothetically (train, decode, prefill, "
                        "publish; 0.5: twice as fast); repeatable; the report lists it as an assumption")
    p.add_argument("--machine-runs", nargs="+", metavar="RUN_DIR",
                   help="recorded real runs of the machine the plan is for (one machine): the prediction's "
                        "steps/GPU-h and pace times their measured over simulated steps/GPU-h, over the runs of "
                        "the plan's kind (dedicated or shared); with runs of both kinds the ratio vs dedicated "
                        "times the quotient of the two (the profile's machine-calibrated error is its error bar)")
    p.set_defaults(fn=cmd_sim)

    p = sub.add_parser("profiles", help="the shipped simulator profiles: where measured, and their error bars")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_profiles)

    p = sub.add_parser("sweep", help="simulate every arm over job counts, groups and seeds")
    p.add_argument("--jobs", default="2,4,8,16")
    p.add_argument("--groups", default="1,2,4")
    p.add_argument("--policies", default="all", help="comma list of " + ",".join(POLICIES) + " or all")
    p.add_argument("--sharing", default="none,mps")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--share-prompts", default=None, metavar="K,...",
                   help="trainer.share_prompts values to sweep (0: plain rows; K > 1 needs a graphed profile; "
                        "default: 4 on a graphed profile, 0 on an eager one); "
                        "each value's ratios are over its own dedicated arm")
    p.add_argument("--stacks", default="1", metavar="N,...",
                   help="engine + trainer stack counts (arm.stacks) for shared-sync, overlap and continuous, where "
                        "the jobs fill them (default 1); two stacks are priced by the profile's two-engine rate "
                        f"(sharing.mps_engines, nodus fit-stacks; shipped: {STACKS_PROFILE}; on an H100 80GB: "
                        f"{H100_STACKS_PROFILE}) or flagged without one")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--arrive-every", type=float, metavar="S", default=None, help=ARRIVE_EVERY_HELP)
    p.add_argument("--profile", help=f"shipped profile name or profile JSON path (default {DEFAULT_PROFILE}; with "
                                     f"--stacks past 1 under MPS, {STACKS_PROFILE} for every run, as nodus sim and "
                                     "nodus plan pick it; --gpu picks another)")
    p.add_argument("--gpu", choices=GPUS, default="h200", help=GPU_HELP)
    p.add_argument("--workers", type=int, help="processes (default: CPU count)")
    p.add_argument("--out", help="write sweep.csv, sweep.json, sweep.png into this new folder")
    p.add_argument("--json", action="store_true")
    _add_audit_flags(p)  # every run of the sweep, the dedicated baseline's too
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("plan", help="how many GPUs a fleet of jobs needs, packed N to a GPU, and for how long")
    p.add_argument("config", nargs="?", help="YAML/JSON config whose jobs are the templates, repeated to "
                                             "--total-jobs (default: the reference workload's 8 jobs)")
    p.add_argument("--total-jobs", type=int, required=True, metavar="J", help="jobs to place")
    p.add_argument("--steps", type=int, help="optimizer steps per job (default: each job's own steps in the config, "
                                             "20 where it sets none)")
    p.add_argument("--per-gpu", default="1,2,4,8,16", metavar="N,...",
                   help="jobs a GPU to weigh (1: a GPU per job, the dedicated baseline; default 1,2,4,8,16)")
    p.add_argument("--policies", default="shared-sync,overlap,continuous", metavar="P,...",
                   help="shared arms to weigh (default shared-sync,overlap,continuous)")
    p.add_argument("--groups", default="2", metavar="K,...", help="overlap's phase groups (default 2)")
    p.add_argument("--sharing", default="mps", metavar="S,...", help="none, mps or both (default mps)")
    p.add_argument("--stacks", default="1", metavar="N,...",
                   help="engine + trainer stacks a GPU (arm.stacks; default 1); with more than one under MPS and "
                        f"no profile chosen, every option is priced on {STACKS_PROFILE}")
    p.add_argument("--profile", help="shipped profile name or profile JSON path (default: the config's, else "
                                     + DEFAULT_PROFILE + "; --gpu picks another)")
    p.add_argument("--gpu", choices=GPUS, default="h200", help=GPU_HELP)
    p.add_argument("--seed", type=int, default=1, help="run seed (default 1)")
    p.add_argument("--deadline-h", type=float, metavar="H", help="every job done within H hours")
    p.add_argument("--max-gpus", type=int, metavar="G", help="at most G GPUs")
    p.add_argument("--gpus", type=int, metavar="G",
                   help="a fixed fleet of G GPUs for every option: jobs dealt to them in turn, each GPU running at "
                        "most N at once (--per-gpu) while the rest queue for a slot; each job's wait is reported")
    p.add_argument("--max-wait-h", type=float, metavar="H", help="no job waits longer than H hours to start")
    p.add_argument("--price", type=float, metavar="P", help="what a GPU-hour costs: each option's cost column")
    p.add_argument("--arrive-every", type=float, metavar="S",
                   help="job i arrives i x S seconds after the first; a GPU's jobs (dealt in order) join it as they "
                        "arrive, and it is billed from its first job's arrival")
    p.add_argument("--sim-steps", type=int, metavar="N",
                   help="simulate N steps a job and project to --steps by each GPU's steady pace (faster for "
                        "long jobs; default: simulate every step)")
    p.add_argument("--workers", type=int, help="processes (default: CPU count)")
    p.add_argument("--out", help="write plan.json and plan.md into this new folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("run", help="run one arm through the real backend (vLLM + multi-LoRA trainer) or the sim")
    _add_arm_flags(p)
    p.add_argument("--backend", choices=("real", "sim"), default="real")
    p.add_argument("--model", default="tiny", help="local folder or hub name; 'tiny': a tiny Qwen3 made locally")
    p.add_argument("--mode", choices=("tasks", "synthetic"), default="tasks",
                   help="tasks: text prompts and verifiable rewards; synthetic: token ids, lengths forced "
                        "to the length model (timing runs with random weights)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--engine-memory", type=float, default=0.45, help="engine's share of GPU memory")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start, slower decode)")
    p.add_argument("--engine-thread-pct", type=int, help="MPS active thread percentage of the engine")
    p.add_argument("--trainer-thread-pct", type=int, help="MPS active thread percentage of the trainer")
    p.add_argument("--trainer-priority", default="normal", choices=("normal", "below-normal"),
                   help="MPS client priority of the trainer: below-normal lets the engine's kernels go first")
    p.add_argument("--trainer-cpu-threads", type=int, metavar="N",
                   help="torch's CPU threads in each trainer process (default: 2 for a trainer on a GPU, torch's "
                        "own count for one on the CPU; 0: torch's own count everywhere)")
    p.add_argument("--engine-cpu-threads", type=int, metavar="N",
                   help="torch's CPU threads in each engine process (0: torch's own count, one per CPU; default: "
                        "that with one engine, and with several on a GPU (--stacks N, timeslice's groups) half the "
                        "CPUs over them; vLLM's own GPU workers run 1)")
    p.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the engine processes, e.g. "
                        "VLLM_TUNED_CONFIG_FOLDER=DIR (tuned multi-LoRA kernel configs); repeatable")
    p.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="a vLLM engine argument (LLM(...) keyword; VALUE read as JSON, else a string), e.g. "
                        "specialize_active_lora=true; repeatable; those nodus sets itself are refused")
    p.add_argument("--tuned-lora-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's multi-LoRA kernels with the tuned configs nodus ships for its GPU (an H200: "
                        "1.0-3.0x per kernel over vLLM's defaults); --no-tuned-lora-kernels: vLLM's defaults")
    p.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's engine core (scheduler, model runner) in a process of its own: its next decode step "
                        "runs while the engine worker handles the last one's outputs; default: one process")
    p.add_argument("--adapter-format", choices=ADAPTER_FORMATS, default=None,
                   help="how each new adapter version goes from trainer to engine: one flat file each (one write, "
                        "one read; needs the engine core in the engine's process) or PEFT safetensors folders; "
                        "default: flat, safetensors under --engine-core-process")
    p.add_argument("--checkpoint-dir", help="checkpoint every job after every step")
    p.add_argument("--adapters-out", help="where each job's final adapter goes as a PEFT folder "
                                          "(<DIR>/<policy>/<job>; default: the --out folder's adapters/)")
    _add_audit_flags(p)
    p.add_argument("--trainer-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the trainer's element-wise ops (RMSNorm, rotary, SiLU*up); compiles at "
                        "start-up (default: on a GPU, where it measured 1.44x on the H200; off on a CPU)")
    p.add_argument("--trainer-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="each trainer micro-batch as one CUDA graph replay (fixed shapes: rows padded to a few "
                        "bucket widths, captured in the warm-up; masked layout; a GPU); it also packs each prompt's "
                        "responses 4 to a row unless the config or --share-prompts says otherwise. Off: the eager step")
    p.add_argument("--lora-layout", default="masked", choices=("padded", "masked", "auto"),
                   help="trainer's multi-adapter path (same update; masked measured 1.21x padded on the H200)")
    p.add_argument("--unseeded", action="store_true",
                   help="no per-response sampling seeds (faster on GPU; rollouts not reproducible)")
    p.add_argument("--no-baseline", action="store_true", help="don't also run the dedicated baseline")
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("validate", help="simulate recorded runs' configurations and report the prediction error")
    p.add_argument("runs", nargs="*", help="run folders written by nodus run --out")
    p.add_argument("--runs", dest="more_runs", nargs="+", action="extend", default=[], metavar="RUN",
                   help="run folders too (the same as naming them before the options)")
    p.add_argument("--profile", help="shipped profile name or profile JSON path (default: the shipped profile that "
                                     "describes the runs, by their GPU, trainer and stacks: `nodus profiles`)")
    p.add_argument("--fit-max-jobs", type=int, default=4, help="runs with more jobs per GPU are held out")
    p.add_argument("--annotate", metavar="PROFILE_OUT",
                   help="write the profile with this validation's held-out error (every sim report prints it)")
    p.add_argument("--report-path", help="where the report will live, recorded in the annotation")
    p.add_argument("--out", help="write validation.json and validation.md into this new folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("calibrate", help="measure engine and trainer costs into a profile (GPU; CPU for smoke tests)")
    p.add_argument("--model", help="local model folder (weights saved, e.g. random); needed unless --from-raw")
    p.add_argument("--out", required=True, help="profile JSON to write (never overwritten)")
    p.add_argument("--base", default=None, help="profile whose sharing section is kept (default h200-qwen3-0.6b)")
    p.add_argument("--batches", default="8,64,256,512")
    p.add_argument("--adapters", default="1,8")
    p.add_argument("--prompt-tokens", default="64,256", help="two prompt lengths (KV context cost)")
    p.add_argument("--lengths", default="16,64", help="two forced response lengths per point")
    p.add_argument("--train-tokens", default=None,
                   help="train points' token counts, the larger the trainer's micro-batch (default 4096,16384; with "
                        "--trainer-graphs on a GPU the larger is the largest halving of 16384 whose graphed trainer "
                        "is expected to fit beside the engine, 8192 on an H100 80GB)")
    p.add_argument("--repeats", type=int, default=3, help="timed pairs per decode point (median)")
    _measuring_device_args(p)
    p.add_argument("--trainer-graphs", action="store_true",
                   help="measure the trainer with its micro-batches as CUDA graphs (the fixed-shape program on a "
                        "CPU): the profile's train terms then model --trainer-graphs runs (train.step_mode), and "
                        "calibrate-sharing with it as --base measures the co-run rates with that trainer")
    p.add_argument("--tuned-lora-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the engine with the tuned LoRA kernel configs nodus ships for its GPU (as runs "
                        "use them by default; recorded in the profile's environment)")
    p.add_argument("--engine-slots", type=int, default=None, metavar="N",
                   help="the engine's adapter slots (vLLM max_loras; default: the largest of --adapters), as the "
                        "runs the profile should describe start theirs: one per job of a run, or of the largest arm "
                        "in a gpu_arms call (recorded in the profile's environment.engine_max_loras)")
    p.add_argument("--adapter-format", choices=ADAPTER_FORMATS, default=None,
                   help="the adapter handoff whose save and publish are timed (environment.adapter_format); "
                        "default: the runs' own, flat files where vLLM's engine core runs in this process "
                        "(nodus's default), PEFT safetensors folders under VLLM_ENABLE_V1_MULTIPROCESSING=1")
    p.add_argument("--decode-model", choices=DECODE_MODELS, default="surface",
                   help="surface: the decode curves are a + b*batch + c*adapters + d*batch*adapters (each >= 0) "
                        "fitted to the measured points by relative least squares, points more than "
                        f"{DECODE_OUTLIER * 100:.0f}%% off it named; "
                        "points: the measured points themselves, interpolated (calibrations before session 21)")
    p.add_argument("--from-raw", metavar="PROFILE",
                   help="refit the measurements (measurements.calibrate) of a profile nodus calibrate wrote instead "
                        "of measuring (its environment and sharing kept; the measuring options are not used)")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("calibrate-sharing",
                       help="measure engine and trainer co-running in two processes (no MPS, MPS) into a profile")
    _bench_profile_args(p, "profile whose other sections are kept; its train.step_mode picks the trainer measured "
                           "(graphed: the micro-batches as CUDA graphs)")
    p.add_argument("--from-raw", metavar="FILE",
                   help="build the profile without measuring, from a run's raw timings (OUT.raw.json) or its "
                        "log's bucket lines (a log's grid: --modes, --batches, --train-tokens as that run had them)")
    p.add_argument("--modes", default="none,mps", help="sharing modes to measure; none is the unit")
    p.add_argument("--batches", default="64,256,512", help="engine batch buckets")
    p.add_argument("--train-tokens", default="16384,49152", help="trainer step token buckets")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--length", type=int, default=128, help="forced response length")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engine-memory", type=float, default=0.35)
    _measuring_device_args(p)
    p.set_defaults(fn=cmd_calibrate_sharing)

    p = sub.add_parser("calibrate-engines",
                       help="measure two stacks' engines generating at once, by engine size, into a profile "
                            "(sharing.engines_by_batch)")
    _bench_profile_args(p, "profile whose other sections are kept (its LoRA kernels, CUDA-graph size, trainer "
                           "mode and stacks controls are measured); a stacks profile keeps its fitted rates at the "
                           "fit's engine size")
    p.add_argument("--from-raw", metavar="FILE", nargs="+",
                   help="build the profile from a run's raw timings, without measuring (several runs' files: each "
                        "bucket's timings pooled, medians over all)")
    p.add_argument("--transplant", action="store_true",
                   help="with --from-raw: take a bench run under other settings than the base's (another GPU, "
                        "CUDA-graph size, LoRA kernels, trainer mode or stacks controls), as a what-if; the profile "
                        "names each difference in an assumption (without it such a bench is refused)")
    p.add_argument("--modes", default="mps", help="sharing modes to measure: mps (a GPU), none (time-sliced)")
    p.add_argument("--batches", default=None,
                   help="engine sizes in sequences, each engine over one adapter per 64 sequences (default "
                        "64,128,256,512); with --from-raw, the sizes to take of the raw timings (default: all)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--length", type=int, default=256, help="forced response length")
    p.add_argument("--repeats", type=int, default=2, help="timings per engine and bucket, of each kind")
    p.add_argument("--beside", default="engine,trainer",
                   help="what runs beside the timed engine: the other engine, the other stack's trainer (stepping "
                        "over as many sequences and adapters; graphed where the base's train.step_mode is), or both")
    p.add_argument("--train-microbatch-tokens", type=int, default=8192,
                   help="the trainers' micro-batch tokens (the runs': 8192 on the H200, 4096 on an 80 GB H100)")
    p.add_argument("--engine-memory", type=float, default=0.35, help="GPU memory share of both engines together")
    _measuring_device_args(p)
    p.set_defaults(fn=cmd_calibrate_engines)

    p = sub.add_parser("fit", help="refit a profile's trainer and publish costs from recorded real runs")
    p.add_argument("runs", nargs="+", help="run folders written by nodus run --out")
    p.add_argument("--base", default="h200-qwen3-0.6b", help="profile whose other sections are kept")
    p.add_argument("--out", required=True, help="profile JSON to write (never overwritten)")
    p.add_argument("--fit-max-jobs", type=int, default=4,
                   help="use only runs with at most this many jobs per GPU (the rest stay held out)")
    p.add_argument("--trainer-mode", choices=STEP_MODES, default=None,
                   help="the trainer the runs used (default: the base's train.step_mode); another than the base's "
                        "fits that trainer's terms onto the base, its unfitted co-run rates kept from the base "
                        "(an assumption the profile names)")
    p.add_argument("--graphless-from", default=None, metavar="JSON",
                   help="decode steps measured past the engine's CUDA-graph sizes (a JSON of decode rows: batch, "
                        "adapters, step_s; a phase-profile measurement or a calibrated profile): the steps a "
                        "mid-batch admission runs without graphs cost that")
    p.add_argument("--graph-max-tokens", type=int, default=None, metavar="N",
                   help="with --graphless-from: the largest CUDA graph (tokens) of the engine that measured those "
                        "rows, when the file does not record it (nodus calibrate's does); default 512, vLLM's")
    p.add_argument("--lora-kernels", choices=LORA_KERNELS, default=None,
                   help="the engine's LoRA kernel configs the runs used (default: the base's "
                        "environment.lora_kernel_configs); another than the base's fits that engine onto the base "
                        "through the dedicated runs' decode.scale, the curves' shape kept (an assumption the profile "
                        "names)")
    p.add_argument("--scales-only", action="store_true",
                   help="carry the base to the runs' host and day instead of refitting it: its cost shapes and "
                        "sharing rates kept, the runs fit the trainer's scale, decode.scale and the publish cost "
                        "(the day's dedicated runs suffice; one is needed)")
    p.add_argument("--decode-scale-only", action="store_true",
                   help="refit decode.scale alone on dedicated runs' generations (one job alone, no MPS), every "
                        "other term and rate of the base kept: for a profile whose engine scale came from runs of "
                        "other engine settings; refit its stacks rates after it (nodus fit-stacks)")
    p.add_argument("--step-floor", action="store_true",
                   help="fit the engine's per-step host floor (decode.step_floor_s: a step costs max(curves x "
                        "scale, floor)) together with decode.scale, on the runs' lone generations (the engine alone, "
                        "no MPS: dedicated and shared-sync runs) of batch sizes at least 2x apart")
    p.add_argument("--term-selection", choices=TERM_SELECTIONS, default="runs",
                   help="how the train terms the runs support are chosen by cross-validation: runs (leave one run "
                        "out) or extrapolate (the largest steps predicted from the smaller ones, as the profile is "
                        "used at 8-16 jobs)")
    p.set_defaults(fn=cmd_fit)

    p = sub.add_parser("fit-packed", help="fit the packed rows' attention (trainer.share_prompts) from trainer "
                                          "benches into a copy of a profile")
    p.add_argument("benches", nargs="+", help="JSONs of experiments/bench_shared_prompts.py (GPU, graphed trainer)")
    p.add_argument("--base", default=DEFAULT_PROFILES["graphed"], help="graphed-trainer profile to copy")
    p.add_argument("--out", required=True, help="profile JSON to write (never overwritten)")
    p.add_argument("--report", default=None, metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    p.set_defaults(fn=cmd_fit_packed)

    p = sub.add_parser("fit-stacks", help="fit two stacks' engines' co-run rate (arm.stacks=2, MPS) from recorded "
                                          "runs into a copy of a profile")
    p.add_argument("runs", nargs="+", help="run folders of two-stack runs under MPS (config.json, summary.json, "
                                           "spans.jsonl)")
    _fit_out_args(p)
    p.add_argument("--rate", default="engines", choices=("engines", "trainer", "phases"),
                   help="engines: each of two stacks' engines generating together (sharing.mps_engines); trainer: a "
                        "lone trainer beside engines of several stacks (sharing.mps_stacks_trainer), fitted on a base "
                        "with a two-engine rate, held (fit it on runs whose trains ran beside generations: offset "
                        "stacks, --offset-stacks); each to zero mean error in steps/GPU-h. phases: those two and the "
                        "engines' rate beside the lone trainer (sharing.mps_stacks_engine) together, to the runs' "
                        "mean generation and train-step times, each at most its kind's rate alone under MPS "
                        "(sharing.mps_alone; no left-out fits; the runs may mix free, offset, held and lockstep stacks)")
    p.add_argument("--tie-engines", action="store_true",
                   help="--rate phases: one rate for an engine beside another stack's engine and beside its lone "
                        "trainer (sharing.mps_stacks_engine = sharing.mps_engines), two rates fitted: where the "
                        "three-rate fit puts the engine beside the lone trainer at its bound, the runs do not pin the "
                        "two apart (free-running runs mix both cases alike)")
    p.add_argument("--fit-trainers", dest="trainers", action="store_const", const=True, default=None,
                   help="--rate phases: fit the two-trainer rate (sharing.mps_trainers: each trainer while two stacks' "
                        "trainers train together) with the others, refused where the runs' trains never ran together. "
                        "By default it is fitted where they did enough to move a run's phase times 0.5%% (lockstep "
                        "runs, `lock`, train together throughout; free ones in part)")
    p.add_argument("--no-fit-trainers", dest="trainers", action="store_const", const=False,
                   help="--rate phases: keep the base's two-trainer rate (none: the many-clients rule, the pair's "
                        "combined rate split over the trainers)")
    p.add_argument("--no-left-out", action="store_true",
                   help="fit on every run only, without leaving each run and each day out (those fits replay "
                        "the runs about 20,000 times for thirty runs: hours on two cores); validate the profile on "
                        "held-out runs instead (nodus validate)")
    p.set_defaults(fn=cmd_fit_stacks)

    p = sub.add_parser("fit-audit", help="fit the audit's engine cost (decode.logprob_s_per_seq) from pairs of "
                                         "recorded runs that differ in their audit alone, into a copy of a profile")
    p.add_argument("runs", nargs="+", help="run folders, in pairs: one configuration and seed with the full audit "
                                           "and with a lighter one (--audit-responses / --audit-every / --no-audit), "
                                           "back to back on one machine")
    _fit_out_args(p)
    p.set_defaults(fn=cmd_fit_audit)

    p = sub.add_parser("fit-handoff", help="fit the host's handoff from a generation to its train step "
                                           "(train.handoff_s_per_sequence, _per_audited) on recorded runs' gaps, "
                                           "into a copy of a profile")
    p.add_argument("runs", nargs="+", help="run folders of the real backend (runs of two audits tell the "
                                           "logprobs' share apart)")
    _fit_out_args(p)
    p.set_defaults(fn=cmd_fit_handoff)

    p = sub.add_parser("report", help="re-render tables and plots of a run or sweep folder")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("tasks", help="the verifiable task families")
    tsub = p.add_subparsers(dest="tasks_cmd")
    tl = tsub.add_parser("list")
    tl.add_argument("--json", action="store_true")
    ts = tsub.add_parser("sample")
    ts.add_argument("task")
    ts.add_argument("-n", "--n", type=int, default=3, dest="n")
    ts.add_argument("--seed", type=int, default=0)
    td = tsub.add_parser("dataset", help="read a job's own problems (jobs[].dataset) as a run would: counts "
                                         "and the first items")
    td.add_argument("train", help="JSONL of {\"question\", \"answer\"} a line")
    td.add_argument("--task", default="gsm8k", help="the family whose answer check scores them (default gsm8k)")
    td.add_argument("--eval", help="held-out JSONL (default: the last --eval-size items of the training file)")
    td.add_argument("--eval-size", type=int, default=64)
    td.add_argument("-n", "--n", type=int, default=2, dest="n", help="items to show (default 2)")
    p.set_defaults(fn=cmd_tasks, json=False)

    p = sub.add_parser("compare", help="equal-learning comparison and gate verdict across run folders")
    p.add_argument("runs", nargs="+")
    p.add_argument("--baseline", help="baseline arm policy (default dedicated)")
    p.add_argument("--aa-runs", nargs="+", default=None, metavar="RUN",
                   help="A/A repeats recorded apart from the compared runs (two or more runs of one arm and "
                        "seed, e.g. another call's dedicated pair): the noise floor where the compared arm and "
                        "its baseline have no repeats; never in the ratios or the learning CIs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_compare)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `nodus sim | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except (ConfigError, FileExistsError, FileNotFoundError, KeyError, ValueError, RuntimeError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"nodus: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
