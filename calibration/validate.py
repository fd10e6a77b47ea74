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
import re
from pathlib import Path

import numpy as np

from nodus.config import (DEFAULT_MICROBATCH_TOKENS, AuditSpec, ConfigError, build_config, corun_key,
                          drop_idle_priority, packed_rows, stacks_of, trainer_freed)
from nodus.timeline import read_bytes, read_text, stored
from nodus.runner import run_arm
from calibration.run_health import (flagged_text, gpu_flags, gpu_text, host_flags, host_monitor_flags,
                                    host_monitor_text, jit_flags, jit_text, minutes_apart, run_engine_steps,
                                    run_gpu_monitor, run_host_monitor, run_host_probe, run_jit_compiles,
                                    run_machine, run_started, unique_names)
from calibration.run_settings import audit_label, run_audit, run_controls, unmodelled_controls

PHASES = ("generate", "train", "publish")
SAMPLE_SEED_OFFSET = 7919  # sampled lengths: the recorded jobs' seeds plus this


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


def action_seconds(spans: list[dict], phases: tuple[str, ...] = ("generate", "train")) -> dict[str, dict[tuple, float]]:
    """Each action's seconds in ``phases`` (generate and train unless told), by phase and
    ``_phase_actions``' key (gpu, group, step): a recorded run's and its replay's actions pair by that
    key (the replay runs the run's own steps)."""
    return {phase: {k: a[1] - a[0] for k, a in acts.items()} for phase, acts in _phase_actions(spans, phases).items()}


def action_key(sp: dict) -> tuple:
    """The action a span belongs to, ``_phase_actions``' key: (gpu, group, ("step", step)), or for a
    span without a step (gpu, group, ("start", its start))."""
    step = (sp.get("attrs") or {}).get("step")
    return sp["gpu"], sp["group"], ("step", step) if step is not None else ("start", sp["start_s"])


def _phase_actions(spans: list[dict], phases: tuple[str, ...] = ("generate", "train")) -> dict[str, dict[tuple, list]]:
    """A run's actions in ``phases`` (generate and train unless told): a group's spans of one step
    (their start, where a span has no step) as one action, ``{phase: {(gpu, group, step): [first
    start, last end, sequences]}}`` (sequences: its spans' ``n_sequences``, 0 for another phase)."""
    acts: dict[str, dict[tuple, list]] = {ph: {} for ph in phases}
    for sp in spans:
        if sp["phase"] in acts:
            attrs = sp.get("attrs") or {}
            a = acts[sp["phase"]].setdefault(action_key(sp), [sp["start_s"], sp["end_s"], 0])
            a[0], a[1] = min(a[0], sp["start_s"]), max(a[1], sp["end_s"])
            if sp["phase"] == "generate":
                a[2] += int(attrs.get("n_sequences") or len(attrs.get("response_tokens") or []))
    return acts


def _beside_fraction(key: tuple, start: float, end: float, others: dict[tuple, list]) -> float:
    """The fraction of the action ``key`` (``start``-``end``) that other groups' actions ``others``
    (``_phase_actions``' of one phase) ran beside on its GPU."""
    from nodus.accounting import covered_length

    gpu, group, _ = key
    return covered_length(start, end, [(s, e) for (g2, grp2, _), (s, e, _) in others.items()
                                       if g2 == gpu and grp2 != group]) / (end - start)


def _corun_side(key: tuple, start: float, end: float, others: dict[tuple, list], cover: float) -> str | None:
    """Whether the action ``key`` (``start``-``end``) ran "alone" (other groups' actions of the
    other phase, ``others``, beside it for at most 1 - ``cover`` of it on its GPU) or "beside"
    them (for at least ``cover``); None in between."""
    frac = _beside_fraction(key, start, end, others)
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


BESIDE_CLASSES = ("throughout", "partly", "not")  # another stack's action of the phase beside one: >= 90%, between, <= 10%


def beside_same_phase(spans: list[dict], phase: str, cover: float = 0.9) -> dict[tuple, tuple[float, str]]:
    """A run of several stacks' actions of ``phase`` (``_phase_actions``' keys), each with its seconds
    and how much of it another stack's action of the same phase ran beside it on its GPU:
    "throughout" (at least ``cover``), "not" (at most 1 - ``cover``) or "partly"."""
    return {key: (secs, "throughout" if frac >= cover else "not" if frac <= 1 - cover else "partly")
            for key, (secs, frac) in _same_phase_overlaps(spans, phase).items()}


