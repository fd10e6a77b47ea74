"""What #6's targets would take, in the simulator: the 8-job reference workload on an arm (by
default overlap + MPS in 2 groups; the current one is two stacks: --policy shared-sync --stacks 2)
on a host's profile with its train and decode costs scaled, hypothetically.

    python experiments/what_it_takes.py [--profile PROFILE] [--out experiments/results]
    python experiments/what_it_takes.py --policy shared-sync --stacks 2 --steps 6 \
        --profile h200-xeon16-graphed-stacks-audit-sessions30-35-qwen3-0.6b \
        --train 1,0.9,0.8,0.7 --decode 1,0.9,0.8,0.7 --out experiments/results/what_it_takes_stacks

Writes what_it_takes_sim.{json,md}: steps per GPU-hour and the ratio to a dedicated GPU per job
(whose phases get the same factors) for each (train factor, decode factor), and for each train
factor the decode factor that first reaches --target steps per GPU-hour. A prediction with the
profile's error bar, not a measurement: it says which phase has to get how much faster.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from nodus.config import DEFAULT_PROFILE, STACKS_PROFILE, ConfigError

TRAIN = (1.0, 0.75, 0.5, 0.35)
DECODE = (1.0, 0.75, 0.5)
ARM = {"policy": "overlap", "groups": 2, "stacks": 1}  # session 16's arm, the grid's default


def factors(text: str, flag: str) -> tuple[float, ...]:
    """A comma-separated list of cost factors (each > 0; 0.5: twice as fast)."""
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated numbers, such as 1,0.9,0.8") from None
    bad = [v for v in vals if not v > 0]
    if bad:
        raise SystemExit(f"{flag} {text!r}: every factor must be > 0 (0.5: twice as fast); got {bad}")
    return vals


def grid(profile: str, steps: int = 20, seed: int = 1, *, train: tuple[float, ...] = TRAIN,
         decode: tuple[float, ...] = DECODE, jobs: int = 8, arm: dict | None = None) -> list[dict]:
    from nodus.config import with_default_packing
    from nodus.simulate import config_from_args, simulate
    from sim.profile import profile_dict, what_if

    arm = {**ARM, **(arm or {})}
    base = profile_dict(profile)
    graphed = (base.get("train") or {}).get("step_mode") == "graphed"
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodus-what-it-takes-") as tmp:
        for t in train:
            for d in decode:
                path = Path(tmp) / f"t{t}-d{d}.json"
                path.write_text(json.dumps(what_if(base, {"train": t, "decode": d})))
                cfg = config_from_args(jobs=jobs, steps=steps, policy=arm["policy"], groups=arm["groups"],
                                       sharing="mps", seed=seed, profile=str(path),
                                       stacks=arm["stacks"] if arm["stacks"] > 1 else None)
                # As nodus sim: a graphed profile's trainer packs each prompt's responses by default.
                cfg = with_default_packing(cfg, graphed)
                s = simulate(cfg)
                rows.append({"train_factor": t, "decode_factor": d, "share_prompts": cfg.trainer.share_prompts,
                             "steps_per_gpu_hour": s["steps_per_gpu_hour"],
                             "ratio_vs_dedicated": s["ratio_vs_dedicated"], "busy": s["busy"]})
    return rows


def first_reaching(rows: list[dict], target: float) -> dict[float, float | None]:
    """For each train factor, the largest decode factor (the least speed-up) whose cell reaches
    ``target`` steps per GPU-hour; None where no cell of the grid does."""
    out: dict[float, float | None] = {}
    for t in dict.fromkeys(r["train_factor"] for r in rows):
        hits = [r["decode_factor"] for r in rows if r["train_factor"] == t and r["steps_per_gpu_hour"] >= target]
        out[t] = max(hits) if hits else None
    return out


def arm_text(arm: dict, jobs: int, steps: int) -> str:
    arm = {**ARM, **arm}
    shape = (f"{arm['groups']} groups" if arm["policy"] == "overlap" else "one group")
    stacks = f", {arm['stacks']} stacks" if arm["stacks"] > 1 else ""
    return f"{jobs} jobs x {steps} steps, {arm['policy']} + MPS, {shape}{stacks}"


def render(rows: list[dict], profile: str, validation: dict | None, *, arm: dict | None = None, jobs: int = 8,
           steps: int = 20, target: float | None = None) -> str:
    train = list(dict.fromkeys(r["train_factor"] for r in rows))
    decode = list(dict.fromkeys(r["decode_factor"] for r in rows))
    k = rows[0].get("share_prompts") if rows else None
    packed = f", each prompt's responses {k} to a row" if k else ""
    shape = arm_text(arm or {}, jobs, steps) + packed
    lines = [f"Simulated (profile `{profile}` with train and decode costs scaled; {shape}; the dedicated baseline "
             "gets the same factors). Steps per GPU-hour (ratio to dedicated):", "",
             "| train cost x | " + " | ".join(f"decode x{d:g}" for d in decode) + " |",
             "|---|" + "---|" * len(decode)]
    for t in train:
        cells = [next(r for r in rows if r["train_factor"] == t and r["decode_factor"] == d) for d in decode]
        lines.append(f"| {t:g} | " + " | ".join(f"{c['steps_per_gpu_hour']:.0f} ({c['ratio_vs_dedicated']:.2f}x)"
                                                 for c in cells) + " |")
    if target:
        reach = first_reaching(rows, target)
        parts = [f"train x{t:g}: " + (f"decode x{d:g}" if d is not None else "no decode factor of the grid")
                 for t, d in reach.items()]
        lines += ["", f"To reach {target:,.0f} steps per GPU-hour: " + "; ".join(parts) + "."]
    if validation:
        from nodus.simulate import error_bar_line

        lines += ["", f"Error bar: {error_bar_line(validation)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help=f"profile to scale (default {DEFAULT_PROFILE}; with --stacks past 1, "
                                      f"{STACKS_PROFILE}, as nodus sim picks it under MPS)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    ap.add_argument("--policy", choices=("overlap", "shared-sync"), default=ARM["policy"])
    ap.add_argument("--groups", type=int, default=None, help="overlap's phase-offset groups (default 2)")
    ap.add_argument("--stacks", type=int, default=1, help="engine + trainer stacks splitting the jobs (default 1)")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per job (default 20)")
    ap.add_argument("--train", default=",".join(f"{t:g}" for t in TRAIN), help="train cost factors, comma-separated")
    ap.add_argument("--decode", default=",".join(f"{d:g}" for d in DECODE), help="decode cost factors, comma-separated")
    ap.add_argument("--target", type=float, default=10_000.0,
                    help="steps per GPU-hour to name the least speed-up for (default 10000, #6's)")
    a = ap.parse_args(argv)
    from sim.profile import load_profile

    if a.stacks < 1 or a.jobs < 1 or a.steps < 1:
        raise SystemExit(f"--stacks {a.stacks} --jobs {a.jobs} --steps {a.steps}: each must be >= 1")
    if a.groups is not None and a.policy != "overlap":
        raise SystemExit(f"--groups {a.groups}: phase-offset groups are overlap's; {a.policy} runs one group")
    if a.profile is None:
        a.profile = STACKS_PROFILE if a.stacks > 1 else DEFAULT_PROFILE
    arm = {"policy": a.policy, "stacks": a.stacks,
           "groups": (a.groups or ARM["groups"]) if a.policy == "overlap" else 1}
    train, decode = factors(a.train, "--train"), factors(a.decode, "--decode")
    try:
        rows = grid(a.profile, a.steps, train=train, decode=decode, jobs=a.jobs, arm=arm)
        # The profile's error bars as nodus sim prints them (a stacks profile's two-engine fit included).
        validation = load_profile(a.profile).validation()
    except ConfigError as e:  # an unknown profile, a config the arm cannot run
        raise SystemExit(f"what_it_takes: {e}") from None
    result = {"profile": a.profile, "validation": validation, "arm": arm, "jobs": a.jobs, "steps": a.steps,
              "target": a.target, "reach": {f"{t:g}": d for t, d in first_reaching(rows, a.target).items()},
              "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "what_it_takes_sim.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(rows, a.profile, validation, arm=arm, jobs=a.jobs, steps=a.steps, target=a.target)
    (a.out / "what_it_takes_sim.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
