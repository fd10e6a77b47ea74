"""The audit's engine cost: what one sequence returning its sampled token's logprob adds to a
decode step (``decode.logprob_s_per_seq``), fitted from pairs of recorded runs that differ in their
audit alone (RunConfig.audit).

The on-policy audit has the engine return the logprobs of the sampled tokens, which the trainer
compares with its own. A profile's decode curves were measured with every sequence returning them.
The cost is host work per sequence and step (vLLM's output processor builds a logprob entry per
token), so a run that audits fewer responses (``audit.responses``), fewer steps (``audit.every``) or
none runs faster. On the H200, auditing one response a prompt instead of every one made two stacks
+14.6% at 16 jobs and +13.3% at 8 (session 32), with the simulator at +0% for want of this term.

The fit replays each run's own response lengths and finds the term at which the pairs' simulated
throughput ratio (lighter audit over full audit) matches the measured one on average, in logs. Only
the ratio within a pair counts, so the day's offset (a base profile pricing both runs of a pair 15%
high, say) cancels: a pair is two runs of one configuration and seed, back to back on one machine.
Leaving each pair out in turn, and predicting its ratio from the others, gives the term's error.

    nodus fit-audit RUN... --base PROFILE --out PROFILE.json [--report PREFIX]
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from calibration.stacks import crossing
from calibration.validate import _simulate, load_recorded, recorded_configs, spans_digest
from calibration.run_health import unique_names
from calibration.run_settings import run_controls
from nodus.config import AuditSpec, ConfigError
from sim.profile import (add_source, drop_base_validation, profile_dict, refuse_existing, set_assumption, write_fit_report,
                         write_profile)

TERM_MAX = 1e-3  # the search's upper end: a millisecond per sequence and step (measured: ~10 us)
TOLERANCE = 1e-8  # the search stops when the term's bracket is this narrow (seconds)


def _key(cfg: dict, controls: dict) -> str:
    """What a pair's two runs share: the configuration and run settings but the audit."""
    return json.dumps({"cfg": {k: v for k, v in cfg.items() if k not in ("audit", "profile")},
                       "controls": {k: v for k, v in controls.items() if k != "audit"}}, sort_keys=True, default=str)


def audit_pairs(runs: list[str | Path]) -> list[dict]:
    """The runs as pairs (full audit, a lighter audit) of one configuration, seed and run settings
    but the audit: a full-audit run pairs with each lighter-audit run of its configuration (one
    responses, one every N steps, one none...). Runs of one configuration from several days pair
    within their folders: where a configuration has two runs of one audit, each folder holding its
    runs must hold one run of each audit (a day's pair; session 32's and session 33's, say). Refuses
    the same run twice, two runs of one audit and configuration in one folder (which of them pairs
    is not for this tool to guess), and a run with no partner, naming it."""
    groups: dict[str, list[dict]] = {}
    seen: dict[str, str] = {}
    for rd in map(Path, runs):
        cfg, meas, spans = load_recorded(rd)
        digest = spans_digest(rd)
        if digest in seen:
            raise ConfigError(f"nodus fit-audit: {rd} is {seen[digest]} again (the same spans.jsonl): give each run "
                              "once")
        seen[digest] = str(rd)
        replay, _ = recorded_configs(rd, cfg, spans, "")
        audit = AuditSpec(**replay["audit"])
        slot = "full" if audit.is_full() else json.dumps(audit.model_dump(), sort_keys=True)
        groups.setdefault(_key(cfg, run_controls(meas)), []).append(  # the recorded config (replay names its trace)
            {"run": str(rd), "folder": str(rd.resolve().parent), "slot": slot, "cfg": replay,
             "audit": audit.model_dump(), "measured": meas["steps_per_gpu_hour"]})
    pairs = []
    for members in groups.values():
        slots = [m["slot"] for m in members]
        by_folder: dict[str, list[dict]] = {}
        for m in members:  # one set if no audit repeats, else a set per folder
            by_folder.setdefault(m["folder"] if len(set(slots)) < len(slots) else "", []).append(m)
        for ms in by_folder.values():
            g: dict[str, dict] = {}
            for m in ms:
                if m["slot"] in g:
                    raise ConfigError(
                        f"nodus fit-audit: {m['run']} and {g[m['slot']]['run']} are both runs of one configuration "
                        f"with one audit ({'full' if m['slot'] == 'full' else m['slot']}) in one folder: give one run "
                        "of each audit per configuration and seed (runs of several days: each day's pair in its own "
                        "folder)")
                g[m["slot"]] = m
            lights = [v for k, v in g.items() if k != "full"]
            if "full" not in g or not lights:
                only = next(iter(g.values()))
                raise ConfigError(f"nodus fit-audit: {only['run']} has no partner: give each run with the run of the "
                                  "same configuration and seed with the "
                                  + ("lighter audit" if "full" in g else "full audit")
                                  + " (the two back to back on one machine, in one folder where the configuration "
                                  "has runs of several days)")
            pairs += [{"full": g["full"], "light": v, "measured_ratio": v["measured"] / g["full"]["measured"]}
                      for v in lights]
    if not pairs:
        raise ConfigError("nodus fit-audit: no runs given")
    return sorted(pairs, key=lambda p: p["light"]["run"])