def generations_beside_engines(spans: list[dict], cover: float = 0.9) -> dict[tuple, tuple[float, str]]:
    """``beside_same_phase`` of generations: two engines generating together and an engine beside
    another stack's lone trainer have rates of their own (``sharing.mps_engines``,
    ``sharing.mps_stacks_engine``); a free run's generations mix both, step by step."""
    return beside_same_phase(spans, "generate", cover)


def trains_beside_trainers(spans: list[dict], cover: float = 0.9) -> dict[tuple, tuple[float, str]]:
    """``beside_same_phase`` of train steps: two stacks' trainers together (lockstep stacks train at
    once) have a rate of their own (``sharing.mps_trainers``) apart from a lone trainer beside engines
    (``sharing.mps_stacks_trainer``)."""
    return beside_same_phase(spans, "train", cover)


def _same_phase_overlaps(spans: list[dict], phase: str = "generate") -> dict[tuple, tuple[float, float]]:
    """Each action of ``phase``: its seconds and the fraction of them another group's (stack's) action
    of the same phase ran beside it on its GPU."""
    acts = _phase_actions(spans)[phase]
    return {key: (end - start, _beside_fraction(key, start, end, acts))
            for key, (start, end, _) in acts.items() if end - start > 0}


def engine_sequences(spans: list[dict]) -> int:
    """The most sequences one generate action of a run held (a group's generations of one step: on
    a stack of shared-sync, everything its engine generated at once); 0 without generations."""
    return max((seqs for _, _, seqs in _phase_actions(spans)["generate"].values()), default=0)


def beside_engines_share(spans: list[dict], phase: str = "generate") -> float | None:
    """The share of a run's generation (or train) seconds that another stack's action of the same
    phase ran beside (None without any): how its stacks lined up, 1 in lockstep."""
    acts = _same_phase_overlaps(spans, phase).values()
    total = sum(secs for secs, _ in acts)
    return sum(secs * frac for secs, frac in acts) / total if total > 0 else None


def beside_engines_errors(measured: dict[tuple, tuple[float, str]], replayed: dict[tuple, float]) -> dict:
    """A run's generations by ``generations_beside_engines``' class (of the measured action), each
    paired with the replay's action of the same key: ``{class: {"n", "measured_s", "simulated_s"}}``
    (sums of seconds over the paired actions; an action the replay did not run is left out)."""
    out: dict = {}
    for key, (secs, side) in measured.items():
        if key in replayed:
            a = out.setdefault(side, {"n": 0, "measured_s": 0.0, "simulated_s": 0.0})
            a["n"] += 1
            a["measured_s"] += secs
            a["simulated_s"] += replayed[key]
    return out


def beside_engines_table(rows: list[dict], key: str = "beside_engines") -> list[dict]:
    """``beside_engines_errors`` over the validated runs of several stacks (each row's ``key``:
    generations, or "beside_trainers", train steps), by sharing and class: runs, paired actions, the
    measured and simulated mean seconds and the simulated total's error against the measured; sorted
    by sharing, then throughout / partly / not."""
    acc: dict[tuple, dict] = {}
    for r in rows:
        sharing = (r.get("arm") or {}).get("sharing") or "none"
        for side, a in (r.get(key) or {}).items():
            t = acc.setdefault((sharing, side), {"runs": 0, "heldout_runs": 0, "n": 0, "m": 0.0, "s": 0.0})
            t["runs"] += 1
            t["heldout_runs"] += bool(r.get("heldout"))
            t["n"] += a["n"]
            t["m"] += a["measured_s"]
            t["s"] += a["simulated_s"]
    return [{"sharing": sh, "beside": side, "runs": t["runs"], "heldout_runs": t["heldout_runs"], "actions": t["n"],
             "measured_s": t["m"] / t["n"], "simulated_s": t["s"] / t["n"], "error": t["s"] / t["m"] - 1}
            for (sh, side), t in sorted(acc.items(), key=lambda kv: (kv[0][0], BESIDE_CLASSES.index(kv[0][1])))
            if t["n"] and t["m"] > 0]


