"""What #6's targets would take, in the simulator: the 8-job reference workload (overlap + MPS, the
current scheduler) on a host's profile with its train and decode costs scaled, hypothetically.

    python experiments/what_it_takes.py [--profile PROFILE] [--out experiments/results]

Writes what_it_takes_sim.{json,md}: steps per GPU-hour and the ratio to a dedicated GPU per job
(whose phases get the same factors) for each (train factor, decode factor). A prediction with the
profile's error bar, not a measurement: it says which phase has to get how much faster.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from nodus.config import DEFAULT_PROFILE

TRAIN = (1.0, 0.75, 0.5, 0.35)
DECODE = (1.0, 0.75, 0.5)


def grid(profile: str, steps: int = 20, seed: int = 1) -> list[dict]:
    from nodus.simulate import config_from_args, simulate
    from sim.profile import profile_dict, what_if

    base = profile_dict(profile)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodus-what-it-takes-") as tmp:
        for t in TRAIN:
            for d in DECODE:
                path = Path(tmp) / f"t{t}-d{d}.json"
                path.write_text(json.dumps(what_if(base, {"train": t, "decode": d})))
                s = simulate(config_from_args(jobs=8, steps=steps, policy="overlap", groups=2, sharing="mps",
                                              seed=seed, profile=str(path)))
                rows.append({"train_factor": t, "decode_factor": d, "steps_per_gpu_hour": s["steps_per_gpu_hour"],
                             "ratio_vs_dedicated": s["ratio_vs_dedicated"], "busy": s["busy"]})
    return rows


def render(rows: list[dict], profile: str, validation: dict | None) -> str:
    lines = [f"Simulated (profile `{profile}` with train and decode costs scaled; 8 jobs x 20 steps, overlap + MPS, "
             "2 groups; the dedicated baseline gets the same factors). Steps per GPU-hour (ratio to dedicated):", "",
             "| train cost x | " + " | ".join(f"decode x{d:g}" for d in DECODE) + " |",
             "|---|" + "---|" * len(DECODE)]
    for t in TRAIN:
        cells = [next(r for r in rows if r["train_factor"] == t and r["decode_factor"] == d) for d in DECODE]
        lines.append(f"| {t:g} | " + " | ".join(f"{c['steps_per_gpu_hour']:.0f} ({c['ratio_vs_dedicated']:.2f}x)"
                                                 for c in cells) + " |")
    if validation:
        from nodus.simulate import error_bar_line

        lines += ["", f"Error bar: {error_bar_line(validation)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    a = ap.parse_args(argv)
    from sim.profile import profile_dict

    rows = grid(a.profile)
    validation = profile_dict(a.profile).get("validation")
    result = {"profile": a.profile, "validation": validation, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "what_it_takes_sim.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(rows, a.profile, validation)
    (a.out / "what_it_takes_sim.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
