"""The measured arms table from real-backend run folders, with the simulator's prediction beside
each point.

    python experiments/gpu_table.py RUN_DIR... --out experiments/results/paper_table_gpu [--profile PROFILE (default: each run's shipped profile)]

Groups runs by arm (policy, groups, sharing), job count and seed; the dedicated runs of a
(jobs, seed) are the baseline (their mean: the order runs are named in never decides it), two of
them its A/A spread. Per arm and seed: steps per GPU-hour,
ratio to dedicated, rollout tokens per GPU-second, busy fractions, stale rollouts, and the
simulator's steps per GPU-hour for the same configuration replaying the run's response lengths, and
each job's slowdown (its finish time over its finish time alone, from the dedicated run).
Writes <out>.json (per arm, per seed: steps_per_gpu_hour, ratio_vs_dedicated, ...), <out>.md and
<out>.png (measured and simulated bars per arm).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from nodus.config import (DEFAULT_MICROBATCH_TOKENS, NO_CORUN_POLICIES, ConfigError, drop_idle_priority,
                          corun_key, packed_rows, stacks_of, trainer_freed)
from nodus.accounting import own_pace_steps_per_gpu_hour, pace_of, projected_steps_per_gpu_hour, runs_by_gpu
from nodus.microbatch import mb_tag
from calibration.run_settings import audit_label, run_audit, run_controls, trainer_step_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

REFERENCE = {  # the published study's ratios (8 jobs unless named); for the comparison column only
    "overlap/mps/g2": 2.137, "shared-sync/none/g1": 1.762, "overlap/none/g2": 1.639,
    "shared-sync/mps/g1": 1.630, "timeslice/none/g2": 1.033,
}
REFERENCE_SCALING = {("overlap/mps/g2", 2): 1.256, ("overlap/mps/g2", 4): 1.668}  # its 2- and 4-job points


# The full runs' length a job (issue 6: learning on 20-step runs), for the pace's projection.
PROJECT_STEPS = 20


def label_flags(label: str) -> frozenset:
    """The settings an arm label names ('overlap/mps/g2+lowpri+cg' -> {'+lowpri', '+cg'})."""
    return frozenset("+" + f for f in label.split("/")[-1].split("+")[1:])


def best_flags(present: set, flags: frozenset, own: frozenset | None) -> frozenset | None:
    """Of the dedicated runs' setting sets ``present``, the one an arm with settings ``flags`` is
    measured over: the largest that ``flags`` holds (ties: the first in sorted order), or ``own``
    when given (a dedicated row's baseline is the plain dedicated run: own = frozenset()) and
    present; None if none fits."""
    if own is not None:
        return own if own in present and own != flags else None
    fits = [f for f in present if f <= flags]
    return max(fits, key=lambda f: (len(f), sorted(f))) if fits else None


def run_day(run: str | Path) -> str | None:
    """A run's day as a label setting: ``calibration.validate.run_day`` (the folder holding its
    ``arms`` folder: ``.../session35/arms/RUN``, 'session35'), a '+' in it as '-', since a label's
    settings are split on '+'; None for a run laid out otherwise."""
    from calibration.validate import run_day as day_folder

    day = day_folder(run)
    return day.replace("+", "-") if day else None


def _flags_text(flags: frozenset) -> str | None:
    """A baseline's settings as the ratio names them ('+cg+lk'), its day aside (always the row's own);
    None for none."""
    return "".join(sorted(f for f in flags if not f.startswith("+@"))) or None


def microbatch_flag(flag: str) -> bool:
    """Whether a label flag is a trainer micro-batch size ('+mb8k', '+mb512': ``mb_tag``)."""
    return re.fullmatch(r"\+mb\d+k?", flag) is not None


def slots_flag(flag: str) -> int | None:
    """N of an engine-slot setting '+lsN'; None for any other flag."""
    m = re.fullmatch(r"\+ls(\d+)", flag)
    return int(m.group(1)) if m else None


def _other_machine(arm: set, dedicated: list | None) -> dict | None:
    """{"arm": [...], "dedicated": [...]} where the runs of a row and the dedicated runs its ratio
    divides by did not all run on one machine; None where they did, or where a machine is unknown
    (runs before session 35)."""
    if not arm or not dedicated or None in arm or None in dedicated or len(arm | set(dedicated)) == 1:
        return None
    return {"arm": sorted(arm), "dedicated": sorted(dedicated)}


def audit_flag(flags: frozenset) -> str:
    """The audit among a label's settings ('+r1', '+a4', '+a0', '+a4r1'); "" for the full audit."""
    return next((f for f in sorted(flags) if re.fullmatch(r"\+(a\d+(r\d+)?|r\d+)", f)), "")


