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

``--tail N`` splits the seconds beside the other phase by the engine's running batch: a generation's
by its own (its seconds at N running sequences or fewer, its tail, apart), a train step's by the other
stack's engine beside it, and fits a third rate of each kind for the tail. A generation's running
batch over its seconds is not recorded: it is read off its sequences' lengths, each decode step
priced by the profile's decode curve at the batch still running (``batch_fractions``), spread over
the measured action. Session 64: the engine's tail beside a trainer goes slower than its full batch,
and a trainer beside an engine's tail at about its rate alone (experiments/results/h200/session64/).

    python experiments/overlap_rates.py --profile P RUN_DIR... [--tail N] [--out PREFIX] [--write-profile OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.validate import (_beside_fraction, _phase_actions, _simulate, action_key,  # noqa: E402
                                 load_recorded, recorded_configs)
from nodus.accounting import covered_length  # noqa: E402

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


def batch_fractions(lengths: list[int], prompt_tokens: float, jobs: list[str], cost) -> list[tuple[float, float, int]]:
    """A generation's running batch over its seconds, ``[(from, to, sequences)]`` in fractions of the
    action: its prompts' prefill at the full batch, then its decode steps, each priced by ``cost``
    (a ``sim.profile.CostModel``) at the sequences still running (``lengths``: each one's response
    tokens, ``jobs``: its job, whose adapter it uses; ``prompt_tokens``: one sequence's prompt)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    left = {j: jobs.count(j) for j in set(jobs)}
    segs = [(cost.prefill_s(int(prompt_tokens * n), lora=True, cold=False), n)]
    done, k = 0, 0
    while done < n:
        nxt = lengths[order[done]]
        running = n - done
        if nxt > k:
            ctx = running * (prompt_tokens + (k + nxt) / 2)
            segs.append(((nxt - k) * cost.decode_step_s(running, ctx, sum(c > 0 for c in left.values())), running))
            k = nxt
        while done < n and lengths[order[done]] <= k:
            left[jobs[order[done]]] -= 1
            done += 1
    total = sum(t for t, _ in segs) or 1.0
    out, t = [], 0.0
    for dt, b in segs:
        out.append((t / total, (t + dt) / total, b))
        t += dt
    return out


def batch_segments(spans: list[dict], acts: dict, cost) -> dict[tuple, list[tuple[float, float, int]]]:
    """Each measured generation's running batch over its seconds (``_phase_actions``' keys):
    ``[(start, end, sequences)]``, ``batch_fractions`` spread over the action's measured span."""
    seqs: dict[tuple, list] = {}
    for sp in spans:
        if sp["phase"] == "generate":
            attrs = sp.get("attrs") or {}
            rt = list(attrs.get("response_tokens") or [])
            a = seqs.setdefault(action_key(sp), [[], [], 0])
            a[0] += rt
            a[1] += [sp.get("job")] * len(rt)
            a[2] += attrs.get("prompt_tokens") or 0
    out = {}
    for key, (lengths, jobs, prompt) in seqs.items():
        if key in acts["generate"] and lengths:
            s, e, _ = acts["generate"][key]
            out[key] = [(s + f0 * (e - s), s + f1 * (e - s), b)
                        for f0, f1, b in batch_fractions(lengths, prompt / len(lengths), jobs, cost)]
    return out


def tail_overlaps(acts: dict, segs: dict, phase: str, tail: int) -> dict[tuple, tuple[float, ...]]:
    """``overlaps`` with the seconds beside the other phase split by the engine's running batch:
    (seconds, beside the same phase, beside the other with the engine past ``tail`` sequences, beside
    it at ``tail`` or fewer). A generation's engine is its own (``segs``, ``batch_segments``); a train
    step's is the other stack's generation beside it (the largest where several run)."""
    other_phase = "train" if phase == "generate" else "generate"
    out = {}
    for key, (s, e, _) in acts[phase].items():
        gpu, group, _ = key
        same = [(x[0], x[1]) for (g, grp, _), x in acts[phase].items() if g == gpu and grp != group]
        other = [(x[0], x[1]) for (g, grp, _), x in acts[other_phase].items() if g == gpu and grp != group]
        t_same = covered_length(s, e, same)
        if phase == "generate":
            if key not in segs:
                continue
            big = tail_s = 0.0
            for a0, a1, b in segs[key]:
                beside = covered_length(a0, a1, same + other) - covered_length(a0, a1, same)
                big, tail_s = (big + beside, tail_s) if b > tail else (big, tail_s + beside)
        else:
            engines = [seg for (g, grp, _), ss in segs.items() if g == gpu and grp != group for seg in ss]
            large = [(a0, a1) for a0, a1, b in engines if b > tail]
            big = covered_length(s, e, same + large) - t_same
            tail_s = covered_length(s, e, same + other) - t_same - big
        out[key] = (e - s, t_same, big, max(tail_s, 0.0))
    return out


