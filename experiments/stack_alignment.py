"""How the stacks' phases lined up in recorded runs of two stacks or more, and what went with it.

    python experiments/stack_alignment.py RUN_DIR... [--out PREFIX]

Each stack (``arm.stacks``) alternates its own generate and train phases; nothing ties one stack's
phases to another's. A run's stacks may train at the same time (in step) or one may train while
another generates (alternating). For each run this reports the share of the stacks' train time
spent beside another stack's train (any of them), and beside another's generation; the run's stacks,
its steps per GPU-hour; and its mean train and generate action (seconds a stack's phase took, its
jobs' spans merged). With two stacks the two shares add up to at most one; with more, a train may be
beside one stack's train and another's generation at once, so they may add up to more. Over the
runs of each job count and stack count (three runs or more) it gives the Pearson r of the in-step
share with each of those, and pools the train actions by what ran beside them: in step (at least
90% of the action beside another stack's train) against alternating (beside another's generation),
their mean seconds and the ratio. Each run's phase by step: how far each stack's generation of a
step started from stack 0's, in stack 0's cycles (0: in step; 1/2: one generates while the other
trains), and the share of steps at least a quarter cycle apart; offset stacks start half a cycle apart
and may drift back in step. Writes PREFIX.json and PREFIX.md when --out is given.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from nodus.timeline import read_text

SIDE_SHARE = 0.9  # a train action "in step" or "alternating": this share of it beside the other kind


def merged(intervals) -> list[tuple[float, float]]:
    """Union of (start, end) intervals, sorted and non-overlapping."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(a, b) -> float:
    """Seconds two unions of intervals overlap."""
    return sum(max(0.0, min(e, e2) - max(s, s2)) for s, e in a for s2, e2 in b)


def span(iv) -> float:
    return sum(e - s for s, e in iv)


APART = 0.25  # a step's stacks "apart": their generations started at least this share of a cycle apart


def phase_by_step(starts: dict[int, dict[int, float]]) -> dict[int, list[float]] | None:
    """Per stack k > 0, per step both stack 0 and k generated: how far k's generation started from
    stack 0's, in cycles of stack 0 (its mean time from one generation's start to the next), folded
    to [0, 1/2] (0: in step, 1/2: half a cycle apart). ``starts``: stack -> step -> its generation's
    first start. None when stack 0 has fewer than two steps (no cycle) or no step number was recorded."""
    base = starts.get(0, {})
    steps = sorted(base)
    if len(steps) < 2:
        return None
    cycle = (base[steps[-1]] - base[steps[0]]) / (steps[-1] - steps[0])
    if cycle <= 0:
        return None
    out = {}
    for k in sorted(starts):
        if k == 0:
            continue
        ph = [((starts[k][t] - base[t]) / cycle) % 1.0 for t in steps if t in starts[k]]
        out[k] = [min(p, 1.0 - p) for p in ph]
    return out


def held_cycle(starts: dict[int, dict[int, float]], held: dict[int, dict[int, float]], pace: dict) -> dict:
    """What holding stacks apart (arm.hold_apart) cost a run: each stack's mean cycle (one generation's
    start to the next), the mean seconds a generation was held, and the cycle less the holds. With the
    pace over the run's window, the pace the run would have made at that shorter cycle, had the stacks
    kept their phases and speeds unheld (a projection, not a measurement). Empty when nothing was held."""
    gaps, holds = [], []
    for k, by_step in starts.items():
        steps = sorted(by_step)
        gaps += [by_step[b] - by_step[a] for a, b in zip(steps, steps[1:])]
        holds += [held.get(k, {}).get(b, 0.0) for b in steps[1:]]
    if not gaps or not any(holds):
        return {}
    cycle, hold = sum(gaps) / len(gaps), sum(holds) / len(holds)
    out = {"cycle_s": cycle, "held_s_per_step": hold, "unheld_cycle_s": cycle - hold}
    if pace.get("pace_steps_per_gpu_hour"):
        out["pace"] = pace["pace_steps_per_gpu_hour"]
        out["unheld_pace_projected"] = out["pace"] * cycle / (cycle - hold)
    return out


