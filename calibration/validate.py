"""`nodus validate`: how well the simulator predicts recorded runs it was not fitted on.

For each recorded run folder (config.json, summary.json, spans.jsonl from `nodus run`), the
simulator runs the same configuration twice: replaying the run's own response lengths, and
sampling fresh ones from the length models (other seeds than the run's). Errors are relative to
the measured value; runs with more than `fit_max_jobs` jobs per GPU are held out (the
calibration fits on 1-4 jobs per GPU only).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from nodus.config import (DEFAULT_MICROBATCH_TOKENS, AuditSpec, ConfigError, build_config, corun_key,
                          drop_idle_priority, packed_rows, stacks_of, trainer_freed)
from nodus.gpumon import SLOWDOWN_REASONS
from nodus.timeline import read_bytes, read_text, stored
from nodus.runner import run_arm

PHASES = ("generate", "train", "publish")
SAMPLE_SEED_OFFSET = 7919  # sampled lengths: the recorded jobs' seeds plus this
HOST_SLOW = 1.3  # a run whose host probe took this many times the validated runs' median is flagged
GPU_CLOCK_LOW = 0.05  # a run whose busy SM clock lies this far under the validated runs' median is flagged
GPU_THROTTLE = 0.10  # ... or one with a slowdown reason (power cap, thermal, ...) active in this share of samples
# The host monitor (nodus.hostmon) flags a run whose CPUs lost this share of the time they wanted
# to run to the hypervisor (steal), whose cgroup was quota-throttled in this share of its periods,
# where other processes than the run's took this many cores, or whose cores' clock sat this far
# under the median; and names (not flags) a run whose busiest thread used this share of a core.
HOSTMON_STEAL, HOSTMON_CG_THROTTLED, HOSTMON_OTHER_CORES, HOSTMON_MHZ_LOW = 0.05, 0.05, 1.0, 0.05
HOSTMON_ONE_THREAD = 0.9


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a between two rankings (None with fewer than two items)."""
    n = len(a)
    if n < 2:
        return None
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return float(s / (n * (n - 1) / 2))


def _gap(a: float, b: float) -> float:
    """a over b, as a fraction (infinite over a zero)."""
    return a / b - 1 if b else float("inf")


def discordant_pairs(labels: list[str], pred: list[float], meas: list[float]) -> list[dict]:
    """The pairs Kendall's tau counts against the simulator: ordered one way measured and the other
    way (or level) simulated. Each as ``higher`` (measured higher), ``lower``, and the gaps
    ``measured`` and ``simulated`` (higher over lower, fractions), largest measured gap first: a
    pair apart by less than the runs' noise is ordered by chance."""
    out = []
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if np.sign(pred[i] - pred[j]) * np.sign(meas[i] - meas[j]) <= 0 and meas[i] != meas[j]:
                hi, lo = (i, j) if meas[i] > meas[j] else (j, i)
                out.append({"higher": labels[hi], "lower": labels[lo], "measured": _gap(meas[hi], meas[lo]),
                            "simulated": _gap(pred[hi], pred[lo])})
    return sorted(out, key=lambda d: -d["measured"])


# A pair of configurations counts as measurably apart when their measured means differ by at least
# this many standard errors of the difference (two: about 95% for independent normal means).
RESOLVED_Z = 2.0


