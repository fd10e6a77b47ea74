"""`nodus validate`: how well the simulator predicts recorded runs it was not fitted on.

For each recorded run folder (config.json, summary.json, spans.jsonl from `nodus run`), the
simulator runs the same configuration twice: replaying the run's own response lengths, and
sampling them from the length models. Errors are relative to the measured value; runs with more
than `fit_max_jobs` jobs are held out (the calibration fits on 1-4 jobs only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nodus.config import ConfigError, build_config
from nodus.simulate import simulate


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a between two rankings (None with fewer than two items)."""
    n = len(a)
    if n < 2:
        return None
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return float(s / (n * (n - 1) / 2))


def error_stats(pred: list[float], meas: list[float]) -> dict:
    """Mean absolute percentage error, worst case and signed bias of predictions (fractions)."""
    if not meas:
        return {"mape": None, "worst": None, "bias": None, "n": 0}
    rel = [(p - m) / m for p, m in zip(pred, meas)]
    return {"mape": float(np.mean(np.abs(rel))), "worst": float(np.max(np.abs(rel))),
            "bias": float(np.mean(rel)), "n": len(rel)}


def _phase_means(spans: list[dict]) -> dict[str, float]:
    out = {}
    for ph in ("generate", "train", "publish"):
        # One span per action: jobs of a group share train/publish spans.
        d = {(s["gpu"], s["group"], s["start_s"], s["end_s"]) for s in spans if s["phase"] == ph}
        if d:
            out[ph] = float(np.mean([e - s for _, _, s, e in d]))
    return out


def load_recorded(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    for f in ("config.json", "summary.json", "spans.jsonl"):
        if not (run_dir / f).is_file():
            raise ConfigError(f"{str(run_dir)!r} is not a recorded run: {f} is missing")
    cfg = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    spans = [json.loads(x) for x in (run_dir / "spans.jsonl").read_text().splitlines() if x.strip()]
    return cfg, summary, spans


def validate(runs: list[str | Path], profile: str, fit_max_jobs: int = 4) -> dict:
    rows = []
    for rd in map(Path, runs):
        cfg, meas, spans = load_recorded(rd)
        cfg["profile"] = profile
        trace = str((rd / "spans.jsonl").resolve())
        # The recorded run's grouping, not a re-balance over the replayed lengths.
        pol = cfg["arm"]["policy"]
        group_key = "group" if pol == "overlap" else "stack"
        groups = {s["job"]: s[group_key] for s in spans} if pol in ("overlap", "timeslice") else {}
        jobs = [dict(j, group=groups.get(j["id"])) for j in cfg["jobs"]]
        replay_cfg = dict(cfg, jobs=[dict(j, lengths={"kind": "replay", "trace": trace, "job": j["id"]}) for j in jobs])
        sampled_cfg = dict(cfg, jobs=[dict(j, lengths=None) for j in jobs])
        rep = simulate(build_config(replay_cfg, f"{rd}/config.json"))
        sam = simulate(build_config(sampled_cfg, f"{rd}/config.json"))
        row = {"run": str(rd), "jobs": len(cfg["jobs"]), "arm": meas.get("arm"),
               "heldout": len(cfg["jobs"]) > fit_max_jobs,
               "measured": {"steps_per_gpu_hour": meas["steps_per_gpu_hour"], "busy": meas["busy"],
                            "phase_s": _phase_means(spans)},
               "replay": {"steps_per_gpu_hour": rep["steps_per_gpu_hour"], "busy": rep["busy"]},
               "sampled": {"steps_per_gpu_hour": sam["steps_per_gpu_hour"], "busy": sam["busy"]},
               "outside_profile": sorted(set(rep["outside_profile"]) | set(sam["outside_profile"]))}
        rows.append(row)
    report: dict = {"profile": profile, "fit_max_jobs": fit_max_jobs, "rows": rows}
    for split, keep in (("heldout", lambda r: r["heldout"]), ("all", lambda r: True)):
        sel = [r for r in rows if keep(r)]
        meas = [r["measured"]["steps_per_gpu_hour"] for r in sel]
        for mode in ("replay", "sampled"):
            pred = [r[mode]["steps_per_gpu_hour"] for r in sel]
            report[f"{split}_{mode}"] = {**error_stats(pred, meas), "kendall_tau": kendall_tau(pred, meas)}
    h = report["heldout_replay"]
    report.update(heldout_mape_replay=h["mape"], heldout_mape_sampled=report["heldout_sampled"]["mape"],
                  worst=h["worst"], bias=h["bias"], kendall_tau=h["kendall_tau"])
    return report


def render_markdown(rep: dict) -> str:
    lines = [f"Simulator (profile `{rep['profile']}`) against recorded runs; held out: more than "
             f"{rep['fit_max_jobs']} jobs.", "",
             "| run | jobs | arm | measured steps/GPU-h | replay | sampled | held out |", "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        arm = r["arm"] or {}
        m = r["measured"]["steps_per_gpu_hour"]
        lines.append(f"| {Path(r['run']).name} | {r['jobs']} | {arm.get('policy')} g={arm.get('groups')} "
                     f"{arm.get('sharing')} | {m:.0f} | {r['replay']['steps_per_gpu_hour']:.0f} "
                     f"({(r['replay']['steps_per_gpu_hour'] - m) / m:+.1%}) | {r['sampled']['steps_per_gpu_hour']:.0f} "
                     f"({(r['sampled']['steps_per_gpu_hour'] - m) / m:+.1%}) | {r['heldout']} |")
    lines += ["", "| split | lengths | MAPE | worst | bias | Kendall tau | n |", "|---|---|---|---|---|---|---|"]
    for split in ("heldout", "all"):
        for mode in ("replay", "sampled"):
            e = rep[f"{split}_{mode}"]
            fmt = (lambda x: "-" if x is None else f"{x:.1%}")
            tau = "-" if e["kendall_tau"] is None else f"{e['kendall_tau']:.2f}"
            lines.append(f"| {split} | {mode} | {fmt(e['mape'])} | {fmt(e['worst'])} | {fmt(e['bias'])} | {tau} | {e['n']} |")
    return "\n".join(lines)