def load_recorded(run_dir: Path, spans: bool = True) -> tuple[dict, dict, list[dict]]:
    """A recorded run's config, summary and spans (``spans`` False: [] for them, unread; the
    folder must still hold them)."""
    for f in ("config.json", "summary.json", "spans.jsonl"):
        if not stored(run_dir / f).is_file():  # spans.jsonl may be kept as spans.jsonl.gz
            raise ConfigError(f"{str(run_dir)!r} is not a recorded run: {f} is missing")
    cfg = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in read_text(run_dir / "spans.jsonl").splitlines() if x.strip()] if spans else []
    return cfg, summary, rows


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
            "action_seconds": action_seconds(spans),
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


def validate(runs: list[str | Path], profile: str, fit_max_jobs: int = 4) -> dict:
    from sim.profile import (audit_priced, profile_adapter_format, profile_dict, profile_lora_kernels,
                             profile_step_mode)

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
        if audit_priced(prof):
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
                                                                  "share_prompts": packing},
                                                                 profile_adapter_format(prof))))}
        if stacks_of(cfg["arm"]) > 1:
            row["beside_engines"] = beside_engines_errors(generations_beside_engines(spans),
                                                          rep["action_seconds"]["generate"])
            row["beside_trainers"] = beside_engines_errors(trains_beside_trainers(spans),
                                                           rep["action_seconds"]["train"])
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
    report["generations_beside_engines"] = beside_engines_table(rows)
    report["trains_beside_trainers"] = beside_engines_table(rows, "beside_trainers")
    report["host"] = host_flags(rows)
    report["gpu"] = gpu_flags(rows)
    report["host_monitor"] = host_monitor_flags(rows)
    report["jit"] = jit_flags(rows)
    report["error_correlates"] = error_correlates(rows)
    for split, keep in (("heldout", lambda r: r["heldout"]), ("all", lambda r: True)):
        report[f"{split}_per_config"] = per_config_errors([r for r in rows if keep(r)])
    report["heldout_machine_calibrated"] = machine_calibrated([r for r in rows if r["heldout"]])
    report["machine_kinds"] = machine_kinds(rows)
    report["heldout_unflagged"] = unflagged_errors(report)
    report["heldout_ratio"] = ratio_errors(rows)
    h = report["heldout_replay"]
    report.update(heldout_mape_replay=h["mape"], heldout_mape_sampled=report["heldout_sampled"]["mape"],
                  worst=h["worst"], bias=h["bias"], kendall_tau=h["kendall_tau"])
    report["targets"] = target_check(report)
    return report


# The held-out targets a calibrated profile is held to (a planner's error bar; LLMServingSim 2.0,
# Revati / LLM-Emu and Vidur report about 2%, 5% and under 9%): steps per GPU-hour MAPE replaying the
# runs' response lengths and sampling them, the worst case, |signed bias| and Kendall tau.
TARGETS = {"mape_replay": 0.04, "mape_sampled": 0.08, "worst": 0.08, "bias": 0.02, "kendall_tau": 0.9}


def _target_figures(replay: dict, sampled: dict) -> dict:
    """One split's figures against ``TARGETS``: the worst case, bias and tau of both length modes,
    each met only where both modes meet it (None where a figure could not be computed)."""
    def met(value, ok) -> bool | None:
        return None if value is None else bool(ok(value))

    worst = [e["worst"] for e in (replay, sampled) if e.get("worst") is not None]
    bias = [e["bias"] for e in (replay, sampled) if e.get("bias") is not None]
    taus = [e["kendall_tau"] for e in (replay, sampled) if e.get("kendall_tau") is not None]
    out = {"n": replay.get("n"),
           "mape_replay": replay.get("mape"), "mape_sampled": sampled.get("mape"),
           "worst": max(worst) if worst else None,
           "bias_replay": replay.get("bias"), "bias_sampled": sampled.get("bias"),
           "kendall_tau_replay": replay.get("kendall_tau"), "kendall_tau_sampled": sampled.get("kendall_tau")}
    out["met"] = {
        "mape_replay": met(out["mape_replay"], lambda v: v <= TARGETS["mape_replay"]),
        "mape_sampled": met(out["mape_sampled"], lambda v: v <= TARGETS["mape_sampled"]),
        "worst": met(out["worst"], lambda v: v <= TARGETS["worst"]),
        "bias": met(max(bias, key=abs) if bias else None, lambda v: abs(v) <= TARGETS["bias"]),
        "kendall_tau": met(min(taus) if taus else None, lambda v: v >= TARGETS["kendall_tau"])}
    return out