def resolved_tau(pred: list[float], meas: list[float], runs: list[list[float]]) -> dict:
    """Kendall's tau over the pairs of configurations the measurements tell apart: a pair whose
    measured means (``meas``; each configuration's runs in ``runs``) differ by at least
    ``RESOLVED_Z`` standard errors of the difference. A configuration's standard error is the larger
    of its runs' own spread and the pooled relative spread of all configurations with two runs or
    more, over the square root of its runs (a configuration of one run, or of runs on one machine,
    is not taken as more certain than the pool). Each resolved pair counts +1 ordered alike, -1
    unlike, 0 level simulated; None with no resolved pair. Plain tau counts every pair, also those
    apart by less than the runs' noise, which are ordered by chance."""
    multi = [np.asarray(v, float) for v in runs if len(v) >= 2]
    dof = sum(len(v) - 1 for v in multi)
    pooled = float(np.sqrt(sum(np.sum(((v - v.mean()) / v.mean()) ** 2) for v in multi) / dof)) if dof else None
    se = []
    for v, m in zip(runs, meas):
        own = float(np.std(v, ddof=1)) if len(v) >= 2 else 0.0
        spread = max(own, pooled * m) if pooled is not None else (own or None)
        se.append(None if spread is None else spread / np.sqrt(len(v)))
    n = len(meas)
    score, resolved = 0.0, 0
    for i in range(n):
        for j in range(i + 1, n):
            if se[i] is None or se[j] is None:
                continue
            if abs(meas[i] - meas[j]) >= RESOLVED_Z * float(np.hypot(se[i], se[j])):
                resolved += 1
                score += np.sign(pred[i] - pred[j]) * np.sign(meas[i] - meas[j])
    return {"kendall_tau_resolved": float(score / resolved) if resolved else None,
            "pairs_resolved": resolved, "pairs": n * (n - 1) // 2, "pooled_run_spread": pooled}


def error_stats(pred: list[float], meas: list[float]) -> dict:
    """Mean absolute percentage error, worst case and signed bias of predictions (fractions)."""
    if not meas:
        return {"mape": None, "worst": None, "bias": None, "n": 0}
    rel = [(p - m) / m for p, m in zip(pred, meas)]
    return {"mape": float(np.mean(np.abs(rel))), "worst": float(np.max(np.abs(rel))),
            "bias": float(np.mean(rel)), "n": len(rel)}


def _phase_means(spans: list[dict]) -> dict[str, float]:
    """Mean seconds of each phase's actions (generate per job, train/publish per group)."""
    out = {}
    for ph in PHASES:
        # One span per action: jobs of a group share train/publish spans.
        d = {(s["gpu"], s["group"], s["start_s"], s["end_s"]) for s in spans if s["phase"] == ph}
        if d:
            out[ph] = float(np.mean([e - s for _, _, s, e in d]))
    return out


def _phase_actions(spans: list[dict]) -> dict[str, dict[tuple, list]]:
    """A run's generate and train actions: a group's spans of one step (their start, where a span
    has no step) as one action, ``{phase: {(gpu, group, step): [first start, last end, sequences]}}``
    (sequences: its spans' ``n_sequences``, 0 for a train step)."""
    acts: dict[str, dict[tuple, list]] = {"generate": {}, "train": {}}
    for sp in spans:
        if sp["phase"] in acts:
            attrs = sp.get("attrs") or {}
            step = attrs.get("step")
            key = (sp["gpu"], sp["group"], ("step", step) if step is not None else ("start", sp["start_s"]))
            a = acts[sp["phase"]].setdefault(key, [sp["start_s"], sp["end_s"], 0])
            a[0], a[1] = min(a[0], sp["start_s"]), max(a[1], sp["end_s"])
            if sp["phase"] == "generate":
                a[2] += int(attrs.get("n_sequences") or len(attrs.get("response_tokens") or []))
    return acts


def _corun_side(key: tuple, start: float, end: float, others: dict[tuple, list], cover: float) -> str | None:
    """Whether the action ``key`` (``start``-``end``) ran "alone" (other groups' actions of the
    other phase, ``others``, beside it for at most 1 - ``cover`` of it on its GPU) or "beside"
    them (for at least ``cover``); None in between."""
    from nodus.accounting import union_length

    gpu, group, _ = key
    covered = [(max(s, start), min(e, end)) for (g2, grp2, _), (s, e, _) in others.items()
               if g2 == gpu and grp2 != group and s < end and e > start]
    frac = union_length(covered) / (end - start)
    return "alone" if frac <= 1 - cover else "beside" if frac >= cover else None


def corun_phase_means(spans: list[dict], cover: float = 0.9) -> dict:
    """Mean seconds of a run's generate and train actions that ran alone (the other phase beside them
    for at most 1 - ``cover`` of their length) and beside the other phase (for at least ``cover``):
    what co-running costs each side. A group's generate action spans its jobs' generations of one
    step (from the first start to the last end); other actions partly beside the other phase count in
    neither. {phase: {"alone": s, "beside": s, "n_alone": k, "n_beside": k}}, means None where none."""
    acts = _phase_actions(spans)
    out = {}
    for ph, other in (("generate", "train"), ("train", "generate")):
        alone, beside = [], []
        for key, (start, end, _) in acts[ph].items():
            if end - start <= 0:
                continue
            side = _corun_side(key, start, end, acts[other], cover)
            (alone if side == "alone" else beside if side == "beside" else []).append(end - start)
        out[ph] = {"alone": float(np.mean(alone)) if alone else None,
                   "beside": float(np.mean(beside)) if beside else None,
                   "n_alone": len(alone), "n_beside": len(beside)}
    return out


def load_recorded(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    for f in ("config.json", "summary.json", "spans.jsonl"):
        if not stored(run_dir / f).is_file():  # spans.jsonl may be kept as spans.jsonl.gz
            raise ConfigError(f"{str(run_dir)!r} is not a recorded run: {f} is missing")
    cfg = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    spans = [json.loads(x) for x in read_text(run_dir / "spans.jsonl").splitlines() if x.strip()]
    return cfg, summary, spans


def jobs_per_gpu(cfg: dict) -> int:
    """Jobs sharing one GPU in a recorded run (a dedicated arm is one job per GPU)."""
    return 1 if cfg["arm"]["policy"] == "dedicated" else len(cfg["jobs"])


def generations_by_size(spans: list[dict], cover: float = 0.9) -> dict[str, dict]:
    """A run's generate actions (a group's generations of one step, first start to last end) by
    their size and what ran beside them: ``{"SEQ/alone" or "SEQ/beside": {"s": mean seconds, "n":
    actions}}``, SEQ the sequences the action generated (its jobs' ``n_sequences``), "beside" where
    another group's train step covered at least ``cover`` of it, "alone" at most 1 - ``cover``
    (partly covered actions count in neither, as in ``corun_phase_means``). It tells a day whose
    large generations slow more than its small ones: session 25's 512-sequence generations took
    1.73x its 256-sequence ones, where sessions 21-24's took 1.25-1.32x, and a profile fitted on
    1-4 jobs (at most 256 sequences) priced them 18% short (this table on its runs)."""
    acts = _phase_actions(spans)
    sizes: dict[str, list[float]] = {}
    for key, (start, end, seqs) in acts["generate"].items():
        if end - start <= 0 or seqs <= 0:
            continue
        side = _corun_side(key, start, end, acts["train"], cover)
        if side:
            sizes.setdefault(f"{seqs}/{side}", []).append(end - start)
    return {k: {"s": float(np.mean(v)), "n": len(v)} for k, v in sizes.items()}


def generation_size_errors(rows: list[dict]) -> list[dict]:
    """``generations_by_size`` over the validated runs, measured against replayed: per size, side
    (alone / beside a train step) and sharing (mps / none), the measured actions' mean seconds, and
    over the runs whose simulation has actions of that size and side too, the simulated mean (each
    run's simulated mean weighted by its measured actions, so both sides weigh the runs alike) and
    its error against those runs' measured mean; ``unsimulated`` counts the measured actions of runs
    whose simulation has none of that key (it put them partly beside a train step, say). Sorted by
    sharing, side and size."""
    acc: dict[tuple, dict] = {}
    for r in rows:
        meas, sim = r["measured"].get("gen_by_size") or {}, r["replay"].get("gen_by_size") or {}
        sharing = (r.get("arm") or {}).get("sharing") or "none"
        for key, m in meas.items():
            seqs, side = key.split("/")
            a = acc.setdefault((sharing, side, int(seqs)), {"meas": 0.0, "n": 0, "sim": 0.0, "um": 0.0, "um_n": 0,
                                                            "runs": 0, "heldout_runs": 0})
            a["runs"] += 1
            a["heldout_runs"] += bool(r.get("heldout"))
            if key in sim:
                a["meas"] += m["s"] * m["n"]
                a["sim"] += sim[key]["s"] * m["n"]
                a["n"] += m["n"]
            else:
                a["um"] += m["s"] * m["n"]
                a["um_n"] += m["n"]
    out = []
    for (sharing, side, seqs), a in sorted(acc.items()):
        m = a["meas"] / a["n"] if a["n"] else None
        p = a["sim"] / a["n"] if a["n"] else None
        out.append({"sequences": seqs, "side": side, "sharing": sharing, "runs": a["runs"],
                    "heldout_runs": a["heldout_runs"], "actions": a["n"] + a["um_n"], "unsimulated": a["um_n"],
                    "measured_s": (a["meas"] + a["um"]) / (a["n"] + a["um_n"]), "simulated_s": p,
                    "error": (p - m) / m if m else None})
    return out


def _simulate(cfg: dict, source: str) -> dict:
    """The simulator's summary of a configuration, with its own per-phase mean times."""
    from sim import backend_factory

    make = backend_factory(cfg["profile"])
    try:
        summary, runs = run_arm(build_config(cfg, source), make)
    except ConfigError as err:  # e.g. packed rows on an eager profile: name the run it came from
        raise ConfigError(f"{source}: {err}") from None
    spans = [{**s.to_dict(), "gpu": gpu} for gpu, run in enumerate(runs) for s in run]
    return {"steps_per_gpu_hour": summary["steps_per_gpu_hour"], "busy": summary["busy"],
            "pace": summary.get("pace") or {}, "phase_s": _phase_means(spans), "gen_by_size": generations_by_size(spans),
            "outside_profile": sorted(make.cost.flags),
            "per_job": {j: {"steps": d["steps"], "finish_s": d["finish_s"]}
                        for j, d in summary.get("per_job", {}).items()}}


def recorded_audit(rd: Path, cfg: dict) -> dict:
    """A recorded run's audit as a config's (RunConfig.audit): its config's, or for a run recorded
    before the config held it, what its summary's diagnostics recorded (``run_audit``; none: the
    full audit, how every run before the record ran)."""
    if cfg.get("audit") is not None:
        return cfg["audit"]
    summ = Path(rd) / "summary.json"
    return AuditSpec.from_record(run_audit(json.loads(summ.read_text())) if summ.is_file() else {}).model_dump()


def recorded_configs(rd: Path, cfg: dict, spans: list[dict], profile: str) -> tuple[dict, dict]:
    """A recorded run's configuration for the simulator on `profile`, in the run's own grouping
    (not a re-balance over the replayed lengths): replaying its response lengths, and sampling
    fresh ones."""
    trace = str((rd / "spans.jsonl").resolve())  # or its .gz: nodus.lengths reads either
    cfg = dict(cfg, audit=recorded_audit(rd, cfg))
    pol = cfg["arm"]["policy"]
    group_key = "group" if pol == "overlap" else "stack"
    groups = {s["job"]: s[group_key] for s in spans} if pol in ("overlap", "timeslice") else {}
    if stacks_of(cfg["arm"]) > 1:
        # Each job's stack, and for overlap its group within that stack (spans number the groups
        # across stacks: the scheduler's list, stack by stack).
        stacks = {s["job"]: s["stack"] for s in spans}
        within = {st: sorted({groups[j] for j, t in stacks.items() if t == st and j in groups})
                  for st in set(stacks.values())}
        jobs = [dict(j, stack=stacks.get(j["id"]),
                     group=within[stacks[j["id"]]].index(groups[j["id"]]) if j["id"] in groups else None)
                for j in cfg["jobs"]]
    else:
        jobs = [dict(j, group=groups.get(j["id"])) for j in cfg["jobs"]]
    # The scheduler the run had: runs recorded before the field existed held the trainer until
    # each publish was done.
    cfg = dict(cfg, arm=dict(cfg["arm"], trainer_waits_for_publish=cfg["arm"].get("trainer_waits_for_publish", True)))
    replay = dict(cfg, profile=profile,
                  jobs=[dict(j, lengths={"kind": "replay", "trace": trace, "job": j["id"]}) for j in jobs])
    # Fresh draws from the length models: the jobs' seeds moved, so a synthetic run, whose
    # forced lengths came from the same models and seeds, is not simply replayed.
    sampled = dict(cfg, profile=profile,
                   jobs=[dict(j, lengths=None, seed=int(j.get("seed") or 0) + SAMPLE_SEED_OFFSET) for j in jobs])
    return replay, sampled


def spans_digest(run: str | Path) -> str:
    """A recorded run's identity, whatever path reaches it: the SHA-256 of its spans.jsonl (of the
    decompressed bytes where it is kept as spans.jsonl.gz: the same digest)."""
    return hashlib.sha256(read_bytes(Path(run) / "spans.jsonl")).hexdigest()


def stacks_fit_run(prof: dict, run: str | Path) -> bool:
    """Whether ``run`` is one the profile's two-engine rate or lone-trainer rate was fitted on
    (``measurements.stacks`` or ``measurements.stacks_trainer``, `nodus fit-stacks`): the same
    spans.jsonl, whatever path reaches it."""
    meas = prof.get("measurements") or {}
    rows = [r for key in ("stacks", "stacks_trainer") for r in ((meas.get(key) or {}).get("rows") or [])]
    digests = {r.get("spans_sha256") for r in rows} - {None}
    if not digests or not stored(Path(run) / "spans.jsonl").is_file():
        return False
    return spans_digest(run) in digests


def stacks_run_settings(policy: str | None, stacks: int, packing: int | None, controls: dict,
                        lockstep: bool = False, offset_stacks: bool = False, hold_apart: float = 0.0) -> dict:
    """What a stacks run's two-engine rate depends on beyond a profile's terms, flat: its policy,
    packing (``packing``: as its trainer ran it, ``RunConfig.trainer_packing``), engine and trainer
    CPU thread caps, and its MPS settings (``mps.<name>``) as a run of ``stacks`` stacks uses them:
    the trainer's priority counts, another stack's generation running beside a train step even
    under shared-sync; ``lockstep: True`` for stacks held in step (arm.lockstep) and
    ``offset_stacks: True`` for stacks started out of step (arm.offset_stacks), ``hold_apart`` for
    stacks then held apart (arm.hold_apart). `nodus
    fit-stacks` records them (``sharing.engines_controls``) and ``unmodelled_controls`` compares a
    run's with them."""
    out = {"policy": policy, "share_prompts": packing,
           "engine_cpu_threads": controls.get("engine_cpu_threads"),
           "trainer_cpu_threads": controls.get("trainer_cpu_threads")}
    out.update({f"mps.{k}": v for k, v in sharing_controls(controls, corun_key(policy, stacks)).items()})
    if lockstep:  # arm.lockstep; absent: free-running stacks, as every profile before the field
        out["lockstep"] = True
    if offset_stacks:  # arm.offset_stacks; absent: the stacks started together
        out["offset_stacks"] = True
    if hold_apart:  # arm.hold_apart; absent: left to drift
        out["hold_apart"] = hold_apart
    return out


def validate(runs: list[str | Path], profile: str, fit_max_jobs: int = 4) -> dict:
    from sim.profile import profile_dict, profile_lora_kernels, profile_step_mode

    prof = profile_dict(profile)
    step_mode, lora_kernels = profile_step_mode(prof), profile_lora_kernels(prof)
    rows = []
    profile_slots = (prof.get("environment") or {}).get("engine_max_loras")
    profile_cpu_threads = (prof.get("environment") or {}).get("trainer_cpu_threads")
    for rd in map(Path, runs):
        cfg, meas, spans = load_recorded(rd)
        replay_cfg, sampled_cfg = recorded_configs(rd, cfg, spans, profile)
        rep = _simulate(replay_cfg, f"{rd}/config.json")
        sam = _simulate(sampled_cfg, f"{rd}/config.json")
        arm = meas.get("arm")
        if arm is not None and "trainer_waits_for_publish" in cfg["arm"]:  # the summary's arm omits it
            arm = dict(arm, trainer_waits_for_publish=cfg["arm"]["trainer_waits_for_publish"])
        controls = run_controls(meas)
        if ((prof.get("decode") or {}).get("logprob_s_per_seq") or 0) > 0:
            # The profile prices the audit (decode.logprob_s_per_seq, `nodus fit-audit`): the run's
            # own audit, from its config (recorded_configs), is simulated, not outside the profile.
            controls = {k: v for k, v in controls.items() if k != "audit"}
        packing = build_config(replay_cfg, f"{rd}/config.json").trainer_packing()  # as the trainer ran it
        row = {"run": str(rd), "jobs": len(cfg["jobs"]), "seed": cfg.get("seed"), "day": run_day(rd),
               "arm": arm, "controls": controls,
               "audit": audit_label(replay_cfg["audit"]),  # its own configuration, priced or not
               "machine": run_machine(meas), "started_unix_s": run_started(meas),
               "host_probe": run_host_probe(meas), "gpu_monitor": run_gpu_monitor(meas),
               "host_monitor": run_host_monitor(meas), "jit_compiles": run_jit_compiles(meas),
               **({"engine_steps": es} if (es := run_engine_steps(meas)) else {}),
               "mb_tokens": (cfg.get("trainer") or {}).get("max_tokens_per_microbatch"),
               "share_prompts": packed_rows((cfg.get("trainer") or {}).get("share_prompts")),
               # A stacks run is never a fit run of nodus fit (it refuses one): held out at any size,
               # unless nodus fit-stacks fitted the profile's two-engine rate on it.
               "jobs_per_gpu": jobs_per_gpu(cfg),
               "heldout": (jobs_per_gpu(cfg) > fit_max_jobs or stacks_of(cfg["arm"]) > 1)
               and not stacks_fit_run(prof, rd),
               "measured": {"steps_per_gpu_hour": meas["steps_per_gpu_hour"], "busy": meas["busy"],
                            "phase_s": _phase_means(spans), "gen_by_size": generations_by_size(spans)},
               "replay": {k: rep[k] for k in ("steps_per_gpu_hour", "busy", "phase_s", "gen_by_size")},
               "sampled": {k: sam[k] for k in ("steps_per_gpu_hour", "busy", "phase_s")},
               "outside_profile": sorted(set(rep["outside_profile"]) | set(sam["outside_profile"])
                                         | set(unmodelled_controls(controls, step_mode, lora_kernels,
                                                                 prof["sharing"].get("controls"),
                                                                 cfg["arm"].get("sharing") == "mps",
                                                                 corun_key(cfg["arm"].get("policy"),
                                                                           cfg["arm"].get("stacks")),
                                                                 profile_slots,
                                                                 (cfg.get("engine") or {}).get("max_loras")
                                                                 or len(cfg["jobs"]), len(cfg["jobs"]),
                                                                 profile_cpu_threads, stacks_of(cfg["arm"]),
                                                                 prof["sharing"].get("engines_controls")
                                                                 if prof["sharing"].get("mps_engines") is not None
                                                                 else None,
                                                                 {"policy": cfg["arm"].get("policy"),
                                                                  "share_prompts": packing})))}
        rows.append(row)
    report: dict = {"profile": profile, "fit_max_jobs": fit_max_jobs, "rows": rows}
    for split, keep in (("heldout", lambda r: r["heldout"]), ("all", lambda r: True)):
        sel = [r for r in rows if keep(r)]
        meas = [r["measured"]["steps_per_gpu_hour"] for r in sel]
        for mode in ("replay", "sampled"):
            pred = [r[mode]["steps_per_gpu_hour"] for r in sel]
            report[f"{split}_{mode}"] = {**error_stats(pred, meas), "kendall_tau": kendall_tau(pred, meas)}
            # Per phase (mean seconds of its actions) and per busy fraction: the same error
            # statistics, which say where a steps-per-GPU-hour error comes from.
            per = {}
            for ph in PHASES:
                pairs = [(r[mode]["phase_s"][ph], r["measured"]["phase_s"][ph]) for r in sel
                         if ph in r[mode]["phase_s"] and r["measured"]["phase_s"].get(ph)]
                per[f"{ph}_s"] = error_stats([a for a, _ in pairs], [b for _, b in pairs])
            for side in ("engine", "trainer", "gpu"):
                pairs = [(r[mode]["busy"][side], r["measured"]["busy"][side]) for r in sel
                         if side in r[mode]["busy"] and r["measured"]["busy"].get(side)]
                per[f"busy_{side}"] = error_stats([a for a, _ in pairs], [b for _, b in pairs])
            report[f"{split}_{mode}_components"] = per
    report["noise"] = measurement_noise(rows)
    report["generation_sizes"] = generation_size_errors(rows)
    report["host"] = host_flags(rows)
    report["gpu"] = gpu_flags(rows)
    report["host_monitor"] = host_monitor_flags(rows)
    report["jit"] = jit_flags(rows)
    report["error_correlates"] = error_correlates(rows)
    for split, keep in (("heldout", lambda r: r["heldout"]), ("all", lambda r: True)):
        report[f"{split}_per_config"] = per_config_errors([r for r in rows if keep(r)])
    report["heldout_machine_calibrated"] = machine_calibrated([r for r in rows if r["heldout"]])
    report["heldout_unflagged"] = unflagged_errors(report)
    report["heldout_ratio"] = ratio_errors(rows)
    h = report["heldout_replay"]
    report.update(heldout_mape_replay=h["mape"], heldout_mape_sampled=report["heldout_sampled"]["mape"],
                  worst=h["worst"], bias=h["bias"], kendall_tau=h["kendall_tau"])
    return report


def unflagged_errors(report: dict) -> dict:
    """The held-out error over the runs no monitor flagged (host probe, GPU monitor, host monitor:
    ``report["host"]``, ``["gpu"]``, ``["host_monitor"]``) and over the flagged ones apart: what a
    plan on an uncontended machine meets. Flagged runs stay in every other figure."""
    flagged = {f["run"] for key in ("host", "gpu", "host_monitor") for f in (report.get(key) or {}).get("flagged", [])}
    held = [r for r in report["rows"] if r["heldout"]]
    out: dict = {"flagged_runs": sorted(r["run"] for r in held if r["run"] in flagged)}
    for name, sel in (("unflagged", [r for r in held if r["run"] not in flagged]),
                      ("flagged", [r for r in held if r["run"] in flagged])):
        meas = [r["measured"]["steps_per_gpu_hour"] for r in sel]
        out[name] = {mode: error_stats([r[mode]["steps_per_gpu_hour"] for r in sel], meas)
                     for mode in ("replay", "sampled")}
    return out


def run_day(run: str | Path) -> str | None:
    """A recorded run's day: the folder holding its ``arms`` folder (``.../session43/arms/RUN``:
    'session43'; a second machine's runs lie in a day folder of their own), None for a run laid out
    otherwise."""
    p = Path(run).resolve()
    return p.parent.parent.name if p.parent.name == "arms" else None


def ratio_errors(rows: list[dict]) -> dict | None:
    """The simulator's ratio over dedicated, the figure a plan is booked on: each held-out run that
    is not dedicated over the dedicated runs among ``rows`` of its day (``run_day``), seed, job count
    and audit, on its machine where both record one (their mean where the day repeats one: an A/A
    pair). Per lengths mode the error statistics of the simulated ratio against the measured one,
    and ``pairs`` (each run, its dedicated runs, the measured and simulated ratios). None where no
    held-out run has such a dedicated run."""
    def dedicated(r: dict) -> bool:
        return (r.get("arm") or {}).get("policy") == "dedicated"

    base: dict[tuple, list[dict]] = {}
    for r in rows:
        if dedicated(r) and r.get("day"):
            base.setdefault((r["day"], r.get("seed"), r["jobs"], r["audit"]), []).append(r)
    pairs = []
    for r in rows:
        if not r["heldout"] or dedicated(r) or not r.get("day"):
            continue
        ds = [d for d in base.get((r["day"], r.get("seed"), r["jobs"], r["audit"]), [])
              if not (d.get("machine") and r.get("machine")) or d["machine"] == r["machine"]]
        if not ds:
            continue
        # How far apart the ratio's runs began: a dedicated baseline moved 11-25% on one machine within
        # 15 minutes (session 43), so a ratio's two runs are best minutes apart.
        pair = {"run": r["run"], "dedicated": [d["run"] for d in ds],
                "minutes_apart": minutes_apart(r.get("started_unix_s"), [d.get("started_unix_s") for d in ds])}
        for mode in ("measured", "replay", "sampled"):
            pair[mode] = r[mode]["steps_per_gpu_hour"] / float(np.mean([d[mode]["steps_per_gpu_hour"] for d in ds]))
        pairs.append(pair)
    if not pairs:
        return None
    out: dict = {"pairs": pairs}
    for mode in ("replay", "sampled"):
        out[mode] = error_stats([p[mode] for p in pairs], [p["measured"] for p in pairs])
    return out


def _speed_ratio(row: dict, mode: str = "replay") -> float:
    """A validated run's measured over simulated steps/GPU-h (``mode``: replayed or sampled lengths)."""
    return row["measured"]["steps_per_gpu_hour"] / row[mode]["steps_per_gpu_hour"]


def machine_calibrated(rows: list[dict]) -> dict | None:
    """The simulator with the machine's speed known: each run's prediction times its machine's
    measured over simulated steps/GPU-h on that machine's *other* runs (the mean ratio; leave one
    out, so a run never calibrates itself), as a planner who measured other configurations on the
    machine would have it. Runs alone on their machine, or of no recorded machine, are left out.
    Per lengths mode: the error statistics and Kendall tau of those predictions; with ``machines``
    (how many) and ``factors`` (each machine's mean ratio over all its runs). None with no machine of
    two runs or more. What is left is the simulator's error between configurations on one machine;
    the factors' spread is what the machine itself adds."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("machine"):
            by.setdefault(r["machine"], []).append(r)
    by = {m: rs for m, rs in by.items() if len(rs) >= 2}
    if not by:
        return None
    out: dict = {"machines": len(by)}
    for mode in ("replay", "sampled"):
        pred, meas = [], []
        for rs in by.values():
            for r in rs:
                f = float(np.mean([_speed_ratio(o, mode) for o in rs if o is not r]))
                pred.append(r[mode]["steps_per_gpu_hour"] * f)
                meas.append(r["measured"]["steps_per_gpu_hour"])
        out[mode] = {**error_stats(pred, meas), "kendall_tau": kendall_tau(pred, meas)}
    out["factors"] = {m: float(np.mean([_speed_ratio(r) for r in rs])) for m, rs in sorted(by.items())}
    return out


def machine_factor(runs: list[str | Path], profile: str) -> dict:
    """How fast one machine runs against a profile: the mean measured over simulated steps/GPU-h of
    runs recorded on it (their own configurations, replayed lengths). Raises ConfigError when the
    runs name no machine or more than one, or a folder is not a recorded run; both before any
    simulation. With ``factor``, ``runs``, ``machine`` and each run's ``ratio``: ``nodus sim
    --machine-runs`` scales a prediction by it (the profiles' machine-calibrated held-out error is
    the error bar of that). Only the replayed lengths are simulated (``validate`` also samples)."""
    recorded = [(str(rd), *load_recorded(rd)) for rd in map(Path, runs)]
    machines = {run_machine(meas) for _, _, meas, _ in recorded}
    if None in machines:
        raise ConfigError("--machine-runs: "
                          f"{[rd for rd, _, meas, _ in recorded if run_machine(meas) is None]} record no machine (host "
                          "name and boot id, or GPU UUIDs: runs of the real backend since session 35 do); a factor needs "
                          "runs known to share one machine")
    if len(machines) > 1:
        raise ConfigError(f"--machine-runs: the runs come from {len(machines)} machines ({sorted(machines)}); a machine "
                          "factor is one machine's: give runs of the machine the plan is for")
    ratios = {}
    for rd, cfg, meas, spans in recorded:
        replay_cfg, _ = recorded_configs(Path(rd), cfg, spans, profile)
        sim = _simulate(replay_cfg, f"{rd}/config.json")
        ratios[rd] = meas["steps_per_gpu_hour"] / sim["steps_per_gpu_hour"]
    return {"factor": float(np.mean(list(ratios.values()))), "runs": len(ratios), "machine": machines.pop(),
            "ratio": ratios}


def run_audit(summary: dict) -> dict:
    """A run's logprob audit settings as its diagnostics recorded them (logprobs, every, responses;
    the last entry that has them), {} for a run before the record (the default audit)."""
    return next((d["audit"] for d in reversed(summary.get("diagnostics", [])) if d.get("audit")), {})


def audit_text(audit: dict) -> str:
    """A run's logprob audit (its diagnostics' ``audit``: logprobs, every, responses) in words when
    it is not the default (every step, every response): ``AuditSpec.words``; "" at the default."""
    return AuditSpec.from_record(audit).words()


def audit_label(audit: dict) -> str:
    """The same as a table label: "a0" (off), "a4" (every 4th step), "r1" (1 response a prompt),
    "a4r1"; "" at the default."""
    if audit.get("logprobs") is False:
        return "a0"
    every, responses = audit.get("every") or 1, audit.get("responses")
    return (f"a{every}" if every != 1 else "") + (f"r{responses}" if responses is not None else "")


def trainer_cpu_cap(diagnostics: dict) -> int | None:
    """torch's CPU threads in a backend's trainers where capped (RealOptions.trainer_cpu_threads;
    nodus's default on a GPU since session 28), else None. A trainer records None on torch's own
    count, beside ``torch_threads``; the first runs to record the field (session 28's call c, no
    ``torch_threads``) recorded that count itself, the host's CPUs, which is read as no cap."""
    cpus = (diagnostics.get("host") or {}).get("cpus")
    caps = [w["cpu_threads"] for name, w in (diagnostics.get("workers") or {}).items()
            if name.startswith("trainer") and w.get("cpu_threads")
            and ("torch_threads" in w or not cpus or w["cpu_threads"] < cpus)]
    return max(caps) if caps else None


def trainer_step_modes(summary: dict) -> list[str]:
    """Each recorded trainer's step mode ("eager", "graphed", "static"), over every diagnostics entry
    (a dedicated run records its one trainer once a job); trainers that recorded none are left out."""
    return [w["step_mode"] for d in summary.get("diagnostics", []) for name, w in (d.get("workers") or {}).items()
            if name.startswith("trainer") and w.get("step_mode")]


def run_controls(summary: dict) -> dict:
    """The settings a run used beyond the defaults that change its phases' speed, from its
    diagnostics: MPS thread percentages and trainer priority, ``trainer_step_mode`` for a trainer
    that replayed CUDA graphs (``--trainer-graphs``; "graphed N of M" where only N of the run's M
    recorded trainers did, the others' capture having failed), ``engine_args`` for extra vLLM arguments
    (``--engine-arg``), ``engine_core_process`` for vLLM's core in its own process
    (``--engine-core-process``), ``trainer_cpu_threads`` for torch's CPU threads in the trainers
    where capped (``trainer_cpu_cap``), ``publish_pinned`` False for adapters the engine loaded into pageable
    host memory (``RealOptions.publish_pinned``), ``adapter_format`` "flat" for adapters the trainer handed
    over as flat files (``RealOptions.adapter_format``), ``cuda_graph_max_tokens`` for the engine's
    CUDA-graph size set in the config (``engine.cuda_graph_max_tokens``), ``engine_max_loras`` for an
    engine started with more or fewer adapter slots than the run has jobs (recorded since session 21),
    ``engine_env`` for the engine's extra environment variables (their names), ``audit`` for a logprob
    audit on fewer steps or responses than all (``audit_text``), ``engine_cpu_threads`` for torch's CPU
    threads in the engines where capped (``RealOptions.engine_cpu_threads``), and ``lora_kernels``
    "tuned" for an engine that ran tuned LoRA kernel configs (the shipped ones,
    ``real/lora_kernels.py``, or a folder set through the environment). {} for a run
    at the defaults of runs before session 11 (vLLM's own LoRA kernels, the audit every step); a
    default H200 run since gives {"lora_kernels": "tuned"}."""
    from real.backend import RealOptions  # light: no torch, no vLLM
    from real.lora_kernels import ENV as LORA_CONFIG_ENV

    defaults = RealOptions().sharing_controls("mps")
    out = {}
    for d in summary.get("diagnostics", []):
        for k, v in (d.get("sharing_controls") or {}).items():
            if k in defaults and v != defaults[k]:
                out[k] = v
        if d.get("engine_core_process"):
            out["engine_core_process"] = True
        if d.get("publish_pinned") is False:
            out["publish_pinned"] = False  # published adapters loaded into pageable host memory (:np)
        if d.get("adapter_format", "safetensors") != "safetensors":
            out["adapter_format"] = d["adapter_format"]  # adapters handed over as flat files (:flat)
        if d.get("cuda_graph_max_tokens"):
            out["cuda_graph_max_tokens"] = d["cuda_graph_max_tokens"]  # the sim models it (config)
        # One slot per job of an engine's own: the run's jobs, or its largest stack's (arm.stack_jobs).
        own = max((summary.get("arm") or {}).get("stack_jobs") or [summary.get("jobs") or 0])
        if summary.get("jobs") and d.get("engine_max_loras") not in (None, own):
            # An engine with other than one adapter slot per job: more (a pool sized for a larger
            # arm) or fewer (engine.max_loras, which the simulator admits by): another engine
            # (unmodelled_controls compares it with the profile's).
            out["engine_max_loras"] = d["engine_max_loras"]
        if d.get("engine_args"):
            out["engine_args"] = ",".join(f"{k}={v}" for k, v in sorted(d["engine_args"].items()))
        env = dict(d.get("engine_env") or {})
        if env.pop(LORA_CONFIG_ENV, None):
            out["lora_kernels"] = "tuned"  # the folder given through --engine-env
        if env:
            out["engine_env"] = ",".join(sorted(env))
        cap = trainer_cpu_cap(d)
        if cap:
            out["trainer_cpu_threads"] = cap
        for name, w in (d.get("workers") or {}).items():
            if name.startswith("engine") and w.get("cpu_threads"):
                out["engine_cpu_threads"] = w["cpu_threads"]  # RealOptions.engine_cpu_threads
            if name.startswith("engine") and w.get("lora_kernel_configs"):
                out["lora_kernels"] = "tuned"
    modes = trainer_step_modes(summary)
    graphed = [m for m in modes if m != "eager"]
    if graphed:
        # Every trainer replayed its graphs, or only some (the others' capture failed and they
        # trained eager: session 29's two stacks), a mix no profile's trainer terms describe.
        out["trainer_step_mode"] = (graphed[0] if len(graphed) == len(modes)
                                    else f"{graphed[0]} {len(graphed)} of {len(modes)}")
    audit = audit_text(run_audit(summary))
    if audit:
        out["audit"] = audit
    return out


# Run settings the profile's terms were not measured with: such a run is simulated with them
# anyway, and flagged outside the profile (the trainer's step mode: when it is not the profile's).
UNMODELLED_CONTROLS = {"trainer_step_mode": "the trainer replayed CUDA graphs (--trainer-graphs): "
                                            "the profile's trainer terms are the eager step's",
                      "engine_args": "the engine ran with extra vLLM arguments (--engine-arg): the profile's "
                                     "engine terms are the default engine's",
                      "engine_core_process": "the engine's core ran in a process of its own (--engine-core-process): "
                                             "the profile's engine terms are one process's",
                      "engine_cpu_threads": "the engine's torch CPU threads were capped (--engine-cpu-threads): the "
                                            "profile's engine terms were measured on torch's own count",
                      "engine_env": "the engine ran with extra environment (--engine-env, e.g. tuned LoRA "
                                    "kernel configs): the profile's engine terms are the default engine's",
                      "publish_pinned": "the engine loaded published adapters into pageable host memory "
                                        "(publish_pinned false, :np): the profile's publish is vLLM's pinned one",
                      "adapter_format": "the trainer handed adapters to the engine as flat files (:flat): the "
                                        "profile's train and publish terms include the PEFT safetensors save and load",
                      "audit": "the engine returned logprobs on fewer steps or responses (--audit-every / "
                               "--audit-responses / --no-audit): the profile's engine terms were measured returning "
                               "them for every response of every step"}


def sharing_controls(controls: dict, policy: str | None = None) -> dict:
    """The MPS settings among a run's controls (``run_controls``) that are not the defaults
    (thread percentages, the trainer's priority) and that can move its rates: the trainer's
    priority only where the run's ``policy`` co-runs engine and trainer. {} for the defaults."""
    from real.backend import RealOptions  # light: no torch, no vLLM

    keys = RealOptions().sharing_controls("mps")
    return {k: v for k, v in drop_idle_priority(controls, policy).items() if k in keys}


def settings_text(settings: dict) -> str:
    """'trainer_priority=below-normal, trainer_thread_pct=50'; 'the defaults' for none."""
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "the defaults"


def mps_settings_differ(controls: dict, profile_sharing: dict | None, mps: bool,
                        policy: str | None = None) -> tuple[dict, dict] | None:
    """For a run under MPS (``mps``), its MPS settings and the profile's (``sharing.controls``) as far
    as its ``policy`` uses them (``sharing_controls``), where they differ; None where they agree."""
    run_sharing = sharing_controls(controls, policy)
    prof_sharing = sharing_controls(dict(profile_sharing or {}), policy)
    return (run_sharing, prof_sharing) if mps and run_sharing != prof_sharing else None


def unmodelled_controls(controls: dict, profile_step_mode: str = "eager",
                        profile_lora_kernels: str = "default", profile_sharing: dict | None = None,
                        mps: bool = False, policy: str | None = None, profile_slots: int | None = None,
                        run_slots: int | None = None, run_jobs: int | None = None,
                        profile_cpu_threads: int | None = None, stacks: int = 1,
                        profile_engines_controls: dict | None = None,
                        run_settings: dict | None = None) -> list[str]:
    """What a run's settings (``run_controls``) have that the profile was not measured with;
    ``profile_step_mode``: the trainer its train terms describe (``train.step_mode``);
    ``profile_lora_kernels``: the engine's LoRA kernels its engine terms describe ("tuned" or
    "default", ``sim.profile.profile_lora_kernels``); ``profile_sharing``: the MPS settings its
    MPS rates were fitted under (``sharing.controls``), compared for a run under MPS (``mps``) as
    far as its ``policy`` uses them (``sharing_controls``); ``profile_slots``: the adapter slots of the
    engine its engine terms were measured on (``environment.engine_max_loras``, None where not
    recorded), against the run's engine's (its ``engine_max_loras`` control where it had other than one
    per job, else ``run_slots``, the config's ``engine.max_loras`` or one per job); without the
    profile's, a run with more slots than its ``run_jobs`` (default ``run_slots``);
    ``profile_cpu_threads``: the trainers' capped CPU threads its train terms were measured with
    (``environment.trainer_cpu_threads``; None: torch's own count, every profile before session 28);
    ``stacks``: the run's engine + trainer stacks; ``profile_engines_controls``: the settings the
    profile's two-engine rate was fitted under (``sharing.engines_controls``; None where the profile
    has no ``sharing.mps_engines``), against which a stacks run under MPS is compared, its
    ``run_settings`` (policy, share_prompts) with its controls (``stacks_run_settings``)."""
    cap = controls.get("engine_cpu_threads")
    fitted = profile_engines_controls or {}
    engines_fitted = stacks > 1 and mps and profile_engines_controls is not None
    out = [UNMODELLED_CONTROLS[k] for k in controls if k in UNMODELLED_CONTROLS and k != "trainer_step_mode"
           and not (k == "engine_cpu_threads" and engines_fitted and cap == fitted.get("engine_cpu_threads"))]
    if engines_fitted:
        def threads(n):
            return f"{n} CPU threads" if n else "torch's own CPU thread count"

        given = run_settings or {}
        mine = stacks_run_settings(given.get("policy"), stacks, given.get("share_prompts"), controls)
        for k in sorted(set(fitted) | {m for m in mine if m.startswith("mps.")}):
            have, want = mine.get(k), fitted.get(k)
            if have == want:
                continue
            if k == "engine_cpu_threads":
                out.append(f"the engines ran {threads(have)}; the profile's two-engine rate (sharing.mps_engines) was "
                           f"fitted with {threads(want)} (sharing.engines_controls)")
            else:
                out.append(f"the run's {k} is {have}; the profile's two-engine rate (sharing.mps_engines) was fitted "
                           f"on runs with {want} (sharing.engines_controls)")
    cap = controls.get("trainer_cpu_threads")
    if cap != profile_cpu_threads:
        def said(n):
            return f"{n} CPU threads" if n else "torch's own CPU thread count"

        out.append(f"the trainer ran {said(cap)}; the profile's train terms were measured with "
                   f"{said(profile_cpu_threads)} (environment.trainer_cpu_threads): beside the engine under MPS, a "
                   "trainer capped at 2 trained in half the time of one on 16 (session 28)")
    slots = controls.get("engine_max_loras") or run_slots
    if profile_slots is not None and slots is not None and slots != profile_slots:
        out.append(f"the engine had {slots} adapter slots; the profile's engine terms were measured with "
                   f"{profile_slots} (environment.engine_max_loras)")
    elif profile_slots is None and (controls.get("engine_max_loras") or 0) > (run_jobs or run_slots or 0):
        out.append(f"the engine had {controls['engine_max_loras']} adapter slots, more than the run's jobs (started "
                   "for a larger arm of the invocation); the profile does not say which engine it measured")
    differ = mps_settings_differ(controls, profile_sharing, mps, policy)
    if differ:
        run_sharing, prof_sharing = differ
        out.append(f"the run's MPS settings ({settings_text(run_sharing)}) are not those the profile's MPS rates "
                   f"were fitted under ({settings_text(prof_sharing)}, sharing.controls)")
    kernels = controls.get("lora_kernels", "default")
    if kernels != profile_lora_kernels:
        out.append(f"the engine ran {'tuned' if kernels == 'tuned' else 'vLLM default'} LoRA kernel configs; "
                   f"the profile's engine terms are the {profile_lora_kernels} kernels' "
                   "(real/lora_kernels.py; --no-tuned-lora-kernels runs vLLM's)")
    mode = controls.get("trainer_step_mode", "eager")
    if mode != profile_step_mode:
        out.insert(0, UNMODELLED_CONTROLS["trainer_step_mode"] if profile_step_mode == "eager" and " of " not in mode
                   else f"the trainer ran {mode}; the profile's trainer terms are the {profile_step_mode} step's")
    return out


def run_host_probe(summary: dict) -> dict | None:
    """The slowest of a run's host probes (``nodus.outdir.host_probe``, at the start and end of each
    GPU's run): the largest loop and file seconds and load average; None for a run without one."""
    probes = [p for d in summary.get("diagnostics", []) for p in (d.get("host_probe") or {}).values()
              if isinstance(p, dict)]
    out = {}
    for k in ("cpu_loop_s", "file_rw_s", "load1"):
        vals = [p[k] for p in probes if isinstance(p.get(k), (int, float))]
        if vals:
            out[k] = float(max(vals))
    return out or None


def run_started(summary: dict) -> float | None:
    """When a run began, in Unix seconds: its earliest host probe's start (``nodus.outdir.host_probe``
    records the time it ran); None for a run without one."""
    starts = [p["unix_s"] for d in summary.get("diagnostics", []) for p in (d.get("host_probe") or {}).values()
              if isinstance(p, dict) and isinstance(p.get("unix_s"), (int, float))]
    return float(min(starts)) if starts else None


def minutes_apart(start: float | None, others: list) -> float | None:
    """Minutes between a run's start and the farthest of ``others``' starts (``run_started``: Unix
    seconds); None where any of them is unrecorded (runs before the host probe's times) or there is
    no other."""
    if start is None or not others or None in others:
        return None
    return max(abs(start - t) for t in others) / 60


def run_machine(summary: dict) -> str | None:
    """Which machine a run ran on, as one name: its host name and boot id (``nodus.outdir.machine``;
    two GPUs of one host are one machine), else its GPUs' UUIDs (``nodus.gpumon``) for a run that
    recorded those alone; None for a run recorded before either was (before session 35). The real
    backend records both, so two runs of it are always named the same way."""
    diags = summary.get("diagnostics", [])
    hosts = sorted({f"{m.get('hostname')}/{m.get('boot_id')}" for d in diags
                    for m in [d.get("machine") or {}] if m.get("hostname") or m.get("boot_id")})
    if hosts:
        return ",".join(hosts)
    uuids = sorted({g["uuid"] for d in diags for g in ((d.get("gpu_monitor") or {}).get("gpus") or {}).values()
                    if isinstance(g, dict) and g.get("uuid")})
    return ",".join(uuids) or None


def _label_runs(rows: list[dict], *entries: list[dict]) -> None:
    """Each entry's run by the shortest trailing path no other of ``rows`` shares (``unique_names``),
    under "label": runs of one folder name from several days stay apart in a report's lines."""
    runs = [r["run"] for r in rows]
    names = dict(zip(runs, unique_names(runs)))
    for entry in (e for es in entries for e in es):
        entry["label"] = names.get(entry["run"], Path(entry["run"]).name)


def _run_name(entry: dict) -> str:
    """A flagged run as a report names it: its label (``_label_runs``), else its folder's name."""
    return entry.get("label") or Path(entry["run"]).name


def host_flags(rows: list[dict]) -> dict:
    """Runs whose host probe took more than ``HOST_SLOW`` times the median of the validated runs'
    probes: their host was slower than the others' while they ran (other load, a throttled CPU, a
    slow scratch disk), so their error may be the host's, not the simulator's. Flagged, never
    dropped."""
    probed = [r for r in rows if r.get("host_probe")]
    median = {}
    for k in ("cpu_loop_s", "file_rw_s"):
        vals = [r["host_probe"][k] for r in probed if k in r["host_probe"]]
        if vals:
            median[k] = float(np.median(vals))
    flagged = []
    for r in probed:
        slower = {k: r["host_probe"][k] / m for k, m in median.items()
                  if m > 0 and r["host_probe"].get(k, 0) > HOST_SLOW * m}
        if slower:
            flagged.append({"run": r["run"], "slower": slower})
    _label_runs(rows, flagged)
    return {"runs_with_probe": len(probed), "runs": len(rows), "median": median, "threshold": HOST_SLOW,
            "flagged": flagged}


def run_gpu_monitor(summary: dict) -> dict | None:
    """The slowest GPU state a run's GPU monitors recorded (``nodus.gpumon``, one per GPU's run):
    the lowest SM clock while busy (the mean over samples above 50% utilisation), the largest
    share of samples each slowdown reason was active in, and the tightest power limit; None for a
    run without one (recorded before session 26), ``{"available": False, "why": ...}`` for one
    whose monitors recorded no figures (no GPU, no NVML)."""
    mons = [d["gpu_monitor"] for d in summary.get("diagnostics", []) if isinstance(d.get("gpu_monitor"), dict)]
    if not mons:
        return None
    gpus = [g for m in mons if m.get("available") for g in (m.get("gpus") or {}).values()]
    if not gpus:
        return {"available": False, "why": "; ".join(sorted({str(m.get("why")) for m in mons}))}
    busy = [g["busy"]["sm_clock_mhz"] for g in gpus if (g.get("busy") or {}).get("sm_clock_mhz") is not None]
    limits = [g["power_limit_w"] for g in gpus if g.get("power_limit_w") is not None]
    throttle = {}
    for reason in SLOWDOWN_REASONS:
        fracs = [(g.get("throttle") or {}).get(reason, 0.0) for g in gpus]
        if max(fracs) > 0:
            throttle[reason] = float(max(fracs))
    stopped = "; ".join(sorted({str(m["stopped_early"]) for m in mons if m.get("stopped_early")}))

    def weighted(get):  # over every GPU's samples (a dedicated arm's jobs are one monitor each)
        pairs = [(get(g), g.get("samples") or 0) for g in gpus]
        pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

    return {"available": True, "busy_sm_clock_mhz": min(busy) if busy else None,
            "busy_fraction": weighted(lambda g: (g.get("busy") or {}).get("fraction")),
            "util_pct": weighted(lambda g: (g.get("util_pct") or {}).get("mean")),
            "max_sm_clock_mhz": max((g.get("max_sm_clock_mhz") or 0.0) for g in gpus) or None,
            "power_limit_w": min(limits) if limits else None, "throttle": throttle,
            **({"stopped_early": stopped} if stopped else {})}


def gpu_flags(rows: list[dict]) -> dict:
    """Runs whose GPU ran slow: a busy SM clock more than ``GPU_CLOCK_LOW`` under the median of
    the validated runs' busy clocks, or a slowdown reason (power cap, thermal, hardware slowdown)
    active in at least ``GPU_THROTTLE`` of the samples; also a run whose sampling stopped early (its
    figures cover part of it). Their error may be the GPU's state, not the simulator's: session
    25's 8-job shared-sync + MPS generations (512 sequences) took 3.10 s a step against 2.41-2.67 s
    on four other days with the host probe unchanged. Flagged, never dropped."""
    monitored = [r for r in rows if (r.get("gpu_monitor") or {}).get("available")]
    clocks = [r["gpu_monitor"]["busy_sm_clock_mhz"] for r in monitored
              if r["gpu_monitor"].get("busy_sm_clock_mhz") is not None]
    median = float(np.median(clocks)) if clocks else None
    flagged = []
    for r in monitored:
        m, why = r["gpu_monitor"], {}
        clock = m.get("busy_sm_clock_mhz")
        if median and clock is not None and clock < (1 - GPU_CLOCK_LOW) * median:
            why["busy_sm_clock"] = clock / median
        why.update({k: v for k, v in (m.get("throttle") or {}).items() if v >= GPU_THROTTLE})
        if m.get("stopped_early"):
            why["stopped_early"] = m["stopped_early"]
        if why:
            flagged.append({"run": r["run"], "busy_sm_clock_mhz": clock, "why": why})
    without = [r["gpu_monitor"] for r in rows if r.get("gpu_monitor") and not r["gpu_monitor"].get("available")]
    _label_runs(rows, flagged)
    return {"runs_with_monitor": len(monitored), "runs": len(rows), "runs_without_figures": len(without),
            "why_without_figures": sorted({str(m.get("why")) for m in without}),
            "median_busy_sm_clock_mhz": median, "clock_threshold": GPU_CLOCK_LOW, "throttle_threshold": GPU_THROTTLE,
            "flagged": flagged}


def gpu_flagged_text(flags: dict) -> str:
    """``gpu_flags``' flagged runs as 'run (busy SM clock 1650 MHz, 0.88x the median; sw_power_cap in
    30% of samples); ...' for a report."""
    def one(f: dict) -> str:
        parts = [f"busy SM clock {f['busy_sm_clock_mhz']:.0f} MHz, {v:.2f}x the median" if k == "busy_sm_clock"
                 else f"sampling stopped early: {v}" if k == "stopped_early"
                 else f"{k} in {v:.0%} of samples" for k, v in f["why"].items()]
        return f"{_run_name(f)} ({'; '.join(parts)})"
    return "; ".join(one(f) for f in flags["flagged"])


def _monitor_preamble(flags: dict, name: str, since: int) -> tuple[str, str | None]:
    """A monitor's flags (``gpu_flags``, ``host_monitor_flags``) as the sentence on the runs
    without figures from it, and the whole paragraph where no run has figures (else None)."""
    without = (f"{flags['runs_without_figures']} of {flags['runs']} runs have no figures from it: "
               f"{'; '.join(flags['why_without_figures'])}." if flags.get("runs_without_figures") else "")
    if not flags.get("runs_with_monitor"):
        return without, f"{name}: " + (without or f"no run records one (recorded before session {since}).")
    return without, None


def gpu_text(flags: dict) -> str:
    """The report's paragraph on ``gpu_flags``."""
    without, only = _monitor_preamble(flags, "GPU monitor", 26)
    if only:
        return only
    med = flags["median_busy_sm_clock_mhz"]
    head = (f"GPU monitor (NVML: SM clock, power, temperature and throttle reasons through each run; "
            f"{flags['runs_with_monitor']} of {flags['runs']} runs have one): median SM clock while busy "
            + ("-" if med is None else f"{med:.0f} MHz") + ". ")
    rule = (f"a busy SM clock more than {flags['clock_threshold']:.0%} under the median, or a slowdown reason in "
            f"{flags['throttle_threshold']:.0%} of samples or more")
    tail = f" {without}" if without else ""
    if flags["flagged"]:
        return (head + f"On a slowed GPU ({rule}; their GPU, not only the simulator, may explain their error): "
                + gpu_flagged_text(flags) + "." + tail)
    return head + f"No run on a slowed GPU ({rule})." + tail


def _extreme(items: list[dict], get, f=max) -> float | None:
    """``f`` (max or min) of ``get(item)`` over the items that have it; None where none does."""
    vals = [v for v in (get(m) for m in items) if v is not None]
    return float(f(vals)) if vals else None


def run_host_monitor(summary: dict) -> dict | None:
    """The most contended host state a run's host monitors recorded (``nodus.hostmon``, one per GPU's
    run): the largest steal share, cgroup-throttled share and other processes' cores, the lowest
    mean core clock, and the run's own cores and busiest thread (the largest); None for a run
    without one (recorded before session 27), ``{"available": False, "why": ...}`` for one whose
    monitors recorded no figures."""
    mons = [d["host_monitor"] for d in summary.get("diagnostics", []) if isinstance(d.get("host_monitor"), dict)]
    if not mons:
        return None
    ok = [m for m in mons if m.get("available") and "cores_busy" in m]
    if not ok:
        return {"available": False, "why": "; ".join(sorted({str(m.get("why", "an empty window")) for m in mons}))}

    def top(key, f=max):
        return _extreme(ok, key, f)

    busiest = max((m["busiest_thread"] for m in ok if m.get("busiest_thread")), key=lambda b: b["core_frac"],
                  default=None)
    stopped = "; ".join(sorted({str(m["stopped_early"]) for m in mons if m.get("stopped_early")}))
    cg_error = "; ".join(sorted({str(m["cgroup_error"]) for m in mons if m.get("cgroup_error")}))
    return {"available": True, "steal_frac": top(lambda m: m.get("steal_frac")),
            "other_cores": top(lambda m: m.get("other_cores")), "run_cores": top(lambda m: m.get("run_cores")),
            "cgroup_throttled_frac": top(lambda m: (m.get("cgroup") or {}).get("throttled_frac")),
            "cpu_mhz": top(lambda m: (m.get("cpu_mhz") or {}).get("mean"), min),
            "busiest_thread": busiest, **({"stopped_early": stopped} if stopped else {}),
            **({"cgroup_error": cg_error} if cg_error else {})}


def run_engine_steps(summary: dict) -> dict | None:
    """A run's engine step figures (``real.stepstats``, ``diagnostics[].engine_steps``; one per
    GPU's run): the mean engine step in ms (each step counted once, weighted by steps across GPUs),
    the slowest generation's mean step over the fastest's, and the largest shares of the engines'
    busy time between steps, collecting results and in garbage collection; None for a run without
    them (recorded before session 28) or with no generation."""
    sums = [d["engine_steps"]["summary"] for d in summary.get("diagnostics", [])
            if isinstance(d.get("engine_steps"), dict) and (d["engine_steps"].get("summary") or {}).get("generations")]
    if not sums:
        return None
    per = [x["step_ms_per_generation"] for x in sums]
    counted = [x for x in sums if x.get("steps") and x.get("mean_step_ms") is not None]
    steps = sum(x["steps"] for x in counted)

    def top(key):
        return _extreme(sums, lambda x: x.get(key))

    lo = min(p["min"] for p in per)
    return {"generations": sum(x["generations"] for x in sums), "steps": steps,
            "mean_step_ms": sum(x["mean_step_ms"] * x["steps"] for x in counted) / steps if steps else None,
            "step_ms_spread": max(p["max"] for p in per) / lo if lo > 0 else None,
            "between_share": top("between_share"), "collect_share": top("collect_share"),
            "gc_share": top("gc_share")}


def contention_why(m: dict, median_mhz: float | None = None) -> dict:
    """What marks one run's host monitor figures (``run_host_monitor``) as a contended host: steal
    at least ``HOSTMON_STEAL`` of the time its CPUs wanted, a cgroup quota-throttled in
    ``HOSTMON_CG_THROTTLED`` of its periods or more, other processes on ``HOSTMON_OTHER_CORES`` cores
    or more, and, given the runs' median clock, cores more than ``HOSTMON_MHZ_LOW`` under it. Each
    as its figure (the clock: over the median); empty for an uncontended run."""
    why = {}
    if (m.get("steal_frac") or 0) >= HOSTMON_STEAL:
        why["steal"] = m["steal_frac"]
    if (m.get("cgroup_throttled_frac") or 0) >= HOSTMON_CG_THROTTLED:
        why["cgroup_throttled"] = m["cgroup_throttled_frac"]
    if (m.get("other_cores") or 0) >= HOSTMON_OTHER_CORES:
        why["other_cores"] = m["other_cores"]
    if median_mhz and m.get("cpu_mhz") and m["cpu_mhz"] < (1 - HOSTMON_MHZ_LOW) * median_mhz:
        why["cpu_mhz"] = m["cpu_mhz"] / median_mhz
    return why


def contention_text(why: dict) -> str:
    """A run's contention (``contention_why``, or a flag's ``why``) in words: 'steal 6% of the CPU
    time wanted; other processes on 2.1 cores'."""
    text = {"steal": lambda v: f"steal {v:.0%} of the CPU time wanted",
            "cgroup_throttled": lambda v: f"cgroup quota-throttled in {v:.0%} of periods",
            "other_cores": lambda v: f"other processes on {v:.1f} cores",
            "cpu_mhz": lambda v: f"core clock {v:.2f}x the median",
            "stopped_early": lambda v: f"sampling stopped early: {v}"}
    return "; ".join(text[k](v) for k, v in why.items())


def host_monitor_flags(rows: list[dict]) -> dict:
    """Runs whose host was contended while measured: steal at least ``HOSTMON_STEAL`` of the time
    the run's CPUs wanted, a cgroup quota-throttled in ``HOSTMON_CG_THROTTLED`` of its periods or
    more, other processes on ``HOSTMON_OTHER_CORES`` cores or more, or the cores' clock more than
    ``HOSTMON_MHZ_LOW`` under the validated runs' median; also a run whose sampling stopped early.
    Their error may be the host's. Flagged, never dropped. Named apart: runs with a thread on
    ``HOSTMON_ONE_THREAD`` of a core or more, and runs whose cgroup could not be read (their
    throttling is unknown, not absent)."""
    monitored = [r for r in rows if (r.get("host_monitor") or {}).get("available")]

    def med(key):
        vals = [key(r["host_monitor"]) for r in monitored]
        vals = [v for v in vals if v is not None]
        return float(np.median(vals)) if vals else None

    median = {"cpu_mhz": med(lambda m: m.get("cpu_mhz")), "run_cores": med(lambda m: m.get("run_cores")),
              "other_cores": med(lambda m: m.get("other_cores")), "steal_frac": med(lambda m: m.get("steal_frac")),
              "busiest_thread_core_frac": med(lambda m: (m.get("busiest_thread") or {}).get("core_frac"))}
    flagged = []
    for r in monitored:
        m = r["host_monitor"]
        why = contention_why(m, median["cpu_mhz"])
        if m.get("stopped_early"):
            why["stopped_early"] = m["stopped_early"]
        if why:
            flagged.append({"run": r["run"], "why": why})
    # A thread of the run near a full core: the run's own host work paces it there (not a
    # contended host, so named apart from the flags).
    one_thread = [{"run": r["run"], **r["host_monitor"]["busiest_thread"]} for r in monitored
                  if (r["host_monitor"].get("busiest_thread") or {}).get("core_frac", 0) >= HOSTMON_ONE_THREAD]
    cgroup_unread = [{"run": r["run"], "why": r["host_monitor"]["cgroup_error"]} for r in monitored
                     if r["host_monitor"].get("cgroup_error")]
    without = [r["host_monitor"] for r in rows if r.get("host_monitor") and not r["host_monitor"].get("available")]
    _label_runs(rows, flagged, one_thread, cgroup_unread)
    return {"runs_with_monitor": len(monitored), "runs": len(rows), "runs_without_figures": len(without),
            "why_without_figures": sorted({str(m.get("why")) for m in without}), "median": median,
            "thresholds": {"steal_frac": HOSTMON_STEAL, "cgroup_throttled_frac": HOSTMON_CG_THROTTLED,
                           "other_cores": HOSTMON_OTHER_CORES, "cpu_mhz_low": HOSTMON_MHZ_LOW,
                           "one_thread_core_frac": HOSTMON_ONE_THREAD},
            "flagged": flagged, "one_thread": one_thread, "cgroup_unread": cgroup_unread}


def host_monitor_flagged_text(flags: dict) -> str:
    """``host_monitor_flags``' flagged runs as 'run (steal 6% of the CPU time wanted; other
    processes on 2.1 cores); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({contention_text(f['why'])})" for f in flags["flagged"])


def host_monitor_text(flags: dict) -> str:
    """The report's paragraph on ``host_monitor_flags``."""
    without, only = _monitor_preamble(flags, "Host monitor", 27)
    if only:
        return only
    m = flags["median"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"Host monitor (/proc and the cgroup through each run; {flags['runs_with_monitor']} of {flags['runs']} "
            f"runs have one): median cores used by the run {f(m['run_cores'], '.2f')}, its busiest thread "
            f"{f(m['busiest_thread_core_frac'], '.0%')} of a core, other processes {f(m['other_cores'], '.2f')} "
            f"cores, steal {f(m['steal_frac'], '.1%')}, core clock {f(m['cpu_mhz'], '.0f')} MHz. ")
    t = flags["thresholds"]
    rule = (f"steal {t['steal_frac']:.0%} of the CPU time wanted or more, a cgroup quota-throttled in "
            f"{t['cgroup_throttled_frac']:.0%} of its periods or more, other processes on {t['other_cores']:g} "
            f"core{'' if t['other_cores'] == 1 else 's'} or more, "
            f"or a core clock more than {t['cpu_mhz_low']:.0%} under the median")
    one = flags.get("one_thread") or []
    tail = (f" A thread of the run on {t['one_thread_core_frac']:.0%} of a core or more (its own host work paces "
            "it): " + "; ".join(f"{_run_name(o)} ({o['name']}"
                                + (f" of {o['process']}" if o.get("process") else "")  # older runs lack it
                                + f", {o['core_frac']:.0%})" for o in one) + "."
            if one else "")
    unread = flags.get("cgroup_unread") or []
    tail += (" Throttling unknown (a cgroup unread): " + "; ".join(f"{_run_name(u)} ({u['why']})"
                                                                   for u in unread) + "." if unread else "")
    tail += f" {without}" if without else ""
    if flags["flagged"]:
        return (head + f"On a contended host ({rule}; their host, not only the simulator, may explain their "
                "error): " + host_monitor_flagged_text(flags) + "." + tail)
    return head + f"No run on a contended host ({rule})." + tail


# What a run recorded of its own state: key -> (label, the figure from a validated row, None where
# the run lacks it). `error_correlates` sets each against the simulator's error. The host monitor's
# figures are a run's most contended monitor's (`run_host_monitor`), the GPU's sample-weighted.
def _figure(section: str, key: str):
    """A validated row's ``row[section][key]`` (None where the run lacks either)."""
    return lambda r: (r.get(section) or {}).get(key)


RUN_STATE = {
    "gpu_busy_share": ("GPU busy share (samples over 50% utilisation)", _figure("gpu_monitor", "busy_fraction")),
    "gpu_util": ("GPU utilisation", _figure("gpu_monitor", "util_pct")),
    "probe_loop_s": ("host probe loop s", _figure("host_probe", "cpu_loop_s")),
    "probe_file_s": ("host probe file s", _figure("host_probe", "file_rw_s")),
    "run_cores": ("run's cores (its largest monitor's)", _figure("host_monitor", "run_cores")),
    "busiest_thread": ("busiest thread's core share",
                       lambda r: ((r.get("host_monitor") or {}).get("busiest_thread") or {}).get("core_frac")),
    "other_cores": ("other processes' cores", _figure("host_monitor", "other_cores")),
    "steal": ("steal share", _figure("host_monitor", "steal_frac")),
    "cgroup_throttled": ("cgroup throttled share", _figure("host_monitor", "cgroup_throttled_frac")),
    "cpu_mhz": ("core clock", _figure("host_monitor", "cpu_mhz")),
    "engine_step_ms": ("engine's mean step ms", _figure("engine_steps", "mean_step_ms")),
    "engine_step_spread": ("engine step spread (slowest generation's mean step over the fastest's)",
                           _figure("engine_steps", "step_ms_spread")),
    "engine_between": ("share of the engines' busy time between steps (submits included)",
                       _figure("engine_steps", "between_share")),
    "engine_collect": ("share of the engines' busy time collecting results", _figure("engine_steps", "collect_share")),
    "engine_gc": ("share of the engines' busy time in GC", _figure("engine_steps", "gc_share")),
}
MIN_CORRELATE_RUNS = 5  # runs (with at least 3 distinct values) before a figure's correlation is reported
PERMUTATIONS = 20000  # for the permutation p-value of each r (seeded: a report regenerates the same)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1])


def _varies(v: np.ndarray) -> bool:
    return len(np.unique(np.round(v, 12))) >= 3 and np.ptp(v) > 1e-9 * max(1.0, float(np.abs(v).max()))


def error_correlates(rows: list[dict]) -> dict:
    """The Pearson correlation between the simulator's replayed error (simulated over measured
    steps per GPU-hour, minus 1) and each figure of ``RUN_STATE``, over the held-out runs (every
    validated run where fewer than ``MIN_CORRELATE_RUNS`` are held out: the fit runs' in-sample
    errors then count too), for figures at least that many runs recorded with 3 or more distinct
    values; with a two-sided permutation p-value, and the r over configuration means where as many
    configurations have the figure. A pointer to what the error moves with, not a cause: runs of one
    configuration are not independent, and a figure may follow the arm's structure (session 26's
    held-out runs: r = -0.92 against the GPU busy share, -0.91 over its 7 configurations' means)."""
    usable = [r for r in rows if r["measured"].get("steps_per_gpu_hour")]
    held = [r for r in usable if r["heldout"]]
    sel, split = (held, "heldout") if len(held) >= MIN_CORRELATE_RUNS else (usable, "all")
    out = {"split": split, "runs": len(sel), "min_runs": MIN_CORRELATE_RUNS, "figures": {}}
    rng = np.random.default_rng(0)
    for key, (label, get) in RUN_STATE.items():
        vals = [(r, get(r)) for r in sel]
        used = [(r, float(v)) for r, v in vals if v is not None and np.isfinite(float(v))]
        if len(used) < MIN_CORRELATE_RUNS:
            continue
        x = np.array([v for _, v in used])
        y = np.array([r["replay"]["steps_per_gpu_hour"] / r["measured"]["steps_per_gpu_hour"] - 1 for r, _ in used])
        if not (_varies(x) and _varies(y)):
            continue
        r = _pearson(x, y)
        # Every permutation's r at once: y's shuffles standardised, against x standardised.
        ys = rng.permuted(np.tile(y, (PERMUTATIONS, 1)), axis=1)
        zx = (x - x.mean()) / x.std()
        perm = ((ys - y.mean()) / y.std()) @ zx / len(x)
        by_cfg: dict = {}
        for (u, _), xi, yi in zip(used, x, y):
            by_cfg.setdefault(config_key(u), []).append((xi, yi))
        fig = {"label": label, "pearson_r": r, "p_value": float((np.sum(np.abs(perm) >= abs(r) - 1e-12) + 1)
                                                                / (PERMUTATIONS + 1)),
               "runs": len(used), "configurations": len(by_cfg)}
        if len(by_cfg) >= MIN_CORRELATE_RUNS:
            cx, cy = np.array([np.mean(v, axis=0) for v in by_cfg.values()]).T
            if _varies(cx) and _varies(cy):
                fig["pearson_r_config_means"] = _pearson(cx, cy)
        out["figures"][key] = fig
    return out


def error_correlates_text(d: dict) -> str:
    """``error_correlates`` as one report line, strongest correlation first ('' without any)."""
    if not d.get("figures"):
        return ""
    items = sorted(d["figures"].values(), key=lambda v: -abs(v["pearson_r"]))

    def one(v: dict) -> str:
        cfg = v["configurations"]
        means = (f", {v['pearson_r_config_means']:+.2f} over the configurations' means"
                 if "pearson_r_config_means" in v else "")
        pv = "p < 0.001" if v["p_value"] < 0.001 else f"p = {v['p_value']:.3f}"
        return (f"{v['label']} {v['pearson_r']:+.2f} ({pv}; {v['runs']} runs, {cfg} "
                f"configuration{'' if cfg == 1 else 's'}{means})")

    which = ("held-out runs" if d["split"] == "heldout" else
             "validated runs, fit runs included (fewer than " f"{d['min_runs']} held out)")
    return (f"The simulator's replayed error against what the runs recorded of their state (Pearson r over the {which} "
            "that record it, with a permutation p-value; a pointer, not a cause: runs of one configuration are not "
            "independent, and a figure can follow the arm): " + "; ".join(one(v) for v in items) + ".")


def run_jit_compiles(summary: dict) -> list[str] | None:
    """The kernels a run's engines JIT-compiled inside its measured window (``engine_jit_compiles``
    at run seconds >= 0; the warm-up's are before it), one entry per compile; None for a run that
    recorded none (before session 14, or the engine core in a process of its own)."""
    seen = [d.get("engine_jit_compiles") for d in summary.get("diagnostics", [])]
    if not seen or any(s is None for s in seen):
        return None
    return [c["kernel"] for s in seen for c in s if c.get("t_s", 0) >= 0]


def jit_flags(rows: list[dict]) -> dict:
    """Runs whose engine JIT-compiled kernels while measured: each compile stalls the steps beside
    it (session 14-15: generations of 4.3-7.3 s against ~2 s), which the simulator does not model,
    so their error may be the stall's. Flagged, never dropped."""
    seen = [r for r in rows if r.get("jit_compiles") is not None]
    flagged = [{"run": r["run"], "compiles": len(r["jit_compiles"]), "kernels": sorted(set(r["jit_compiles"]))}
               for r in seen if r["jit_compiles"]]
    _label_runs(rows, flagged)
    return {"runs_recorded": len(seen), "runs": len(rows), "flagged": flagged}


def jit_text(flags: dict) -> str:
    """``jit_flags``' flagged runs as 'run (6: kernel, kernel); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({f['compiles']}: {', '.join(f['kernels'])})" for f in flags["flagged"])


def flagged_text(flags: dict) -> str:
    """``host_flags``' flagged runs as 'run (cpu_loop_s 2.0x); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({', '.join(f'{k} {v:.1f}x' for k, v in f['slower'].items())})"
                     for f in flags["flagged"])


