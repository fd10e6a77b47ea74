"""`nodus fit`: refit a profile's trainer and publish costs from recorded real runs.

    nodus fit RUN_DIR... --base PROFILE --out PROFILE.json [--fit-max-jobs 4]

A microbenchmark (`nodus calibrate`) times the trainer on uniform rows and nothing else; a real
step also pads long-tailed rows, saves every adapter inside the train phase and computes its
audit. This fits what the simulator charges for those phases on the runs themselves, using only
runs with at most `fit_max_jobs` jobs per GPU (a dedicated arm is one job per GPU), so that the
shared 8- and 16-job runs stay held out for `nodus validate`.

Train: seconds = a * micro-batches + b * padded tokens + c * adapters + d * regroup tokens,
relative-error least squares, non-negative, with the micro-batches packed exactly as the trainer
packs them (`nodus.microbatch`). When every fitted step has the same adapter count, c cannot be
told from a and is kept from the base profile; runs with one job per step never regroup, which
leaves d at 0. Publish: the controller's wait per published adapter.
Everything else (decode, prefill, sharing) is kept from the base profile.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from calibration.validate import jobs_per_gpu, load_recorded
from nodus.config import ConfigError
from nodus.microbatch import microbatch_costs, step_rows


def train_samples(run_dir: Path) -> tuple[list[dict], list[float]]:
    """Per train action of a run: its micro-batches' padded tokens, adapter count and seconds;
    and the run's publish waits per adapter."""
    cfg, _, spans = load_recorded(run_dir)
    cap = cfg["trainer"]["max_tokens_per_microbatch"]
    gen = {(s["gpu"], s["job"], s["attrs"].get("step")): s for s in spans if s["phase"] == "generate"}
    actions: dict[tuple, list[dict]] = {}
    for s in spans:
        if s["phase"] in ("train", "publish"):
            actions.setdefault((s["phase"], s["gpu"], s["group"], s["start_s"], s["end_s"]), []).append(s)
    samples, publish = [], []
    for (phase, gpu, _, start, end), members in sorted(actions.items()):
        if phase == "publish":
            publish.append((end - start) / len(members))
            continue
        rows = []
        for m in members:
            g = gen.get((gpu, m["job"], m["attrs"].get("step")))
            if g is None:
                raise ConfigError(f"{run_dir}: train span of {m['job']} step {m['attrs'].get('step')} "
                                  "has no generate span to take its rows from")
            rows.append(step_rows(g["attrs"]["prompt_tokens"], g["attrs"]["n_sequences"], g["attrs"]["response_tokens"]))
        mbs, regroup = microbatch_costs(rows, cap)
        samples.append({"microbatches": len(mbs), "padded_tokens": sum(mbs), "regroup_tokens": regroup,
                        "adapters": len(members), "s": end - start})
    return samples, publish


def nonneg_rel_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin sum(((X w - y) / y)^2) over w >= 0: the best unconstrained fit over every subset
    of free coefficients (few columns, so exhaustive)."""
    A, t = X / y[:, None], np.ones(len(y))
    best, best_err = np.zeros(X.shape[1]), float(np.sum(t ** 2))
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            w, *_ = np.linalg.lstsq(A[:, cols], t, rcond=None)
            if np.any(w < 0):
                continue
            full = np.zeros(X.shape[1])
            full[list(cols)] = w
            err = float(np.sum((A @ full - t) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def fit(runs: list[str | Path], base: str, fit_max_jobs: int = 4) -> dict:
    """A profile: the base's, with trainer and publish costs fitted on the eligible runs."""
    from sim.profile import Profile, add_source, profile_dict

    used, skipped, samples, publish = [], [], [], []
    for rd in map(Path, runs):
        cfg, _, _ = load_recorded(rd)
        if jobs_per_gpu(cfg) > fit_max_jobs:
            skipped.append(str(rd))
            continue
        s, p = train_samples(rd)
        samples += s
        publish += p
        used.append(str(rd))
    if len(samples) < 3:
        raise ConfigError(f"nodus fit: {len(samples)} train steps in runs with <= {fit_max_jobs} jobs per GPU "
                          f"(need >= 3); held out: {skipped}")
    prof = profile_dict(base)
    y = np.array([s["s"] for s in samples])
    mb = np.array([s["microbatches"] for s in samples], dtype=float)
    tok = np.array([s["padded_tokens"] for s in samples], dtype=float)
    ad = np.array([s["adapters"] for s in samples], dtype=float)
    rg = np.array([s["regroup_tokens"] for s in samples], dtype=float)
    # A coefficient is fitted only where the runs vary its feature apart from the others: one
    # adapter count everywhere leaves c to the base profile, no regrouping leaves d at 0.
    cols, names = [mb, tok], ["a", "b"]
    if len(set(ad)) > 1:
        cols.append(ad)
        names.append("c")
    if rg.max() > 0:
        cols.append(rg)
        names.append("d")
    base_c = prof["train"]["s_per_adapter"]
    target = y if "c" in names else y - base_c * ad
    w = dict(zip(names, nonneg_rel_lstsq(np.stack(cols, 1), target)))
    a, b = w["a"], w["b"]
    c = w.get("c", base_c)
    d = w.get("d", 0.0)
    c_source = "fitted" if "c" in names else "base profile (one adapter count in the fitted runs)"
    pred = a * mb + b * tok + c * ad + d * rg
    rel = (pred - y) / y
    prof["train"]["per_microbatch"] = {"a_s": float(a), "b_s_per_unit": float(b)}
    prof["train"]["s_per_adapter"] = float(c)
    prof["train"]["s_per_regroup_token"] = float(d)
    prof["train"]["max_profiled_tokens"] = int(max(tok.max(), prof["train"].get("max_profiled_tokens") or 0))
    if publish:
        prof["publish"]["save_s_per_adapter"] = float(np.median(publish))
    add_source(prof, f"nodus fit on {len(used)} run(s)")
    prof.setdefault("measurements", {})["fit_runs"] = {
        "runs": used, "held_out": skipped, "fit_max_jobs": fit_max_jobs, "train_steps": len(samples),
        "train_fit": {"a_s_per_microbatch": float(a), "b_s_per_padded_token": float(b),
                      "c_s_per_adapter": float(c), "c_source": c_source,
                      "d_s_per_regroup_token": float(d),
                      "d_source": "fitted" if "d" in names else "0 (no regrouping in the fitted runs)",
                      "mape": float(np.mean(np.abs(rel))), "worst": float(np.max(np.abs(rel)))},
        "publish_s_per_adapter": float(np.median(publish)) if publish else None,
        "padded_tokens_range": [int(tok.min()), int(tok.max())]}
    Profile.model_validate(prof)
    return prof


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, fit_max_jobs: int = 4) -> dict:
    from sim.profile import refuse_existing, write_profile

    refuse_existing(out, "nodus fit")
    prof = fit(runs, base, fit_max_jobs)
    write_profile(prof, out, "nodus fit")
    return prof