def target_check(report: dict) -> dict:
    """The held-out errors against ``TARGETS``, per configuration (each configuration's mean over its
    runs, the figure the targets name) and per run, with the tau over the configuration pairs the
    measurements tell apart beside the plain one (``resolved_tau``: pairs within the runs' noise are
    ordered by chance, and the plain tau counts them all the same)."""
    out: dict = {"targets": dict(TARGETS)}
    pc = report.get("heldout_per_config")
    if pc and pc["replay"].get("n"):
        out["per_configuration"] = _target_figures(pc["replay"], pc["sampled"])
        out["per_configuration"].update(
            kendall_tau_resolved=pc["replay"].get("kendall_tau_resolved"),
            pairs_resolved=pc["replay"].get("pairs_resolved"), pairs=pc["replay"].get("pairs"))
    if report.get("heldout_replay", {}).get("n"):
        out["per_run"] = _target_figures(report["heldout_replay"], report["heldout_sampled"])
    return out


def targets_markdown(check: dict) -> list[str]:
    """The target table a report opens with ('-' where a split has no held-out run)."""
    t = check["targets"]
    pct = (lambda x: "-" if x is None else f"{x:.1%}")
    sgn = (lambda x: "-" if x is None else f"{x:+.1%}")
    tau = (lambda x: "-" if x is None else f"{x:.2f}")
    mark = (lambda ok: "" if ok is None else (" ✓" if ok else " ✗"))
    lines = ["Held out against the targets (per configuration: each configuration's mean over its runs; "
             "worst: the larger of replayed and sampled lengths; a figure is met where both modes meet it):", "",
             "| held out | n | MAPE replay | MAPE sampled | worst | bias replay / sampled | Kendall tau replay / "
             "sampled | tau over pairs measurably apart |", "|---|---|---|---|---|---|---|---|",
             f"| target | | <= {t['mape_replay']:.0%} | <= {t['mape_sampled']:.0%} | <= {t['worst']:.0%} | "
             f"within ±{t['bias']:.0%} | >= {t['kendall_tau']} | |"]
    for key, name in (("per_configuration", "per configuration"), ("per_run", "per run")):
        e = check.get(key)
        if not e:
            continue
        m = e["met"]
        res = "-"
        if e.get("pairs") is not None:
            res = f"{tau(e.get('kendall_tau_resolved'))} ({e['pairs_resolved']} of {e['pairs']} pairs)"
        lines.append(f"| {name} | {e['n']} | {pct(e['mape_replay'])}{mark(m['mape_replay'])} | "
                     f"{pct(e['mape_sampled'])}{mark(m['mape_sampled'])} | {pct(e['worst'])}{mark(m['worst'])} | "
                     f"{sgn(e['bias_replay'])} / {sgn(e['bias_sampled'])}{mark(m['bias'])} | "
                     f"{tau(e['kendall_tau_replay'])} / {tau(e['kendall_tau_sampled'])}{mark(m['kendall_tau'])} | "
                     f"{res} |")
    return lines


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


