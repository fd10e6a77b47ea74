"""Simulator speed (pytest-benchmark; reports, does not pass/fail on absolute times).

    python -m pytest benchmarks --benchmark-only

Targets on a 2-core machine: one 16-job x 20-step run under 1 s; the full sweep (jobs 2,4,8,16 x
groups 1,2,4 x all arms x 3 seeds) under 60 s with 2 workers.
"""

import pytest

from nodus.runner import run_spans
from nodus.simulate import config_from_args, sweep
from sim import backend_factory


@pytest.mark.benchmark(group="sim")
@pytest.mark.parametrize("policy,groups", [("overlap", 2), ("shared-sync", 1), ("overlap", 4)])
def test_one_16_job_run(benchmark, policy, groups):
    cfg = config_from_args(jobs=16, steps=20, policy=policy, groups=groups, sharing="mps")
    make = backend_factory(cfg.profile)
    spans = benchmark(lambda: run_spans(cfg, make))
    assert spans


@pytest.mark.benchmark(group="sweep")
def test_full_sweep_2_workers(benchmark):
    result = benchmark.pedantic(lambda: sweep(workers=2, progress=False), rounds=1, iterations=1)
    benchmark.extra_info["runs"] = len(result["rows"])
