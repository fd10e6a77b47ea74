"""real.stepstats: each generation's engine steps, the time between them and the collections."""

import gc

import pytest

from real.stepstats import EngineStepStats, GcPauses, summarise_generations


class FakeGc:
    def __init__(self):
        self.n, self.s = 0, 0.0

    def totals(self):
        return self.n, self.s

    def collect(self, s):
        self.n, self.s = self.n + 1, self.s + s


def _stats(g=None):
    """An EngineStepStats whose clock is set by hand (``st.now``)."""
    st = EngineStepStats(g)
    st.now = 0.0
    st.clock = lambda: st.now
    return st


def _begin(st, tag, submitted, now):
    st.now = submitted
    st.begin(tag, st.mark(), now)


def test_each_generation_from_its_submit_to_its_last_step():
    g = FakeGc()
    st = _stats(g)
    st.step(9.0, 9.1)            # nothing open: no one's step
    _begin(st, "a", 9.9, 10.0)   # 0.1 s building and adding its requests
    st.step(10.5, 10.52, 0.01)   # 0.5 s after the submit, a 10 ms engine step + 10 ms collecting
    g.collect(0.004)
    g.collect(0.0)
    _begin(st, "b", 10.6, 10.62)  # another generation joins the running batch after the last step
    st.step(10.63, 10.66, 0.03)  # a 30 ms step serving both: a waited 0.11 s since that step, b 0.01 s
    a = st.finish("a")
    st.step(10.66, 10.67)        # only b left (no engine time given: all of it is the step)
    g.collect(0.006)
    b = st.finish("b")
    want_a = {"submit_s": 0.1, "steps": 2, "step_s": 0.04, "step_max_s": 0.03, "between_s": 0.61, "collect_s": 0.01,
              "gc_collections": 2, "gc_s": 0.004}
    assert {k: a[k] for k in want_a} == pytest.approx(want_a)
    want_b = {"submit_s": 0.02, "steps": 2, "step_s": 0.04, "between_s": 0.01, "collect_s": 0.0,
              "gc_collections": 1, "gc_s": 0.006}
    assert {k: b[k] for k in want_b} == pytest.approx(want_b)
    # The parts add up to the generation's time from its submit to its last step's end.
    assert a["submit_s"] + a["between_s"] + a["step_s"] + a["collect_s"] == pytest.approx(10.66 - 9.9)
    assert b["submit_s"] + b["between_s"] + b["step_s"] + b["collect_s"] == pytest.approx(10.67 - 10.6)
    # The worker's totals count each step once (the shared step too), never a step with nothing open,
    # and its between the busy period's time outside steps and collection, submits included.
    assert a["cumulative_at_begin"]["steps"] == 0 and b["cumulative"]["steps"] == 3
    assert b["cumulative"]["step_s"] == pytest.approx(0.01 + 0.03 + 0.01)
    assert b["cumulative"]["between_s"] == pytest.approx(0.6 + 0.11 + 0.0)
    c = b["cumulative"]
    assert c["between_s"] + c["step_s"] + c["collect_s"] == pytest.approx(10.67 - 9.9)
    assert c["gc_collections"] == 3 and c["gc_s"] == pytest.approx(0.01)
    assert b["cumulative"]["seq"] > a["cumulative"]["seq"] > a["cumulative_at_begin"]["seq"]
    assert st.finish("b") is None and st.open == {}
    # Idle between generations: a collection there is no one's, and the next period opens at its submit.
    g.collect(0.05)
    _begin(st, "c", 20.0, 20.05)
    st.step(20.1, 20.2)
    c = st.finish("c")
    assert c["between_s"] == pytest.approx(0.05) and c["gc_collections"] == 0
    assert c["cumulative"]["between_s"] - c["cumulative_at_begin"]["between_s"] == pytest.approx(0.1)
    assert c["cumulative"]["gc_collections"] == 3  # the idle one not added


def test_without_a_collector_no_gc_figures():
    st = _stats()
    _begin(st, "a", 0.0, 0.0)
    st.step(0.0, 0.01)
    out = st.finish("a")
    assert "gc_s" not in out and "gc_s" not in out["cumulative"] and out["steps"] == 1


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


def test_summary_counts_each_engine_step_once():
    g = FakeGc()
    st = _stats(g)
    recs = []
    # Two overlapping generations on stack 0: 4 steps of 10 ms, 2 of them shared; b submitted
    # before the first step, with a collection during its submit; b finishes first.
    _begin(st, "a", 0.0, 0.0)
    g.collect(0.25)
    _begin(st, "b", 0.0, 0.0)    # the same step count as a's begin: the sequence orders them
    st.step(0.0, 0.01, 0.01)
    st.step(0.01, 0.02, 0.01)
    recs.append({**st.finish("b"), "seconds": 0.02, "stack": 0})
    g.collect(0.5)               # between two finishes in the same step: still in the busy period
    st.step(0.02, 0.03, 0.01)
    recs.append({**st.finish("a"), "seconds": 0.03, "stack": 0})
    # Idle, with a collection no one's.
    g.collect(1.0)
    _begin(st, "c", 0.04, 0.04)
    st.step(0.05, 0.06, 0.01)    # 10 ms between
    recs.append({**st.finish("c"), "seconds": 0.02, "stack": 0})
    # Another engine (a second stack): one generation of 2 steps of 20 ms.
    st2 = _stats(FakeGc())
    _begin(st2, "d", 0.0, 0.0)
    st2.step(0.0, 0.02, 0.02)
    st2.step(0.02, 0.04, 0.02)
    recs.append({**st2.finish("d"), "seconds": 0.04, "stack": 1})
    recs.append({"seconds": 0.0, "steps": 0})  # no steps: left out
    s = summarise_generations(recs)
    assert s["generations"] == 4
    assert s["steps"] == 6  # 3 + 1 + 2, not 3 + 2 + 1 + 2
    assert s["mean_step_ms"] == pytest.approx((4 * 10 + 2 * 20) / 6, abs=1e-3)  # rounded to 0.1 us
    assert s["step_ms_per_generation"] == {"min": pytest.approx(10.0), "median": pytest.approx(10.0),
                                           "max": pytest.approx(20.0)}
    assert s["step_max_ms"] == pytest.approx(20.0)
    busy = 0.03 + 0.02 + 0.04  # stack 0's two busy periods, stack 1's one
    assert s["step_share"] == pytest.approx(0.08 / busy, abs=1e-4)
    assert s["between_share"] == pytest.approx(0.01 / busy, abs=1e-4)
    assert s["collect_share"] == pytest.approx(0.0)
    assert s["gc_collections"] == 2 and s["gc_s"] == pytest.approx(0.75)  # the idle one left out
    assert summarise_generations([]) == {"generations": 0}
    # Records without the cumulative totals (or the collector) give what they can.
    bare = [{k: v for k, v in r.items() if not k.startswith("cumulative")} for r in recs[:2]]
    assert "steps" not in summarise_generations(bare) and summarise_generations(bare)["generations"] == 2
    st3 = _stats()
    _begin(st3, "e", 0.0, 0.0)
    st3.step(0.0, 0.01)
    assert "gc_s" not in summarise_generations([{**st3.finish("e"), "seconds": 0.01}])
