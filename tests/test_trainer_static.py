"""The trainer's fixed-shape step (``real.graphed``: what a CUDA graph replays) against the eager
step, on a tiny random Qwen3 on the CPU. The GPU only adds the capture; the program is this one."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from real.graphed import WIDTH_QUANTUM, bucket_widths, round_width, static_plan  # noqa: E402
from real.trainer import JobBatch  # noqa: E402
from tests.test_trainer import (JOBS, make_batches, make_trainer, max_rel_diff, params,  # noqa: E402
                                two_step_data, with_old_logprobs)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


KL_JOBS = {**JOBS, "c": dict(JOBS["c"], beta=0.05), "d": dict(rank=4, alpha=4, lr=1e-2, seed=14, beta=0.1,
                                                             epsilon_low=0.1, epsilon_high=0.3)}


def _steps(jobs):
    step1, step2 = two_step_data()
    if "d" in jobs:
        reference = make_trainer({})
        step1 = dict(step1, d=make_batches(seed=40)["a"])
        step2 = dict(step2, d=with_old_logprobs(make_batches(seed=41)["b"], reference, seed=9))
    return step1, step2


@pytest.mark.parametrize("jobs", [JOBS, KL_JOBS], ids=["grpo-bnpo-drgrpo", "with-kl"])
@pytest.mark.parametrize("mb_tokens", [4096, 96])
def test_static_step_gives_the_eager_update(jobs, mb_tokens):
    """Mixed ranks, all loss types, on- and off-policy rows, KL terms, one or many micro-batches
    with empty padding rows: the same losses, grad norms and updates to fp64 rounding."""
    step1, step2 = _steps(jobs)
    trainers = {m: make_trainer(jobs, dtype=torch.float64, max_tokens_per_microbatch=mb_tokens, step_mode=m)
                for m in ("eager", "static")}
    stats = {m: [t.train_step(step1), t.train_step(step2)] for m, t in trainers.items()}
    for got, want in zip(stats["static"], stats["eager"]):
        for j in jobs:
            assert got[j].loss == pytest.approx(want[j].loss, rel=1e-10, abs=1e-14)
            assert got[j].grad_norm == pytest.approx(want[j].grad_norm, rel=1e-10)
            assert got[j].step == want[j].step
    for j in jobs:
        assert max_rel_diff(params(trainers["static"], j), params(trainers["eager"], j)) < 1e-10
    assert trainers["static"].programs, "the fixed-shape path did not run"
    if mb_tokens == 96:
        assert trainers["static"].last_microbatches > 1


def test_static_step_audit_matches_eager():
    batches = make_batches(seed=5)
    base = make_trainer(dtype=torch.float64)
    mine = {j: [t.numpy() + 0.25 * (i % 2) for i, t in enumerate(base.logprobs(j, b))] for j, b in batches.items()}
    audits = {}
    for m in ("eager", "static"):
        t = make_trainer(dtype=torch.float64, step_mode=m, max_tokens_per_microbatch=96)
        t.train_step(batches, audit={"a": mine["a"], "c": mine["c"]})
        audits[m] = t.last_audit
    assert set(audits["static"]) == {"a", "c"}
    for j in ("a", "c"):
        for k in ("max_abs", "mean_abs"):
            assert audits["static"][j][k] == pytest.approx(audits["eager"][j][k], rel=1e-9, abs=1e-12)
    assert audits["static"]["a"]["max_abs"] == pytest.approx(0.25, abs=1e-9)


def test_an_audit_of_some_sequences_counts_only_theirs():
    """A sequence's audit entry may be None (an audit of a sample of the responses): its tokens are
    left out of max and mean, on the eager and the fixed-shape path alike; a job with no audited
    sequence gets no audit."""
    batches = make_batches(seed=5)
    base = make_trainer(dtype=torch.float64)
    mine = {j: [t.numpy() + 0.25 * (i % 2) for i, t in enumerate(base.logprobs(j, b))] for j, b in batches.items()}
    even = [x if i % 2 == 0 else None for i, x in enumerate(mine["a"])]  # the unshifted ones
    odd = [x if i % 2 else None for i, x in enumerate(mine["c"])]  # the shifted ones
    for m in ("eager", "static"):
        t = make_trainer(dtype=torch.float64, step_mode=m, max_tokens_per_microbatch=96)
        t.train_step(batches, audit={"a": even, "c": odd, "b": [None] * len(mine["b"])})
        assert set(t.last_audit) == {"a", "c"}, m
        assert t.last_audit["a"]["max_abs"] < 1e-9, m
        # Only shifted tokens counted: the mean is the shift (a full audit's would be about half).
        assert t.last_audit["c"]["max_abs"] == pytest.approx(0.25, abs=1e-9), m
        assert t.last_audit["c"]["mean_abs"] == pytest.approx(0.25, abs=1e-9), m


def test_static_step_nan_job_fails_alone():
    """A job whose loss is NaN is not stepped; the others redo the step on the padded path and
    get exactly the update of a step without it."""
    step1, step2 = two_step_data()
    bad = step2["b"]
    poisoned = dict(step2, b=JobBatch(bad.input_ids, bad.completion_mask, [float("nan")] * len(bad.advantages),
                                      old_logprobs=bad.old_logprobs))
    t = make_trainer(dtype=torch.float64, step_mode="static", max_tokens_per_microbatch=96)
    clean = make_trainer(dtype=torch.float64, max_tokens_per_microbatch=96)
    t.train_step(step1)
    clean.train_step(step1)
    before = params(t, "b")
    stats = t.train_step(poisoned)
    clean.train_step({j: step2[j] for j in ("a", "c")})
    assert stats["b"].failed and not stats["a"].failed
    assert max_rel_diff(params(t, "b"), before) == 0.0
    for j in ("a", "c"):
        assert max_rel_diff(params(t, j), params(clean, j)) < 1e-10


def test_prepared_programs_serve_steps_of_fewer_jobs_and_shorter_rows():
    """A run's programs are built up front (``prepare_static``, as the warm-up does); its steps,
    also those of fewer jobs, use only those, and their updates are still the eager ones."""
    t = make_trainer(dtype=torch.float64, step_mode="static", max_tokens_per_microbatch=96)
    e = make_trainer(dtype=torch.float64, max_tokens_per_microbatch=96)
    keys = t.prepare_static(slots=3, rank=8, width=32)
    assert sorted({k.width for k in keys}, reverse=True) == bucket_widths(32) and all(k.slots == 3 for k in keys)
    assert {(k.rows, k.width) for k in keys} >= {(96 // w, w) for w in bucket_widths(32)}  # full programs
    assert {(k.rows, k.width) for k in keys} >= {(96 // w // 2, w) for w in bucket_widths(32)}  # tails
    batches = make_batches(seed=3)
    for tr in (t, e):
        tr.train_step(batches)
        tr.train_step({"a": batches["a"], "c": batches["c"]})
    assert set(t.programs) == set(keys)
    assert set(t.build_s) == {str(k) for k in keys} and all(v >= 0 for v in t.build_s.values())
    for j in JOBS:
        assert max_rel_diff(params(t, j), params(e, j)) < 1e-10


def test_static_plan_buckets_rows():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(5, 300, n).tolist() for n in (64, 64, 64, 64)]
    plan = static_plan(lengths, 16384)
    longest = max(map(max, lengths))
    widths = bucket_widths(round_width(longest))
    assert widths[0] >= longest and widths == sorted(widths, reverse=True) and widths[-1] >= 32
    assert all(w % WIDTH_QUANTUM == 0 for w in widths)
    rows = [r for _, _, mb in plan for r in mb]
    assert sorted(rows) == sorted((k, s) for k in range(4) for s in range(64))
    padded = 0
    for i, (R, T, mb) in enumerate(plan):
        last = i == len(plan) - 1
        assert T in widths and 0 < len(mb) <= R
        # Full programs, but a half one for the step's last rows when they fit in it.
        assert R == 16384 // T or (last and R == 16384 // T // 2 and len(mb) <= R)
        first = lengths[mb[0][0]][mb[0][1]]
        assert all(lengths[k][s] <= first <= T for k, s in mb)
        assert T == min(w for w in widths if w >= first)  # the narrowest bucket holding it
        padded += R * T
    # Buckets keep padding near the eager planner's (a single width padded 2.2x on the H200 rows).
    assert padded < 1.6 * sum(map(sum, lengths)) + 16384
    assert {T for _, T, _ in static_plan(lengths, 16384, width_hint=512)} <= set(bucket_widths(512))
    assert static_plan(lengths, 16384, width_hint=128)[0][1] == widths[0]  # rows longer than the hint


def test_graphed_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_trainer(step_mode="graphed")
    with pytest.raises(ValueError, match="step_mode"):
        make_trainer(step_mode="fast")


def test_a_failed_build_releases_every_program_and_trains_eager(monkeypatch):
    """A program build (a CUDA-graph capture on the GPU) that fails after others were built: the
    trainer drops them all, their stacks and graph pool (their memory would starve the eager step),
    records why, and its steps give the eager trainer's updates: no job loses anything."""
    import weakref

    import real.trainer as rt

    step1, step2 = two_step_data()
    eager = make_trainer(JOBS, dtype=torch.float64, max_tokens_per_microbatch=96, step_mode="eager")
    failing = make_trainer(JOBS, dtype=torch.float64, max_tokens_per_microbatch=96, step_mode="static")
    built, real_step = [], rt.StaticStep  # weak references: the test keeps no program alive

    def build_then_fail(*args, **kwargs):
        if len(built) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        st = real_step(*args, **kwargs)
        built.append(weakref.ref(st))
        return st

    freed = []  # at each give-back of memory: whether the program built is gone by then
    monkeypatch.setattr(rt, "StaticStep", build_then_fail)
    monkeypatch.setattr(rt.MultiLoRATrainer, "_free_memory", staticmethod(lambda: freed.append(built[0]() is None)))
    got = [failing.train_step(step1), failing.train_step(step2)]
    want = [eager.train_step(step1), eager.train_step(step2)]
    assert len(built) == 1 and failing.step_mode == "eager"
    # The build failed inside the step: the program built before it lived on in the step's frame at
    # the release, and was gone at the give-back after the fixed-shape path returned.
    assert freed == [False, True]
    assert failing.graph_error.startswith("OutOfMemoryError: CUDA out of memory (simulated)")
    assert failing.programs == [] and failing._states == {} and failing._pool is None
    for g, w in zip(got, want):
        for j in JOBS:
            assert g[j].loss == pytest.approx(w[j].loss, rel=1e-10, abs=1e-14)
            assert g[j].step == w[j].step
    for j in JOBS:
        assert max_rel_diff(params(failing, j), params(eager, j)) < 1e-10
