"""Gate statistics on synthetic data with known answers: bootstrap CIs, A/A spread, verdicts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodus.stats import aa_spread, gate_verdict, paired_bootstrap_ci


def test_bootstrap_covers_true_mean_at_about_the_nominal_rate():
    rng = np.random.default_rng(1)
    true_mean, trials = 0.3, 200
    covered = 0
    for t in range(trials):
        _, lo, hi = paired_bootstrap_ci(rng.normal(true_mean, 1.0, size=100), n_boot=1000, seed=t)
        covered += lo <= true_mean <= hi
    assert 0.88 <= covered / trials <= 0.99


def test_bootstrap_ci_is_narrow_for_big_n_and_centred_on_the_mean():
    diffs = np.random.default_rng(2).normal(-0.1, 1.0, size=20_000)
    mean, lo, hi = paired_bootstrap_ci(diffs, n_boot=2000)
    assert mean == pytest.approx(diffs.mean())
    assert lo < mean < hi and hi - lo < 0.05
    assert lo < -0.1 < hi


def test_bootstrap_is_deterministic_per_seed():
    diffs = np.random.default_rng(3).normal(size=50)
    assert paired_bootstrap_ci(diffs, seed=5) == paired_bootstrap_ci(diffs, seed=5)
    assert paired_bootstrap_ci(diffs, seed=5) != paired_bootstrap_ci(diffs, seed=6)


def test_constant_differences_give_a_point_ci():
    assert paired_bootstrap_ci([0.25] * 10, n_boot=100) == (0.25, 0.25, 0.25)


def test_cluster_bootstrap_is_wider_when_clusters_are_correlated():
    rng = np.random.default_rng(4)
    # 12 clusters of 64 items: a large per-cluster effect and little noise inside a cluster, so
    # the items are far from independent and an item-level CI is overconfident.
    effects = rng.normal(0.0, 0.5, size=12)
    diffs = np.concatenate([e + rng.normal(0, 0.05, size=64) for e in effects])
    labels = [c for c in range(12) for _ in range(64)]
    _, lo_i, hi_i = paired_bootstrap_ci(diffs, n_boot=2000)
    mean_c, lo_c, hi_c = paired_bootstrap_ci(diffs, n_boot=2000, clusters=labels)
    assert mean_c == pytest.approx(diffs.mean())
    assert hi_c - lo_c > 3 * (hi_i - lo_i)


def test_cluster_labels_may_be_tuples():
    mean, lo, hi = paired_bootstrap_ci([1, 1, 0, 0], n_boot=500, clusters=[("a", 0)] * 2 + [("b", 0)] * 2)
    assert mean == 0.5 and lo == 0.0 and hi == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(diffs=[]), "at least one"),
    (dict(diffs=[1.0, float("nan")]), "finite"),
    (dict(diffs=[1.0], alpha=0.0), "alpha"),
    (dict(diffs=[1.0], n_boot=0), "n_boot"),
    (dict(diffs=[1.0, 2.0], clusters=[1]), "labels"),
])
def test_bootstrap_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        paired_bootstrap_ci(**kwargs)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=30), st.floats(-3, 3), st.integers(0, 100))
def test_bootstrap_bounds_and_shift_equivariance(diffs, shift, seed):
    mean, lo, hi = paired_bootstrap_ci(diffs, n_boot=200, seed=seed)
    assert min(diffs) - 1e-9 <= lo <= hi <= max(diffs) + 1e-9
    m2, lo2, hi2 = paired_bootstrap_ci([d + shift for d in diffs], n_boot=200, seed=seed)
    assert (m2, lo2, hi2) == pytest.approx((mean + shift, lo + shift, hi + shift), abs=1e-9)


def test_aa_spread_known_values():
    spread = aa_spread([100.0, 200.0], [110.0, 200.0])
    assert spread["per_seed"] == pytest.approx([10 / 105, 0.0])
    assert spread["max"] == pytest.approx(10 / 105)
    assert spread["mean"] == pytest.approx(5 / 105)


@pytest.mark.parametrize("a, b", [([], []), ([1.0], [1.0, 2.0]), ([0.0], [1.0])])
def test_aa_spread_rejects_bad_input(a, b):
    with pytest.raises(ValueError):
        aa_spread(a, b)


def make_verdict(**overrides) -> dict:
    """A gate verdict for a clearly passing arm, with any input overridden."""
    args = dict(ratios_per_seed=[2.5, 2.4, 2.6], aa_spread=0.02, acc_ci=(0.0, -0.02, 0.02),
                reward_ci=(0.01, -0.01, 0.03))
    return gate_verdict(**{**args, **overrides})


def failed(verdict: dict) -> set[str]:
    return {name for name, c in verdict["criteria"].items() if not c["pass"]}


def test_gate_passes_a_clear_win():
    verdict = make_verdict()
    assert verdict["pass"] and not failed(verdict)
    c = verdict["criteria"]
    assert c["ratio_every_seed"]["value"] == 2.4 and c["ratio_every_seed"]["threshold"] == 2.0
    assert c["gain_above_noise"]["value"] == pytest.approx(1.5)
    assert c["gain_above_noise"]["threshold"] == pytest.approx(0.1)
    assert c["acc_ci_lower"]["value"] == -0.02 and c["acc_ci_lower"]["threshold"] == -0.05


@pytest.mark.parametrize("overrides, criterion", [
    (dict(ratios_per_seed=[2.5, 1.9, 2.6]), "ratio_every_seed"),  # one slow seed is enough to fail
    (dict(ratios_per_seed=[]), "ratio_every_seed"),
    (dict(aa_spread=0.4), "gain_above_noise"),  # 5 x 0.4 = 2.0 > gain 1.5
    (dict(aa_spread=None), "gain_above_noise"),  # no noise estimate, no pass
    (dict(acc_ci=(-0.03, -0.06, 0.0)), "acc_ci_lower"),
    (dict(acc_ci=None), "acc_ci_lower"),
    (dict(reward_ci=(-0.2, -0.3, -0.1)), "reward_ci_lower"),
])
def test_gate_fails_on_each_criterion(overrides, criterion):
    verdict = make_verdict(**overrides)
    assert not verdict["pass"]
    assert criterion in failed(verdict)


def test_gate_thresholds_are_parameters():
    assert make_verdict(min_ratio=3.0)["pass"] is False
    assert make_verdict(acc_ci=(-0.03, -0.06, 0.0), min_lower=-0.1)["pass"] is True
    assert make_verdict(aa_spread=0.4, spread_mult=1.0)["pass"] is True
    assert make_verdict(acc_ci=(0.0, -0.05, 0.05))["pass"] is True  # the bound itself passes