def run_alignment(run_dir: str | Path) -> dict:
    """One run's stack alignment. Raises ValueError when the run has not two stacks or more, each
    with train and generate phases."""
    rd = Path(run_dir)
    phases: dict[tuple[int, str], set] = {}
    gen_starts: dict[int, dict[int, float]] = {}  # stack -> step -> its generation's first start
    held: dict[int, dict[int, float]] = {}  # stack -> step -> seconds its generation was held (hold_apart)
    actions: dict[tuple[int, str, int], list[float]] = {}  # (stack, phase, step) -> [first start, last end]
    for line in read_text(rd / "spans.jsonl").splitlines():  # or spans.jsonl.gz
        d = json.loads(line)
        if d.get("phase") in ("train", "generate") and d.get("stack") is not None:
            phases.setdefault((int(d["stack"]), d["phase"]), set()).add((d["start_s"], d["end_s"]))
            attrs = d.get("attrs") or {}
            step = attrs.get("step")
            if step is not None:
                a = actions.setdefault((int(d["stack"]), d["phase"], step), [d["start_s"], d["end_s"]])
                a[0], a[1] = min(a[0], d["start_s"]), max(a[1], d["end_s"])
            if d["phase"] == "generate" and step is not None:
                by_step = gen_starts.setdefault(int(d["stack"]), {})
                by_step[step] = min(by_step.get(step, d["start_s"]), d["start_s"])
                held_by_step = held.setdefault(int(d["stack"]), {})
                held_by_step[step] = max(held_by_step.get(step, 0.0), attrs.get("held_s", 0.0))
    stacks = sorted({k[0] for k in phases})
    if len(stacks) < 2 or any((s, p) not in phases for s in stacks for p in ("train", "generate")):
        raise ValueError(f"{rd}: expected two stacks or more, each with train and generate spans; found stacks "
                         f"{stacks} and phases {sorted(phases)}")
    iv = {k: merged(v) for k, v in phases.items()}

    def others(s: int, phase: str) -> list[tuple[float, float]]:
        return merged(x for o in stacks if o != s for x in iv[(o, phase)])

    train = sum(span(iv[(s, "train")]) for s in stacks)
    n_train = sum(len(iv[(s, "train")]) for s in stacks)
    gen = sum(span(iv[(s, "generate")]) for s in stacks)
    n_gen = sum(len(iv[(s, "generate")]) for s in stacks)
    beside_train = sum(overlap(iv[(s, "train")], others(s, "train")) for s in stacks) / train
    beside_gen = sum(overlap(iv[(s, "train")], others(s, "generate")) for s in stacks) / train
    # Each train action by what ran beside it: at least SIDE_SHARE of it beside another stack's
    # train (in step), or beside another's generation (alternating); the seconds each kind took.
    sides: dict[str, list[float]] = {"in_step": [], "alternating": []}
    for s in stacks:
        ot, og = others(s, "train"), others(s, "generate")
        for a in iv[(s, "train")]:
            d = a[1] - a[0]
            if d <= 0:
                continue
            if overlap([a], ot) >= SIDE_SHARE * d:
                sides["in_step"].append(d)
            elif overlap([a], og) >= SIDE_SHARE * d:
                sides["alternating"].append(d)
    summary = json.loads((rd / "summary.json").read_text())
    phase = phase_by_step(gen_starts)
    pooled = [p for ph in (phase or {}).values() for p in ph]
    hold = held_cycle(gen_starts, held, summary.get("pace") or {})
    return {"run": str(rd), "jobs": len(summary.get("per_job") or {}), "stacks": len(stacks),
            **leading_and_trailing(actions, stacks),
            "phase_by_step": phase, "apart_share": sum(p >= APART for p in pooled) / len(pooled) if pooled else None,
            "steps_per_gpu_hour": summary["steps_per_gpu_hour"],
            "train_beside_train": beside_train, "train_beside_generate": beside_gen,
            "train_s": train / n_train, "generate_s": gen / n_gen,
            **hold, **{f"train_{k}_n": len(v) for k, v in sides.items()},
            **{f"train_{k}_s": sum(v) for k, v in sides.items()}}


