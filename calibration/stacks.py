"""Two engines at once: the rate of the engines of two stacks (``arm.stacks = 2``) generating
together under MPS, fitted from recorded two-stack runs.

A profile's engine terms describe one engine. With two stacks, each stack's engine has its own
process and host thread, and the two share the GPU. Without a fitted rate the simulator prices the
two engines as two more clients of one GPU, sharing the engine-trainer pair's combined rate. Session
30's two-stack runs (shared-sync + MPS, 8 jobs) came out 13.7-18.1% under the measured that way
on session 16's profile.

This module fits one number, ``sharing.mps_engines``: each engine's rate, in alone-without-MPS work
per second, while both engines generate and nothing else runs. ``sim.gpu.sharing_rates`` uses it, and
beside a trainer it scales it by the pair's engine rate over the engine's alone rate. The fit replays
each run's own response lengths in the simulator. It searches for the rate at which the mean signed
error of the runs' steps per GPU-hour is zero, every other term kept from the base profile. The runs must
agree in policy, packing, engine and trainer thread caps and MPS settings; the profile records
them (``sharing.engines_controls``), and the simulator and `nodus validate` flag a run that differs. The rate therefore
also absorbs whatever the base misprices on the runs' day (its engine's day scale, its train terms):
fit on the base you will simulate with. Leaving each run out in turn, and predicting it from the
others, gives the error the fitted rate carries among its own days. Where the runs lie in the folders
of two days or more (``.../DAY/arms/RUN``), leaving each day out and predicting its runs from the
other days' rate gives the error on a new day, which is a planner's case (a day's runs share its
host's speed, so leaving one run out keeps its day-mates in and understates it).

    nodus fit-stacks RUN... --base PROFILE --out PROFILE.json [--report PREFIX]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from calibration.validate import _simulate, engine_sequences, load_recorded, recorded_configs, spans_digest
from calibration.run_health import unique_names
from calibration.run_settings import run_controls, stacks_run_settings
from nodus.config import ConfigError, build_config, stacks_of
from sim.profile import (RATE_MAX, add_source, audit_priced, drop_base_validation, profile_adapter_format,
                         profile_dict, profile_lora_kernels, profile_step_mode, refuse_existing, set_assumption,
                         write_fit_report, write_profile)

# The rates fit-stacks fits (--rate), each a field of the profile's sharing terms, and what each is.
RATES = {"engines": "mps_engines", "trainer": "mps_stacks_trainer"}
WHAT = {"mps_engines": "two engines' rate", "mps_stacks_trainer": "a lone trainer's rate beside engines"}
RATE_MIN = 0.05  # the search's lower end: an engine at a twentieth of its alone speed
TOLERANCE = 1e-4  # the search stops when the rate's bracket is this narrow
# A rate the runs do not identify: from RATE_MIN to RATE_MAX no run's prediction moves this much (of
# its measured steps/GPU-h): lockstep stacks, say, never run a lone trainer beside engines. (Session
# 35's free-running two-stack runs of 2 and 4 jobs do: 3506-4312 steps/GPU-h over that range.)
IDENTIFIED_MIN = 0.005
# Which runs carry each rate, for the error that finds none of it in the runs given.
RUNS_THAT_SHOW = {"mps_engines": ": both stacks generating at once",
                  "mps_stacks_trainer": ": one stack training while the other generates, as offset stacks "
                                        "(--offset-stacks) run"}


# How a run's stacks lined up (stacks_run_settings): settings a rate fitted to steps/GPU-h averages
# over, which a fit to phase times (stacks_phases) does not: there the runs may differ in them.
ALIGNMENT = ("lockstep", "offset_stacks", "hold_apart")


def runs_for_base(runs: list[str | Path], prof: dict, any_alignment: bool = False) -> list[dict]:
    """``stack_runs`` checked against what the base profile dict ``prof`` describes: its trainer's
    step mode, its engine's LoRA kernels, its adapter handoff, and whether it prices a lighter audit."""
    return stack_runs(runs, profile_step_mode(prof), profile_lora_kernels(prof), any_alignment=any_alignment,
                      adapter_format=profile_adapter_format(prof), audit_ok=audit_priced(prof))