def rows_of(run: Path, alone_path: str, tail: int | None = None, cost=None) -> dict[str, list[tuple]]:
    """Each action of the run with its work (seconds alone, the replay's) and the seconds ``overlaps``
    (or with ``tail``, ``tail_overlaps``, its running batches priced by ``cost``) gives it."""
    cfg, _, spans = load_recorded(run)
    replay, _ = recorded_configs(run, cfg, spans, alone_path)
    sim = _simulate(replay, str(run))["action_seconds"]
    acts = _phase_actions(spans)
    segs = batch_segments(spans, acts, cost) if tail is not None else None
    out: dict[str, list[tuple]] = {"generate": [], "train": []}
    for phase in out:
        parts = overlaps(acts, phase) if tail is None else tail_overlaps(acts, segs, phase, tail)
        for key, (d, *beside) in parts.items():
            if key in sim[phase] and d > 0:
                out[phase].append((sim[phase][key], d, *beside))
    return out


def fit(rows: list[tuple], r_alone: float) -> dict:
    """Least squares on the relative error of each action's work (alone seconds x r_alone). A row:
    (alone seconds, seconds, then its seconds beside each kind of neighbour: the same phase, the other
    phase, and with ``--tail`` the other phase at the engine's tail); one rate per kind."""
    w = np.array([a * r_alone for a, *_ in rows])
    d = np.array([r[1] for r in rows])
    T = np.array([r[2:] for r in rows], dtype=float)
    y = (w - r_alone * (d - T.sum(axis=1))) / w
    X = T / w[:, None]
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = r_alone * (d - T.sum(axis=1)) + X @ coef * w
    err = pred / w - 1
    names = ("same", "other", "other_tail")[:T.shape[1]]
    return {**{n: float(c) for n, c in zip(names, coef)}, "actions": len(rows),
            **{f"share_beside_{n}": float(T[:, i].sum() / d.sum()) for i, n in enumerate(names)},
            "rel_err_mean_abs": float(np.mean(np.abs(err)))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", help="write PREFIX.json")
    ap.add_argument("--write-profile", help="the profile with the fitted rates")
    ap.add_argument("--tail", type=int, default=None, metavar="N",
                    help="fit the rates beside the other phase apart where the engine runs N sequences or fewer")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args(argv)
    if not Path(args.profile).is_file():
        raise SystemExit(f"overlap_rates: --profile {args.profile}: no such file (a profile JSON path: "
                         "the shipped ones are under calibration/profiles/)")
    if args.tail is not None and args.tail < 1:
        raise SystemExit(f"overlap_rates: --tail {args.tail}: give the tail's largest running batch, 1 or more")
    if args.tail is not None and args.write_profile:
        raise SystemExit("overlap_rates: --write-profile with --tail: a profile holds one rate per pair of "
                         "phases (the tail's rate has no field); fit without --tail to write one")
    from sim.profile import load_profile

    raw = json.loads(Path(args.profile).read_text())
    cost = load_profile(args.profile) if args.tail is not None else None
    alone = raw["sharing"]["mps_alone"]
    with tempfile.TemporaryDirectory() as tmp:
        alone_path = Path(tmp) / "alone.json"
        alone_profile(raw, alone_path)
        rows: dict[str, list] = {"generate": [], "train": []}
        for run in args.runs:
            for phase, r in rows_of(Path(run), str(alone_path), args.tail, cost).items():
                rows[phase] += r
    result = {"profile": args.profile, "runs": args.runs, "tail": args.tail}
    for phase, (same_key, other_key) in RATES.items():
        if not any(sum(r[2:]) > 0 for r in rows[phase]):
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
              + (f"at the engine's tail (at most {args.tail} sequences running; {f['share_beside_other_tail']:.0%} "
                 f"of the seconds) {f['other_tail']:.3f}; " if args.tail is not None else "")
              + f"mean |error| of an action's work {f['rel_err_mean_abs']:.1%}")
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