def _by_machine(rows: list[dict]) -> dict[str, list[dict]]:
    """Validated runs by the machine they recorded (runs of no recorded machine left out)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("machine"):
            by.setdefault(r["machine"], []).append(r)
    return by


def machine_calibrated(rows: list[dict]) -> dict | None:
    """The simulator with the machine's speed known: each run's prediction times its machine's
    measured over simulated steps/GPU-h on that machine's *other* runs (the mean ratio; leave one
    out, so a run never calibrates itself), as a planner who measured other configurations on the
    machine would have it. Runs alone on their machine, or of no recorded machine, are left out.
    Per lengths mode: the error statistics and Kendall tau of those predictions; with ``machines``
    (how many) and ``factors`` (each machine's mean ratio over all its runs). None with no machine of
    two runs or more. What is left is the simulator's error between configurations on one machine;
    the factors' spread is what the machine itself adds."""
    by = {m: rs for m, rs in _by_machine(rows).items() if len(rs) >= 2}
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
    the error bar of that). Only the replayed lengths are simulated (``validate`` also samples).
    ``kinds``: the factor and run count of the dedicated runs and of the shared ones apart
    (``run_kind``), for ``nodus.simulate.scale_to_machine`` to scale each by its own kind."""
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
    ratios, kind_of = {}, {}
    for rd, cfg, meas, spans in recorded:
        replay_cfg, _ = recorded_configs(Path(rd), cfg, spans, profile)
        sim = _simulate(replay_cfg, f"{rd}/config.json")
        ratios[rd] = meas["steps_per_gpu_hour"] / sim["steps_per_gpu_hour"]
        kind_of[rd] = run_kind(cfg["arm"]["policy"])
    kinds = {}
    for kind in ("dedicated", "shared"):
        rs = [ratios[rd] for rd in ratios if kind_of[rd] == kind]
        if rs:
            kinds[kind] = {"factor": float(np.mean(rs)), "runs": len(rs)}
    return {"factor": float(np.mean(list(ratios.values()))), "runs": len(ratios), "machine": machines.pop(),
            "ratio": ratios, "kinds": kinds}


def machine_kinds(rows: list[dict]) -> dict | None:
    """Does a machine's speed carry from its dedicated runs to its shared ones (replayed lengths)?
    Over the machines with both a dedicated run and a held-out run: each held-out run's prediction
    unscaled, times its machine's dedicated runs' factor, and times its machine's other held-out
    runs' factor (leave one out); and its ratio over the machine's dedicated runs of its seed, as
    simulated and times the quotient of the two factors (what ``nodus sim --machine-runs`` does with
    runs of both kinds). Error statistics of each; None where no machine has both."""
    meas, unscaled, by_ded, m_ratio, sim_ratio, scaled_ratio = [], [], [], [], [], []
    shared_pred, shared_meas = [], []  # runs with another held-out run on their machine
    machines = 0
    for rs in _by_machine(rows).values():
        ded = [r for r in rs if run_kind(r["arm"]["policy"]) == "dedicated"]
        held = [r for r in rs if r["heldout"]]
        if not ded or not held:
            continue
        machines += 1
        fd = float(np.mean([_speed_ratio(r) for r in ded]))
        for r in held:
            sim, m = r["replay"]["steps_per_gpu_hour"], r["measured"]["steps_per_gpu_hour"]
            meas.append(m)
            unscaled.append(sim)
            by_ded.append(sim * fd)
            others = [_speed_ratio(o) for o in held if o is not r]
            if not others:
                continue
            fs = float(np.mean(others))
            shared_pred.append(sim * fs)
            shared_meas.append(m)
            same_seed = [d for d in ded if d.get("seed") == r.get("seed")]
            if same_seed:
                m_ratio.append(m / float(np.mean([d["measured"]["steps_per_gpu_hour"] for d in same_seed])))
                sr = sim / float(np.mean([d["replay"]["steps_per_gpu_hour"] for d in same_seed]))
                sim_ratio.append(sr)
                scaled_ratio.append(sr * fs / fd)
    if not machines:
        return None
    return {"machines": machines,
            "unscaled": error_stats(unscaled, meas),
            "by_dedicated_factor": error_stats(by_ded, meas),
            "by_other_shared_factor": error_stats(shared_pred, shared_meas),
            "ratio_as_simulated": error_stats(sim_ratio, m_ratio),
            "ratio_by_factor_quotient": error_stats(scaled_ratio, m_ratio)}


def run_kind(policy: str) -> str:
    """'dedicated' (one job a GPU: bound by the engine's host loop at small batches) or 'shared' (many
    jobs on one GPU: bound by the GPU). A machine's measured over simulated speed differs between the
    two: on session 53's H100 host 1.23 on dedicated runs, 1.09 on two stacks; on the H200's 7 machines
    with both (the 81 held-out runs' protocol), a dedicated-run factor put on shared runs left them
    4.7% off against 4.3% unscaled and 3.8% with the machine's other shared runs
    (``machine_factor``'s ``kinds``)."""
    return "dedicated" if policy == "dedicated" else "shared"


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


def arm_key(arm: dict) -> str:
    """A configuration's arm alone, as its label begins after the job count: 'overlap g=2 mps',
    'shared-sync g=1 mps stacks=2 offset' (policy, groups, sharing and how the stacks run): what a
    profile's error bar is told apart by (``annotate_profile``'s ``arms``; ``nodus sim`` says whether
    the arm it simulated is among them)."""
    return f"{arm['policy']} g={arm.get('groups') or 1} {arm['sharing']}" + _stacks_text(arm)


_ARM_OF_LABEL = re.compile(r"^\d+ jobs (\S+ g=\d+ \S+(?: stacks=\d+)?(?: lockstep| offset(?: hold=\S+)?)?)")


def arm_of_label(label: str) -> str | None:
    """``arm_key`` of a configuration's ``config_label`` (None for a label of another form)."""
    m = _ARM_OF_LABEL.match(label)
    return m.group(1) if m else None


def heldout_arms(validation: dict | None) -> dict[str, int | None]:
    """A profile's ``validation`` (a dict) -> each arm of its held-out runs (``arm_key``) and their
    count: from its per-arm errors (``arm_errors``), and None for an arm only its configurations'
    labels name (an annotation written before per-arm errors)."""
    v = validation or {}
    out: dict[str, int | None] = {k: int(e.get("runs") or 0) for k, e in (v.get("arms") or {}).items()}
    for a in map(arm_of_label, v.get("configurations") or []):
        if a and a not in out:
            out[a] = None
    return dict(sorted(out.items()))


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
    return (f"{row['jobs']} jobs " + arm_key(arm)
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
    lines = [f"Simulator (profile `{rep['profile']}`) against recorded runs; held out: runs of more than "
             f"{rep['fit_max_jobs']} jobs per GPU or of several stacks, unless the profile's stacks rates were "
             "fitted on them (nodus fit-stacks).", "",
             "| run | jobs | arm | measured steps/GPU-h | replay | sampled | held out |", "|---|---|---|---|---|---|---|"]
    if rep.get("targets") and (rep["targets"].get("per_configuration") or rep["targets"].get("per_run")):
        lines[2:2] = targets_markdown(rep["targets"]) + [""]
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
    mk = rep.get("machine_kinds")
    if mk:
        lines += ["", f"A machine's speed from its dedicated runs against from its shared ones ({mk['machines']} "
                  "machines with a dedicated run and a held-out run; replayed lengths; `calibration.validate."
                  "machine_kinds`, what `nodus sim --machine-runs` scales by):", "",
                  "| held-out runs' prediction | MAPE | worst | bias | n |", "|---|---|---|---|---|"]
        for key, what in (("unscaled", "steps/GPU-h, unscaled"),
                          ("by_dedicated_factor", "steps/GPU-h times the machine's dedicated runs' factor"),
                          ("by_other_shared_factor", "steps/GPU-h times the machine's other held-out runs' factor"),
                          ("ratio_as_simulated", "ratio over the machine's dedicated run of the seed, as simulated"),
                          ("ratio_by_factor_quotient", "that ratio times the shared over the dedicated factor")):
            e = mk[key]
            if e["n"]:
                lines.append(f"| {what} | {e['mape']:.1%} | {e['worst']:.1%} | {e['bias']:+.1%} | {e['n']} |")
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
    beside = rep.get("generations_beside_engines")
    if beside:
        lines += ["", "Generations of runs of several stacks by how much of each another stack's generation ran "
                  "beside (measured: throughout, at least 90% of it; partly; not, at most 10%), each paired with "
                  "the replay's generation of the same stack and step (replayed lengths). Two engines together "
                  "and an engine beside another stack's lone trainer are priced by rates of their own "
                  "(`sharing.mps_engines`, `sharing.mps_stacks_engine`); errors of opposite sign here, right on "
                  "average, are those two rates' split mispriced:", "",
                  "| sharing | another stack generating beside | runs (held out) | actions | measured s | simulated s "
                  "| error |", "|---|---|---|---|---|---|---|"]
        for g in beside:
            lines.append(f"| {g['sharing']} | {g['beside']} | {g['runs']} ({g['heldout_runs']}) | {g['actions']} | "
                         f"{g['measured_s']:.3f} | {g['simulated_s']:.3f} | {g['error']:+.1%} |")
    trains = rep.get("trains_beside_trainers")
    if trains:
        lines += ["", "Train steps of runs of several stacks by how much of each another stack's train step ran "
                  "beside (throughout, partly, not, as above), each paired with the replay's train step of the "
                  "same stack and step (replayed lengths). Two trainers together (lockstep stacks train at once) "
                  "are priced by `sharing.mps_trainers` where the profile has it, else by the many-clients rule "
                  "(the engine-and-trainer pair's combined rate split over them: an assumption); a lone trainer "
                  "beside engines by `sharing.mps_stacks_trainer`:", "",
                  "| sharing | another stack training beside | runs (held out) | actions | measured s | simulated s "
                  "| error |", "|---|---|---|---|---|---|---|"]
        for g in trains:
            lines.append(f"| {g['sharing']} | {g['beside']} | {g['runs']} ({g['heldout_runs']}) | {g['actions']} | "
                         f"{g['measured_s']:.3f} | {g['simulated_s']:.3f} | {g['error']:+.1%} |")
    return "\n".join(lines)


PLOT_RUN_LABELS = 12  # runs a plot names point by point; past this the labels only hide the points


def short_config_labels(labels: list[str]) -> list[str]:
    """Configuration labels without the words every one of them shares ('8 jobs shared-sync g=1 mps
    stacks=2 offset ...' -> '8 jobs offset' where the rest is common): what tells them apart."""
    words = [lab.split() for lab in labels]
    common = set.intersection(*(set(w) for w in words)) if words else set()
    out = []
    for w, lab in zip(words, labels):
        kept = [x for x in w if x not in common or x == "jobs" or x.isdigit()]
        text = " ".join(kept).replace("cuda_graph_max_tokens", "gm")
        out.append(text if kept else lab)
    return out


def _diagonal(ax, lo: float, hi: float) -> None:
    """A predicted-against-measured panel's axes from ``lo`` to ``hi``: the diagonal and its +-8% band."""
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.fill_between([lo, hi], [lo * 0.92, hi * 0.92], [lo * 1.08, hi * 1.08], color="grey", alpha=0.15, label="+-8%")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured steps per GPU-hour")
    ax.set_ylabel("simulated steps per GPU-hour")


def _plot_configurations(ax, groups: list[list[dict]], pc: dict) -> list[str]:
    """The held-out configurations' panel: each configuration's simulated mean (replayed and sampled
    lengths) against its measured mean, the bar its runs' measured range, numbered, with a key of the
    words that tell the configurations apart (``short_config_labels``) under the axes."""
    runs = [[r["measured"]["steps_per_gpu_hour"] for r in g] for g in groups]
    m_mean = [float(np.mean(v)) for v in runs]
    sims = {mode: [float(np.mean([r[mode]["steps_per_gpu_hour"] for r in g])) for g in groups]
            for mode in ("replay", "sampled")}
    vals = [v for vs in runs for v in vs] + sims["replay"] + sims["sampled"]
    _diagonal(ax, min(vals) * 0.9, max(vals) * 1.06)
    xerr = [[m - min(v) for m, v in zip(m_mean, runs)], [max(v) - m for m, v in zip(m_mean, runs)]]
    for mode, marker in (("replay", "o"), ("sampled", "^")):
        ax.errorbar(m_mean, sims[mode], xerr=xerr, fmt=marker, color="C1", ecolor="C1", elinewidth=0.8,
                    capsize=2, alpha=0.9, label=("replayed lengths (bar: the runs' measured range)"
                                                 if mode == "replay" else "sampled lengths"))
    key = []
    for i, (x, y, text) in enumerate(zip(m_mean, sims["replay"], short_config_labels(pc["configs"]))):
        ax.annotate(str(i + 1), (x, y), fontsize=7, xytext=(5 if i % 2 == 0 else -10, 3), textcoords="offset points")
        key.append(f"{i + 1}: {text} ({len(runs[i])} run{'s' if len(runs[i]) > 1 else ''})")
    e = pc["replay"]
    tau = "-" if e.get("kendall_tau") is None else f"{e['kendall_tau']:.2f}"
    ax.set_title(f"held-out configurations ({e['n']}): MAPE {e['mape']:.1%}, worst {e['worst']:.1%}, tau {tau}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return key


def plot_validation(rep: dict, path: Path) -> None:
    """Predicted (replayed and sampled lengths) against measured steps per GPU-hour: one point per
    run, held-out runs filled (named where there are at most ``PLOT_RUN_LABELS``), and beside it the
    held-out configurations' means, each with its runs' measured range; the diagonal is a perfect
    prediction, the band +-8%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = run_labels(rep)
    pc = rep.get("heldout_per_config") or {}
    by = _by_config([r for r in rep["rows"] if r["heldout"]])
    panels = 2 if pc.get("replay", {}).get("n") and len(by) == len(pc.get("configs", [])) else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5.6 + (0.16 * len(by) if panels == 2 else 0)),
                             squeeze=False)
    ax = axes[0][0]
    meas = [r["measured"]["steps_per_gpu_hour"] for r in rep["rows"]]
    top = max(meas + [r[m]["steps_per_gpu_hour"] for r in rep["rows"] for m in ("replay", "sampled")]) * 1.1

    _diagonal(ax, 0, top)
    named = len(rep["rows"]) <= PLOT_RUN_LABELS
    for mode, marker in (("replay", "o"), ("sampled", "^")):
        for i, r in enumerate(rep["rows"]):
            ax.scatter(r["measured"]["steps_per_gpu_hour"], r[mode]["steps_per_gpu_hour"], marker=marker,
                       facecolors="C0" if r["heldout"] else "none", edgecolors="C0", alpha=0.8)
            if mode == "replay" and named:
                ax.annotate(label[r["run"]], (r["measured"]["steps_per_gpu_hour"], r[mode]["steps_per_gpu_hour"]),
                            fontsize=7, xytext=(4, -10 if i % 2 == 0 else 4), textcoords="offset points")
    ax.scatter([], [], marker="o", color="C0", label="replayed lengths (filled: held out)")
    ax.scatter([], [], marker="^", color="C0", label="sampled lengths")
    h = rep.get("heldout_replay") or {}
    mape = "-" if h.get("mape") is None else f"{h['mape']:.1%}"
    held = sum(1 for r in rep["rows"] if r["heldout"])
    ax.set_title(f"per run ({len(rep['rows'])}, {held} held out): held-out MAPE {mape}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    key = _plot_configurations(axes[0][1], list(by.values()), pc) if panels == 2 else []
    name = Path(str(rep["profile"])).name.removesuffix(".json")
    fig.suptitle(f"simulator against recorded runs, profile {name}", fontsize=8)
    fig.tight_layout()
    if key:  # the configurations' key under both panels, the figure's width (a panel's cut long labels off)
        height, lines = fig.get_size_inches()[1], 0.16 * len(key)
        fig.subplots_adjust(bottom=(lines + 0.75) / height)
        fig.text(0.01, (lines + 0.1) / height, "\n".join(key), fontsize=7, va="top", ha="left")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def arm_errors(rows: list[dict]) -> dict[str, dict]:
    """Each arm's share of an error bar (``arm_key``: policy, groups, sharing, stacks), over ``rows``
    (validate's rows; the held-out ones for a profile's annotation): its runs, configurations, and the
    per-run steps per GPU-hour MAPE, bias and worst case replaying lengths. A profile's one MAPE is
    of the arms its held-out runs ran; another arm's prediction is not covered by it."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("arm"):
            by.setdefault(arm_key(r["arm"]), []).append(r)
    out = {}
    for key, rs in sorted(by.items()):
        e = error_stats([r["replay"]["steps_per_gpu_hour"] for r in rs],
                        [r["measured"]["steps_per_gpu_hour"] for r in rs])
        out[key] = {"runs": e["n"], "configurations": len({config_key(r) for r in rs}), "mape": e["mape"],
                    "bias": e["bias"], "worst": e["worst"]}
    return out


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
        "arms": arm_errors(held), "report": report, **days}
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