def unique_names(runs: list[str]) -> list[str]:
    """Each run folder by its shortest trailing path that no other run of ``runs`` shares
    (``session32/arms/X`` beside ``session33/arms/X``; the folder name alone where it is unique)."""
    parts = [Path(r).parts for r in runs]
    out = []
    for p in parts:
        n = 1
        while n < len(p) and sum(q[-n:] == p[-n:] for q in parts) > 1:
            n += 1
        out.append("/".join(p[-n:]))
    return out


def config_key(row: dict) -> tuple:
    """Runs of one configuration: the same arm, job count, trainer micro-batch size, packing of
    each prompt's responses (trainer.share_prompts), publish wait, audit (full and ``:r1`` runs are
    two configurations, also where the profile prices the audit) and MPS settings (seeds and repeats
    differ). Stacks held in lockstep (arm.lockstep), started out of step (arm.offset_stacks) or held
    apart (arm.hold_apart) are other configurations than free ones."""
    arm = row["arm"] or {}
    return (arm.get("policy"), arm.get("groups"), arm.get("sharing"), stacks_of(arm), bool(arm.get("lockstep")),
            bool(arm.get("offset_stacks")), arm.get("hold_apart") or 0.0, row["jobs"],
            row.get("mb_tokens"), _packed(row), trainer_freed(arm), row.get("audit") or "",
            tuple(sorted(_config_controls(row).items())))