def stack_runs(runs: list[str | Path], step_mode: str, lora_kernels: str, any_alignment: bool = False,
               adapter_format: str = "safetensors", audit_ok: bool = False) -> list[dict]:
    """Each run's replay configuration (on no profile yet), measured steps per GPU-hour and
    settings (``stacks_run_settings``). Refuses a run that is not a two-stack run under MPS; one whose
    trainers did not all run ``step_mode`` or whose engine ran other LoRA kernels than
    ``lora_kernels`` (the base profile's terms), or that handed adapters over otherwise than
    ``adapter_format`` (the base's handoff); one with settings no profile describes (audit, unless
    ``audit_ok``: the base prices it, ``sim.profile.audit_priced``, and each run is replayed with its
    own; engine core process, pageable publishes, extra engine arguments or environment beside the
    shipped kernel configs); the same run twice; and runs of mixed settings (``any_alignment``: but
    for how their stacks lined up, ``ALIGNMENT``)."""
    out, seen = [], {}
    for rd in map(Path, runs):
        cfg, meas, spans = load_recorded(rd)
        arm = cfg["arm"]
        if stacks_of(arm) != 2 or arm.get("policy") == "timeslice":
            raise ConfigError(f"nodus fit-stacks: {rd} ran {stacks_of(arm)} stack(s) ({arm.get('policy')}): the rate "
                              "is of two stacks' engines generating together; fit runs with arm.stacks=2")
        if arm.get("sharing") != "mps":
            raise ConfigError(f"nodus fit-stacks: {rd} shared the GPU with sharing={arm.get('sharing')!r}; the rate "
                              "is the engines' under MPS: fit runs with sharing=mps")
        digest = spans_digest(rd)
        if digest in seen:
            raise ConfigError(f"nodus fit-stacks: {rd} is {seen[digest]} again (the same spans.jsonl): give each run "
                              "once")
        seen[digest] = str(rd)
        controls = run_controls(meas)
        mode = controls.get("trainer_step_mode", "eager")
        if mode != step_mode:
            raise ConfigError(f"nodus fit-stacks: {rd}'s trainers ran {mode}, and the base profile's train terms "
                              f"describe the {step_mode} step (train.step_mode): fit runs whose every trainer ran it")
        kernels = controls.get("lora_kernels", "default")
        if kernels != lora_kernels:
            raise ConfigError(f"nodus fit-stacks: {rd}'s engines ran the {kernels} LoRA kernel configs, and the base "
                              f"profile's engine terms are the {lora_kernels} ones': fit on a base of that engine")
        odd = [k for k in ("audit", "engine_core_process", "engine_args", "engine_env")
               if controls.get(k) and not (k == "audit" and audit_ok)]
        odd += ["publish_pinned"] if controls.get("publish_pinned") is False else []
        handoff = controls.get("adapter_format", "safetensors")
        if handoff != adapter_format:
            raise ConfigError(f"nodus fit-stacks: {rd} handed adapters to the engines as {handoff} files, and the "
                              f"base profile's train and publish terms describe the {adapter_format} handoff "
                              "(environment.adapter_format): fit on a base of that handoff (nodus fit on its "
                              "dedicated runs)")
        if odd:
            raise ConfigError(f"nodus fit-stacks: {rd} ran settings no profile describes ({', '.join(odd)}; "
                              "nodus validate names them): fit runs without them")
        replay, _ = recorded_configs(rd, cfg, spans, "unset")
        packing = build_config(replay, f"{rd}/config.json").trainer_packing()
        out.append({"run": str(rd), "spans_sha256": digest, "cfg": replay, "measured": meas["steps_per_gpu_hour"],
                    "engine_sequences": engine_sequences(spans),
                    "settings": stacks_run_settings(arm.get("policy"), stacks_of(arm), packing, controls,
                                                    bool(arm.get("lockstep")), bool(arm.get("offset_stacks")),
                                                    arm.get("hold_apart") or 0.0)})
    keys = sorted({k for r in out for k in r["settings"]} - (set(ALIGNMENT) if any_alignment else set()))
    mixed = [k for k in keys if len({r["settings"].get(k) for r in out}) > 1]
    if mixed:
        raise ConfigError("nodus fit-stacks: the runs differ in " + ", ".join(mixed) + " ("
                          + "; ".join(f"{r['run']}: " + ", ".join(f"{k}={r['settings'].get(k)}" for k in mixed)
                                      for r in out) + "); fit runs of one setting")
    return out


