"""How a profile fitted on one day predicts other days: each profile against each day's held-out runs.

A planner books GPUs on a day no profile was fitted on. For each profile (fitted on one day's runs
of at most 4 jobs) and each day's folder of recorded real runs, `nodus validate`'s errors over the
day's runs of more than 4 jobs per GPU: steps per GPU-hour, per run (replayed lengths) and per
configuration. A profile's own day is the in-day figure; the rest are what it gives across days.

    python experiments/crossday.py --profile NAME[=DAY] ... --day DAY=RUN_DIR_GLOB ... \
        --out experiments/results/crossday [--annotate]

Only runs of the trainer and engine settings a profile describes are compared (the graphed trainer,
the tuned LoRA kernels, the full audit, the engine in one process with no extra arguments or
environment, vLLM's pinned publish, and the adapter slots its engine terms were measured with, or one
per job where it does not record them; `--keep-any` compares every run); a run whose MPS settings
differ from a profile's is kept and counted (`mps_flagged`), as a planner would meet it. Writes
crossday.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

from nodus.config import corun_key, packed_rows

# Run controls (calibration.run_settings.run_controls) of settings no profile here was fitted with.
OTHER_SETTINGS = ("audit", "engine_core_process", "engine_args", "engine_env", "publish_pinned", "engine_cpu_threads")


def comparable(row: dict, profile_slots: int | None = None, profile_cpu_threads: int | None = None) -> bool:
    """A run of the settings the profile describes: the graphed trainer with plain rows (no
    trainer.share_prompts packing, which only some profiles price), the tuned LoRA kernels, none of
    OTHER_SETTINGS, and the engine's adapter slots: those the profile's engine terms were measured
    with (``profile_slots``, its ``environment.engine_max_loras``; a run's are its
    ``engine_max_loras`` control, else one per job), or one per job for a profile that does not
    record them (session 23: 16 slots against 8 moved a run 11-27%); and the trainers' CPU threads
    the profile's train terms were measured with (``profile_cpu_threads``, its
    ``environment.trainer_cpu_threads``; None: torch's own count)."""
    c = row.get("controls") or {}
    slots = c.get("engine_max_loras") or row.get("jobs")
    same_engine = "engine_max_loras" not in c if profile_slots is None else slots == profile_slots
    return (c.get("trainer_step_mode") == "graphed" and c.get("lora_kernels") == "tuned"
            and not packed_rows(row.get("share_prompts")) and not any(k in c for k in OTHER_SETTINGS)
            and same_engine and c.get("trainer_cpu_threads") == profile_cpu_threads)


def mps_flagged(row: dict, profile_sharing: dict | None) -> bool:
    """The run's MPS settings are not those the profile's MPS rates were fitted under
    (``profile_sharing``: its ``sharing.controls``)."""
    from calibration.run_settings import mps_settings_differ

    arm = row.get("arm") or {}
    return mps_settings_differ(row.get("controls") or {}, profile_sharing, arm.get("sharing") == "mps",
                               corun_key(arm.get("policy"), arm.get("stacks"))) is not None


def cell(rows: list[dict], profile_sharing: dict | None) -> dict:
    """Held-out error statistics of one (profile, day): per run and per configuration, replayed."""
    from calibration.validate import error_stats, kendall_tau, per_config_errors

    meas = [r["measured"]["steps_per_gpu_hour"] for r in rows]
    pred = [r["replay"]["steps_per_gpu_hour"] for r in rows]
    per_config = per_config_errors(rows)["replay"] if rows else {}
    return {"per_run": {**error_stats(pred, meas), "kendall_tau": kendall_tau(pred, meas)},
            "per_config": {k: per_config.get(k) for k in ("mape", "worst", "bias", "n", "kendall_tau")},
            "mps_flagged": sum(mps_flagged(r, profile_sharing) for r in rows),
            "runs": [r["run"] for r in rows]}


def crossday(profiles: list[tuple[str, str | None]], days: list[tuple[str, list[str]]],
             keep_any: bool = False) -> dict:
    from calibration.validate import validate
    from sim.profile import profile_dict

    out: dict = {"profiles": [{"profile": p, "fit_day": d} for p, d in profiles], "days": [d for d, _ in days],
                 "cells": {}, "matched": {}}
    for p, _ in profiles:
        prof = profile_dict(p)
        controls, slots = prof["sharing"].get("controls"), prof["environment"].get("engine_max_loras")
        cap = prof["environment"].get("trainer_cpu_threads")
        for day, runs in days:
            rows = [r for r in validate(runs, p)["rows"]
                    if r["heldout"] and (keep_any or comparable(r, slots, cap))]
            out["cells"].setdefault(p, {})[day] = cell(rows, controls)
            # The runs whose MPS settings are the profile's (a planner picks the profile of the
            # settings the jobs will run under).
            out["matched"].setdefault(p, {})[day] = cell([r for r in rows if not mps_flagged(r, controls)], controls)
    # Across days: every held-out run of a day other than the profile's own, pooled.
    for p, fit_day in profiles:
        for part in ("cells", "matched"):
            others = [c for day, c in out[part][p].items() if day != fit_day and c["per_run"]["n"]]
            n = sum(c["per_run"]["n"] for c in others)
            out[part][p]["across_days"] = {
                "runs": n, "days": len(others),
                "mape": sum(c["per_run"]["mape"] * c["per_run"]["n"] for c in others) / n if n else None,
                "bias": sum(c["per_run"]["bias"] * c["per_run"]["n"] for c in others) / n if n else None,
                "worst": max((c["per_run"]["worst"] for c in others), default=None),
                # Each day weighing the same (the days hold different numbers and kinds of runs).
                "mape_per_day_mean": (sum(c["per_run"]["mape"] for c in others) / len(others)) if others else None}
    return out


