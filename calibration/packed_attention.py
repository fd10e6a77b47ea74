"""The packed rows' attention (``trainer.share_prompts``), fitted from the trainer bench.

A packed row holds a prompt once and up to K of its responses; its explicit mask sends the
attention to SDPA's masked kernel, which computes every query-key pair of the padded row. The
simulator prices a train step as ``a`` per micro-batch plus ``b`` per padded token; with packed rows
it adds ``c`` per query-key pair (``nodus.microbatch.packed_pairs_per_microbatch``: rows x longest
row squared per micro-batch). Physics gives the size of ``c / b``: the attention's forward and backward take about
``3.5 x 4 x (heads x head_dim) x layers`` FLOPs a pair against ``~4 x params`` a token (frozen base),
3.3e-4 for Qwen3-0.6B at equal kernel efficiency.

``experiments/bench_shared_prompts.py`` times one trainer's step on the same rows plain and packed
(K = 2, 3, 4, 8; 1 and 4 jobs). This module fits ``t = a n_mb + b padded + c pairs`` to every bench
point by relative least squares (non-negative), checks it by leaving each (jobs, K) configuration
out, and writes ``c / b`` (the profile's ``train.packed_pair_per_token``, in units of the profile's
own per-token term, so a refit or a what-if of the train terms carries it) into a copy of a profile.

    nodus fit-packed BENCH.json... --base PROFILE --out PROFILE.json [--report PREFIX]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from calibration.fit_runs import nonneg_rel_lstsq
from nodus.config import ConfigError
from nodus.lengths import recorded_step_lengths
from nodus.microbatch import microbatch_costs, packed_pairs_per_microbatch, step_rows
from sim.profile import (add_source, drop_base_validation, drop_two_engine_rate, profile_dict, refuse_existing,
                         write_fit_report, write_profile)

FEATURES = ("microbatches", "padded_tokens", "packed_pairs")
ROOT = Path(__file__).resolve().parents[1]


def _case_lengths(bench: dict, case: dict, path: str) -> list[tuple[int, list[int]]]:
    """Each job's (prompt tokens, response lengths) of a bench case: recorded in the case, or (benches
    before the field) rebuilt from the run folder and step the bench read them from."""
    if case.get("lengths"):
        return [(int(p), [int(x) for x in r]) for p, r in case["lengths"]]
    args = (bench.get("env") or {}).get("args") or {}
    run = args.get("lengths_from")
    if not run:
        raise ConfigError(f"{path}: case of {case.get('jobs')} jobs records no lengths and the bench names no "
                          "--lengths-from run (synthetic rows cannot be rebuilt): rerun the bench")
    if not Path(run).is_dir() and (ROOT / run).is_dir():
        run = ROOT / run  # a bench run from the repository root names the folder from there
    rec = recorded_step_lengths(run, int(args.get("step", 1)))
    jobs = sorted(rec, key=lambda j: int("".join(c for c in j if c.isdigit()) or 0))
    return [rec[jobs[k % len(jobs)]] for k in range(int(case["jobs"]))]


def bench_points(paths: list[str | Path]) -> list[dict]:
    """One point per (bench file, case, variant): the sim's features of the step and its measured
    median seconds."""
    points = []
    for path in paths:
        path = str(path)
        try:
            bench = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: not a readable bench JSON ({err})") from None
        if not isinstance(bench, dict) or not bench.get("cases"):
            raise ConfigError(f"{path}: no 'cases' (a JSON written by experiments/bench_shared_prompts.py)")
        args = (bench.get("env") or {}).get("args") or {}
        if args.get("tiny"):
            raise ConfigError(f"{path}: a --tiny bench (the CPU's uncaptured program) says nothing of a GPU's "
                              "masked attention")
        per_prompt = int(args.get("responses_per_prompt", 8))
        mb_tokens = int(args.get("mb_tokens", 16384))
        for case in bench["cases"]:
            if not isinstance(case, dict) or "jobs" not in case or not isinstance(case.get("variants"), dict) \
                    or not all(isinstance(v, dict) and "median_s" in v for v in case["variants"].values()):
                raise ConfigError(f"{path}: a case without 'jobs' and 'variants' (share -> {{median_s, ...}}): not a "
                                  "JSON written by experiments/bench_shared_prompts.py")
            lengths = _case_lengths(bench, case, path)
            for k, v in case["variants"].items():
                if v.get("graph_error"):
                    continue  # the variant ran uncaptured: not the graphed trainer the profile prices
                share = int(k)
                rows = [step_rows(p * len(r), len(r), r, per_prompt, share) for p, r in lengths]
                padded, _ = microbatch_costs(rows, mb_tokens)
                per_mb = packed_pairs_per_microbatch(rows, mb_tokens) if share > 1 else [0]
                points.append({
                    "file": path, "jobs": int(case["jobs"]), "share": share, "measured_s": float(v["median_s"]),
                    "microbatches": len(padded), "padded_tokens": int(sum(padded)),
                    "packed_pairs": sum(per_mb), "largest_microbatch_pairs": max(per_mb)})
    if not any(p["share"] > 1 for p in points) or not any(p["share"] <= 1 for p in points):
        raise ConfigError("the benches need plain rows (share 0) and packed ones (share > 1) to fit the packed "
                          "attention")
    return points


def _solve(points: list[dict], features: tuple[str, ...]) -> np.ndarray:
    X = np.array([[p[f] for f in features] for p in points], float)
    y = np.array([p["measured_s"] for p in points])
    return nonneg_rel_lstsq(X, y)


def _predict(p: dict, w: np.ndarray, features: tuple[str, ...]) -> float:
    return float(sum(p[f] * c for f, c in zip(features, w)))


def fit(paths: list[str | Path]) -> dict:
    """The fit over every bench point, and each (jobs, K) configuration's error when it is left out,
    with the packed-attention term and (for contrast) without it. A configuration's points (one per
    bench file) are each held-out points: ``loo_by_config`` is their mean absolute error (signed
    errors of two files could cancel), ``loo_bias_by_config`` the signed mean, and ``loo_mape`` /
    ``loo_worst`` the mean and largest absolute error over every held-out point."""
    points = bench_points(paths)
    configs = sorted({(p["jobs"], p["share"]) for p in points})
    out = {"points": points, "models": {}}
    for name, feats in (("with_pairs", FEATURES), ("without_pairs", FEATURES[:2])):
        w = _solve(points, feats)
        loo, loo_bias, held_out = {}, {}, []
        for cfg in configs:
            rest = [p for p in points if (p["jobs"], p["share"]) != cfg]
            wl = _solve(rest, feats)
            errs = [_predict(p, wl, feats) / p["measured_s"] - 1 for p in points if (p["jobs"], p["share"]) == cfg]
            loo[f"{cfg[0]} jobs, K={cfg[1]}"] = float(np.mean(np.abs(errs)))
            loo_bias[f"{cfg[0]} jobs, K={cfg[1]}"] = float(np.mean(errs))
            held_out += errs
        fitted = [_predict(p, w, feats) / p["measured_s"] - 1 for p in points]
        out["models"][name] = {
            "coefficients": dict(zip(feats, map(float, w))),
            "fit_mape": float(np.mean(np.abs(fitted))), "fit_worst": float(np.max(np.abs(fitted))),
            "loo_by_config": loo, "loo_bias_by_config": loo_bias,
            "loo_mape": float(np.mean(np.abs(held_out))), "loo_worst": float(np.max(np.abs(held_out)))}
    c = out["models"]["with_pairs"]["coefficients"]
    if c["padded_tokens"] <= 0:
        raise ConfigError(f"the benches fit no per-token cost ({c}): their steps do not grow with their tokens; "
                          "nothing to write")
    if c["packed_pairs"] <= 1e-6 * c["padded_tokens"]:
        raise ConfigError(f"the benches fit no positive per-pair cost ({c}): packed rows cost no more than their "
                          "tokens there; nothing to write")
    out["packed_pair_per_token"] = c["packed_pairs"] / c["padded_tokens"]
    out["max_profiled_packed_pairs"] = max(p["largest_microbatch_pairs"] for p in points)
    return out


def ratio_rows(result: dict, prof: dict) -> list[dict]:
    """Per (jobs, K): the packed step's time over the plain step's, measured (mean over files) and as
    the profile prices it with and without the packed-attention term (what a planner's `nodus sim
    --share-prompts` sees)."""
    t = prof["train"]
    a, b = t["per_microbatch"]["a_s"], t["per_microbatch"]["b_s_per_unit"]
    rel = result["packed_pair_per_token"]
    rows = []
    by = {}
    for p in result["points"]:
        by.setdefault(p["jobs"], {}).setdefault(p["share"], []).append(p)
    for jobs, variants in sorted(by.items(), reverse=True):
        plain = variants.get(0) or variants.get(1)
        if not plain:
            continue
        t0 = np.mean([p["measured_s"] for p in plain])
        s0 = a * plain[0]["microbatches"] + b * plain[0]["padded_tokens"]
        for share, ps in sorted(variants.items()):
            if share <= 1:
                continue
            p = ps[0]
            lin = a * p["microbatches"] + b * p["padded_tokens"]
            rows.append({"jobs": jobs, "share": share, "measured": float(np.mean([q["measured_s"] for q in ps]) / t0),
                         "profile_without": lin / s0, "profile_with": (lin + b * rel * p["packed_pairs"]) / s0})
    return rows


def report_markdown(result: dict, rows: list[dict], base: str) -> str:
    w, wo = result["models"]["with_pairs"], result["models"]["without_pairs"]
    c = w["coefficients"]
    lines = [
        "# Packed rows' attention (`trainer.share_prompts`), fitted on the trainer bench", "",
        f"Benches: {', '.join(sorted({p['file'] for p in result['points']}))} ({len(result['points'])} points).", "",
        f"Fit over every point: t = {c['microbatches']:.4f} s x micro-batches + {c['padded_tokens'] * 1e6:.3f} us x "
        f"padded tokens + {c['packed_pairs'] * 1e9:.3f} ns x packed query-key pairs; "
        f"**packed_pair_per_token = {result['packed_pair_per_token']:.3g}** (physics at equal kernel efficiency, "
        "Qwen3-0.6B: ~3.3e-4).", "",
        "| model | fit MAPE | worst | leave-one-configuration-out MAPE | worst |",
        "|---|---|---|---|---|",
        *(f"| {name} | {m['fit_mape']:.1%} | {m['fit_worst']:.1%} | {m['loo_mape']:.1%} | {m['loo_worst']:.1%} |"
          for name, m in (("with the pair term", w), ("without it", wo))),
        "", "| left out | with the pair term: MAPE (mean signed) | without it: MAPE (mean signed) |", "|---|---|---|"]
    for k in w["loo_by_config"]:
        lines.append(f"| {k} | {w['loo_by_config'][k]:.1%} ({w['loo_bias_by_config'][k]:+.1%}) | "
                     f"{wo['loo_by_config'][k]:.1%} ({wo['loo_bias_by_config'][k]:+.1%}) |")
    lines += ["", f"The packed step over the plain step, as profile `{base}` prices it (its own per-micro-batch and "
              "per-token terms) without and with the pair term, against the bench:", "",
              "| jobs | K | measured | profile without | profile with |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['jobs']} | {r['share']} | {r['measured']:.3f} | {r['profile_without']:.3f} "
                     f"({r['profile_without'] / r['measured'] - 1:+.1%}) | {r['profile_with']:.3f} "
                     f"({r['profile_with'] / r['measured'] - 1:+.1%}) |")
    lines += ["", "Measured on the trainer alone (one step, no engine beside it). A run that packs rows is "
              "flagged by the simulator: the term prices the step alone, not the step beside a generation."]
    return "\n".join(lines) + "\n"


def fit_to_file(paths: list[str | Path], base: str, out: str | Path, report: str | Path | None = None) -> dict:
    """Fit the benches, write ``base`` with ``train.packed_pair_per_token`` to ``out`` (never
    overwritten), and the report to ``report``.{md,json} when given."""
    refuse_existing(out, "nodus fit-packed", report)
    result = fit(paths)
    prof = profile_dict(base)
    if prof["train"].get("step_mode", "eager") == "eager":
        raise ConfigError(f"--base {base}: its train terms describe the eager trainer, and packed rows run on the "
                          "graphed one only (train.step_mode)")
    prof["train"]["packed_pair_per_token"] = result["packed_pair_per_token"]
    drop_base_validation(prof)
    prof["train"]["max_profiled_packed_pairs"] = result["max_profiled_packed_pairs"]
    meas = prof.setdefault("measurements", {})
    meas["packed_attention"] = {
        "benches": sorted({p["file"] for p in result["points"]}),
        "packed_pair_per_token": result["packed_pair_per_token"],
        "models": result["models"], "points": result["points"]}
    add_source(prof, "nodus fit-packed " + " ".join(str(p) for p in paths))
    drop_two_engine_rate(prof)  # fitted beside the packed term just replaced: stale now
    write_profile(prof, out, "nodus fit-packed")
    rows = ratio_rows(result, prof)
    result["ratios"] = rows
    write_fit_report(report, report_markdown(result, rows, base), result)
    return result
