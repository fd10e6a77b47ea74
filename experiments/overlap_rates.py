"""The stacks' sharing rates from what ran beside each measured action (a prototype, session 63).

``nodus fit-stacks --rate phases`` fits the rates to the runs' phase means as the simulator reaches
them, under the alignment the simulator's stacks fall into; where that is not the runs' (session 63:
the runs' free stacks stayed in step, the simulator's drift half a cycle apart), the fit can land
anywhere along the ridge of rates that give the same means. This reads the alignment off the
measured timeline instead. Each measured generation of a stack ran some seconds alone, some beside
another stack's generation and some beside another stack's train step; its work, the seconds the
same generation takes alone (the profile's replay of the run with every stacks rate set to the rate
alone under MPS), is then linear in the rates:

    alone_s * r_alone = r_alone * t_alone + r_engines * t_beside_engine + r_beside_trainer * t_beside_train

and the same for train steps (r_trainers beside another stack's train, r_lone_trainer beside
another stack's generation; seconds beside another stack's publish count as alone). The two unknown
rates of each kind are fitted by least squares on the relative error, over every action of every run
given. Session 63: on the protocol profile's three fit runs it gives the phases fit's rates back
(within 0.03-0.06), so that fit is not an artefact of the simulated alignment; with the 8-job runs'
own rates the simulator's free stacks still drift apart (experiments/results/h100/session63/).

    python experiments/overlap_rates.py --profile P RUN_DIR... [--out PREFIX] [--write-profile OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.validate import (_beside_fraction, _phase_actions, _simulate, load_recorded,  # noqa: E402
                                 recorded_configs)

# What each kind's two unknown rates are in the profile (sharing.*): beside the same kind, beside the other.
RATES = {"generate": ("mps_engines", "mps_stacks_engine"), "train": ("mps_trainers", "mps_stacks_trainer")}


def alone_profile(raw: dict, path: Path) -> None:
    """Write the profile ``raw`` (a profile JSON's contents, left as they are) to ``path`` with every
    stacks rate at its kind's MPS-alone rate and no bench shape, so that its replay times each action
    as if it ran alone."""
    alone = json.loads(json.dumps(raw))
    sh, solo = alone["sharing"], alone["sharing"]["mps_alone"]
    sh.update(mps_engines=solo["engine"], mps_stacks_engine=solo["engine"], mps_trainers=solo["trainer"],
              mps_stacks_trainer=solo["trainer"], engines_by_batch=[])
    path.write_text(json.dumps(alone))


def overlaps(acts: dict, phase: str) -> dict[tuple, tuple[float, float, float]]:
    """Each action of ``phase``: (seconds, seconds beside other stacks' actions of the same phase,
    beside their actions of the other phase only); the fractions are ``_beside_fraction``'s."""
    # Both phases' actions in one dict of _phase_actions' key shape, the step tagged with its phase.
    both = {(gpu, group, (ph, step)): a for ph in acts for (gpu, group, step), a in acts[ph].items()}
    out = {}
    for key, (s, e, _) in acts[phase].items():
        d = e - s
        t_same = d * _beside_fraction(key, s, e, acts[phase])
        out[key] = (d, t_same, d * _beside_fraction(key, s, e, both) - t_same)
    return out


def rows_of(run: Path, alone_path: str) -> dict[str, list[tuple]]:
    cfg, _, spans = load_recorded(run)
    replay, _ = recorded_configs(run, cfg, spans, alone_path)
    sim = _simulate(replay, str(run))["action_seconds"]
    acts = _phase_actions(spans)
    out: dict[str, list[tuple]] = {"generate": [], "train": []}
    for phase in out:
        for key, (d, t_same, t_other) in overlaps(acts, phase).items():
            if key in sim[phase] and d > 0:
                out[phase].append((sim[phase][key], d, t_same, t_other))
    return out


def fit(rows: list[tuple], r_alone: float) -> dict:
    """Least squares on the relative error of each action's work (alone seconds x r_alone)."""
    w = np.array([a * r_alone for a, *_ in rows])
    d = np.array([r[1] for r in rows])
    same = np.array([r[2] for r in rows])
    other = np.array([r[3] for r in rows])
    y = (w - r_alone * (d - same - other)) / w
    X = np.stack([same / w, other / w], axis=1)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = r_alone * (d - same - other) + X @ coef * w
    err = pred / w - 1
    return {"same": float(coef[0]), "other": float(coef[1]), "actions": len(rows),
            "share_beside_same": float(same.sum() / d.sum()), "share_beside_other": float(other.sum() / d.sum()),
            "rel_err_mean_abs": float(np.mean(np.abs(err)))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", help="write PREFIX.json")
    ap.add_argument("--write-profile", help="the profile with the fitted rates")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args(argv)
    if not Path(args.profile).is_file():
        raise SystemExit(f"overlap_rates: --profile {args.profile}: no such file (a profile JSON path: "
                         "the shipped ones are under calibration/profiles/)")
    raw = json.loads(Path(args.profile).read_text())
    alone = raw["sharing"]["mps_alone"]
    with tempfile.TemporaryDirectory() as tmp:
        alone_path = Path(tmp) / "alone.json"
        alone_profile(raw, alone_path)
        rows: dict[str, list] = {"generate": [], "train": []}
        for run in args.runs:
            for phase, r in rows_of(Path(run), str(alone_path)).items():
                rows[phase] += r
    result = {"profile": args.profile, "runs": args.runs}
    for phase, (same_key, other_key) in RATES.items():
        if not any(r[2] + r[3] > 0 for r in rows[phase]):
            raise SystemExit(f"overlap_rates: no {phase} action of these runs ran beside another stack's: "
                             "give runs of two stacks or more")
        f = fit(rows[phase], alone["engine" if phase == "generate" else "trainer"])
        result[phase] = {**f, same_key: f["same"], other_key: f["other"],
                         "profile_" + same_key: raw["sharing"].get(same_key),
                         "profile_" + other_key: raw["sharing"].get(other_key)}
        print(f"{phase}: {f['actions']} actions, {f['share_beside_same']:.0%} of their seconds beside the same "
              f"kind, {f['share_beside_other']:.0%} beside the other; {same_key} {f['same']:.3f} "
              f"(profile {raw['sharing'].get(same_key)}), {other_key} {f['other']:.3f} "
              f"(profile {raw['sharing'].get(other_key)}); "
              f"mean |error| of an action's work {f['rel_err_mean_abs']:.1%}")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    if args.write_profile:
        sh = raw["sharing"]
        for phase, (same_key, other_key) in RATES.items():
            sh[same_key], sh[other_key] = result[phase]["same"], result[phase]["other"]
        sh["engines_by_batch"] = []
        Path(args.write_profile).write_text(json.dumps(raw, indent=1))
    return result


if __name__ == "__main__":
    main()