def leading_and_trailing(actions: dict[tuple[int, str, int], list[float]], stacks: list[int]) -> dict:
    """Two stacks' actions of one step and phase, the one begun first (leading) against the other
    (trailing): their mean seconds over the steps both ran, per phase (``{phase}_leading_s``,
    ``{phase}_trailing_s``, ``{phase}_pairs``). A phase the trailing stack takes longer in widens
    the gap between the stacks and one it takes shorter narrows it: what holds stacks in step or
    drives them apart (session 63: on the GPU the leading stack's train step ran longer, in the
    simulator the trailing stack's generation did). Runs of other stack counts, or without steps
    on their spans: none."""
    if len(stacks) != 2:
        return {}
    out = {}
    for phase in ("generate", "train"):
        pairs = []
        for (st, ph, step), a in actions.items():
            b = actions.get((stacks[1], ph, step))
            if st == stacks[0] and ph == phase and b is not None:
                lead, trail = (a, b) if a[0] <= b[0] else (b, a)
                pairs.append((lead[1] - lead[0], trail[1] - trail[0]))
        if pairs:
            out.update({f"{phase}_pairs": len(pairs), f"{phase}_leading_s": sum(p[0] for p in pairs) / len(pairs),
                        f"{phase}_trailing_s": sum(p[1] for p in pairs) / len(pairs)})
    return out


