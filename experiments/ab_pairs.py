"""A paired A/B of one run-loop setting: runs that differ by that setting alone, each paired with its
twin of the same invocation (one folder of gpu_arms runs: one cluster, one machine) and seed.

    python experiments/ab_pairs.py RUN_DIR... --variant flat [--out PREFIX]
    python experiments/ab_pairs.py RUN_DIR... --policies shared-sync,continuous [--out PREFIX]

gpu_arms names a run by its settings (``...-audr1-flat-sp4-k2-mb4k-s1``); a setting of the run loop
(``:flat``, ``:rK``, ``:aN``, ``:np``) keeps every process, so an invocation can run both sides on
one cluster, back to back. A run whose name holds ``-VARIANT-`` is side B; its twin is the run of
the same folder whose name is the same without it (side A). Runs without a twin are listed, not
paired. ``--policies A,B`` pairs by the arm's policy instead: side B the runs whose name starts with
policy B (``continuous+mps-...``), each with the run of the same folder named the same with policy A
(``shared-sync+mps-...``): an A/B of two policies run back to back on one machine (session 73).
Per run: steps per GPU-hour and the pace (``summary.json``), the mean generate, train and
publish action (a group's spans of one step merged, ``calibration.validate.action_seconds``; gpu_arms'
``phase_seconds`` counts each job's generation apart), the engines' mean step
(``diagnostics.engine_steps``) and the host's steal. Per pair, B over A; over the pairs, the mean of
B over A with a paired bootstrap 95% CI (``nodus.stats.paired_bootstrap_ci``, on the log ratios:
with a handful of pairs the percentile bootstrap runs narrow, so the sign count is given too).
Writes PREFIX.json and PREFIX.md when --out is given.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from calibration.validate import action_seconds
from nodus.stats import paired_bootstrap_ci
from nodus.timeline import read_text

PHASES = ("generate", "train", "publish")
FIGURES = ("steps_per_gpu_hour", "pace", "generate_s", "train_s", "publish_s", "engine_step_ms")


def run_figures(run_dir: str | Path) -> dict:
    """One run's figures (see the module's doc); a phase the run never recorded is None."""
    d = Path(run_dir)
    try:
        summary = json.loads(read_text(d / "summary.json"))
        spans = [json.loads(line) for line in read_text(d / "spans.jsonl").splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{d}: not a run folder with summary.json and spans.jsonl ({err})") from None
    actions = action_seconds(spans, PHASES)  # a group's spans of one step merged, as nodus validate's actions
    out = {"run": d.name, "folder": d.parent.name, "seed": summary.get("seed"),
           "steps_per_gpu_hour": summary["steps_per_gpu_hour"],
           "pace": (summary.get("pace") or {}).get("pace_steps_per_gpu_hour")}
    for phase in PHASES:
        secs = list(actions[phase].values())
        out[f"{phase}_s"] = sum(secs) / len(secs) if secs else None
    diag = (summary.get("diagnostics") or [{}])[0]
    gens = (diag.get("engine_steps") or {}).get("generations") or []
    steps = sum(g.get("steps", 0) for g in gens)
    out["engine_step_ms"] = 1000 * sum(g.get("step_s", 0.0) for g in gens) / steps if steps else None
    out["steal"] = (diag.get("host_monitor") or {}).get("steal_frac")
    return out


def policy_pair(text: str) -> tuple[str, str]:
    """``A,B`` (two policies, e.g. shared-sync,continuous) as (A, B); refused by name otherwise."""
    from nodus.config import POLICIES

    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in POLICIES]
    if len(parts) != 2 or bad or parts[0] == parts[1]:
        raise ValueError(f"--policies {text!r}: two different policies A,B of {', '.join(POLICIES)} "
                         f"(side A first), e.g. shared-sync,continuous")
    return parts[0], parts[1]


def _twin_name(name: str, variant: str | None, policies: tuple[str, str] | None) -> str | None:
    """Side A's run name for side B's ``name``; None where ``name`` is no side-B run."""
    if policies is not None:
        a, b = policies
        head = name[:len(b) + 1]
        return a + name[len(b):] if head in (b + "+", b + "-") else None
    tag = f"-{variant}-"
    return name.replace(tag, "-", 1) if tag in name else None


def pair_runs(run_dirs: list[str | Path], variant: str | None,
              policies: tuple[str, str] | None = None) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """(pairs of (A, B) folders, runs left without a twin), in one parent folder: B's name holds
    ``-variant-`` and A's is the same name without it; or, with ``policies`` (A, B), B's name starts
    with policy B and A's is the same name with policy A."""
    if policies is None and (not variant or "-" in variant):
        raise ValueError(f"--variant {variant!r}: one name part of a run key, e.g. flat (no dashes)")
    dirs = [Path(d) for d in run_dirs]
    by_name = {(d.parent.resolve(), d.name): d for d in dirs}
    pairs, used = [], set()
    for b in dirs:
        twin = _twin_name(b.name, variant, policies)
        a = by_name.get((b.parent.resolve(), twin)) if twin else None
        if a is not None:
            pairs.append((a, b))
            used.update({a, b})
    return pairs, [d for d in dirs if d not in used]


