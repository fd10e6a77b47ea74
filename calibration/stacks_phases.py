"""Two stacks' MPS rates fitted together on the runs' phase times: the two engines' rate
(``sharing.mps_engines``), a lone trainer's beside engines (``sharing.mps_stacks_trainer``), the
engines' beside that trainer (``sharing.mps_stacks_engine``) and, where the runs' trains ran
together, each of two trainers' (``sharing.mps_trainers``).

``nodus fit-stacks --rate engines`` and ``--rate trainer`` fit one rate each, to zero mean signed
error in steps per GPU-hour. One number cannot tell a fast trainer beside a slowed engine from a
slow trainer beside a fast one: on the H200, the rates fitted that way on session 35's two-stack
runs of 2 and 4 jobs priced held-out trains 15-98% long and generations 7-18% short, right in
steps/GPU-h by errors that cancel, and wrong wherever the mix of phases moves (offset stacks 4-16%
low). Here the three rates are fitted together to the runs' mean generation and train-step times
(replayed lengths; relative least squares), the other terms of the base kept: Nelder-Mead on the
rates' logarithms, each between ``RATE_MIN`` and its kind's rate alone under MPS
(``sharing.mps_alone``: a client beside others goes no faster than alone in its share; ``upper``).
A rate no run's phases move (runs that never ran what it prices) is refused, not fitted.

``tie_engines`` (``--tie-engines``) fits two rates: an engine goes at one rate beside another
stack's engine or beside its lone trainer. Free-running fit runs mix the two cases in about the same
proportion (on the H100, 72-87% of each generation beside the other stack's), so the runs' means are
met along a ridge of the two engine rates and the split is not pinned: the H100's five fit runs gave
0.452 for two engines and the bound beside the trainer, which priced a held-out 8-job run whose
stacks generated in lockstep 14.5% slow and another 8.1% fast; tied, 0.559, and -0.9% / +4.7%
(session 56, ``experiments/results/h100/session56/README.md``). A three-rate fit that puts the
engine's rate beside the trainer at its bound is the sign to tie them. On the H200 the three rates
are interior and keep the better held-out figures (5.0% against 5.6% tied, on the 81 runs).

Two trainers together were priced by the many-clients rule (the engine-and-trainer pair's combined
rate split over them) until session 57: on the H100 that put lockstep runs' train steps, which run
together throughout, 20% short (0.889 s measured, 0.710 s simulated), free runs' 9% where they ran
together in part, and on the H200's 81 held-out runs 7% short; the error hid in steps/GPU-h behind
generations priced long. The fit moves ``sharing.mps_trainers`` as well where it moves a run's
phase times by ``IDENTIFIED_MIN`` (``--fit-trainers`` asks for it, ``--no-fit-trainers`` keeps the
base's).

    nodus fit-stacks RUN... --rate phases --base PROFILE --out PROFILE.json [--report PREFIX]
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from calibration.run_health import unique_names
from calibration.stacks import ALIGNMENT, IDENTIFIED_MIN, RATE_MIN, record_engine_sequences, replay, runs_for_base
from calibration.validate import _phase_means, beside_engines_share, load_recorded
from nodus.config import ConfigError
from sim.profile import (RATE_MAX, add_source, drop_base_validation, profile_dict, refuse_existing, set_assumption,
                         write_fit_report, write_profile)

FIELDS = ("mps_engines", "mps_stacks_trainer", "mps_stacks_engine", "mps_trainers")
PHASES = ("generate", "train")  # the phase times fitted (publish has terms of its own)
WHAT = {"mps_engines": "each engine while two stacks' engines generate",
        "mps_stacks_trainer": "a lone trainer beside engines of stacks",
        "mps_stacks_engine": "an engine beside that lone trainer",
        "mps_trainers": "each trainer while two stacks' trainers train together"}
FIRST_STEP = math.log(1.25)  # the search's first simplex: the start and each rate 25% above it
LAST_STEP = math.log(1.002)  # it stops once the simplex is this narrow on every rate (0.2%)
MAX_REPLAYS = 300  # ... or after this many distinct sets of rates (each a replay of every run)
MAX_RESTARTS = 2  # ... then restarted from its best point at most this often (each a fresh simplex)
PROGRESS_EVERY = 25  # sets of rates between progress lines (three runs: about 20 s on two cores)


def phase_rows(runs: list[str | Path], prof: dict) -> list[dict]:
    """``stack_runs``' rows (settings checked alike, but the runs may differ in how their stacks lined
    up: free, offset, held or lockstep), each with its measured mean phase times."""
    rows = runs_for_base(runs, prof, any_alignment=True)
    for r in rows:
        _, _, spans = load_recorded(Path(r["run"]))
        means = _phase_means(spans)
        missing = [ph for ph in PHASES if not means.get(ph)]
        if missing:
            raise ConfigError(f"nodus fit-stacks --rate phases: {r['run']} recorded no {' or '.join(missing)} phase "
                              "(spans.jsonl): the rates are fitted to the runs' phase times")
        r["phase_s"] = {ph: means[ph] for ph in PHASES}
        r["beside_engines"] = beside_engines_share(spans)
        r["beside_trainers"] = beside_engines_share(spans, "train")
    return rows


KIND = {"mps_engines": "engine", "mps_stacks_trainer": "trainer", "mps_stacks_engine": "engine",
        "mps_trainers": "trainer"}
# The two-trainer rate is fitted where the runs' trains ran together enough to move a run's phase
# times by IDENTIFIED_MIN over its range: lockstep runs train at once throughout, free ones in part.
TRAINERS_FIELD = "mps_trainers"


def upper(prof: dict) -> dict[str, float]:
    """Each rate's bound: its kind's rate alone under MPS (``sharing.mps_alone``, at most ``RATE_MAX``).
    Beside other clients a kernel runs no faster than alone, so a fit past it would be the rate
    making up for another term's error (session 55: on H100 runs of 2 and 4 jobs, unbounded, an
    engine beside a lone trainer came out at 1.57, 1.49x its rate alone, with the two engines' rate
    at 0.38)."""
    alone = prof["sharing"]["mps_alone"]
    return {f: min(RATE_MAX, alone[KIND[f]]) for f in FIELDS}


def _start(prof: dict) -> dict[str, float]:
    """Where the search starts: the base's rates where it has them, else the pair's (one stack's),
    within ``upper``."""
    sh, top = prof["sharing"], upper(prof)
    pair = sh["mps_corun"]
    start = {"mps_engines": sh.get("mps_engines") or pair["engine"],
             "mps_stacks_trainer": sh.get("mps_stacks_trainer") or pair["trainer"],
             "mps_stacks_engine": sh.get("mps_stacks_engine") or pair["engine"],
             # the many-clients rule's rate for two trainers alone: the pair's combined rate halved
             "mps_trainers": sh.get("mps_trainers") or (pair["engine"] + pair["trainer"]) / 2}
    return {f: min(v, top[f]) for f, v in start.items()}


def predict(rows: list[dict], prof: dict, rates: dict[str, float | None], tmp: Path) -> list[dict]:
    """Each run replayed on ``prof`` with ``rates`` set: steps per GPU-hour and mean phase times."""
    return [{"steps_per_gpu_hour": s["steps_per_gpu_hour"], "phase_s": s["phase_s"]}
            for s in replay(rows, prof, rates, tmp)]


def phase_errors(pred: list[dict], rows: list[dict]) -> list[dict[str, float]]:
    """Each run's relative error of each fitted phase's mean time (simulated over measured, less 1)."""
    return [{ph: p["phase_s"].get(ph, 0.0) / r["phase_s"][ph] - 1 for ph in PHASES} for p, r in zip(pred, rows)]


def loss(pred: list[dict], rows: list[dict]) -> float:
    """Mean over runs and phases of the squared relative error of the phase's mean time."""
    errs = [e for d in phase_errors(pred, rows) for e in d.values()]
    return sum(e * e for e in errs) / len(errs)


def check_identified(rows: list[dict], prof: dict, rates: dict[str, float], tmp: Path,
                     fields: tuple[str, ...] = FIELDS, known: dict[str, float] | None = None) -> None:
    """Refuse a rate of ``fields`` that moves no run's phase times by ``IDENTIFIED_MIN`` over its
    whole range (``rate_moves``; ``known``: moves already measured, by rate)."""
    top = upper(prof)
    for f in fields:
        moved = (known or {}).get(f)
        if moved is None:
            moved = rate_moves(rows, prof, rates, tmp, f)
        if moved < IDENTIFIED_MIN:
            raise ConfigError(f"nodus fit-stacks --rate phases: the runs' phase times are the same whatever "
                              f"sharing.{f} is (at most {moved:.2%} apart from {RATE_MIN} to {top[f]:.3f}): they never "
                              f"ran what it prices ({WHAT[f]}); fit runs that do ("
                              + ("lockstep stacks, `lock`, train together throughout; free-running ones in part"
                                 if f == TRAINERS_FIELD else
                                 "free-running stacks drift into each case; offset stacks, --offset-stacks, put a "
                                 "lone trainer beside an engine") + ")")


def searched(tie_engines: bool, trainers: bool = False) -> tuple[str, ...]:
    """The rates the search moves: the three, or tied, the two-engine rate (the engine's beside a
    lone trainer follows it) and the lone trainer's; with ``trainers``, the two-trainer rate too."""
    three = ("mps_engines", "mps_stacks_trainer") if tie_engines else FIELDS[:3]
    return three + ((TRAINERS_FIELD,) if trainers else ())


def rate_moves(rows: list[dict], prof: dict, rates: dict[str, float], tmp: Path, field: str) -> float:
    """How much ``sharing.<field>`` moves the runs' phase times over its range, [``RATE_MIN``,
    ``upper``], the other rates at ``rates``: the largest relative move of a run's mean phase time."""
    lo = predict(rows, prof, dict(rates, **{field: RATE_MIN}), tmp)
    hi = predict(rows, prof, dict(rates, **{field: upper(prof)[field]}), tmp)
    return max(abs(a["phase_s"].get(ph, 0.0) - b["phase_s"].get(ph, 0.0)) / r["phase_s"][ph]
               for a, b, r in zip(lo, hi, rows) for ph in PHASES)


def trainers_identified(rows: list[dict], prof: dict, rates: dict[str, float], tmp: Path) -> float:
    """``rate_moves`` of the two-trainer rate: at least ``IDENTIFIED_MIN`` where the runs' trains ran
    together."""
    return rate_moves(rows, prof, rates, tmp, TRAINERS_FIELD)


def search(rows: list[dict], prof: dict, tmp: Path, progress: bool = False,
           tie_engines: bool = False, trainers: bool = False,
           start: dict[str, float] | None = None) -> tuple[dict[str, float], list[dict], int]:
    """The rates of least ``loss``: Nelder-Mead on their logarithms (each clamped to
    [``RATE_MIN``, ``upper``]) from ``_start``, its first simplex ``FIRST_STEP`` apart on each rate,
    until the simplex is ``LAST_STEP`` across or ``MAX_REPLAYS`` rounds have run. The loss is
    piecewise in the rates (a simulation's events reorder), which stalls a search along one rate at a
    time on a ridge; the simplex moves along it. Its vertices stay within the bounds, and it restarts
    from its best point until a restart finds nothing better (``MAX_RESTARTS`` at most); ``start``:
    rates to start from over ``_start``'s. Returns the rates, the runs' predictions there and the
    replays it took (of all the runs). ``progress``: a line on stderr every ``PROGRESS_EVERY``."""
    lo, top = math.log(RATE_MIN), upper(prof)
    hi = {f: math.log(top[f]) for f in FIELDS}
    free = searched(tie_engines, trainers)
    cache: dict[tuple, float] = {}

    def rates_of(x: np.ndarray) -> dict[str, float]:
        rates = {f: float(math.exp(min(hi[f], max(lo, v)))) for f, v in zip(free, x)}
        if tie_engines:  # an engine goes at one rate beside another engine or a lone trainer
            rates["mps_stacks_engine"] = rates["mps_engines"]  # both bounded by the engine's alone rate
        return rates

    def f(x: np.ndarray) -> float:
        key = tuple(round(v, 9) for v in rates_of(x).values())
        if key not in cache:
            cache[key] = loss(predict(rows, prof, rates_of(x), tmp), rows)
            if progress and len(cache) % PROGRESS_EVERY == 0:
                print(f"nodus fit-stacks --rate phases: {len(cache)} sets of rates replayed on {len(rows)} run(s), "
                      f"least loss {min(cache.values()):.5f}", file=sys.stderr, flush=True)
        return cache[key]

    bounds_lo = np.full(len(free), lo)
    bounds_hi = np.array([hi[k] for k in free])

    def inside(x: np.ndarray) -> np.ndarray:
        # Each vertex kept within the bounds (not only its rates): a simplex strayed past a bound
        # sees a flat loss there and collapses onto it (session 57: a fit on simulated runs stopped
        # with the lone trainer's rate at its bound, 16% off the rate the runs were recorded with).
        return np.clip(x, bounds_lo, bounds_hi)

    def nelder_mead(x0: np.ndarray) -> tuple[np.ndarray, float]:
        # The first simplex FIRST_STEP from x0 on each rate, towards the inside where x0 is at a bound.
        steps = [x0 + (FIRST_STEP if x0[i] + FIRST_STEP <= bounds_hi[i] else -FIRST_STEP) * np.eye(len(free))[i]
                 for i in range(len(free))]
        simplex = [x0] + [inside(x) for x in steps]
        vals = [f(x) for x in simplex]
        while len(cache) < MAX_REPLAYS:
            order = np.argsort(vals)
            simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
            if max(np.abs(x - simplex[0]).max() for x in simplex[1:]) < LAST_STEP:
                break
            centre = np.mean(simplex[:-1], axis=0)
            worst = simplex[-1]
            refl = inside(centre + (centre - worst))
            fr = f(refl)
            if fr < vals[0]:
                exp_ = inside(centre + 2 * (centre - worst))
                fe = f(exp_)
                simplex[-1], vals[-1] = (exp_, fe) if fe < fr else (refl, fr)
            elif fr < vals[-2]:
                simplex[-1], vals[-1] = refl, fr
            else:
                con = centre + 0.5 * (worst - centre) if fr >= vals[-1] else centre + 0.5 * (refl - centre)
                fc = f(con)
                if fc < min(fr, vals[-1]):
                    simplex[-1], vals[-1] = con, fc
                else:  # shrink towards the best
                    simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                    vals = [vals[0]] + [f(x) for x in simplex[1:]]
        i = int(np.argmin(vals))
        return simplex[i], vals[i]

    # Restarted from its best point with a fresh simplex until a restart finds nothing better (a
    # simplex shrunk across a ridge stops short of the minimum), MAX_RESTARTS times at most.
    first = dict(_start(prof), **(start or {}))
    best, val = nelder_mead(inside(np.log([first[k] for k in free])))
    for _ in range(MAX_RESTARTS):
        if len(cache) >= MAX_REPLAYS:
            break
        again, v = nelder_mead(best)
        if v >= val * (1 - 1e-6):
            break
        best, val = again, v
    rates = rates_of(best)
    return rates, predict(rows, prof, rates, tmp), len(cache) + 1


def fit(runs: list[str | Path], base: str, progress: bool = False, tie_engines: bool = False,
        trainers: bool | None = None) -> dict:
    """Fit the three rates on ``runs`` (two-stack runs under MPS of one setting) over ``base``, and
    the two-trainer rate with them: where the runs identify it (``trainers`` None), always (True:
    refused where they do not) or never (False: the base's kept)."""
    prof = profile_dict(base)
    rows = phase_rows(runs, prof)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        moved = None if trainers is False else trainers_identified(rows, prof, _start(prof), tmp)
        if trainers is None:
            trainers = moved >= IDENTIFIED_MIN
        check_identified(rows, prof, _start(prof), tmp, searched(tie_engines, trainers),
                         None if moved is None else {TRAINERS_FIELD: moved})
        rates, pred, evals = search(rows, prof, tmp, progress, tie_engines)
        if trainers:
            # The two-trainer rate from where the others fit without it (it starts at the many-clients
            # rule's rate for two trainers): a search of all four from the base's rates stopped at a
            # worse loss than the three alone on session 35's H200 runs (0.0043 against 0.0040).
            rates, pred, more = search(rows, prof, tmp, progress, tie_engines, True, start=rates)
            evals += more
        rates.setdefault(TRAINERS_FIELD, prof["sharing"].get(TRAINERS_FIELD))
        before = predict(rows, prof, {f: prof["sharing"].get(f) for f in FIELDS}, tmp)
    out_rows = []
    for r, p, b, e, eb in zip(rows, pred, before, phase_errors(pred, rows), phase_errors(before, rows)):
        out_rows.append({"run": r["run"], "spans_sha256": r["spans_sha256"], "measured": r["measured"],
                         "predicted": p["steps_per_gpu_hour"],
                         "error": p["steps_per_gpu_hour"] / r["measured"] - 1,
                         "measured_phase_s": r["phase_s"], "beside_engines": r["beside_engines"],
                         "beside_trainers": r["beside_trainers"],
                         "predicted_phase_s": {ph: p["phase_s"].get(ph) for ph in PHASES},
                         "phase_error": e, "base_predicted": b["steps_per_gpu_hour"],
                         "base_error": b["steps_per_gpu_hour"] / r["measured"] - 1, "base_phase_error": eb})
    n = len(out_rows)
    # The settings the rates hold for: the runs' own, but for how their stacks lined up (the runs may
    # mix free, offset, held and lockstep stacks: each case is priced by its rate, not averaged).
    settings = {k: v for k, v in rows[0]["settings"].items() if k not in ALIGNMENT}
    top = upper(prof)
    return {"base": base, "field": "phases", **rates, "tie_engines": tie_engines, "trainers_fitted": trainers,
            "trainers_moved": moved, "settings": settings,
            "engine_sequences": max(r["engine_sequences"] for r in rows),
            "rows": out_rows,
            "replays": evals * n, "loss": loss(pred, rows),
            "base_rates": {f: prof["sharing"].get(f) for f in FIELDS}, "upper": top,
            # At its bound: within the search's resolution of it (LAST_STEP).
            "at_bound": [f for f in searched(tie_engines, trainers) if math.log(top[f] / rates[f]) < LAST_STEP],
            "mape": sum(abs(x["error"]) for x in out_rows) / n,
            "phase_mape": {ph: sum(abs(x["phase_error"][ph]) for x in out_rows) / n for ph in PHASES},
            "base_mape": sum(abs(x["base_error"]) for x in out_rows) / n,
            "base_phase_mape": {ph: sum(abs(x["base_phase_error"][ph]) for x in out_rows) / n for ph in PHASES}}


def report_markdown(r: dict) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in sorted(r["settings"].items()))
    base = r["base_rates"]

    def was(f: str) -> str:
        return f"{base[f]:.3f}" if base.get(f) is not None else "none"

    lines = [f"# Two stacks' rates fitted on their phase times, on `{r['base']}`", "",
             f"Fitted together on {len(r['rows'])} two-stack run(s)' mean generation and train-step times "
             f"(replayed lengths; relative least squares, {r['replays']} replays); their settings: {settings}. "
             + ("The engine's rate beside a lone trainer is tied to the two-engine rate (--tie-engines). "
                if r.get("tie_engines") else "") + "Alone-without-MPS work per second:", "",
             "| rate | fitted | the base's | bound (its kind alone under MPS) |", "|---|---|---|---|"]

    def note(f: str) -> str:
        if r.get("tie_engines") and f in FIELDS[:3] and f not in searched(True):
            return " (tied to the two-engine rate)"
        if f == TRAINERS_FIELD and not r.get("trainers_fitted"):
            return " (not fitted: the base's)"
        return " (at its bound)" if f in r["at_bound"] else ""

    def value(f: str) -> str:
        return "none (the many-clients rule)" if r[f] is None else f"**{r[f]:.3f}**"

    lines += [f"| `sharing.{f}`: {WHAT[f]} | {value(f)}{note(f)} | {was(f)} | {r['upper'][f]:.3f} |"
              for f in FIELDS if f in r]
    moved = r.get("trainers_moved")
    if moved is not None and not r.get("trainers_fitted"):
        lines += ["", f"The two-trainer rate (`sharing.{TRAINERS_FIELD}`) moves these runs' phase times by at most "
                  f"{moved:.2%} over its range (under {IDENTIFIED_MIN:.1%}): their trains hardly ran together, so it "
                  "is left as the base has it. Lockstep runs (`lock`) train together throughout."]
    if r["at_bound"]:
        lines += ["", f"At its bound: {', '.join('`sharing.' + f + '`' for f in r['at_bound'])}. A client beside "
                  "others runs no faster than alone; the runs asked for more, so another term of the base misprices "
                  "them (the train or decode terms on this machine): the bound keeps that error out of the rate."]
        if "mps_stacks_engine" in r["at_bound"]:
            lines += ["", "The engine's rate beside the lone trainer at its bound is the sign that these runs do not "
                      "pin it apart from the two-engine rate (free-running runs mix both cases alike): fit again with "
                      "--tie-engines (one rate for an engine beside either), and compare the two profiles on "
                      "held-out runs (`nodus validate`)."]
    tshares = [x["beside_trainers"] for x in r["rows"] if x.get("beside_trainers") is not None]
    if tshares:
        lines += ["", f"The runs' train steps ran beside the other stack's train step for {min(tshares):.0%} to "
                  f"{max(tshares):.0%} of their time: what the two-trainer rate is fitted on."]
    shares = [x["beside_engines"] for x in r["rows"] if x.get("beside_engines") is not None]
    if shares:
        lines += ["", f"The runs' generations ran beside the other stack's generation for {min(shares):.0%} to "
                  f"{max(shares):.0%} of their time (1 in lockstep): the two engine rates are told apart by how "
                  "that share differs between runs and within them. Where it hardly differs, the split between them "
                  "is loosely pinned: add runs that line up otherwise (lockstep `lock`, offset) or tie the two "
                  "(--tie-engines), and check the generations by what ran beside them in `nodus validate`."]
    pm, bm = r["phase_mape"], r["base_phase_mape"]
    lines += ["", f"On these runs: generation {pm['generate']:.1%} and train step {pm['train']:.1%} mean absolute "
              f"error (the base's rates: {bm['generate']:.1%} and {bm['train']:.1%}); steps per GPU-hour "
              f"{r['mape']:.1%} (the base's: {r['base_mape']:.1%}).", "",
              "| run | measured steps/GPU-h | predicted | error | generation s measured / error | train s measured "
              "/ error | generation / train beside the other stack's | the base's rates: steps/GPU-h / generation / "
              "train error |", "|---|---|---|---|---|---|---|---|"]
    for x, name in zip(r["rows"], unique_names([x["run"] for x in r["rows"]])):
        m, e, b = x["measured_phase_s"], x["phase_error"], x["base_phase_error"]
        lines.append(f"| {name} | {x['measured']:.0f} | {x['predicted']:.0f} | {x['error']:+.1%} | "
                     f"{m['generate']:.3f} / {e['generate']:+.1%} | {m['train']:.3f} / {e['train']:+.1%} | "
                     + ("-" if x.get("beside_engines") is None else f"{x['beside_engines']:.0%}") + " / "
                     + ("-" if x.get("beside_trainers") is None else f"{x['beside_trainers']:.0%}")
                     + f" | {x['base_error']:+.1%} / {b['generate']:+.1%} / {b['train']:+.1%} |")
    lines += ["", "The rates absorb whatever else the base misprices on these runs' day (README, `nodus fit-stacks`); "
              "validate the profile on runs it was not fitted on (`nodus validate`)."]
    return "\n".join(lines) + "\n"


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, report: str | Path | None = None,
                progress: bool = False, tie_engines: bool = False, trainers: bool | None = None) -> dict:
    """Fit, write ``base`` with the rates to ``out`` (never overwritten), and the report to
    ``report``.{md,json} when given."""
    refuse_existing(out, "nodus fit-stacks", report)  # before the fit's replays
    result = fit(runs, base, progress, tie_engines, trainers)
    prof = profile_dict(base)
    for f in FIELDS:
        prof["sharing"][f] = result[f]
    prof["sharing"]["engines_controls"] = dict(result["settings"])
    prof["sharing"]["stacks_trainer_controls"] = dict(result["settings"])
    prof["sharing"]["stacks_engine_sequences"] = None  # every stacks rate is this fit's
    record_engine_sequences(prof, result["engine_sequences"])
    drop_base_validation(prof)
    # Both rates' fit records (which `nodus validate` reads to keep the fit runs out of its held-out
    # figures, and the error bar quotes) are this fit's: no left-out fits here.
    fitted = {k: v for k, v in result.items()
              if k in (*FIELDS, "tie_engines", "trainers_fitted", "settings", "rows", "loss", "mape", "phase_mape")}
    fitted.update(fitted_on="phases", left_out_mape=None, left_out_worst=None, left_out_days=None)
    prof.setdefault("measurements", {}).update(stacks=fitted, stacks_trainer=fitted)
    n = len(result["rows"])
    set_assumption(prof, {
        "id": "sharing-two-engines",
        "what": f"two stacks' engines generating together each go at sharing.mps_engines, fitted on {n} two-stack "
                "run(s)' phase times with the lone trainer's rates (nodus fit-stacks --rate phases); beside a "
                "trainer, scaled by the engine's rate beside it over its alone rate; past two stacks, each engine "
                "at that rate too (an assumption; session 37)",
        "value": result["mps_engines"]})
    set_assumption(prof, {
        "id": "sharing-stacks-trainer",
        "what": "in an arm of several stacks under MPS, a trainer running alone beside engines goes at "
                f"sharing.mps_stacks_trainer and each engine beside it at sharing.mps_stacks_engine, fitted on {n} "
                "two-stack run(s)' phase times with the two-engine rate (nodus fit-stacks --rate phases"
                + (" --tie-engines: the engine's rate tied to the two-engine rate" if tie_engines else "")
                + ")" + ("" if result["mps_trainers"] is not None else "; two trainers or more keep the many-clients rule"),
        "value": result["mps_stacks_trainer"]})
    if result["mps_trainers"] is not None:
        set_assumption(prof, {
            "id": "sharing-stacks-trainers",
            "what": "in an arm of several stacks under MPS, trainers of two stacks or more training at once each go at "
                    + (f"sharing.mps_trainers, fitted on {n} two-stack run(s)' phase times with the other stacks rates "
                       "(nodus fit-stacks --rate phases)" if result.get("trainers_fitted") else
                       "sharing.mps_trainers, the base's")
                    + "; beside an engine too, scaled by the pair's trainer rate over its alone rate (an assumption)",
            "value": result["mps_trainers"]})
    add_source(prof, "nodus fit-stacks --rate phases " + " ".join(str(p) for p in runs))
    write_profile(prof, out, "nodus fit-stacks")
    write_fit_report(report, report_markdown(result), result)
    return result