def predict(runs: list[dict], prof: dict, term: float, tmp: Path) -> list[float]:
    """Each run's replayed steps per GPU-hour on ``prof`` with ``decode.logprob_s_per_seq = term``."""
    p = json.loads(json.dumps(prof))
    p["decode"]["logprob_s_per_seq"] = term
    path = tmp / f"profile-{term!r}.json"
    write_profile(p, path, "nodus fit-audit", overwrite=True)
    return [_simulate(dict(r["cfg"], profile=str(path)), f"{r['run']}/config.json")["steps_per_gpu_hour"]
            for r in runs]


def _log_gap(pairs: list[dict], full: list[float], light: list[float]) -> float:
    """Mean over the pairs of log(simulated ratio) - log(measured ratio)."""
    return sum(math.log(li / fu) - math.log(p["measured_ratio"]) for p, fu, li in zip(pairs, full, light)) / len(pairs)


def fit_term(pairs: list[dict], prof: dict, tmp: Path, which: str = "",
             full: list[float] | None = None) -> tuple[float, list[float], list[float]]:
    """The term at which the pairs' simulated ratios match the measured ones on average (in logs),
    and the full- and light-audit predictions there (``full``: the full-audit ones, when already
    simulated). A full-audit run does not depend on the term; the lighter one's prediction rises
    with it, so a bracketed root (``calibration.stacks.crossing``). A pair whose lighter audit
    measured no faster gives 0."""
    if full is None:
        full = predict([p["full"] for p in pairs], prof, 0.0, tmp)
    def light(term: float) -> list[float]:
        return predict([p["light"] for p in pairs], prof, term, tmp)

    at0 = light(0.0)
    if _log_gap(pairs, full, at0) >= 0:
        return 0.0, full, at0
    lo, hi = 0.0, TERM_MAX
    at_hi = light(hi)
    if _log_gap(pairs, full, at_hi) < 0:
        raise ConfigError(f"nodus fit-audit: even at decode.logprob_s_per_seq={hi} s the pairs{which} are simulated "
                          "closer than measured: the lighter audit's measured gain is more than the decode steps can "
                          "give (does something else differ between the runs of a pair?)")
    term = crossing(lambda t: _log_gap(pairs, full, light(t)), lo, hi, _log_gap(pairs, full, at0),
                    _log_gap(pairs, full, at_hi), TOLERANCE)
    return term, full, light(term)