def compare(run_dirs: list[str | Path], variant: str | None, seed: int = 0,
            policies: tuple[str, str] | None = None) -> dict:
    pairs, alone = pair_runs(run_dirs, variant, policies)
    if not pairs:
        what = (f"no run of policy {policies[1]} beside its twin of policy {policies[0]}" if policies
                else f"no run named with -{variant}- beside its twin without it")
        raise ValueError(f"no pair: {what} in one folder ({len(alone)} run(s) given)")
    label = f"{policies[1]} over {policies[0]}" if policies is not None else variant
    rows = []
    for a, b in pairs:
        fa, fb = run_figures(a), run_figures(b)
        ratio = {k: (fb[k] / fa[k] if fa[k] and fb[k] is not None else None) for k in FIGURES}
        rows.append({"folder": fa["folder"], "seed": fa["seed"], "a": fa, "b": fb, "b_over_a": ratio})
    summary = {}
    for k in FIGURES:
        logs = [math.log(r["b_over_a"][k]) for r in rows if r["b_over_a"][k]]
        if logs:
            m, lo, hi = paired_bootstrap_ci(logs, seed=seed)
            summary[k] = {"b_over_a": math.exp(m), "ci95": [math.exp(lo), math.exp(hi)], "pairs": len(logs),
                          "b_higher": sum(x > 0 for x in logs)}
    return {"variant": label, "policies": list(policies) if policies is not None else None, "pairs": rows,
            "summary": summary, "unpaired": [str(d) for d in alone]}


def _fmt(v, k) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if k in ("steps_per_gpu_hour", "pace") else f"{v:.3f}" if k.endswith("_s") else f"{v:.2f}"


def markdown(res: dict) -> str:
    v = res["variant"]
    pol = res.get("policies")
    side = (f"side B the runs of `{pol[1]}`, side A their twins of `{pol[0]}`" if pol
            else "side B the runs with it, side A their twins without it")
    lines = [f"Paired A/B of `{v}`: {side} (same invocation folder, same seed).", "",
             "| folder | seed | " + " | ".join(f"{k} A / B" for k in FIGURES) + " |",
             "|---|---|" + "---|" * len(FIGURES)]
    for r in res["pairs"]:
        lines.append(f"| {r['folder']} | {r['seed']} | " + " | ".join(
            f"{_fmt(r['a'][k], k)} / {_fmt(r['b'][k], k)}" for k in FIGURES) + " |")
    lines += ["", "| figure | B over A (mean of pairs) | 95% CI (paired bootstrap) | pairs B higher |",
              "|---|---|---|---|"]
    for k, s in res["summary"].items():
        lines.append(f"| {k} | {s['b_over_a']:.3f} | [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] | "
                     f"{s['b_higher']} of {s['pairs']} |")
    if res["unpaired"]:
        lines += ["", "Runs without a twin (not paired): " + ", ".join(f"`{u}`" for u in res["unpaired"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders of gpu_arms invocations")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--variant", help="the run key's part that marks side B, e.g. flat")
    which.add_argument("--policies", metavar="A,B",
                       help="pair by the arm's policy: side A's, side B's (e.g. shared-sync,continuous)")
    ap.add_argument("--out", help="PREFIX: write PREFIX.json and PREFIX.md")
    a = ap.parse_args(argv)
    try:
        res = compare(a.runs, a.variant, policies=policy_pair(a.policies) if a.policies else None)
    except ValueError as err:
        raise SystemExit(f"ab_pairs: {err}")
    md = markdown(res)
    print(md)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
        Path(a.out + ".md").write_text(md)


if __name__ == "__main__":
    main()