def _packed(row: dict) -> int:
    """The run's trainer.share_prompts as a configuration sees it (``nodus.config.packed_rows``)."""
    return packed_rows(row.get("share_prompts"))


def _config_controls(row: dict) -> dict:
    """A run's controls that make its configuration (``nodus.config.drop_idle_priority``)."""
    arm = row.get("arm") or {}
    return drop_idle_priority(row.get("controls") or {}, corun_key(arm.get("policy"), arm.get("stacks")))


def _stacks_text(arm: dict) -> str:
    """' stacks=2' for an arm on engine + trainer stacks (arm.stacks), then ' lockstep' (arm.lockstep)
    or ' offset' (arm.offset_stacks, with ' hold=0.5' for arm.hold_apart) for how they were started and
    held; '' for one stack."""
    return ((f" stacks={arm['stacks']}" if stacks_of(arm) > 1 else "")
            + (" lockstep" if arm.get("lockstep") else "") + (" offset" if arm.get("offset_stacks") else "")
            + (f" hold={arm['hold_apart']:g}" if arm.get("hold_apart") else ""))


def config_label(row: dict) -> str:
    """'8 jobs overlap g=2 mps', plus ' stacks=2' for engine + trainer stacks splitting the jobs
    (arm.stacks; ' lockstep' where they were held in step, arm.lockstep; ' offset' where they started
    out of step, arm.offset_stacks), ' mb=32768' for a trainer micro-batch other than the default,
    ' sp4' for a trainer that packed each prompt's responses 4 to a row, ' freed' for a trainer that
    did not wait for each publish, ' audit r1' for a lighter audit the profile prices (one it does
    not price is among the controls: ' audit=1 response a prompt') and the MPS settings beyond the
    defaults (' trainer_thread_pct=50')."""
    arm = row["arm"]
    mb = row.get("mb_tokens")
    controls = "".join(f" {k}={v}" for k, v in sorted(_config_controls(row).items()))
    return (f"{row['jobs']} jobs {arm['policy']} g={arm['groups']} {arm['sharing']}"
            + _stacks_text(arm)
            + (f" mb={mb}" if mb and mb != DEFAULT_MICROBATCH_TOKENS else "")
            + (f" sp{_packed(row)}" if _packed(row) else "") + (" freed" if trainer_freed(arm) else "")
            + (f" audit {row['audit']}" if row.get("audit") and "audit" not in (row.get("controls") or {}) else "")
            + controls)


