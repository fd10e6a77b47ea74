"""The host's handoff from a generation to its train step, fitted on recorded runs (`nodus fit-handoff`).

Between a group's last rollout and its train step's start the real backend works on the host: it builds
each sequence's token ids, mask and advantages (and the engine's logprobs, where the audit asked for
them) and hands the batch to the trainer process, whose span starts once the batch is there
(``real.backend.train``). Neither the GPU nor the engine waits on it, but the group's step does: on the
H200 11-12 ms for a dedicated job of 64 sequences under the full audit, 5-6 ms auditing one response a
prompt (session 33), 40-60 ms for a stack of four jobs (session 64), 121 ms for a stack of eight
jobs. A simulator that starts the train step at once makes each step that much shorter.

Each train action's gap (its start less the end of its group's generation of the same step) is one
observation, with the sequences it trains and those of them that carry logprobs under the run's audit.
The model is linear through the origin, ``gap = a * sequences + b * audited``, fitted by least squares
on the relative error over each run's median gap per (sequences, audited) class, so that one run's many
steps do not outweigh another's and a slow step does not move it. Where the runs do not tell the two
terms apart (every sequence audited, or none), the whole gap goes per sequence and the report says so.
With two stacks or more on a GPU the host serves more processes and the handoff is slower (on the
H200 18 ms for a stack of one job of 64 sequences, 12 ms for a dedicated one): ``a`` and ``b`` come from
the runs of one stack where there are some, and a factor on them (``handoff_stacks_factor``, the
geometric mean of measured over fitted) from the runs of several.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nodus.config import AuditSpec, ConfigError, JobSpec, stacks_of
from sim.profile import (add_source, drop_base_validation, handoff_seconds, profile_dict, refuse_existing,
                         set_assumption, write_fit_report, write_profile)


def handoff_gaps(run_dir: str | Path) -> list[dict]:
    """Each train action of a recorded run with its group's generation of the same step: ``{"sequences",
    "audited", "stacks", "gap_s"}`` (the train's start less the generation's end; the run's stacks).
    Raises ConfigError for a folder that is not a recorded run or holds no such pair."""
    from calibration.validate import _phase_actions, action_key, load_recorded, recorded_audit

    rd = Path(run_dir)
    cfg, _, spans = load_recorded(rd)
    stacks = stacks_of(cfg.get("arm"))
    audit = AuditSpec(**recorded_audit(rd, cfg))
    default_k = JobSpec.model_fields["responses_per_prompt"].default
    per_prompt = {j["id"]: int(j.get("responses_per_prompt") or default_k) for j in cfg["jobs"]}
    acts = _phase_actions(spans)
    audited: dict[tuple, int] = {}
    for sp in spans:
        attrs = sp.get("attrs") or {}
        step = attrs.get("step")
        if sp["phase"] != "generate" or step is None:
            continue
        n = int(attrs.get("n_sequences") or len(attrs.get("response_tokens") or []))
        key = action_key(sp)
        audited[key] = audited.get(key, 0) + audit.audited(step, n, per_prompt.get(sp.get("job"), default_k))
    rows = []
    for key, (start, _, _) in acts["train"].items():
        gen = acts["generate"].get(key)
        if gen is None or key not in audited or gen[2] <= 0:
            continue
        rows.append({"sequences": gen[2], "audited": audited[key], "stacks": stacks, "gap_s": start - gen[1]})
    if not rows:
        raise ConfigError(f"{str(rd)!r}: no train step with its group's generation of the same step in its spans "
                          "(a run of the real backend recorded since session 8 has them)")
    return rows


def _classes(run: str, rows: list[dict]) -> list[dict]:
    """One row per (sequences, audited, stacks) class of a run: the class's median gap."""
    by: dict[tuple[int, int, int], list[float]] = {}
    for r in rows:
        by.setdefault((r["sequences"], r["audited"], r["stacks"]), []).append(r["gap_s"])
    return [{"run": run, "sequences": s, "audited": a, "stacks": k, "steps": len(g), "gap_s": float(np.median(g))}
            for (s, a, k), g in sorted(by.items())]


def _solve(rows: list[dict]) -> tuple[float, float, bool]:
    """(per sequence, per audited sequence, whether the two were told apart): least squares on the
    relative error, through the origin, neither term below 0."""
    y = np.ones(len(rows))
    X = np.array([[r["sequences"] / r["gap_s"], r["audited"] / r["gap_s"]] for r in rows])
    ratios = {round(r["audited"] / r["sequences"], 9) for r in rows}
    if len(ratios) > 1:
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if coef.min() >= 0:
            return float(coef[0]), float(coef[1]), True
        # One term would go negative: fit the other alone (the one that describes the rows better).
        fits = []
        for i in (0, 1):
            c = float(np.linalg.lstsq(X[:, [i]], y, rcond=None)[0][0])
            fits.append((float(np.sum((X[:, i] * c - 1) ** 2)), i, max(c, 0.0)))
        _, i, c = min(fits)
        return (c, 0.0, True) if i == 0 else (0.0, c, True)
    # Every class audits the same share of its sequences: the whole gap per sequence.
    c = float(np.linalg.lstsq(X[:, [0]], y, rcond=None)[0][0])
    return max(c, 0.0), 0.0, False


def _fit_rows(rows: list[dict]) -> tuple[float, float, float, bool]:
    """(per sequence, per audited sequence, stacks factor, told apart) from class rows: the terms on the
    one-stack rows where there are some (else on all, factor 1), the factor on the others."""
    one = [r for r in rows if r["stacks"] == 1]
    per_seq, per_audited, apart = _solve(one or rows)
    many = [r for r in rows if r["stacks"] > 1]
    base = [_predict(r, per_seq, per_audited, 1.0) for r in many]
    factor = (max(float(np.exp(np.mean([np.log(r["gap_s"] / b) for r, b in zip(many, base)]))), 1.0)
              if one and many and all(b > 0 for b in base) else 1.0)
    return per_seq, per_audited, factor, apart


def _predict(r: dict, per_seq: float, per_audited: float, factor: float) -> float:
    return handoff_seconds(per_seq, per_audited, factor, r["sequences"], r["audited"], r["stacks"])


def fit(runs: list[str | Path]) -> dict:
    """Fit the handoff's terms on ``runs``; with each run's classes predicted by a fit on the others."""
    if not runs:
        raise ConfigError("nodus fit-handoff: give recorded runs (their folders)")
    rows = [c for run in runs for c in _classes(str(run), handoff_gaps(run))]
    per_seq, per_audited, factor, apart = _fit_rows(rows)
    left_out: dict[str, tuple] = {}  # run -> the terms fitted on the other runs' classes (one fit a run)
    for r in rows:
        r["predicted_s"] = _predict(r, per_seq, per_audited, factor)
        r["error"] = r["predicted_s"] / r["gap_s"] - 1
        if r["run"] not in left_out:
            others = [x for x in rows if x["run"] != r["run"]]
            left_out[r["run"]] = _fit_rows(others)[:3] if others else None
        if left_out[r["run"]] is not None:
            r["left_out_error"] = _predict(r, *left_out[r["run"]]) / r["gap_s"] - 1
    lo = [abs(r["left_out_error"]) for r in rows if "left_out_error" in r]
    return {"handoff_s_per_sequence": per_seq, "handoff_s_per_audited": per_audited, "told_apart": apart,
            "handoff_stacks_factor": factor, "rows": rows, "mape": float(np.mean([abs(r["error"]) for r in rows])),
            "left_out_mape": float(np.mean(lo)) if lo else None, "left_out_worst": float(max(lo)) if lo else None}


def report_markdown(result: dict) -> str:
    lines = ["# The host's handoff from a generation to its train step (`nodus fit-handoff`)", "",
             f"train.handoff_s_per_sequence = {result['handoff_s_per_sequence'] * 1e3:.4f} ms, "
             f"train.handoff_s_per_audited = {result['handoff_s_per_audited'] * 1e3:.4f} ms"
             + ("" if result["told_apart"] else " (the runs audit the same share of their sequences: the whole "
                                                "gap per sequence)")
             + f", times {result['handoff_stacks_factor']:.3f} with two stacks or more"
             + f"; {result['mape']:.1%} off the classes' median gaps"
             + (f", each run left out {result['left_out_mape']:.1%} (worst {result['left_out_worst']:.1%})"
                if result["left_out_mape"] is not None else ""), "",
             "| run | sequences | audited | stacks | steps | median gap ms | fitted ms | error | left out |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lo = f"{r['left_out_error']:+.1%}" if "left_out_error" in r else "-"
        lines.append(f"| {r['run']} | {r['sequences']} | {r['audited']} | {r['stacks']} | {r['steps']} | "
                     f"{r['gap_s'] * 1e3:.1f} | "
                     f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} | {lo} |")
    return "\n".join(lines) + "\n"


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, report: str | Path | None = None) -> dict:
    """Fit, write ``base`` with ``train.handoff_s_per_*`` to ``out`` (never overwritten), and the report to
    ``report``.{md,json} when given."""
    refuse_existing(out, "nodus fit-handoff", report)
    result = fit(runs)
    prof = profile_dict(base)
    prof["train"]["handoff_s_per_sequence"] = result["handoff_s_per_sequence"]
    prof["train"]["handoff_s_per_audited"] = result["handoff_s_per_audited"]
    prof["train"]["handoff_stacks_factor"] = result["handoff_stacks_factor"]
    drop_base_validation(prof)
    prof.setdefault("measurements", {})["handoff"] = dict(result)  # the fit and its rows, as the report has them
    set_assumption(prof, {
        "id": "handoff-linear",
        "what": "the host's handoff from a generation to its train step is linear in the sequences trained and "
                "those carrying the engine's logprobs, through the origin (fitted on runs of one stack), times a "
                "factor with two stacks or more (on runs of several), fitted on "
                f"{len(result['rows'])} run class(es) of {len(runs)} run(s) (nodus fit-handoff); it holds neither "
                "the GPU nor the engine; a host's load other than its stacks' does not move it"
                + ("" if result["told_apart"] else "; the runs did not tell the audited term apart (0)"),
        "value": (f"{result['handoff_s_per_sequence'] * 1e3:.4f} ms a sequence, "
                  f"{result['handoff_s_per_audited'] * 1e3:.4f} ms an audited one, "
                  f"x{result['handoff_stacks_factor']:.3f} with two stacks or more")})
    add_source(prof, "nodus fit-handoff " + " ".join(str(p) for p in runs))
    write_profile(prof, out, "nodus fit-handoff")
    write_fit_report(report, report_markdown(result), result)
    return result