def train_by_side(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Per job count and stack count: the train actions in step (at least SIDE_SHARE beside another
    stack's train) and alternating (beside another's generation) pooled over the runs, their count
    and mean seconds, and in step over alternating (None where either has none)."""
    out = {}
    for jobs, stacks in sorted({(r["jobs"], r["stacks"]) for r in rows}):
        rs = [r for r in rows if r["jobs"] == jobs and r["stacks"] == stacks]
        d = {}
        for k in ("in_step", "alternating"):
            n = sum(r[f"train_{k}_n"] for r in rs)
            d[k] = {"actions": n, "mean_s": sum(r[f"train_{k}_s"] for r in rs) / n if n else None}
        a, b = d["in_step"]["mean_s"], d["alternating"]["mean_s"]
        out[(jobs, stacks)] = {"runs": len(rs), **d, "in_step_over_alternating": a / b if a and b else None}
    return out


def pearson(x: list[float], y: list[float]) -> float | None:
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def correlations(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Per job count and stack count with three runs or more: Pearson r of the in-step share with
    steps per GPU-hour, the mean train action and the mean generate action."""
    out = {}
    for jobs, stacks in sorted({(r["jobs"], r["stacks"]) for r in rows}):
        rs = [r for r in rows if r["jobs"] == jobs and r["stacks"] == stacks]
        if len(rs) < 3:
            continue
        x = [r["train_beside_train"] for r in rs]
        out[(jobs, stacks)] = {"runs": len(rs), **{f"r_{k}": pearson(x, [r[k] for r in rs])
                                                   for k in ("steps_per_gpu_hour", "train_s", "generate_s")}}
    return out


def render(rows: list[dict], corr: dict[int, dict], sides: dict | None = None) -> str:
    lines = ["| run | jobs | stacks | steps/GPU-h | train beside another stack's train | beside another's generation | "
             f"train s | generate s | steps apart (at least {APART:g} cycle) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        apart = r.get("apart_share")
        lines.append(f"| {r['run']} | {r['jobs']} | {r['stacks']} | {r['steps_per_gpu_hour']:.0f} | "
                     f"{r['train_beside_train']:.0%} | "
                     f"{r['train_beside_generate']:.0%} | {r['train_s']:.3f} | {r['generate_s']:.3f} | "
                     f"{'-' if apart is None else f'{apart:.0%}'} |")
    held = [r for r in rows if r.get("held_s_per_step")]
    if held:
        lines += ["", "Held stacks (arm.hold_apart): each stack's mean cycle, the mean seconds a generation was held, "
                  "and the pace projected at the cycle less the holds, the stacks' phases and speeds kept:", "",
                  "| run | cycle s | held s a step | cycle less the holds s | pace | pace projected unheld |",
                  "|---|---|---|---|---|---|"]
        for r in held:
            pace = [f"{r[k]:.0f}" if k in r else "-" for k in ("pace", "unheld_pace_projected")]
            lines.append(f"| {r['run']} | {r['cycle_s']:.2f} | {r['held_s_per_step']:.2f} | {r['unheld_cycle_s']:.2f} | "
                         f"{pace[0]} | {pace[1]} |")
    phased = [r for r in rows if r.get("phase_by_step")]
    if phased:
        lines += ["", "Phase by step: how far each stack's generation started from stack 0's, in stack 0's cycles "
                  "(0.00: in step, 0.50: half a cycle apart):", ""]
        for r in phased:
            for k, ph in r["phase_by_step"].items():
                lines.append(f"- {r['run']}, stack {k}: " + " ".join(f"{p:.2f}" for p in ph))
    paired = [r for r in rows if r.get("generate_pairs") and r.get("train_pairs")]
    if paired:
        lines += ["", "Leading and trailing: each step's two actions of a phase, the one begun first against the "
                  "other, mean seconds; the trailing stack's over the leading's above 1 widens the gap between "
                  "the stacks, below 1 narrows it:", "",
                  "| run | generate leading / trailing s | trailing over leading | train leading / trailing s | "
                  "trailing over leading |", "|---|---|---|---|---|"]
        for r in paired:
            lines.append(f"| {r['run']} | {r['generate_leading_s']:.3f} / {r['generate_trailing_s']:.3f} | "
                         f"{r['generate_trailing_s'] / r['generate_leading_s']:.3f} | "
                         f"{r['train_leading_s']:.3f} / {r['train_trailing_s']:.3f} | "
                         f"{r['train_trailing_s'] / r['train_leading_s']:.3f} |")
    if corr:
        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:+.2f}"

        lines += ["", "Pearson r of the in-step share (train beside another stack's train) over the runs of each job "
                  "count and stack count:", "",
                  "| jobs | stacks | runs | with steps/GPU-h | with train s | with generate s |",
                  "|---|---|---|---|---|---|"]
        for (jobs, stacks), c in corr.items():
            lines.append(f"| {jobs} | {stacks} | {c['runs']} | {fmt(c['r_steps_per_gpu_hour'])} | "
                         f"{fmt(c['r_train_s'])} | {fmt(c['r_generate_s'])} |")
    if sides:
        def mean(v: dict) -> str:
            return "-" if v["mean_s"] is None else f"{v['actions']} at {v['mean_s']:.3f} s"

        lines += ["", f"Train actions by what ran beside them, pooled over the runs (at least {SIDE_SHARE:.0%} of "
                  "the action beside another stack's train: in step; beside another's generation: alternating):", "",
                  "| jobs | stacks | runs | in step | alternating | in step over alternating |", "|---|---|---|---|---|---|"]
        for (jobs, stacks), c in sides.items():
            ratio = c["in_step_over_alternating"]
            lines.append(f"| {jobs} | {stacks} | {c['runs']} | {mean(c['in_step'])} | {mean(c['alternating'])} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders of runs on two stacks or more (spans.jsonl, summary.json)")
    ap.add_argument("--out", type=Path, default=None, help="write PREFIX.json and PREFIX.md")
    a = ap.parse_args(argv)
    try:
        rows = [run_alignment(rd) for rd in a.runs]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"stack_alignment: {e}") from None
    corr, sides = correlations(rows), train_by_side(rows)
    text = render(rows, corr, sides)
    result = {"rows": rows, "correlations": {f"{j}x{k}": v for (j, k), v in corr.items()},
              "train_by_side": {f"{j}x{k}": v for (j, k), v in sides.items()}}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