def _by_config(rows: list[dict]) -> dict[tuple, list[dict]]:
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault(config_key(r), []).append(r)
    return by


def measurement_noise(rows: list[dict]) -> dict:
    """How far the measured steps per GPU-hour of runs of one configuration (other seeds, A/A
    repeats) lie from their configuration's mean: the error a perfect simulator would still show
    against single runs, the floor under any per-run MAPE."""
    by = {k: [r["measured"]["steps_per_gpu_hour"] for r in v] for k, v in _by_config(rows).items()}
    rel = [abs(x - np.mean(v)) / np.mean(v) for v in by.values() if len(v) >= 2 for x in v]
    spread = [(max(v) - min(v)) / np.mean(v) for v in by.values() if len(v) >= 2]
    return {"mape_floor": float(np.mean(rel)) if rel else None,
            "max_spread": float(max(spread)) if spread else None,
            "configs": len(spread), "runs": len(rel)}


def per_config_errors(rows: list[dict]) -> dict:
    """The simulator against each configuration's mean over its runs (seeds, repeats): the
    per-run noise averages out here, as it does for a planner's question about the configuration."""
    by = _by_config(rows)
    out: dict = {}
    out["configs"] = [config_label(v[0]) if v[0].get("arm") else "{}/{}/g{}/{}jobs".format(k[0], k[1], k[2], k[4]) for k, v in by.items()]
    runs = [[r["measured"]["steps_per_gpu_hour"] for r in v] for v in by.values()]
    for mode in ("replay", "sampled"):
        meas = [float(np.mean(v)) for v in runs]
        pred = [float(np.mean([r[mode]["steps_per_gpu_hour"] for r in v])) for v in by.values()]
        out[mode] = {**error_stats(pred, meas), "kendall_tau": kendall_tau(pred, meas),
                     **resolved_tau(pred, meas, runs),
                     "discordant": discordant_pairs(out["configs"], pred, meas)}
    out["runs_per_config"] = [len(v) for v in by.values()]
    return out