def baseline_flags(present: set, flags: frozenset, jobs: int, stacks: int = 1) -> frozenset | None:
    """Of the dedicated runs' (job count, setting set) pairs ``present``, the setting set an arm of
    ``jobs`` jobs in ``stacks`` engine + trainer stacks with settings ``flags`` is measured over
    (``best_flags``). An arm's engine has its ``+lsM`` slots, else one a job of its stack. A dedicated
    run whose ``+lsN`` is not above the arm's M (else its jobs) counts as the arm's engine when:
    - its engine has spare slots (N above its own jobs: ``dedicated:j4`` on the 8-job arms' engine);
    - or N is the slots of the arm's engine (``dedicated:j16`` on 8 slots for 16 jobs in two
      stacks, each engine on 8 slots; or for 8 jobs on one stack, its first 8 jobs);
    - or the arm runs in stacks (each engine on fewer slots than the arm's jobs, as the plain
      dedicated run of its jobs has always stood for it).
    Never of an arm on fewer slots otherwise (more slots cost an engine time). A dedicated run's
    trainer micro-batch (``+mbNk``) counts whatever the arm's: each runs the micro-batch its GPU fits
    (on an H100 the dedicated trainer fits 8k tokens, two stacks' trainers 4k; on the H200 16k and
    8k), so the dedicated run at its own size is the dedicated arm; one at the arm's own size, then
    one at the default, goes first. Ties go to the engine whose slots (its +lsN, else one a job) are
    nearest the arm's, then to the run of more jobs. None if none fits."""
    flagged = next((n for n in map(slots_flag, flags) if n is not None), None)
    most = flagged if flagged is not None else jobs
    per_engine = flagged if flagged is not None else -(-jobs // max(1, stacks))

    def view(ded_jobs: int, f: frozenset) -> frozenset:
        def same_engine(n: int) -> bool:
            return n <= most and (ded_jobs < n or n == per_engine or stacks > 1)
        return frozenset(x for x in f if not (slots_flag(x) and same_engine(slots_flag(x)))
                         and not (microbatch_flag(x) and x not in flags))

    fits = [(dj, f, view(dj, f)) for dj, f in present]
    fits = [(dj, f, v) for dj, f, v in fits if v <= flags]
    if not fits:
        return None

    def gap(dj: int, f: frozenset) -> int:  # a dedicated run's slots: its +lsN, else one a job
        return abs(per_engine - next((n for n in map(slots_flag, f) if n is not None), dj))

    # Then the run holding more jobs, then the flags' text: one answer whatever the set order.
    def own_size(f: frozenset) -> bool:  # no micro-batch of its own but the arm's
        return all(x in flags for x in f if microbatch_flag(x))

    return max(fits, key=lambda x: (len(x[2]), own_size(x[1]), -gap(x[0], x[1]), x[0], sorted(x[2]),
                                    sorted(x[1])))[1]


def arm_label(arm: dict, summary: dict | None = None, trainer: dict | None = None) -> str:
    """policy/sharing/groups (/k<N>: N engine + trainer stacks, arm.stacks; +lock: in lockstep,
    arm.lockstep; +off: started out of step, arm.offset_stacks; +hold<F>: then held F hundredths of a
    cycle apart, arm.hold_apart; +lead<K>: jobs or groups at most K steps ahead of their stack's
    least advanced, arm.max_lead), plus the settings a run
    changed from the defaults (+lowpri: the
    trainer at below-normal MPS client priority; +e<pct>/+t<pct>: active thread percentages;
    +mb<k>k: the trainer's micro-batch tokens; +eager: the trainer's element-wise ops not compiled; +cg: the
    trainer's micro-batches replayed as CUDA graphs; +ep: vLLM's engine core in a process of its own;
    +gm<N>: the engine's CUDA graphs up to N tokens a step (engine.cuda_graph_max_tokens); +ls<N>: an
    engine started with N adapter slots, other than one per job (more: a larger arm's, in one invocation;
    fewer: engine.max_loras);
    +ea: extra vLLM engine arguments; +lk: tuned
    LoRA kernel configs in the engine (real/lora_kernels.py); +ee: other engine environment
    variables; +a0 / +aN / +rK / +aNrK: the engine's logprobs never / every N-th step / for the first K
    responses of each prompt / both (--no-audit, --audit-every, --audit-responses);
    +cpu<N>: torch's CPU threads in the trainer processes capped at N (RealOptions.trainer_cpu_threads);
    +ecpu<N>: the same in the engine processes (RealOptions.engine_cpu_threads);
    +np: the engine loaded published adapters into pageable host memory; +flat: the trainer handed
    them over as flat files (RealOptions.adapter_format); +sp<K>: the trainer packed
    each prompt's responses K to a row (trainer.share_prompts); +freed: the trainer took
    the next train while
    the engine loaded the last adapters, arm.trainer_waits_for_publish false; waiting is the default
    and how every run before the field existed ran, so those carry no label)."""
    label = f"{arm['policy']}/{arm['sharing']}/g{arm['groups']}"
    if stacks_of(arm) > 1:
        label += f"/k{arm['stacks']}"  # engine + trainer stacks splitting the jobs (arm.stacks)
        if arm.get("lockstep"):
            label += "+lock"  # the stacks in lockstep (arm.lockstep)
        if arm.get("offset_stacks"):
            label += "+off"  # the stacks started out of step (arm.offset_stacks)
        if arm.get("hold_apart"):
            label += f"+hold{round(arm['hold_apart'] * 100)}"  # then held apart (arm.hold_apart)
    if arm.get("max_lead") is not None:
        label += f"+lead{arm['max_lead']}"  # jobs (groups) at most K steps ahead in their stack (arm.max_lead)
    run = run_controls(summary or {})
    if trainer_freed(arm):
        label += "+freed"
    if run.get("publish_pinned") is False:
        # Published adapters loaded into pageable host memory (RealOptions.publish_pinned); right
        # after +freed, so the factor below finds its pair as "overlap/mps/g2+np" + the rest.
        label += "+np"
    if run.get("adapter_format") == "flat":
        label += "+flat"  # adapters handed to the engine as flat files (RealOptions.adapter_format)
    mb = (trainer or {}).get("max_tokens_per_microbatch", DEFAULT_MICROBATCH_TOKENS)
    if mb != DEFAULT_MICROBATCH_TOKENS:
        label += f"+{mb_tag(mb)}"
    share = packed_rows((trainer or {}).get("share_prompts"))
    if share:
        label += f"+sp{share}"  # each prompt's responses trained K to a row (trainer.share_prompts)
    controls = next((d["sharing_controls"] for d in (summary or {}).get("diagnostics", [])
                     if d.get("sharing_controls")), {})
    if drop_idle_priority(controls, corun_key(arm["policy"], arm.get("stacks"))).get("trainer_priority",
                                                                                    "normal") != "normal":
        label += "+lowpri"
    for side in ("engine", "trainer"):
        if controls.get(f"{side}_thread_pct"):
            label += f"+{side[0]}{controls[f'{side}_thread_pct']}"
    workers = [w for d in (summary or {}).get("diagnostics", []) for name, w in (d.get("workers") or {}).items()
               if name.startswith("trainer")]
    if workers and not any(w.get("compiled") for w in workers):
        label += "+eager"  # the trainer ran without its compiled element-wise ops
    modes = trainer_step_modes(summary or {})
    graphed = modes.count("graphed")
    if graphed:
        # Each trainer micro-batch one CUDA graph replay (--trainer-graphs); +cgNofM where only N of
        # the M trainers did (the others' capture failed, e.g. out of memory: they trained eager).
        label += "+cg" if graphed == len(modes) else f"+cg{graphed}of{len(modes)}"
    if run.get("trainer_cpu_threads"):
        label += f"+cpu{run['trainer_cpu_threads']}"  # torch's CPU threads in the trainers capped
    if run.get("engine_cpu_threads"):
        label += f"+ecpu{run['engine_cpu_threads']}"  # torch's CPU threads in the engines capped
    if run.get("engine_core_process"):
        label += "+ep"  # vLLM's engine core in a process of its own (--engine-core-process)
    if run.get("cuda_graph_max_tokens"):
        label += f"+gm{run['cuda_graph_max_tokens']}"  # the engine's CUDA graphs up to that many tokens
    if run.get("engine_max_loras"):
        label += f"+ls{run['engine_max_loras']}"  # an engine with that many adapter slots, other than the jobs
    if any(d.get("engine_args") for d in (summary or {}).get("diagnostics", [])):
        label += "+ea"  # extra vLLM engine arguments (--engine-arg)
    if run.get("lora_kernels") == "tuned":
        label += "+lk"  # tuned LoRA kernel configs in the engine (shipped, or VLLM_TUNED_CONFIG_FOLDER)
    if run.get("engine_env"):
        label += "+ee"  # other engine environment (--engine-env)
    # The engine's logprobs on fewer steps or responses: +a0 never, +aN every N-th step, +rK the first K
    # responses of each prompt.
    audit = audit_label(run_audit(summary or {}))
    if audit:
        label += f"+{audit}"
    return label


def build(runs: list[Path], profile: str | None, run_profiles: dict[str, str] | None = None,
          notes: list[str] | None = None) -> dict:
    """`run_profiles`: run-folder path prefix -> profile for the runs under it (runs made on
    another host are simulated on that host's profile); the rest use `profile`, or where it is None
    each its shipped profile (``calibration.run_settings.run_profile``: by its GPU, trainer and
    stacks; the table's ``shipped_profiles`` counts the runs on each)."""
    from calibration.validate import _phase_means, _simulate, corun_phase_means, load_recorded, recorded_configs
    from calibration.run_health import (gpu_flags, host_flags, host_monitor_flags, jit_flags, run_gpu_monitor,
                                        run_host_monitor, run_host_probe, run_jit_compiles, minutes_apart, run_machine,
                                        run_started)
    from calibration.run_settings import run_profile
    from nodus.stats import aa_spread

    table: dict = {"profile": profile, "run_profiles": dict(run_profiles or {}), "notes": list(notes or []),
                   "arms": {}, "aa": {}}
    shipped: dict[str, str] = {}  # run -> its shipped profile, where no profile was named for it

    def named(rd: Path) -> str | None:
        hits = [p for prefix, p in (run_profiles or {}).items() if str(rd).startswith(prefix)]
        return hits[0] if hits else profile

    def profile_of(rd: Path) -> str:
        return named(rd) or shipped[str(rd)]

    # Runs from several day folders (``.../DAY/arms/RUN``) keep to their day: each label carries the
    # day as a setting ("+@session35"), so a run is never a repeat of another day's run and divides
    # by its own day's dedicated runs only (a dedicated run's settings must all be the arm's).
    days = {str(rd): run_day(rd) for rd in runs}
    by_day = len({d for d in days.values() if d}) > 1
    table["days"] = sorted({d for d in days.values() if d}) if by_day else []
    rows = []
    corun: dict[str, dict] = {}  # run -> each phase's mean seconds alone and beside the other
    # Per (jobs, seed, code settings), over its dedicated runs: steps per GPU-hour, each job's
    # finish time alone, and the simulator's dedicated prediction. The settings are the run's
    # label flags (frozenset(): none; {"+cg", "+lk"}: the graphed trainer and tuned LoRA kernels):
    # an arm is measured over the dedicated runs with the most of its own settings (like with like).
    ded_sph: dict[tuple[int, int, frozenset], list[float]] = {}
    sim_sph: dict[tuple[int, int, frozenset], list[float]] = {}
    alone_finish: dict[tuple[int, int, frozenset], dict[str, list[float]]] = {}
    ded_steps: dict[tuple[int, int, frozenset], dict[str, int]] = {}
    sim_alone: dict[tuple[int, int, frozenset], dict[str, tuple[int, float]]] = {}
    ded_task: dict[tuple[int, int, frozenset], dict[str, str]] = {}
    ded_machine: dict[tuple[int, int, frozenset], set] = {}  # the machines of the dedicated runs
    ded_start: dict[tuple[int, int, frozenset], list] = {}  # when they began (Unix s; None: not recorded)
    ded_pace: dict[tuple[int, int, frozenset], list[float]] = {}  # their steady pace (accounting.pace_of)
    ded_runs: dict[tuple[int, int, frozenset], list[str]] = {}  # the dedicated runs themselves
    row_base_starts: dict[tuple[str, str], list] = {}  # (label, seed) -> when its ratio's dedicated runs began
    paces: dict[str, dict] = {}  # run -> its pace_of
    for rd in runs:
        cfg, summary, spans = load_recorded(rd)
        if named(rd) is None:
            shipped[str(rd)] = run_profile(cfg, summary)
        jobs, seed = len(cfg["jobs"]), int(cfg.get("seed", summary.get("seed", 0)))
        sim = _simulate(recorded_configs(rd, cfg, spans, profile_of(rd))[0], f"{rd}/config.json")
        plain = arm_label(cfg["arm"], summary, cfg.get("trainer")) + (f"+@{days[str(rd)]}"
                                                                       if by_day and days[str(rd)] else "")
        rows.append((rd, cfg, summary, jobs, seed, sim, _phase_means(spans), plain))
        corun[str(rd)] = corun_phase_means(spans)
        by_gpu = runs_by_gpu(spans)
        paces[str(rd)] = pace_of(by_gpu)
        if paces[str(rd)]:  # the same jobs at PROJECT_STEPS, each at its own pace (their ends drift apart)
            paces[str(rd)]["own_pace_projected"] = own_pace_steps_per_gpu_hour(by_gpu, PROJECT_STEPS)
        if plain == "dedicated/none/g1" or plain.startswith("dedicated/none/g1+"):
            key = (jobs, seed, label_flags(plain))
            ded_sph.setdefault(key, []).append(summary["steps_per_gpu_hour"])
            ded_machine.setdefault(key, set()).add(run_machine(summary))
            ded_start.setdefault(key, []).append(run_started(summary))
            ded_runs.setdefault(key, []).append(str(rd))
            ded_pace.setdefault(key, []).append(paces[str(rd)].get("pace_steps_per_gpu_hour"))
            sim_sph.setdefault(key, []).append(sim["steps_per_gpu_hour"])
            for j, d in summary.get("per_job", {}).items():
                alone_finish.setdefault(key, {}).setdefault(j, []).append(d["finish_s"])
                ded_task.setdefault(key, {})[j] = d.get("task")
                ded_steps.setdefault(key, {})[j] = d["steps"]
            sim_alone.setdefault(key, {j: (d["steps"], d["finish_s"]) for j, d in sim.get("per_job", {}).items()})
    # The baseline is the mean over the dedicated repeats: the order runs are named in never
    # decides it; two repeats also give the A/A spread.
    mean = (lambda v: sum(v) / len(v))
    for (jobs, seed, flags), vals in ded_sph.items():
        if len(vals) >= 2:
            table["aa"][f"{jobs}-s{seed}{''.join(sorted(flags))}"] = {
                "runs": vals[:2], "rel_diff": aa_spread(vals[:1], vals[1:2])["max"]}
    for rd, cfg, summary, jobs, seed, sim, phase_s, plain in rows:
        machine = run_machine(summary)
        flags = label_flags(plain)
        dedicated = cfg["arm"]["policy"] == "dedicated"
        # A dedicated row is a baseline itself unless a plain dedicated run of its jobs and seed is.
        day = frozenset(f for f in flags if f.startswith("+@"))  # the run's day (by_day), else none
        is_base = dedicated and (flags == day or (jobs, seed, day) not in ded_sph)
        label = plain + ("" if jobs == 8 else f"/{jobs}jobs")
        per = table["arms"].setdefault(label, {})
        if str(seed) in per:  # a repeat of this arm and seed: the row is the mean over its runs
            prev = per[str(seed)]  # (a dedicated repeat is in the baseline's mean already)
            prev["repeats"] = prev.get("repeats", [prev["run"]]) + [str(rd)]
            n = len(prev["repeats"])
            prev["phase_s"] = {k: (v * (n - 1) + phase_s.get(k, v)) / n for k, v in prev["phase_s"].items()}
            prev["corun_s"] = _merge_corun(prev["corun_s"], corun[str(rd)])
            prev["engine_steps"] = (prev.get("engine_steps") or []) + [engine_steps(summary, rd)]
            prev["machines"] = sorted(set(prev["machines"]) | {machine}, key=str)
            prev["baseline_machine"] = _other_machine(set(prev["machines"]), prev["baseline_machines"])
            if prev.get("minutes_from_baseline") is not None and not is_base:  # the farthest of the repeats
                apart = minutes_apart(run_started(summary), row_base_starts.get((label, str(seed))) or [])
                prev["minutes_from_baseline"] = None if apart is None else max(apart, prev["minutes_from_baseline"])
            if not is_base:  # measured and simulated: the mean over the runs, over the row's own baselines
                for kind, value in (("steps_per_gpu_hour", summary["steps_per_gpu_hour"]),
                                    ("sim_steps_per_gpu_hour", sim["steps_per_gpu_hour"])):
                    runs_of = prev.setdefault(f"runs_{kind}", [prev[kind]])
                    runs_of.append(value)
                    prev[kind] = sum(runs_of) / len(runs_of)
                pace = paces[str(rd)]
                if prev.get("pace") and pace:  # the pace and ramp: the mean over the runs too
                    keys = ["pace_steps_per_gpu_hour", "ramp_gpu_s"]
                    if prev["pace"].get("own_pace_projected") and pace.get("own_pace_projected"):
                        keys.append("own_pace_projected")
                    prev["pace"] = {k: (prev["pace"][k] * (n - 1) + pace[k]) / n for k in keys} | {"jobs": pace["jobs"]}
                else:
                    prev["pace"] = {}
                b, sb = prev["baseline_steps_per_gpu_hour"], prev["sim_baseline_steps_per_gpu_hour"]
                prev["ratio_vs_dedicated"] = prev["steps_per_gpu_hour"] / b if b else None
                prev["sim_ratio_vs_dedicated"] = prev["sim_steps_per_gpu_hour"] / sb if sb else None
            continue
        # The dedicated runs this row is measured over: those with the most of its own settings (a
        # dedicated row with a setting: over the plain dedicated run, when there is one).
        own = day if dedicated else None
        present = {(k[0], k[2]) for k in ded_sph if k[:2] == (jobs, seed)}
        base_flags = (baseline_flags(present, flags, jobs, stacks_of(cfg["arm"])) if own is None
                      else best_flags({f for _, f in present}, flags, own))
        variant, by_task = None, False
        over: frozenset = frozenset()  # the settings of the dedicated runs the ratio divides by
        base_machines: set | None = None  # the machines of those runs
        base_starts: list = []  # when those runs began
        base_runs: list = []  # those runs
        base = sbase = bpace = None
        alone: dict = {}
        if base_flags is not None:
            key = (jobs, seed, base_flags)
            base, sbase = mean(ded_sph[key]), mean(sim_sph[key])
            bpace = mean(ded_pace[key]) if all(ded_pace[key]) else None
            alone = {j: mean(v) for j, v in alone_finish.get(key, {}).items()}
            variant, over, base_machines = _flags_text(base_flags), base_flags, ded_machine[key]
            base_starts, base_runs = ded_start[key], ded_runs[key]
        elif not dedicated:
            # No dedicated run of this job count: a dedicated run is one job per GPU, so a larger
            # one holding the same jobs gives the baseline over just these jobs (their steps over
            # their GPU-seconds alone), from the dedicated runs with the most of this row's settings.
            sub_flags = baseline_flags({(k[0], k[2]) for k in ded_sph if k[1] == seed}, flags, jobs,
                                       stacks_of(cfg["arm"]))
            if sub_flags is not None:
                pick = (lambda m: {k[:2]: v for k, v in m.items() if k[2] == sub_flags})
                base, sbase, alone, by_task, used = _subset_baseline(
                    {j: d.get("task") for j, d in summary.get("per_job", {}).items()}, seed, pick(alone_finish),
                    pick(ded_steps), pick(sim_alone), pick(ded_task))
                variant = _flags_text(sub_flags) if base else None
                over = sub_flags if base else over
                base_machines = ded_machine[(*used, sub_flags)] if base else None
                base_starts = ded_start[(*used, sub_flags)] if base else []
                base_runs = ded_runs[(*used, sub_flags)] if base else []
        slow = [d["finish_s"] / alone[j] for j, d in summary.get("per_job", {}).items() if alone.get(j)]
        if is_base:  # the baseline itself: the mean over its repeats
            base_key = (jobs, seed, flags)
            sph, base, sbase = mean(ded_sph[base_key]), mean(ded_sph[base_key]), mean(sim_sph[base_key])
            bpace = mean(ded_pace[base_key]) if all(ded_pace[base_key]) else None
            variant = None
        else:
            sph = summary["steps_per_gpu_hour"]
        pace = dict(paces[str(rd)])
        if is_base and pace and bpace:  # the baseline's pace: the mean over its repeats too
            pace["pace_steps_per_gpu_hour"] = bpace
        # The machines of the dedicated runs the ratio divides by (none for a row that is no ratio).
        over_machines = None if is_base or dedicated or base is None or base_machines is None \
            else sorted(base_machines, key=str)
        per[str(seed)] = {
            "run": str(rd), "jobs": jobs, "steps_per_gpu_hour": sph,
            "ratio_vs_dedicated": sph / base if base else None,
            "rollout_tokens_per_gpu_s": summary.get("rollout_tokens_per_gpu_s"), "busy": summary.get("busy"),
            "stale_rollouts": summary.get("stale_rollouts"),
            # The dedicated row is the "alone" itself.
            "slowdown_vs_alone": ({"min": min(slow), "max": max(slow)}
                                  if slow and cfg["arm"]["policy"] != "dedicated" else None),
            "sim_steps_per_gpu_hour": sim["steps_per_gpu_hour"],
            "sim_ratio_vs_dedicated": sim["steps_per_gpu_hour"] / sbase if sbase else None,
            # What the ratios divide by (a repeat of this arm and seed reuses them).
            "baseline_steps_per_gpu_hour": base, "sim_baseline_steps_per_gpu_hour": sbase,
            # The window split into the jobs' steady pace and the GPU-seconds of their start and
            # drain (nodus.accounting.pace_of), measured and simulated, and the pace over the
            # dedicated runs' pace: what jobs of many steps would get, where a few steps' window
            # also pays offset stacks' start once.
            "pace": pace, "sim_pace": sim.get("pace") or {}, "baseline_pace_steps_per_gpu_hour": bpace,
            "reference_ratio": (REFERENCE.get(arm_label(cfg["arm"])) if jobs == 8
                                else REFERENCE_SCALING.get((arm_label(cfg["arm"]), jobs))),
            "phase_s": phase_s,
            # Each phase's actions alone and beside the other phase (calibration.validate.corun_phase_means).
            "corun_s": corun[str(rd)],
            # Each run's engine: its mean step (ms) and the slowest generation's over the fastest's
            # (real.stepstats; none for runs before session 28 or simulated ones). The same work runs
            # at the speed of these steps: session 29's seeds took 7.9-11.9 ms at 5307-7375 steps/GPU-h.
            "engine_steps": [engine_steps(summary, rd)],
            # True: some jobs had no dedicated run and took a same-task job's (same length model).
            "baseline_by_task": by_task,
            # The dedicated run's settings the ratio divides by, when not the defaults (e.g. "+cg").
            "baseline_variant": variant,
            # The arm's audit where the dedicated run it is measured over ran another (no dedicated
            # run of its audit that day): the ratio then holds the audit's gain too. A dedicated row
            # is that audit's own run.
            "baseline_audit": (None if is_base or dedicated or base is None or audit_flag(flags) == audit_flag(over)
                               else {"arm": audit_flag(flags) or "the full audit",
                                     "dedicated": audit_flag(over) or "the full audit"}),
            # The machines of the dedicated runs the ratio divides by, where one is another machine's
            # than this run's: the ratio then holds the two machines' difference too (session 34's
            # seed 2 at 16 jobs: 3.42x over a second machine's run, 3.78x over its own machine's).
            "baseline_machine": _other_machine({machine}, over_machines),
            "machines": [machine],  # every run's of the row (repeats add theirs)
            "baseline_machines": over_machines,
            "baseline_runs": None if over_machines is None else base_runs,
            # Minutes between this run's start and the farthest start of the dedicated runs its ratio
            # divides by (None: no ratio, or a start not recorded): a dedicated baseline moved 11-25% on
            # one machine within 15 minutes in session 43, so a ratio's runs are best minutes apart.
            "minutes_from_baseline": (None if over_machines is None
                                      else minutes_apart(run_started(summary), base_starts)),
            "sim_profile": profile_of(rd),
        }
        row_base_starts[(label, str(seed))] = base_starts if over_machines is not None else []
    table["factors"] = factors(table)
    # Runs on a slowed host (their host probe above the threshold times the table's median): named,
    # never dropped; runs recorded before the probe existed have none.
    table["host"] = host_flags([{"run": str(rd), "host_probe": run_host_probe(summary)}
                                for rd, _, summary, *_ in rows])
    # Runs on a slowed GPU (busy SM clock under the table's median, or a power or thermal slowdown
    # in many samples): named, never dropped; runs recorded before the GPU monitor have none.
    table["gpu"] = gpu_flags([{"run": str(rd), "gpu_monitor": run_gpu_monitor(summary)}
                              for rd, _, summary, *_ in rows])
    # Runs on a contended host (steal time, cgroup quota throttling, other processes' cores, a slow
    # core clock): named, never dropped; runs recorded before the host monitor have none.
    table["host_monitor"] = host_monitor_flags([{"run": str(rd), "host_monitor": run_host_monitor(summary)}
                                                for rd, _, summary, *_ in rows])
    mark_contended_ratios(table)
    # Runs whose engine JIT-compiled kernels inside the measured window (a stall the simulator does
    # not model): named, never dropped.
    table["jit"] = jit_flags([{"run": str(rd), "jit_compiles": run_jit_compiles(summary)}
                              for rd, _, summary, *_ in rows])
    if shipped:
        table["shipped_profiles"] = {p: sum(v == p for v in shipped.values()) for p in sorted(set(shipped.values()))}
    return table


def mark_contended_ratios(table: dict) -> None:
    """Give each ratio the runs behind it that ran on a contended host (``table["host_monitor"]``'s
    flags): ``ratio_contended`` = {"runs": its own flagged runs, "baseline": the flagged dedicated runs
    it divides by}, each with why; None where none was. Marked, never dropped: session 45's machine
    stole 16-20% of the CPU time its dedicated runs wanted (6% of its two-stack runs'), and the
    ratios over them read 3.54x and 5.01x where the uncontended same-machine ratios were 2.7-3.1x."""
    why = {f["run"]: f["why"] for f in (table.get("host_monitor") or {}).get("flagged", [])}
    for per in table["arms"].values():
        for d in per.values():
            if d.get("ratio_vs_dedicated") is None or d.get("baseline_runs") is None:
                d["ratio_contended"] = None
                continue
            own = [{"run": r, "why": why[r]} for r in [d["run"], *d.get("repeats", [])[1:]] if r in why]
            base = [{"run": r, "why": why[r]} for r in d["baseline_runs"] if r in why]
            d["ratio_contended"] = {"runs": own, "baseline": base} if own or base else None


# Where the ratio comes from: each step of the ladder dedicated -> shared-sync -> overlap ->
# overlap + MPS changes one thing, so its ratio is that thing's factor (their product is the total).
FACTORS = (
    ("batching", "shared-sync/none/g1", "dedicated/none/g1",
     "one engine and one trainer for every job (shared-sync over dedicated)"),
    ("overlap", "overlap/none/g2", "shared-sync/none/g1",
     "two phase-offset groups, no sharing controls (overlap over shared-sync)"),
    ("mps_with_overlap", "overlap/mps/g2", "overlap/none/g2", "MPS under overlap (overlap + MPS over overlap)"),
    ("mps_without_overlap", "shared-sync/mps/g1", "shared-sync/none/g1",
     "MPS with nothing to co-run (shared-sync + MPS over shared-sync)"),
    ("trainer_low_priority", "overlap/mps/g2+lowpri", "overlap/mps/g2",
     "the trainer at below-normal MPS client priority (over overlap + MPS at normal priority)"),
    ("trainer_microbatch_32k", "overlap/mps/g2+mb32k", "overlap/mps/g2",
     "the trainer's micro-batches at 32k tokens instead of 16k (under overlap + MPS)"),
    ("trainer_freed_at_train", "overlap/mps/g2+freed", "overlap/mps/g2",
     "the trainer takes the next group's train while the engine loads the last one's adapters "
     "(over waiting for that publish, under overlap + MPS)"),
    ("publish_unpinned", "overlap/mps/g2+np", "overlap/mps/g2",
     "the engine loads published adapters into pageable host memory (over vLLM's pinned copies, "
     "under overlap + MPS)"),
    ("flat_handoff", "shared-sync/mps/g1/k2+flat", "shared-sync/mps/g1/k2",
     "the trainer hands each version to the engine as one flat file (over PEFT safetensors folders, "
     "shared-sync + MPS on two stacks)"),
    ("flat_handoff_dedicated", "dedicated/none/g1+flat", "dedicated/none/g1",
     "the flat adapter file over PEFT safetensors folders, in the dedicated runs"),
    ("overlap_with_mps", "overlap/mps/g2", "shared-sync/mps/g1",
     "two phase-offset groups under MPS (overlap + MPS over shared-sync + MPS)"),
    ("continuous", "continuous/mps/g1", "overlap/mps/g2",
     "every job its own group, the trainer taking every ready job (continuous + MPS over overlap + MPS)"),
    ("two_stacks", "shared-sync/mps/g1/k2", "shared-sync/mps/g1",
     "two engine + trainer stacks splitting the jobs, each engine paced by a host thread of its own "
     "(shared-sync + MPS on two stacks over one)"),
    ("two_stacks_overlap", "overlap/mps/g2/k2", "overlap/mps/g2",
     "two stacks of two phase-offset groups each (overlap + MPS on two stacks over one)"),
    ("total", "overlap/mps/g2", "dedicated/none/g1", "overlap + MPS over dedicated"),
)


NO_CORUN_ARMS = tuple(f"{p}/" for p in NO_CORUN_POLICIES)  # labels of arms that never co-run


def factors(table: dict) -> dict:
    """Per job count and seed, each factor of the ladder that both its runs were measured for; the
    ladder again among the arms that share a code setting (``+cg``, ``+cg+lk``: its runs over the
    dedicated run with the same setting), keyed by the job count and that setting ("8+cg"). An
    arm with the trainer at below-normal priority (``+lowpri``) is measured over dedicated and
    shared-sync runs without it: with nothing co-running the priority decides nothing."""
    by: dict[tuple[int, str], dict[str, float]] = {}
    for label, per in table["arms"].items():
        arm = label.rsplit("/", 1)[0] if label.endswith("jobs") else label  # "overlap/mps/g2/4jobs"
        for seed, d in per.items():
            by.setdefault((d["jobs"], seed), {})[arm] = d["steps_per_gpu_hour"]

    def idle(arm: str) -> bool:
        # Engine and trainer never run at once (a shared-sync arm on several stacks, "/kN", co-runs
        # one stack's trainer beside another's engine).
        return arm.startswith(NO_CORUN_ARMS) and "/k" not in arm

    def key(arm: str, sfx: str) -> str:
        # The trainer's priority decides nothing where engine and trainer never run at once: a
        # co-running arm at below-normal priority is measured over those arms without it.
        return arm + (sfx.replace("+lowpri", "", 1) if idle(arm) else sfx)

    out: dict = {}
    for (jobs, seed), sph in sorted(by.items()):
        # Each setting the arms carry: "" (none), "+cg", ...: what follows "policy/sharing/gN".
        suffixes = sorted({"+" + a.split("+", 1)[1] if "+" in a else "" for a in sph})
        for sfx in suffixes:
            # Under +lowpri only the factors of a co-running arm (the others are the row without it).
            row = {name: sph[key(num, sfx)] / sph[key(den, sfx)] for name, num, den, _ in FACTORS
                   if ("+lowpri" not in sfx or not idle(num))
                   and key(num, sfx) in sph and key(den, sfx) in sph}
            if row:
                out.setdefault(f"{jobs}{sfx}", {})[seed] = row
    return out


def _subset_baseline(jobs: dict[str, str], seed: int, alone_finish: dict, ded_steps: dict, sim_alone: dict,
                     ded_task: dict):
    """(measured baseline, simulated baseline, each job's mean finish alone, by_task, the (jobs, seed)
    of the dedicated run used) over the jobs
    (id -> task), from the smallest dedicated run of ``seed`` that holds them all; failing that,
    from the largest one, each job it lacks standing in for by a job of the same task there (the
    same length model: its time alone is the same in expectation; ``by_task`` True). (None, None,
    {}, False, None) if neither works."""
    job_ids = set(jobs)
    runs = sorted(k for k in alone_finish if k[1] == seed)
    holding = [k for k in runs if job_ids and job_ids <= set(alone_finish[k])]
    by_task = not holding
    if holding:
        key, stand_in = holding[0], {j: j for j in job_ids}
    elif runs:
        key = runs[-1]
        first_of_task: dict[str, str] = {}
        for j in sorted(ded_task.get(key, {}), key=lambda j: (len(j), j)):
            first_of_task.setdefault(ded_task[key][j], j)
        stand_in = {j: j if j in alone_finish[key] else first_of_task.get(t) for j, t in jobs.items()}
        if not job_ids or None in stand_in.values():
            return None, None, {}, False, None
    else:
        return None, None, {}, False, None
    alone = {j: sum(alone_finish[key][s]) / len(alone_finish[key][s]) for j, s in stand_in.items()}
    base = 3600 * sum(ded_steps[key][s] for s in stand_in.values()) / sum(alone.values())
    sim = sim_alone.get(key, {})
    sbase = (3600 * sum(sim[s][0] for s in stand_in.values()) / sum(sim[s][1] for s in stand_in.values())
             if set(stand_in.values()) <= set(sim) else None)
    return base, sbase, alone, by_task, key


def engine_steps(summary: dict, run: Path) -> dict:
    """A run's engine steps as the table keeps them: {"run", "mean_step_ms", "step_ms_spread"}, the
    two figures None for a run that recorded none (before session 28, or simulated;
    ``calibration.run_health.run_engine_steps``)."""
    from calibration.run_health import run_engine_steps

    es = run_engine_steps(summary) or {}
    return {"run": str(run), "mean_step_ms": es.get("mean_step_ms"), "step_ms_spread": es.get("step_ms_spread")}


def engine_step_text(runs: list[dict]) -> str:
    """'7.94 (1.86x)': the mean engine step over a row's runs that recorded one, the widest spread
    among them, and '(k of n runs)' where only k of its n runs did; '-' where none did."""
    have = [r for r in runs if r.get("mean_step_ms") is not None]
    if not have:
        return "-"
    spread = max((r["step_ms_spread"] for r in have if r.get("step_ms_spread")), default=None)
    text = f"{sum(r['mean_step_ms'] for r in have) / len(have):.2f}" + (f" ({spread:.2f}x)" if spread else "")
    return text + (f" ({len(have)} of {len(runs)} runs)" if len(have) < len(runs) else "")


def _merge_corun(a: dict, b: dict) -> dict:
    """Two runs' ``corun_phase_means`` as one: each mean weighted by its count of actions."""
    out = {}
    for ph in a:
        m = {}
        for side in ("alone", "beside"):
            na, nb = a[ph][f"n_{side}"], b[ph][f"n_{side}"]
            total = (a[ph][side] or 0.0) * na + (b[ph][side] or 0.0) * nb
            m[side], m[f"n_{side}"] = (total / (na + nb) if na + nb else None), na + nb
        out[ph] = m
    return out


def render(table: dict) -> str:
    others = "".join(f"; runs under `{k}` on `{v}`" for k, v in (table.get("run_profiles") or {}).items())
    if table.get("profile"):
        on = f"profile `{table['profile']}`"
    else:  # each run on its shipped profile (by its GPU, trainer and stacks)
        on = "each run's shipped profile (" + ", ".join(f"`{p}`: {n} run{'s' * (n != 1)}" for p, n in
                                                        (table.get("shipped_profiles") or {}).items()) + ")"
    lines = [f"Measured on the GPU; simulator on {on}{others}, replaying each run's lengths.", ""]
    lines += [f"- {n}" for n in table.get("notes") or []] + ([""] if table.get("notes") else [])
    if table.get("days"):
        lines += [f"Runs of {len(table['days'])} days ({', '.join(table['days'])}; a day: the folder holding a run's "
                  "`arms` folder): each label ends in its day (+@DAY), and each ratio divides by that day's dedicated "
                  "runs only.", ""]
    lines += ["| arm | seed | steps/GPU-h | ratio vs dedicated | reference ratio | sim steps/GPU-h | sim ratio | "
              "rollout tokens/GPU-s | busy engine / trainer / GPU | per-job slowdown min-max | stale |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = (lambda x, p=2: "-" if x is None else f"{x:.{p}f}")
    for label, per in table["arms"].items():
        for seed, d in sorted(per.items()):
            b = d.get("busy") or {}
            runs = d.get("runs_steps_per_gpu_hour")
            sph = f"{d['steps_per_gpu_hour']:.0f}" + (f" ({' / '.join(f'{x:.0f}' for x in runs)})" if runs else "")
            ratio = f(d['ratio_vs_dedicated']) + (f" (over dedicated{d['baseline_variant']})"
                                                  if d.get("baseline_variant") and d['ratio_vs_dedicated'] else "")
            ratio += " (contended host)" if d.get("ratio_contended") else ""
            lines.append(f"| {label} | {seed} | {sph} | {ratio} | "
                         f"{f(d['reference_ratio'], 3)} | {d['sim_steps_per_gpu_hour']:.0f} | "
                         f"{f(d['sim_ratio_vs_dedicated'])} | {f(d.get('rollout_tokens_per_gpu_s'), 0)} | "
                         f"{f(b.get('engine'))} / {f(b.get('trainer'))} / "
                         f"{f(b.get('gpu'))} | {_slow(d)} | {d['stale_rollouts']} |")
    if table.get("factors"):
        lines += ["", "Where the ratio comes from (each factor: one arm over the arm that differs from it in one thing):", "",
                  "| jobs | seed | " + " | ".join(name for name, *_ in FACTORS) + " |",
                  "|---|---|" + "---|" * len(FACTORS)]
        for count, per in table["factors"].items():
            for seed, row in sorted(per.items()):
                lines.append(f"| {count} | {seed} | " + " | ".join(f(row.get(name)) for name, *_ in FACTORS) + " |")
        lines += [""] + [f"- {name}: {what}" for name, _, _, what in FACTORS]
    steps = any(r.get("mean_step_ms") is not None for per in table["arms"].values() for d in per.values()
                for r in d.get("engine_steps") or [])
    if table.get("factors") or steps:
        lines += ["", "Mean seconds per phase action (generate / train / publish)"
                  + (" behind those factors" if table.get("factors") else "")
                  + (", and the engine's mean step (in brackets: the slowest generation's mean step over the "
                     "fastest's; runs since session 28)" if steps else "") + ":", "",
                  "| arm | seed | generate s | train s | publish s |" + (" engine step ms |" if steps else ""),
                  "|---|---|---|---|---|" + ("---|" if steps else "")]
        for label, per in table["arms"].items():
            for seed, d in sorted(per.items()):
                ph = d.get("phase_s") or {}
                lines.append(f"| {label} | {seed} | {f(ph.get('generate'), 3)} | {f(ph.get('train'), 3)} | "
                             f"{f(ph.get('publish'), 3)} |"
                             + (f" {engine_step_text(d.get('engine_steps') or [])} |" if steps else ""))
    paced = [(label, seed, d) for label, per in table["arms"].items() for seed, d in sorted(per.items())
             if (d.get("pace") or {}).get("pace_steps_per_gpu_hour")]
    if paced:
        lines += ["", f"Steady pace (`nodus.accounting.pace_of`): each run's steps per GPU-hour once every job is "
                  f"under way (its jobs' steps between their first and last generation's start), the GPU-seconds "
                  f"of the window not at that pace (the start and the drain, paid once a run: offset stacks "
                  f"start a generation apart), the steps per GPU-hour of the same jobs run for "
                  f"{PROJECT_STEPS} steps each (that start and drain plus every step at the pace; after the "
                  f"slash, each job going on at its own pace and the GPU billed until the last one ends: where "
                  f"the jobs' paces differ, as under the continuous policy, their ends drift apart with every "
                  f"step; simulated continuous runs of 20 and 40 steps fell between the two), and the pace over the "
                  f"dedicated runs' pace:", "",
                  f"| arm | seed | steps/GPU-h (window) | pace steps/GPU-h | start and drain GPU-s | "
                  f"at {PROJECT_STEPS} steps a job | pace over dedicated's | sim pace |", "|---|---|---|---|---|---|---|---|"]
        for label, seed, d in paced:
            p, b = d["pace"], d.get("baseline_pace_steps_per_gpu_hour")
            at = projected_steps_per_gpu_hour(d, PROJECT_STEPS)
            own = p.get("own_pace_projected")
            ratio = p["pace_steps_per_gpu_hour"] / b if b else None
            lines.append(f"| {label} | {seed} | {d['steps_per_gpu_hour']:.0f} | {p['pace_steps_per_gpu_hour']:.0f} | "
                         f"{p['ramp_gpu_s']:.2f} | {f(at, 0)}{f' / {own:.0f}' if own else ''} | {f(ratio, 2)} | "
                         f"{f((d.get('sim_pace') or {}).get('pace_steps_per_gpu_hour'), 0)} |")
    other_audit = [f"{label} seed {seed} ({d['baseline_audit']['arm']} over a dedicated run with "
                   f"{d['baseline_audit']['dedicated']})" for label, per in table["arms"].items()
                   for seed, d in sorted(per.items()) if d.get("baseline_audit")]
    if other_audit:
        lines += ["", "Measured over a dedicated run under another audit (none of the arm's own that day; the ratio "
                  "holds any gain the audit gives dedicated too): " + "; ".join(other_audit) + "."]
    apart = [f"{label} seed {seed}: {d['minutes_from_baseline']:.0f}" for label, per in table["arms"].items()
             for seed, d in sorted(per.items()) if d.get("minutes_from_baseline") is not None]
    if apart:
        lines += ["", "Minutes between each ratio's run and the farthest of the dedicated runs it divides by "
                  "(`minutes_from_baseline`; a dedicated baseline moved 11-25% on one machine within 15 minutes "
                  "in session 43): " + "; ".join(apart) + "."]
    contended = [f"{label} seed {seed} ({_contended_text(d['ratio_contended'])})"
                 for label, per in table["arms"].items() for seed, d in sorted(per.items()) if d.get("ratio_contended")]
    if contended:
        lines += ["", "Ratios with a run on a contended host behind them (`ratio_contended` in the JSON; steal on a "
                  "dedicated run it divides by makes the ratio read high, on the arm's own run low; not a "
                  "measurement of the arm): " + "; ".join(contended) + "."]
    other_machine = [f"{label} seed {seed}" for label, per in table["arms"].items()
                     for seed, d in sorted(per.items()) if d.get("baseline_machine")]
    if other_machine:
        lines += ["", "Measured over a dedicated run from another machine (`baseline_machine` in the JSON: the ratio "
                  "holds the two machines' difference too): " + "; ".join(other_machine) + "."]
    both = [(label, seed, d["corun_s"]) for label, per in table["arms"].items() for seed, d in sorted(per.items())
            if d.get("corun_s") and all(d["corun_s"][ph]["n_beside"] for ph in ("generate", "train"))]
    if both:
        lines += ["", "What co-running costs each side (mean seconds of a phase's actions run alone, with none of the "
                  "other phase beside them, and beside the other phase; actions in n):", "",
                  "| arm | seed | generate alone (n) | generate beside (n) | train alone (n) | train beside (n) |",
                  "|---|---|---|---|---|---|"]
        for label, seed, c in both:
            g, t = c["generate"], c["train"]
            cells = [f"{f(x[side])} ({x['n_' + side]})" for x in (g, t) for side in ("alone", "beside")]
            lines.append(f"| {label} | {seed} | " + " | ".join(cells) + " |")
    if table.get("learning"):
        lines += _render_learning(table["learning"])
    hostf = table.get("host") or {}
    if hostf.get("flagged"):
        from calibration.run_health import flagged_text

        lines.append(f"\nRuns on a slowed host (host probe above {hostf['threshold']:.1f}x the table's median): "
                     + flagged_text(hostf))
    gpuf = table.get("gpu") or {}
    if gpuf.get("flagged"):
        from calibration.run_health import gpu_flagged_text

        med = gpuf["median_busy_sm_clock_mhz"]
        lines.append(f"\nRuns on a slowed GPU (busy SM clock more than {gpuf['clock_threshold']:.0%} under the table's "
                     f"median{'' if med is None else f' of {med:.0f} MHz'}, or a power, thermal or hardware slowdown "
                     f"in {gpuf['throttle_threshold']:.0%} of samples or more): " + gpu_flagged_text(gpuf))
    hm = table.get("host_monitor") or {}
    if hm.get("flagged") or hm.get("one_thread") or hm.get("cgroup_unread") or hm.get("runs_without_figures"):
        from calibration.run_health import host_monitor_text

        lines.append("\n" + host_monitor_text(hm))
    jit = table.get("jit") or {}
    if jit.get("flagged"):
        from calibration.run_health import jit_text

        lines.append("\nRuns whose engine JIT-compiled kernels while measured (each compile stalls the steps beside "
                     "it; the simulator does not model it): " + jit_text(jit))
    for k, aa in table["aa"].items():
        lines.append(f"\nA/A (dedicated run twice, {k}): {aa['runs'][0]:.0f} and {aa['runs'][1]:.0f} "
                     f"steps/GPU-h, relative difference {aa['rel_diff']:.1%}")
    for seed, name in sorted((table.get("timelines") or {}).items()):
        number, _, chosen = seed.partition("=")
        which = f"arms {chosen.replace(',', ', ')}" if chosen else "8-job arms"
        lines.append(f"\nTimelines of seed {number}'s {which} on one time axis (each factor as a shorter "
                     f"timeline for the same optimizer steps): `{name}`")
    return "\n".join(lines)


def learning_guard(report: dict, source: str) -> dict:
    """Per compared arm of a `nodus compare` report: seeds, paired CIs, gate verdict."""
    out = {"source": source, "baseline": report["baseline"], "arms": {}}
    for arm in report["arms"]:
        vs = arm.get("vs_baseline")
        if vs:
            out["arms"][arm["arm"]] = {"seeds": vs["seeds"], "ratios": vs["ratios"], "acc_diff": vs["acc_diff"],
                                       "reward_diff": vs["reward_diff"], "gate_pass": vs["gate"]["pass"],
                                       "failed": [k for k, c in vs["gate"]["criteria"].items() if not c["pass"]]}
    return out


def _render_learning(guard: dict) -> list[str]:
    def ci(c):
        return "-" if not c else f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"

    lines = ["", f"Learning guard (`{guard['source']}`, baseline {guard['baseline']}; paired 95% CIs):", "",
             "| arm | seeds | ratios | eval accuracy diff | mean reward diff | gate |", "|---|---|---|---|---|---|"]
    for arm, g in guard["arms"].items():
        verdict = "PASS" if g["gate_pass"] else f"FAIL ({', '.join(g['failed'])})"
        lines.append(f"| {arm} | {' '.join(map(str, g['seeds']))} | {' / '.join(f'{r:.2f}' for r in g['ratios'])} | "
                     f"{ci(g['acc_diff'])} | {ci(g['reward_diff'])} | {verdict} |")
    return lines


def _contended_text(c: dict) -> str:
    """'the run: steal 6% of the CPU time wanted; dedicated: steal 17% of the CPU time wanted' for a
    ratio's ``ratio_contended``, in the validation reports' words (``contention_text``)."""
    from calibration.run_health import contention_text

    parts = ([f"the run: {contention_text(r['why'])}" for r in c["runs"]]
             + [f"dedicated: {contention_text(r['why'])}" for r in c["baseline"]])
    return "; ".join(parts)


def _slow(d: dict) -> str:
    s = d.get("slowdown_vs_alone")
    return "-" if not s else f"{s['min']:.2f}-{s['max']:.2f}x"


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, meas, sim = [], [], []
    for label, per in table["arms"].items():
        for seed, d in sorted(per.items()):
            labels.append(f"{label}\ns{seed}")
            meas.append(d["steps_per_gpu_hour"])
            sim.append(d["sim_steps_per_gpu_hour"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], meas, width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], sim, width=0.4, label="simulated", alpha=0.6)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("optimizer steps per GPU-hour")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TIMELINE_ORDER = ("dedicated/none/g1", "shared-sync/none/g1", "shared-sync/mps/g1", "overlap/none/g2", "overlap/mps/g2",
                  "continuous/mps/g1", "shared-sync/mps/g1/k2", "overlap/mps/g2/k2")


def plot_timelines(table: dict, seed: str, path: Path) -> list[str]:
    """One panel per 8-job arm measured on ``seed`` (``TIMELINE_ORDER``: the factor ladder and the
    other policies), on one time axis: each group's generate (engine), train and publish
    (trainer) actions, so each factor's gain shows as a shorter timeline for the same optimizer
    steps. ``seed`` may name a code setting ("1+cg"): the arms run with exactly it; or the arms
    themselves, as the table labels them ("1=dedicated/none/g1+cg,shared-sync/mps/g1/k2+mb8k+cg"),
    so arms of different settings share the axis (two stacks beside the dedicated run they are
    measured over). Returns the arms drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nodus.timeline import read_jsonl

    seed, chosen, labels = seed.partition("=")
    if chosen:
        arms = [a for a in labels.split(",") if seed in table["arms"].get(a, {})]
    else:
        seed, plus, setting = seed.partition("+")
        arms = [a + plus + setting for a in TIMELINE_ORDER if seed in table["arms"].get(a + plus + setting, {})]
    if not arms:
        return []
    colors = {"generate": "tab:blue", "train": "tab:orange", "publish": "tab:green"}
    fig, axes = plt.subplots(len(arms), 1, figsize=(12, 1.3 + 1.1 * len(arms)), sharex=True, squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        d = table["arms"][arm][seed]
        acts = {(sp.phase, gpu, sp.group, sp.start_s, sp.end_s)
                for gpu, spans in enumerate(read_jsonl(Path(d["run"]) / "spans.jsonl")) for sp in spans
                if sp.phase in colors and sp.end_s > sp.start_s}
        if arm.startswith("dedicated"):
            # One GPU per job: its jobs' timelines one after another (the GPU-seconds it bills).
            offset, shifted = 0.0, []
            for gpu in sorted({a[1] for a in acts}):
                mine = [a for a in acts if a[1] == gpu]
                t0 = min(a[3] for a in mine)
                shifted += [(a[0], 0, 0, a[3] - t0 + offset, a[4] - t0 + offset) for a in mine]
                offset += max(a[4] for a in mine) - t0
            acts = set(shifted)
        groups = sorted({a[2] for a in acts})
        for phase, _, group, start, end in acts:
            row = groups.index(group) * 2 + (0 if phase == "generate" else 1)
            ax.barh(row, end - start, left=start, color=colors[phase], height=0.8)
        ax.set_yticks(range(2 * len(groups)))
        ax.set_yticklabels([f"g{g} {side}" for g in groups for side in ("engine", "trainer")], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{arm}: {d['steps_per_gpu_hour']:.0f} steps/GPU-h ({d['ratio_vs_dedicated']:.2f}x)"
                     if d.get("ratio_vs_dedicated") else f"{arm}: {d['steps_per_gpu_hour']:.0f} steps/GPU-h",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds (dedicated: its jobs' GPUs one after another)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles, list(colors), fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return arms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", required=True, help="path prefix: writes <out>.json, <out>.md, <out>.png")
    ap.add_argument("--profile", help="simulate every run on this profile (default: each run on its shipped one, by "
                                      "its GPU, trainer and stacks: nodus.config.shipped_profile)")
    ap.add_argument("--run-profile", action="append", default=[], metavar="PREFIX=PROFILE",
                    help="simulate the runs whose folder path starts with PREFIX on PROFILE (e.g. runs made "
                         "on another host, on that host's profile); repeatable")
    ap.add_argument("--note", action="append", default=[], help="a line for the table's notes; repeatable")
    ap.add_argument("--learning", type=Path,
                    help="a `nodus compare --json` report of learning runs: its gate verdicts join the table")
    ap.add_argument("--timelines", action="append", default=[], metavar="SEED[+SETTING|=ARM,...]",
                    help="draw the 8-job arms of this seed on one time axis (<out>_timelines_s<SEED>.png); "
                         "SEED+SETTING, e.g. 1+cg: the arms run with that code setting; SEED=ARM,ARM: those "
                         "arms as the table labels them, whatever their settings (<out>_timelines_s<SEED>_"
                         "<N>arms.png); repeatable. Runs of several days carry their day among their settings "
                         "(labels end in +@DAY): 1+cg+@session35, or name such labels after =")
    a = ap.parse_args(argv)
    run_profiles = {}
    for item in a.run_profile:
        prefix, sep, prof = item.partition("=")
        if not sep or not prefix or not prof:
            ap.error(f"--run-profile {item!r}: expected PREFIX=PROFILE")
        run_profiles[prefix] = prof
    try:
        table = build(a.runs, a.profile, run_profiles, a.note)
    except ConfigError as err:  # a folder that is no recorded run, a profile that does not load
        ap.error(str(err))
    if a.learning:
        table["learning"] = learning_guard(json.loads(a.learning.read_text()), str(a.learning))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in a.timelines:
        number, chosen, labels = str(seed).partition("=")
        if chosen:
            asked = labels.split(",")
            missing = [x for x in asked if number not in table["arms"].get(x, {})]
            if missing or not labels:
                ap.error(f"--timelines {seed}: no run of seed {number} labelled {', '.join(missing) or '(none)'}; "
                         f"the table's arms: {', '.join(table['arms'])}")
            path = out.with_name(f"{out.name}_timelines_s{number}_{len(asked)}arms.png")
            taken = set((table.get("timelines") or {}).values())
            for i in range(2, 100):  # another choice of as many arms on that seed: its own file
                if path.name not in taken:
                    break
                path = out.with_name(f"{out.name}_timelines_s{number}_{len(asked)}arms-{i}.png")
        else:
            path = out.with_name(f"{out.name}_timelines_s{seed}.png")
        if not plot_timelines(table, str(seed), path):
            ap.error(f"--timelines {seed}: no 8-job run of {', '.join(TIMELINE_ORDER)} on that seed"
                     + (" with that setting" if "+" in str(seed) else ""))
        table.setdefault("timelines", {})[str(seed)] = path.name
    out.with_suffix(".json").write_text(json.dumps(table, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(table) + "\n")
    plot(table, out.with_suffix(".png"))
    print(render(table))
    return table


if __name__ == "__main__":
    main()
