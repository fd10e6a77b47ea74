"""Statistics of the equal-learning gate: paired bootstrap CIs, the A/A spread and the verdict.

The gate asks two questions of an arm against the dedicated baseline: is it much faster (steps per
GPU-hour ratio on every seed, and a gain well above the run-to-run noise measured by repeating one
arm, the A/A spread), and does it learn no worse (the lower ends of paired 95% CIs on eval accuracy
and mean training reward differences stay above a small negative margin). Pure numpy functions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

# Bootstrap draws are done in chunks so n_boot x n indices never need more than this many cells.
_MAX_CELLS = 1 << 22


def paired_bootstrap_ci(
    diffs: Sequence[float],
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: int = 0,
    clusters: Sequence[Hashable] | None = None,
) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean paired difference and its percentile-bootstrap (1 - alpha) CI.

    Without `clusters`, each difference is resampled independently. With `clusters` (one label per
    difference, e.g. (job, seed) for per-eval-item differences) whole clusters are resampled, which
    keeps the CI honest when the differences inside a cluster are correlated (items answered by
    the same adapter); each resample's mean is over all differences in the drawn clusters."""
    d = np.asarray(diffs, dtype=float).ravel()
    if d.size == 0:
        raise ValueError("paired_bootstrap_ci needs at least one difference")
    if not np.all(np.isfinite(d)):
        raise ValueError("paired_bootstrap_ci: differences must be finite")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha} must be in (0, 1)")
    if n_boot < 1:
        raise ValueError(f"n_boot={n_boot} must be >= 1")
    if clusters is None:
        sums, counts = d, np.ones_like(d)
    else:
        if len(clusters) != d.size:
            raise ValueError(f"clusters has {len(clusters)} labels for {d.size} differences")
        index: dict[Hashable, int] = {}
        ids = np.array([index.setdefault(c, len(index)) for c in clusters])
        sums, counts = np.bincount(ids, weights=d), np.bincount(ids).astype(float)
    rng = np.random.default_rng(seed)
    n = sums.size
    chunk = max(1, _MAX_CELLS // n)
    means = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        rows = min(chunk, n_boot - start)
        draw = rng.integers(0, n, size=(rows, n))
        means[start:start + rows] = sums[draw].sum(axis=1) / counts[draw].sum(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(d.mean()), float(lo), float(hi)


def aa_spread(values_run1: Sequence[float], values_run2: Sequence[float]) -> dict:
    """Relative difference |a - b| / mean(a, b) between two runs of the same arm, per seed.

    values_run1[i] and values_run2[i] are the same seed's steps per GPU-hour in the two runs.
    Returns {"per_seed": [...], "max": ..., "mean": ...}; the gate uses the max (conservative)."""
    a = np.asarray(values_run1, dtype=float)
    b = np.asarray(values_run2, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"aa_spread needs two equal-length non-empty sequences, got {a.shape} and {b.shape}")
    if np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("aa_spread: steps per GPU-hour must be positive")
    rel = np.abs(a - b) / ((a + b) / 2)
    return {"per_seed": [float(x) for x in rel], "max": float(rel.max()), "mean": float(rel.mean())}


def _criterion(value: float | None, threshold: float, passed: bool, rule: str) -> dict:
    return {"value": value, "threshold": threshold, "pass": bool(passed), "rule": rule}


def gate_verdict(
    ratios_per_seed: Sequence[float],
    aa_spread: float | None,
    acc_ci: tuple[float, float, float] | None,
    reward_ci: tuple[float, float, float] | None,
    min_ratio: float = 2.0,
    spread_mult: float = 5.0,
    min_lower: float = -0.05,
) -> dict:
    """Each criterion's value, threshold and pass/fail, and the overall pass (all criteria pass).

    `aa_spread` is a relative spread (e.g. aa_spread(...)["max"]); the CIs are (mean, lo, hi) of
    arm-minus-baseline differences. A missing input (None, or no ratios) fails its criterion: the
    gate passes on evidence, never by default."""
    ratios = [float(r) for r in ratios_per_seed]
    worst = min(ratios) if ratios else None
    gain = float(np.mean(ratios)) - 1.0 if ratios else None
    noise = spread_mult * aa_spread if aa_spread is not None else None
    criteria = {
        "ratio_every_seed": _criterion(
            worst, min_ratio, worst is not None and worst >= min_ratio,
            "min over seeds of the steps-per-GPU-hour ratio >= threshold"),
        "gain_above_noise": _criterion(
            gain, noise, gain is not None and noise is not None and gain > noise,
            f"mean ratio - 1 > {spread_mult} x A/A spread"),
        "acc_ci_lower": _criterion(
            acc_ci[1] if acc_ci else None, min_lower, acc_ci is not None and acc_ci[1] >= min_lower,
            "lower end of the eval-accuracy difference CI >= threshold"),
        "reward_ci_lower": _criterion(
            reward_ci[1] if reward_ci else None, min_lower,
            reward_ci is not None and reward_ci[1] >= min_lower,
            "lower end of the mean-reward difference CI >= threshold"),
    }
    return {"pass": all(c["pass"] for c in criteria.values()), "criteria": criteria}