def record_engine_sequences(prof: dict, seqs: int) -> None:
    """``sharing.stacks_engine_sequences``: ``seqs``, the most sequences an engine of a fit's runs
    generated at once (``stack_runs``' rows), or the smaller of it and the profile's where a fit of
    another stacks rate recorded one (past it, at least one rate is priced where it was not
    fitted); the simulator flags an engine of stacks generating more."""
    if seqs:
        prev = prof["sharing"].get("stacks_engine_sequences")
        prof["sharing"]["stacks_engine_sequences"] = seqs if prev is None else min(prev, seqs)


def replay(rows: list[dict], prof: dict, rates: dict[str, float | None], tmp: Path) -> list[dict]:
    """Each run replayed (``_simulate``'s summary) on ``prof`` with ``sharing`` updated by ``rates``."""
    p = json.loads(json.dumps(prof))
    p["sharing"].update(rates)
    if ({"mps_engines", "mps_stacks_engine", "mps_stacks_trainer"} & set(rates)) and p["sharing"].get("engines_by_batch"):
        # Beside the bench's shape a fitted rate holds at the engine size of the runs it is fitted on
        # (sim.gpu.engines_rate, stacks_engine_rate): anchor it there, as the written profile will.
        p["sharing"]["stacks_engine_sequences"] = max(r["engine_sequences"] for r in rows)
    path = tmp / ("profile-" + "-".join(f"{k}-{v}" for k, v in sorted(rates.items())) + ".json")
    write_profile(p, path, "nodus fit-stacks", overwrite=True)
    return [_simulate(dict(r["cfg"], profile=str(path)), f"{r['run']}/config.json") for r in rows]


def _predict(rows: list[dict], prof: dict, rate: float | None, tmp: Path, field: str = "mps_engines") -> list[float]:
    """Each run's replayed steps per GPU-hour on ``prof`` with ``sharing.<field> = rate``."""
    return [s["steps_per_gpu_hour"] for s in replay(rows, prof, {field: rate}, tmp)]


def _bias(pred: list[float], rows: list[dict]) -> float:
    return sum((p - r["measured"]) / r["measured"] for p, r in zip(pred, rows)) / len(rows)


def fit_rate(rows: list[dict], prof: dict, tmp: Path, which: str = "",
             field: str = "mps_engines") -> tuple[float, list[float]]:
    """The ``sharing.<field>`` at which the runs' replayed steps per GPU-hour have zero mean
    signed error, and the runs' predictions there. The prediction rises with the rate, so a bracketed
    root (``crossing``).
    ``which``: what the runs are, for an error (e.g. the runs but one left out)."""
    lo, hi = RATE_MIN, RATE_MAX
    what = WHAT[field]
    pred_hi = _predict(rows, prof, hi, tmp, field)
    pred_lo = _predict(rows, prof, lo, tmp, field)
    moved = max(abs(h - l) / r["measured"] for h, l, r in zip(pred_hi, pred_lo, rows))
    if moved < IDENTIFIED_MIN:
        raise ConfigError(f"nodus fit-stacks: the runs{which} are predicted the same whatever sharing.{field} is "
                          f"(at most {moved:.2%} apart from {lo} to {hi}): they never ran what it prices "
                          f"({what}{RUNS_THAT_SHOW[field]}), so any value would fit them; fit it on runs that do")
    if _bias(pred_hi, rows) < 0:
        raise ConfigError(f"nodus fit-stacks: even at sharing.{field}={hi} (the most a rate may be) the "
                          f"runs{which} are "
                          f"predicted {-_bias(pred_hi, rows):.1%} under the measured on average: the base profile "
                          f"misprices them by more than {what} can carry (fit on the runs' day's profile)")
    if _bias(pred_lo, rows) > 0:
        raise ConfigError(f"nodus fit-stacks: even at sharing.{field}={lo} the runs{which} are predicted "
                          f"{_bias(pred_lo, rows):.1%} over the measured on average: the base profile prices them "
                          f"faster than {what} at any value explains (fit on the runs' day's profile)")
    rate = crossing(lambda x: _bias(_predict(rows, prof, x, tmp, field), rows),
                    lo, hi, _bias(pred_lo, rows), _bias(pred_hi, rows), TOLERANCE)
    return rate, _predict(rows, prof, rate, tmp, field)