def fit(runs: list[str | Path], base: str) -> dict:
    """Fit the term on every pair, and on all but each pair in turn (that pair's ratio predicted
    from the others)."""
    prof = profile_dict(base)
    pairs = audit_pairs(runs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        term, full, light = fit_term(pairs, prof, tmp)
        loo = []
        for i, p in enumerate(pairs):
            others = pairs[:i] + pairs[i + 1:]
            if not others:
                loo.append(None)
                continue
            t_i, _, _ = fit_term(others, prof, tmp, f" but {p['light']['run']}'s (left out)",
                                 full=full[:i] + full[i + 1:])
            ratio = predict([p["light"]], prof, t_i, tmp)[0] / full[i]
            loo.append({"term": t_i, "ratio": ratio, "error": ratio / p["measured_ratio"] - 1})
    rows = [{"full": p["full"]["run"], "light": p["light"]["run"], "audit": p["light"]["audit"],
             # Both runs in one folder (one call, back to back); else the pair spans days, maybe.
             "same_folder": p["full"]["folder"] == p["light"]["folder"],
             "measured": [p["full"]["measured"], p["light"]["measured"]], "measured_ratio": p["measured_ratio"],
             "predicted": [fu, li], "predicted_ratio": li / fu, "ratio_error": (li / fu) / p["measured_ratio"] - 1,
             "left_out": lo_} for p, fu, li, lo_ in zip(pairs, full, light, loo)]
    errs = [abs(r["left_out"]["error"]) for r in rows if r["left_out"]]
    return {"base": base, "logprob_s_per_seq": term, "decode_scale": prof["decode"].get("scale", 1.0), "rows": rows,
            "left_out_mape": sum(errs) / len(errs) if errs else None, "left_out_worst": max(errs) if errs else None}


def report_markdown(result: dict) -> str:
    r = result
    lines = [f"# The audit's engine cost: `decode.logprob_s_per_seq` on `{r['base']}`", "",
             f"What one sequence returning its sampled token's logprob adds to a decode step: "
             f"**{r['logprob_s_per_seq'] * 1e6:.2f} us** (before the profile's decode scale, "
             f"{r['decode_scale']:.3f}). Fitted on {len(r['rows'])} pair(s) of runs that differ in their audit "
             "alone, replaying their response lengths, to the pairs' throughput ratio (lighter audit over full).", ""]
    if r["left_out_mape"] is not None:
        lines += [f"Each pair's ratio predicted from a term fitted on the others: {r['left_out_mape']:.1%} mean "
                  f"absolute error, worst {r['left_out_worst']:.1%}.", ""]
    lines += ["| lighter run | its audit | measured full / lighter (ratio) | simulated full / lighter (ratio) "
              "| ratio error | left out: term / ratio / error |",
              "|---|---|---|---|---|---|"]
    names = unique_names([x["light"] for x in r["rows"]])
    for x, name in zip(r["rows"], names):
        lo = x["left_out"]
        left = f"{lo['term'] * 1e6:.2f} us / {lo['ratio']:.3f} / {lo['error']:+.1%}" if lo else "-"
        (mf, ml), (pf, pl) = x["measured"], x["predicted"]
        name += "" if x.get("same_folder", True) else " (its full-audit run in another folder)"
        lines.append(f"| {name} | {AuditSpec(**x['audit']).words() or 'full'} | {mf:.0f} / {ml:.0f} "
                     f"({x['measured_ratio']:.3f}) | {pf:.0f} / {pl:.0f} ({x['predicted_ratio']:.3f}) | "
                     f"{x['ratio_error']:+.1%} | {left} |")
    lines += ["", "Only each pair's ratio is fitted, so what the base misprices on both runs of a pair (the day's "
              "offset) cancels; the absolute figures carry it (README, `nodus fit-audit`)."]
    return "\n".join(lines) + "\n"


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, report: str | Path | None = None) -> dict:
    """Fit, write ``base`` with ``decode.logprob_s_per_seq`` to ``out`` (never overwritten), and the
    report to ``report``.{md,json} when given."""
    refuse_existing(out, "nodus fit-audit", report)  # before the fit's replays
    result = fit(runs, base)
    prof = profile_dict(base)
    prof["decode"]["logprob_s_per_seq"] = result["logprob_s_per_seq"]
    drop_base_validation(prof)
    prof.setdefault("measurements", {})["audit"] = {
        k: v for k, v in result.items() if k in ("logprob_s_per_seq", "rows", "left_out_mape", "left_out_worst")}
    set_assumption(prof, {
        "id": "audit-logprob-term",
        "what": "each decode-step sequence not returning its sampled token's logprob (RunConfig.audit) takes "
                "decode.logprob_s_per_seq off the step (never below half of it), fitted on "
                f"{len(result['rows'])} pair(s) of runs differing in their audit alone (nodus fit-audit); the "
                "train phase's share of the audit is not modelled",
        "value": result["logprob_s_per_seq"]})
    add_source(prof, "nodus fit-audit " + " ".join(str(p) for p in runs))
    write_profile(prof, out, "nodus fit-audit")
    write_fit_report(report, report_markdown(result), result)
    return result
