"""Two stacks' engine rate across days: fit ``sharing.mps_engines`` (as `nodus fit-stacks` does) on
every day's runs but one, and predict the left-out day's runs. A day is the session folder a run
lies in (``.../sessionNN/arms/RUN``: the folder above the run's). Leaving a whole day out is the
error a planner meets on a new day. `nodus fit-stacks` reports it too, beside leaving one run out
(whose day-mates stay in); this script gives it alone, without the fit.

    python experiments/stacks_days.py RUN... --base PROFILE [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.stacks import day_of  # noqa: E402 - after the project root is on the path


def leave_days_out(runs: list[str], base: str) -> dict:
    """``calibration.stacks.leave_days_out`` on the runs and ``base``, with the base named."""
    from calibration.stacks import leave_days_out as by_day
    from calibration.stacks import stack_runs
    from nodus.config import ConfigError
    from sim.profile import profile_dict, profile_lora_kernels, profile_step_mode

    prof = profile_dict(base)
    rows = stack_runs(runs, profile_step_mode(prof), profile_lora_kernels(prof))
    with tempfile.TemporaryDirectory() as tmp:
        r = by_day(rows, prof, Path(tmp))
    if r is None:
        days = sorted({day_of(x["run"]) for x in rows})
        raise ConfigError(f"stacks_days: the runs lie in one day's folder ({days}): leaving a day out needs two")
    return {"base": base, **r}


def markdown(r: dict) -> str:
    """The report. Each run is named by its day and its folder, every row alike: a day's only run of
    a configuration would otherwise lose its day to the shortest unique name."""
    lines = [f"# Two stacks' engine rate, each day left out (base `{r['base']}`)", "",
             f"Each day's runs predicted from the rate fitted on the other days: **{r['mape']:.1%} mean absolute "
             f"error, worst {r['worst']:.1%}, mean signed {r['bias']:+.1%}** over {len(r['rows'])} runs.", "",
             "| day | runs | rate fitted without it | mean signed error |", "|---|---|---|---|"]
    lines += [f"| {d} | {x['runs']} | {x['rate']:.3f} | {x['mean_error']:+.1%} |" for d, x in r["days"].items()]
    lines += ["", "| run | measured | predicted | error |", "|---|---|---|---|"]
    for x in r["rows"]:
        name = f"{day_of(x['run'])}/{Path(x['run']).name}"
        lines.append(f"| {name} | {x['measured']:.0f} | {x['predicted']:.0f} | {x['error']:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="two-stack run folders under MPS, of two days or more")
    ap.add_argument("--base", required=True, help="profile to fit the rate on (as nodus fit-stacks --base)")
    ap.add_argument("--out", default=None, metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    r = leave_days_out(a.runs, a.base)
    text = markdown(r)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{a.out}.md").write_text(text)
        Path(f"{a.out}.json").write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    main()
