"""real.stepstats: each generation's engine steps, the time between them and the collections."""

import gc

import pytest

from real.stepstats import EngineStepStats, GcPauses, summarise_generations


class FakeGc:
    def __init__(self):
        self.n, self.s = 0, 0.0

    def totals(self):
        return self.n, self.s


def test_steps_between_and_collections_per_generation():
    g = FakeGc()
    st = EngineStepStats(g)
    st.begin("a", 10.0)
    st.step(10.5, 10.51)   # 0.5 s after the submit, then a 10 ms step
    g.n, g.s = 2, 0.004
    st.begin("b", 10.52)   # another generation joins the running batch
    st.step(10.53, 10.56)  # 20 ms after the last step, a 30 ms step serving both
    a = st.finish("a")
    st.step(10.56, 10.57)  # only b left
    g.n, g.s = 3, 0.010
    b = st.finish("b")
    assert a == {"steps": 2, "step_s": pytest.approx(0.04), "step_max_s": pytest.approx(0.03),
                 "between_s": pytest.approx(0.52), "gc_collections": 2, "gc_s": pytest.approx(0.004)}
    assert b == {"steps": 2, "step_s": pytest.approx(0.04), "step_max_s": pytest.approx(0.03),
                 "between_s": pytest.approx(0.02), "gc_collections": 1, "gc_s": pytest.approx(0.006)}
    assert st.finish("b") is None and st.open == {}
    # Idle between generations: the wait before the next one's first step counts from its submit.
    st.begin("c", 20.0)
    st.step(20.1, 20.2)
    assert st.finish("c")["between_s"] == pytest.approx(0.1)


def test_without_a_collector_no_gc_figures():
    st = EngineStepStats()
    st.begin("a", 0.0)
    st.step(0.0, 0.01)
    out = st.finish("a")
    assert "gc_s" not in out and out["steps"] == 1


def test_gc_pauses_count_real_collections():
    pauses = GcPauses().install()
    try:
        before = pauses.totals()
        for _ in range(3):
            gc.collect()
        n, s = pauses.totals()
        assert n - before[0] >= 3 and s > before[1]
    finally:
        pauses.uninstall()
    assert pauses._callback not in gc.callbacks
    n0 = pauses.totals()
    gc.collect()
    assert pauses.totals() == n0


def test_summary_of_generations():
    recs = [{"seconds": 1.0, "steps": 100, "step_s": 0.8, "step_max_s": 0.02, "between_s": 0.15,
             "gc_collections": 1, "gc_s": 0.01},
            {"seconds": 2.0, "steps": 100, "step_s": 1.6, "step_max_s": 0.05, "between_s": 0.3,
             "gc_collections": 3, "gc_s": 0.05},
            {"seconds": 0.0, "steps": 0, "step_s": 0.0, "step_max_s": 0.0, "between_s": 0.0}]
    s = summarise_generations(recs)
    assert s["generations"] == 2 and s["steps"] == 200
    assert s["mean_step_ms"] == pytest.approx(12.0)
    assert s["step_ms_per_generation"] == {"min": pytest.approx(8.0), "median": pytest.approx(12.0),
                                           "max": pytest.approx(16.0)}
    assert s["step_max_ms"] == pytest.approx(50.0)
    assert s["step_share"] == pytest.approx(0.8) and s["between_share"] == pytest.approx(0.15)
    assert s["gc_collections"] == 4 and s["gc_s"] == pytest.approx(0.06) and s["gc_share"] == pytest.approx(0.02)
    assert summarise_generations([]) == {"generations": 0}
    assert "gc_s" not in summarise_generations([{k: v for k, v in recs[0].items() if not k.startswith("gc")}])
