"""The reference study's four-arm table and job-count scaling, predicted by the simulator.

    python experiments/paper_table_sim.py [--profile PROFILE] [--out experiments/results]

Writes paper_table_sim.json and paper_table_sim.md: each arm's steps per GPU-hour and ratio to a
dedicated GPU per job for 8 jobs on seeds 1-3, and overlap+mps / shared-sync scaling over 2-16
jobs. A prediction under the named profile and its listed assumptions, not a measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nodus.config import DEFAULT_PROFILE
from nodus.simulate import config_from_args, simulate

ARMS = {
    "overlap+mps (nodus)": dict(policy="overlap", groups=2, sharing="mps"),
    "shared-sync": dict(policy="shared-sync", sharing="none"),
    "overlap, no sharing controls": dict(policy="overlap", groups=2, sharing="none"),
    "shared-sync+mps (controls, no overlap)": dict(policy="shared-sync", sharing="mps"),
    "timeslice (two stacks)": dict(policy="timeslice", groups=2, sharing="none"),
}
SEEDS = (1, 2, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = ap.parse_args()
    table, scaling, assumptions, validation = {}, {}, None, None
    for name, arm in ARMS.items():
        table[name] = {}
        for seed in SEEDS:
            s = simulate(config_from_args(jobs=8, seed=seed, profile=args.profile, **arm))
            assumptions, validation = s["assumptions"], s.get("profile_validation")
            table[name][seed] = {k: s[k] for k in ("steps_per_gpu_hour", "ratio_vs_dedicated",
                                                    "dedicated_steps_per_gpu_hour", "stale_rollouts")}
    for name in ("overlap+mps (nodus)", "shared-sync"):
        scaling[name] = {}
        for jobs in (2, 4, 8, 16):
            rs = [simulate(config_from_args(jobs=jobs, seed=sd, profile=args.profile, **ARMS[name]))["ratio_vs_dedicated"]
                  for sd in SEEDS]
            scaling[name][jobs] = sum(rs) / len(rs)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"profile": args.profile, "workload": "8 prompts x 8 responses, <= 256 new tokens, 20 steps",
              "seeds": list(SEEDS), "arms": table, "scaling_ratio_mean": scaling, "assumptions": assumptions,
              "profile_validation": validation}
    (args.out / "paper_table_sim.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"Predicted by the simulator on profile `{args.profile}` (8 jobs, 20 steps each; ratio to a dedicated GPU per job).",
          "", "| arm | seed 1 | seed 2 | seed 3 | mean | steps/GPU-h (mean) |", "|---|---|---|---|---|---|"]
    for name, per in table.items():
        rs = [per[s]["ratio_vs_dedicated"] for s in SEEDS]
        sph = sum(per[s]["steps_per_gpu_hour"] for s in SEEDS) / len(SEEDS)
        md.append(f"| {name} | " + " | ".join(f"{r:.3f}" for r in rs) + f" | {sum(rs) / len(rs):.3f} | {sph:.0f} |")
    md += ["", "| arm | 2 jobs | 4 jobs | 8 jobs | 16 jobs |", "|---|---|---|---|---|"]
    for name, per in scaling.items():
        md.append(f"| {name} | " + " | ".join(f"{per[j]:.3f}" for j in (2, 4, 8, 16)) + " |")
    if validation and validation.get("heldout_mape") is not None:
        md += ["", f"Error bar: this profile against {validation['heldout_runs']} held-out H200 runs "
                   f"({', '.join(validation['configurations'])}): steps per GPU-hour MAPE "
                   f"{validation['heldout_mape']:.1%}, bias {validation['heldout_bias']:+.1%} "
                   f"(`{validation['report']}`)."]
    md += ["", "Assumptions of this profile (not yet measured):"] + [f"- {a['id']}: {a['what']}" for a in assumptions]
    (args.out / "paper_table_sim.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
