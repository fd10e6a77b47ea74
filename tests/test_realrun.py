"""The real backend's process pool, with stand-in clusters (no processes): one cluster per
(sharing, stacks), restarted larger when a run needs more adapter slots than it has."""

import real.backend
from nodus.config import build_config
from nodus.realrun import ClusterPool


class FakeCluster:
    started: list = []

    def __init__(self, opts, sharing, n_stacks, max_loras, **kw):
        self.sharing, self.n_stacks, self.max_loras, self.closed = sharing, n_stacks, max_loras, False
        FakeCluster.started.append(self)

    def close(self):
        self.closed = True


def _cfg(jobs, policy="shared-sync"):
    return build_config({"jobs": [{"task": "sorting"} for _ in range(jobs)],
                         "arm": {"policy": policy, "groups": 1, "sharing": "none"}})


def test_pool_reserves_slots_and_restarts_a_cluster_too_small(monkeypatch):
    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    # Reserved for 8 jobs: a one-job run first still gets 8 slots, and the 8-job run reuses it.
    pool = ClusterPool(opts=None, min_loras=8)
    first = pool(_cfg(1), 1)
    assert first.max_loras == 8 and pool(_cfg(8), 1) is first and len(FakeCluster.started) == 1
    # Without the reservation, the one-job cluster is too small for 8 jobs: restarted with 8.
    small = ClusterPool(opts=None)
    one = small(_cfg(1), 1)
    eight = small(_cfg(8), 1)
    assert one.max_loras == 1 and one.closed and eight.max_loras == 8 and eight is not one