def crossing(f, lo: float, hi: float, f_lo: float, f_hi: float, tol: float) -> float:
    """Where ``f`` crosses zero in [lo, hi] (``f_lo``, ``f_hi``: its values at the ends, of opposite
    signs or zero), to within ``tol``: Brent's method (inverse quadratic and secant steps inside the
    bracket, a bisection whenever they would not shrink it fast enough, and a step of at least half
    ``tol`` so the bracket closes), as in scipy's brentq; then a bisection wherever two steps did not
    halve the bracket, and only bisections after eight steps (Brent alone takes about 40 where ``f``
    is flat at its root; this 20-21 there against bisection's 15). Each value of ``f`` here replays
    every run, a whole simulation each: bisection took 15 a rate from 0.05 to 2 to a tolerance of 1e-4,
    this 5-8 where ``f`` has a slope at its root (tests/test_stacks_fit.py)."""
    if f_lo == 0 or f_hi == 0:
        return lo if f_lo == 0 else hi
    x_pre, f_pre, x_cur, f_cur = lo, f_lo, hi, f_hi
    x_blk = f_blk = s_pre = s_cur = 0.0
    width, slow, steps = hi - lo, 0, 0  # the bracket at its last halving; steps since; all steps
    while True:
        if (f_pre < 0) != (f_cur < 0):  # the bracket's other end
            x_blk, f_blk = x_pre, f_pre
            s_pre = s_cur = x_cur - x_pre
        if abs(f_blk) < abs(f_cur):  # x_cur: the end nearer the root by f
            x_pre, x_cur, x_blk = x_cur, x_blk, x_cur
            f_pre, f_cur, f_blk = f_cur, f_blk, f_cur
        delta = tol / 2
        s_bis = (x_blk - x_cur) / 2
        if f_cur == 0 or abs(s_bis) < delta:
            return x_cur
        if 2 * abs(s_bis) <= width / 2:
            width, slow = 2 * abs(s_bis), 0
        slow, steps = slow + 1, steps + 1
        if slow <= 2 and steps <= 8 and abs(s_pre) > delta and abs(f_cur) < abs(f_pre):
            if x_pre == x_blk:  # secant
                s_try = -f_cur * (x_cur - x_pre) / (f_cur - f_pre)
            else:  # inverse quadratic
                d_pre = (f_pre - f_cur) / (x_pre - x_cur)
                d_blk = (f_blk - f_cur) / (x_blk - x_cur)
                s_try = -f_cur * (f_blk * d_blk - f_pre * d_pre) / (d_blk * d_pre * (f_blk - f_pre))
            if 2 * abs(s_try) < min(abs(s_pre), 3 * abs(s_bis) - delta):
                s_pre, s_cur = s_cur, s_try
            else:
                s_pre = s_cur = s_bis
        else:
            s_pre = s_cur = s_bis
        x_pre, f_pre = x_cur, f_cur
        x_cur += s_cur if abs(s_cur) > delta else (delta if s_bis > 0 else -delta)
        f_cur = f(x_cur)


def day_of(run: str | Path) -> str:
    """The day a run belongs to: the folder above its parent (``.../session31/arms/RUN``: 'session31')."""
    return Path(run).resolve().parent.parent.name


def leave_days_out(rows: list[dict], prof: dict, tmp: Path, field: str = "mps_engines") -> dict | None:
    """Each day's runs predicted from the rate fitted on the other days' (``day_of``): per day its
    runs, that rate and the mean signed error; per run the prediction; over all runs the mean
    absolute error, worst and mean signed error. None where the runs lie in one day's folder."""
    days = sorted({day_of(r["run"]) for r in rows})
    if len(days) < 2:
        return None
    out_rows, per_day = [], {}
    for day in days:
        held = [r for r in rows if day_of(r["run"]) == day]
        rate, _ = fit_rate([r for r in rows if day_of(r["run"]) != day], prof, tmp, f" but {day}'s", field)
        pred = _predict(held, prof, rate, tmp, field)
        errs = [(p - r["measured"]) / r["measured"] for p, r in zip(pred, held)]
        per_day[day] = {"rate": rate, "runs": len(held), "mean_error": sum(errs) / len(errs)}
        out_rows += [{"run": r["run"], "day": day, "measured": r["measured"], "predicted": p, "error": e}
                     for r, p, e in zip(held, pred, errs)]
    abs_errs = [abs(x["error"]) for x in out_rows]
    return {"rows": out_rows, "days": per_day, "mape": sum(abs_errs) / len(abs_errs), "worst": max(abs_errs),
            "bias": sum(x["error"] for x in out_rows) / len(out_rows)}