def render(rep: dict) -> str:
    head = ("Held-out runs (more than 4 jobs per GPU) of each day, simulated on each profile with their "
            "recorded lengths: steps per GPU-hour MAPE per run (bias; runs), and per configuration. "
            "A profile's own day is marked *.")
    return "\n".join([head, "", "Runs under the MPS settings the profile's rates were fitted under:", "",
                      _table(rep, "matched"), "Every run (a run under other MPS settings, e.g. the trainer's "
                      "priority, is simulated with the profile's rates):", "", _table(rep, "cells")])


def _table(rep: dict, part: str) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    days = rep["days"]
    lines = ["| profile | " + " | ".join(days) + " | across days (runs) |",
             "|---|" + "---|" * (len(days) + 1)]
    for p in rep["profiles"]:
        cells = rep[part][p["profile"]]
        row = []
        for d in days:
            c = cells[d]
            r, k = c["per_run"], c["per_config"]
            star = "*" if d == p["fit_day"] else ""
            row.append("-" if not r["n"] else
                       f"{pct(r['mape'])}{star} ({'+' if r['bias'] >= 0 else ''}{pct(r['bias'])}; {r['n']}); "
                       f"config {pct(k.get('mape'))}")
        a = cells["across_days"]
        sign = "+" if (a["bias"] or 0) >= 0 else ""
        row.append(f"{pct(a['mape'])} (bias {sign}{pct(a['bias'])}, worst {pct(a['worst'])}; {a['runs']}); "
                   f"per-day mean {pct(a['mape_per_day_mean'])}")
        lines.append(f"| {p['profile']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def annotate(rep: dict, report: str) -> list[str]:
    """Write each shipped profile's across-days error (the runs under its MPS settings) into its
    file's ``validation``; returns the files written. A profile given as a path is left alone."""
    from sim.profile import profile_dict, shipped_profile_path, shipped_profiles, write_profile

    done = []
    for p in rep["profiles"]:
        name = p["profile"]
        a = rep["matched"][name]["across_days"]
        if name not in shipped_profiles():
            continue
        if p["fit_day"] is None:
            raise ValueError(f"--annotate: {name} has no fit day (--profile {name}=DAY): its own day's runs would "
                             "count as other days'")
        prof = profile_dict(name)
        # No run of another day: no across-days error (an earlier one is cleared, not left standing).
        prof["validation"] = dict(prof.get("validation") or {}, across_days_mape=a["mape"], across_days_bias=a["bias"],
                                  across_days_worst=a["worst"], across_days_runs=a["runs"],
                                  across_days_report=report if a["runs"] else None)
        path = Path(str(shipped_profile_path(name)))
        write_profile(prof, path, "experiments/crossday.py --annotate", overwrite=True)
        done.append(str(path))
    return done


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="append", required=True, metavar="NAME[=DAY]",
                    help="a profile, and the day (a --day name) it was fitted on")
    ap.add_argument("--day", action="append", required=True, metavar="DAY=GLOB",
                    help="a day's run folders (a glob of folders written by nodus run / gpu_arms.py)")
    ap.add_argument("--keep-any", action="store_true", help="compare every run, whatever its settings")
    ap.add_argument("--out", required=True, help="folder for crossday.json and crossday.md")
    ap.add_argument("--annotate", action="store_true",
                    help="write each shipped profile's across-days error into its file (nodus profiles lists it, "
                         "every sim report on it prints it)")
    args = ap.parse_args(argv)
    profiles = [(p.split("=", 1)[0], p.split("=", 1)[1] if "=" in p else None) for p in args.profile]
    days = []
    for d in args.day:
        if "=" not in d:
            ap.error(f"--day {d!r}: give DAY=GLOB")
        name, pattern = d.split("=", 1)
        runs = sorted(x for x in glob.glob(pattern) if (Path(x) / "summary.json").is_file())
        if not runs:
            ap.error(f"--day {d!r}: no run folders (with a summary.json) match {pattern!r}")
        days.append((name, runs))
    names = {n for n, _ in days}
    for p, day in profiles:
        if day is not None and day not in names:
            ap.error(f"--profile {p}={day}: {day!r} is not a --day name ({', '.join(sorted(names))})")
    if args.annotate:
        for p, day in profiles:
            if day is None:
                ap.error(f"--annotate needs each profile's fit day: --profile {p}=DAY")
    rep = crossday(profiles, days, args.keep_any)
    rep["argv"] = list(argv) if argv is not None else sys.argv[1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crossday.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "crossday.md").write_text(render(rep))
    print(render(rep))
    if args.annotate:
        for path in annotate(rep, str(out / "crossday.md")):
            print(f"annotated {path}")
    return rep


if __name__ == "__main__":
    main()