def run_labels(rep: dict) -> dict[str, str]:
    """Each row's run by the shortest trailing path no other row shares (``unique_names``): runs of
    one name from several days' folders stay apart in the tables and the plot."""
    runs = [r["run"] for r in rep["rows"]]
    return dict(zip(runs, unique_names(runs)))


def _tau_text(e: dict) -> str:
    return "-" if e["kendall_tau"] is None else f"{e['kendall_tau']:.2f}"


def _resolved_text(e: dict) -> str:
    """'0.78 (18 of 36)' for a per-configuration error's tau over resolved pairs."""
    if e.get("pairs_resolved") is None:  # a report written before the figure existed
        return "-"
    tau = "-" if e["kendall_tau_resolved"] is None else f"{e['kendall_tau_resolved']:.2f}"
    return f"{tau} ({e['pairs_resolved']} of {e['pairs']})"


def render_markdown(rep: dict) -> str:
    label = run_labels(rep)
    lines = [f"Simulator (profile `{rep['profile']}`) against recorded runs; held out: more than "
             f"{rep['fit_max_jobs']} jobs per GPU.", "",
             "| run | jobs | arm | measured steps/GPU-h | replay | sampled | held out |", "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        arm = r["arm"] or {}
        m = r["measured"]["steps_per_gpu_hour"]
        stacks = _stacks_text(arm)
        lines.append(f"| {label[r['run']]} | {r['jobs']} | {arm.get('policy')} g={arm.get('groups')} "
                     f"{arm.get('sharing')}{stacks}{f' sp{_packed(r)}' if _packed(r) else ''}"
                     f"{f' audit {a}' if (a := r.get('audit')) else ''} | {m:.0f} | "
                     f"{r['replay']['steps_per_gpu_hour']:.0f} "
                     f"({(r['replay']['steps_per_gpu_hour'] - m) / m:+.1%}) | {r['sampled']['steps_per_gpu_hour']:.0f} "
                     f"({(r['sampled']['steps_per_gpu_hour'] - m) / m:+.1%}) | {r['heldout']} |")
    lines += ["", "| split | lengths | MAPE | worst | bias | Kendall tau | n |", "|---|---|---|---|---|---|---|"]
    for split in ("heldout", "all"):
        for mode in ("replay", "sampled"):
            e = rep[f"{split}_{mode}"]
            fmt = (lambda x: "-" if x is None else f"{x:.1%}")
            lines.append(f"| {split} | {mode} | {fmt(e['mape'])} | {fmt(e['worst'])} | {fmt(e['bias'])} | "
                         f"{_tau_text(e)} | {e['n']} |")
    mc = rep.get("heldout_machine_calibrated")
    if mc:
        f = sorted(mc["factors"].values())
        lines += ["", f"With the machine's speed known (each held-out run's prediction times its machine's measured "
                  f"over simulated steps/GPU-h on that machine's other held-out runs; {mc['machines']} machines "
                  f"of two runs or more, their factors {f[0]:.3f}-{f[-1]:.3f}):", "",
                  "| lengths | MAPE | worst | bias | Kendall tau | n |", "|---|---|---|---|---|---|"]
        for mode in ("replay", "sampled"):
            e = mc[mode]
            lines.append(f"| {mode} | {e['mape']:.1%} | {e['worst']:.1%} | {e['bias']:+.1%} | {_tau_text(e)} | {e['n']} |")
    uf = rep.get("heldout_unflagged")
    if uf and uf["flagged_runs"] and uf["unflagged"]["replay"]["n"]:
        lines += ["", "Held out, the runs no monitor flagged (host probe, GPU monitor, host monitor; below) and the "
                  "flagged ones apart:", "", "| runs | lengths | MAPE | worst | bias | n |",
                  "|---|---|---|---|---|---|"]
        for name in ("unflagged", "flagged"):
            for mode in ("replay", "sampled"):
                e = uf[name][mode]
                if e["n"]:
                    lines.append(f"| {name} | {mode} | {e['mape']:.1%} | {e['worst']:.1%} | {e['bias']:+.1%} | "
                                 f"{e['n']} |")
    rt = rep.get("heldout_ratio")
    if rt:
        lines += ["", f"The ratio over dedicated ({len(rt['pairs'])} held-out runs, each over the dedicated runs of its "
                  "day, seed, job count and audit, on its machine; their mean where a day repeats one):", "",
                  "| lengths | MAPE | worst | bias | n |", "|---|---|---|---|---|"]
        for mode in ("replay", "sampled"):
            e = rt[mode]
            lines.append(f"| {mode} | {e['mape']:.1%} | {e['worst']:.1%} | {e['bias']:+.1%} | {e['n']} |")
        lines += ["", "| run | over dedicated runs | minutes apart (the farthest) | measured ratio | simulated (replay) | "
                  "error |", "|---|---|---|---|---|---|"]
        for pr in rt["pairs"]:
            apart = "-" if pr.get("minutes_apart") is None else f"{pr['minutes_apart']:.0f}"
            lines.append(f"| {label[pr['run']]} | {len(pr['dedicated'])} | {apart} | {pr['measured']:.2f} | "
                         f"{pr['replay']:.2f} | {pr['replay'] / pr['measured'] - 1:+.1%} |")
    pc = [(split, rep.get(f"{split}_per_config")) for split in ("heldout", "all")]
    if any(p and p["replay"]["n"] for _, p in pc):
        lines += ["", "Against each configuration's mean over its runs (seeds, repeats):", "",
                  "| split | lengths | configurations | MAPE | worst | bias | Kendall tau | "
                  "tau over pairs measurably apart (pairs) |", "|---|---|---|---|---|---|---|---|"]
        for split, p in pc:
            for mode in ("replay", "sampled"):
                e = p[mode]
                if e["n"]:
                    lines.append(f"| {split} | {mode} | {e['n']} | {e['mape']:.1%} | {e['worst']:.1%} | "
                                 f"{e['bias']:+.1%} | {_tau_text(e)} | {_resolved_text(e)} |")
        lines += ["", f"(Measurably apart: measured means {RESOLVED_Z:.0f} standard errors of their difference or more "
                  "apart, each configuration's error its runs' spread or the pooled spread, the larger, over the "
                  "root of its runs. Plain tau also counts pairs closer than the runs' noise, ordered by chance.)"]
        worse = (rep.get("heldout_per_config") or {}).get("replay", {}).get("discordant")
        if worse:
            lines += ["", "Held-out configurations the simulator orders unlike the measurements, or level "
                      "(replayed lengths; measured gap, simulated gap):", ""]
            lines += [f"- {d['higher']} over {d['lower']}: {d['measured']:+.1%} measured, "
                      f"{d['simulated']:+.1%} simulated" for d in worse]
    noise = rep.get("noise") or {}
    if noise.get("runs"):
        lines += ["", f"Measurement noise: runs of one configuration lie {noise['mape_floor']:.1%} from their "
                  f"configuration's mean on average (widest spread {noise['max_spread']:.1%}; "
                  f"{noise['configs']} configurations, {noise['runs']} runs): no simulator's per-run MAPE "
                  "can fall below that floor on these runs."]
    hostf = rep.get("host") or {}
    if hostf.get("runs_with_probe"):
        med = hostf["median"]
        lines += ["", f"Host probe (the same host work timed at each run's start and end; {hostf['runs_with_probe']} "
                  f"of {hostf['runs']} runs have one): median loop {med.get('cpu_loop_s', float('nan')):.3f} s, "
                  f"file write and read {med.get('file_rw_s', float('nan')):.3f} s. "
                  + (f"Slower than {hostf['threshold']:.1f}x the median (their host, not only the simulator, may "
                     "explain their error): " + flagged_text(hostf) if hostf["flagged"] else "No run slower than "
                     f"{hostf['threshold']:.1f}x the median.")]
    if rep.get("gpu") and rep["gpu"].get("runs"):
        lines += ["", gpu_text(rep["gpu"])]
    hm = rep.get("host_monitor") or {}
    if hm.get("runs_with_monitor") or hm.get("runs_without_figures"):  # silent on runs from before it
        lines += ["", host_monitor_text(hm)]
    correlates = error_correlates_text(rep.get("error_correlates") or {})
    if correlates:
        lines += ["", correlates]
    jit = rep.get("jit") or {}
    if jit.get("runs_recorded"):
        lines += ["", f"JIT compiles inside the measured window ({jit['runs_recorded']} of {jit['runs']} runs record "
                  "them; each stalls the steps beside it, which the simulator does not model): "
                  + (jit_text(jit) if jit["flagged"] else "none.")]
    lines += ["", "Per phase (mean seconds of a phase's actions) and busy fraction, replayed lengths:", "",
              "| run | " + " | ".join(f"{ph} s meas / sim" for ph in PHASES) + " | busy engine meas / sim | busy trainer meas / sim |",
              "|---|" + "---|" * (len(PHASES) + 2)]
    for r in rep["rows"]:
        m, p = r["measured"], r["replay"]
        cells = [f"{m['phase_s'].get(ph, float('nan')):.3f} / {p['phase_s'].get(ph, float('nan')):.3f}" for ph in PHASES]
        cells += [f"{m['busy'].get(side, float('nan')):.2f} / {p['busy'].get(side, float('nan')):.2f}"
                  for side in ("engine", "trainer")]
        lines.append(f"| {label[r['run']]} | " + " | ".join(cells) + " |")
    flagged = [(label[r["run"]], r["outside_profile"]) for r in rep["rows"] if r.get("outside_profile")]
    if flagged:
        lines += ["", "Predicted outside the profiled region (extrapolated):"]
        lines += [f"- {name}: {'; '.join(flags)}" for name, flags in flagged]
    comp = rep.get("all_replay_components", {})
    if comp:
        lines += ["", "| component (all runs, replay) | MAPE | bias | n |", "|---|---|---|---|"]
        for name, e in comp.items():
            if e["n"]:
                lines.append(f"| {name} | {e['mape']:.1%} | {e['bias']:+.1%} | {e['n']} |")
    sizes = rep.get("generation_sizes")
    if sizes:
        lines += ["", "Generations by size (a group's generations of one step; alone, or beside another group's "
                  "train step for at least 90% of it), replayed lengths; a size the fitted runs did not reach "
                  "is an extrapolation of the decode curves:", "",
                  "| sharing | beside training | sequences | runs (held out) | actions (not simulated) | measured s "
                  "| simulated s | error |", "|---|---|---|---|---|---|---|---|"]
        for g in sizes:
            err = "-" if g["error"] is None else f"{g['error']:+.1%}"
            sim = "-" if g["simulated_s"] is None else f"{g['simulated_s']:.3f}"
            lines.append(f"| {g['sharing']} | {'yes' if g['side'] == 'beside' else 'no'} | {g['sequences']} | "
                         f"{g['runs']} ({g['heldout_runs']}) | {g['actions']} ({g.get('unsimulated', 0)}) | "
                         f"{g['measured_s']:.3f} | {sim} | {err} |")
        lines += ["", "(The error compares the runs whose simulation has actions of that size and side; each "
                  "run weighs by its measured actions.)"]
    return "\n".join(lines)


def plot_validation(rep: dict, path: Path) -> None:
    """Predicted (replayed and sampled lengths) against measured steps per GPU-hour, one point per
    run, held-out runs filled; the diagonal is a perfect prediction, the band +-8%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = run_labels(rep)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    meas = [r["measured"]["steps_per_gpu_hour"] for r in rep["rows"]]
    top = max(meas + [r[m]["steps_per_gpu_hour"] for r in rep["rows"] for m in ("replay", "sampled")]) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=1)
    ax.fill_between([0, top], [0, top * 0.92], [0, top * 1.08], color="grey", alpha=0.15, label="+-8%")
    for mode, marker in (("replay", "o"), ("sampled", "^")):
        for i, r in enumerate(rep["rows"]):
            ax.scatter(r["measured"]["steps_per_gpu_hour"], r[mode]["steps_per_gpu_hour"], marker=marker,
                       facecolors="C0" if r["heldout"] else "none", edgecolors="C0")
            if mode == "replay":
                ax.annotate(label[r["run"]], (r["measured"]["steps_per_gpu_hour"], r[mode]["steps_per_gpu_hour"]),
                            fontsize=7, xytext=(4, -10 if i % 2 == 0 else 4), textcoords="offset points")
    ax.scatter([], [], marker="o", color="C0", label="replayed lengths (filled: held out)")
    ax.scatter([], [], marker="^", color="C0", label="sampled lengths")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured steps per GPU-hour")
    ax.set_ylabel("simulated steps per GPU-hour")
    h = rep.get("heldout_replay") or {}
    mape = "-" if h.get("mape") is None else f"{h['mape']:.1%}"
    name = Path(str(rep["profile"])).name.removesuffix(".json")
    ax.set_title(f"{name}: held-out MAPE {mape}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def annotate_profile(profile: str, rep: dict, out: str | Path, report: str | None = None) -> dict:
    """The profile with `rep`'s held-out errors as its `validation`, written to `out` (a new file,
    or the same path as a profile file being annotated in place)."""
    from sim.profile import profile_dict, shipped_profile_path, write_profile

    out = Path(out)
    src = Path(profile)
    if not src.exists() and not profile.endswith(".json"):  # a shipped profile by name: its file
        src = Path(str(shipped_profile_path(profile)))
    in_place = src.exists() and out.resolve() == src.resolve()
    if out.exists() and not in_place:
        raise FileExistsError(f"--annotate {str(out)!r} exists and is not the profile being annotated")
    prof = profile_dict(profile)
    held = [r for r in rep["rows"] if r["heldout"]]
    h = rep["heldout_replay"]
    # An in-place annotation keeps the profile's error on other days (experiments/crossday.py), which
    # this validation does not measure.
    days = {k: v for k, v in (prof.get("validation") or {}).items() if k.startswith("across_days_")} if in_place else {}
    prof["validation"] = {
        "heldout_mape": h["mape"], "heldout_bias": h["bias"], "heldout_worst": h["worst"],
        "kendall_tau": h["kendall_tau"], "heldout_runs": len(held),
        "configurations": sorted({config_label(r) for r in held if r.get("arm")}),
        "report": report, **days}
    mc = rep.get("heldout_machine_calibrated")
    if mc:
        e = mc["replay"]
        prof["validation"].update(machine_mape=e["mape"], machine_bias=e["bias"], machine_worst=e["worst"],
                                  machine_runs=e["n"], machines=mc["machines"])
    rt = rep.get("heldout_ratio")
    if rt:
        e = rt["replay"]
        prof["validation"].update(ratio_mape=e["mape"], ratio_bias=e["bias"], ratio_worst=e["worst"], ratio_pairs=e["n"])
    pc = (rep.get("heldout_per_config") or {}).get("replay")
    if pc and pc.get("n"):
        prof["validation"].update(config_mape=pc["mape"], config_worst=pc["worst"], config_tau=pc["kendall_tau"],
                                  configs=pc["n"], config_tau_resolved=pc.get("kendall_tau_resolved"),
                                  config_pairs_resolved=pc.get("pairs_resolved"), config_pairs=pc.get("pairs"))
    write_profile(prof, out, "nodus validate --annotate", overwrite=in_place)
    return prof