def fit(runs: list[str | Path], base: str, rate_name: str = "engines", left_out: bool = True) -> dict:
    """Fit the rate (``rate_name``: 'engines', ``sharing.mps_engines``; 'trainer',
    ``sharing.mps_stacks_trainer`` on a base with a two-engine rate) on every run, and on all but
    each run in turn (that run's error predicted from the others); with the base's own prediction
    (without the rate) beside. ``left_out`` False: the fit on every run alone, without the
    leave-one-run-out and leave-one-day-out fits (each a bisection over all but a run or a day: on
    thirty runs about 20,000 replays, hours on two cores); validate on held-out runs instead."""
    if rate_name not in RATES:
        raise ConfigError(f"nodus fit-stacks: --rate {rate_name!r}: choose from {', '.join(RATES)}")
    field = RATES[rate_name]
    prof = profile_dict(base)
    if field == "mps_stacks_trainer" and prof["sharing"].get("mps_engines") is None:
        raise ConfigError(f"nodus fit-stacks --rate trainer: {base} has no two-engine rate (sharing.mps_engines); "
                          "the lone trainer's rate is fitted with it held: fit-stacks --rate engines first")
    rows = runs_for_base(runs, prof)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rate, pred = fit_rate(rows, prof, tmp, field=field)
        unfitted = _predict(rows, prof, None, tmp, field)
        loo = []
        for i, r in enumerate(rows):
            others = rows[:i] + rows[i + 1:]
            if not others or not left_out:
                loo.append(None)
                continue
            rate_i, _ = fit_rate(others, prof, tmp, f" but {r['run']} (left out)", field)
            p = _predict([r], prof, rate_i, tmp, field)[0]
            loo.append({"rate": rate_i, "predicted": p, "error": (p - r["measured"]) / r["measured"]})
        by_day = leave_days_out(rows, prof, tmp, field) if left_out else None
    out_rows = [{"run": r["run"], "spans_sha256": r["spans_sha256"], "measured": r["measured"], "predicted": p,
                 "error": (p - r["measured"]) / r["measured"],
                 "predicted_without_rate": u, "error_without_rate": (u - r["measured"]) / r["measured"],
                 "left_out": lo_} for r, p, u, lo_ in zip(rows, pred, unfitted, loo)]
    errs = [abs(x["left_out"]["error"]) for x in out_rows if x["left_out"]]
    return {"base": base, "field": field, field: rate, "settings": rows[0]["settings"],
            "engine_sequences": max(r["engine_sequences"] for r in rows),
            "mps_alone_engine": prof["sharing"]["mps_alone"]["engine"],
            "mps_corun_trainer": prof["sharing"]["mps_corun"]["trainer"], "rows": out_rows,
            "left_out_mape": sum(errs) / len(errs) if errs else None, "left_out_worst": max(errs) if errs else None,
            "without_rate_mape": sum(abs(x["error_without_rate"]) for x in out_rows) / len(out_rows),
            "left_out_days": by_day}


def report_markdown(result: dict) -> str:
    r = result
    field = r.get("field", "mps_engines")
    settings = ", ".join(f"{k}={v}" for k, v in sorted(r["settings"].items()))
    if field == "mps_engines":
        lines = [f"# Two stacks' engines: `sharing.mps_engines` on `{r['base']}`", "",
                 f"Each engine's rate while both stacks' engines generate, alone-without-MPS work per second: "
                 f"**{r['mps_engines']:.3f}** (one engine alone under MPS: {r['mps_alone_engine']:.3f}). Fitted on "
                 f"{len(r['rows'])} two-stack run(s), replaying their response lengths; their settings: {settings}.", ""]
        without = "two engines sharing the engine-trainer pair's combined rate"
    else:
        lines = [f"# A lone trainer beside engines of several stacks: `sharing.mps_stacks_trainer` on `{r['base']}`", "",
                 f"A trainer's rate while it is the only trainer running and engines generate, alone-without-MPS work "
                 f"per second: **{r[field]:.3f}** (the pair's, fitted on one stack, mps_corun.trainer: "
                 f"{r['mps_corun_trainer']:.3f}), the base's two-engine rate held. Fitted on {len(r['rows'])} "
                 f"two-stack run(s), replaying their response lengths; their settings: {settings}.", ""]
        without = "the pair's trainer rate"
    if r["left_out_mape"] is not None:
        lines += [f"Each run predicted from a rate fitted on the others: {r['left_out_mape']:.1%} mean absolute error, "
                  f"worst {r['left_out_worst']:.1%}. Without the rate ({without}): {r['without_rate_mape']:.1%}.", ""]
    d = r.get("left_out_days")
    if d:
        lines += [f"Each day's runs predicted from the rate fitted on the other days' (a new day, as a planner meets "
                  f"it): **{d['mape']:.1%} mean absolute error, worst {d['worst']:.1%}, mean signed {d['bias']:+.1%}** "
                  f"over {len(d['days'])} days:", "",
                  "| day | runs | rate fitted without it | mean signed error |", "|---|---|---|---|"]
        lines += [f"| {day} | {x['runs']} | {x['rate']:.3f} | {x['mean_error']:+.1%} |" for day, x in d["days"].items()]
        lines += [""]
    lines += ["| run | measured | predicted (fitted rate) | error | left out: rate / predicted / error "
              "| without the rate (error) |",
              "|---|---|---|---|---|---|"]
    for x, name in zip(r["rows"], unique_names([x["run"] for x in r["rows"]])):
        lo = x["left_out"]
        left = f"{lo['rate']:.3f} / {lo['predicted']:.0f} / {lo['error']:+.1%}" if lo else "-"
        lines.append(f"| {name} | {x['measured']:.0f} | {x['predicted']:.0f} | {x['error']:+.1%} | "
                     f"{left} | {x['predicted_without_rate']:.0f} ({x['error_without_rate']:+.1%}) |")
    lines += ["", "The rate absorbs whatever else the base misprices on these runs' day: a profile fitted on "
              "another day's runs carries that day's error with it (README, `nodus fit-stacks`)."]
    return "\n".join(lines) + "\n"


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, report: str | Path | None = None,
                rate_name: str = "engines", left_out: bool = True) -> dict:
    """Fit, write ``base`` with the rate (``sharing.mps_engines``, or ``sharing.mps_stacks_trainer``
    for ``rate_name`` 'trainer') to ``out`` (never overwritten), and the report to
    ``report``.{md,json} when given."""
    refuse_existing(out, "nodus fit-stacks", report)  # before the fit's replays
    result = fit(runs, base, rate_name, left_out)
    field = result["field"]
    prof = profile_dict(base)
    prof["sharing"][field] = result[field]
    if prof["sharing"].get("engines_by_batch"):
        # The rate's anchor on the bench's shape: this fit's engine size, as its replays had it
        # (replay anchors every stacks rate it fits, the lone trainer's as the two engines').
        prof["sharing"]["stacks_engine_sequences"] = None
    record_engine_sequences(prof, result["engine_sequences"])
    drop_base_validation(prof)
    kept = ("settings", "rows", "left_out_mape", "left_out_worst", "without_rate_mape", "left_out_days")
    if field == "mps_engines":
        prof["sharing"]["engines_controls"] = dict(result["settings"])
        prof.setdefault("measurements", {})["stacks"] = {k: v for k, v in result.items() if k in ("mps_engines", *kept)}
        set_assumption(prof, {
            "id": "sharing-two-engines",
            "what": "two stacks' engines generating together each go at sharing.mps_engines, fitted on "
                    f"{len(result['rows'])} two-stack run(s) by replay (nodus fit-stacks); beside a trainer, scaled by "
                    "the pair's engine rate over its alone rate; past two stacks, each engine at that rate too "
                    "(an assumption; session 37)",
            "value": result["mps_engines"]})
        add_source(prof, "nodus fit-stacks " + " ".join(str(p) for p in runs))
    else:
        prof["sharing"]["stacks_trainer_controls"] = dict(result["settings"])
        prof.setdefault("measurements", {})["stacks_trainer"] = {k: v for k, v in result.items()
                                                                 if k in (field, *kept)}
        set_assumption(prof, {
            "id": "sharing-stacks-trainer",
            "what": "in an arm of several stacks under MPS, a trainer running alone beside engines goes at "
                    f"sharing.mps_stacks_trainer, fitted on {len(result['rows'])} two-stack run(s) by replay with the "
                    "two-engine rate held (nodus fit-stacks --rate trainer); two trainers or more keep the "
                    "many-clients rule",
            "value": result[field]})
        add_source(prof, "nodus fit-stacks --rate trainer " + " ".join(str(p) for p in runs))
    write_profile(prof, out, "nodus fit-stacks")
    write_fit_report(report, report_markdown(result), result)
    return result
