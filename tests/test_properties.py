"""Scheduler invariants over random workloads, run through the simulator (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodus.accounting import audit_on_policy, job_overlaps
from nodus.config import build_config
from nodus.runner import run_spans
from nodus.tasks import TASK_NAMES
from sim import backend_factory

FACTORY = backend_factory("h200-qwen3-0.6b")

workloads = st.fixed_dictionaries({
    "n": st.integers(1, 6),
    "steps": st.lists(st.integers(1, 3), min_size=6, max_size=6),
    "tasks": st.lists(st.sampled_from(TASK_NAMES), min_size=6, max_size=6),
    "prompts": st.integers(1, 3),
    "responses": st.integers(1, 4),
    "max_new": st.integers(1, 64),
    "policy": st.sampled_from(["shared-sync", "overlap", "timeslice", "dedicated", "continuous"]),
    "groups": st.integers(1, 4),
    "sharing": st.sampled_from(["none", "mps"]),
    "max_num_seqs": st.integers(1, 16),
    "seed": st.integers(0, 10),
    # shared-sync on two stacks: free-running, in lockstep, started out of step, or held apart too
    "stacks": st.sampled_from(["one", "free", "lockstep", "offset", "hold"]),
    "hold": st.sampled_from([0.1, 0.25, 0.5]),
    # jobs[].arrive_s of jobs 1..5 (job 0 arrives at the start), or all at the start
    "arrivals": st.one_of(st.none(), st.lists(st.floats(0.0, 8.0), min_size=5, max_size=5)),
    "max_active": st.one_of(st.none(), st.integers(1, 4)),  # arm.max_active (shared policies)
    "max_lead": st.one_of(st.none(), st.integers(0, 2)),  # arm.max_lead (continuous, overlap)
})


def _cfg(w):
    n = w["n"]
    groups = max(2, min(w["groups"], n)) if w["policy"] in ("overlap", "timeslice") and n >= 2 else 1
    policy = w["policy"] if (w["policy"] not in ("overlap",) or n >= 2) else "shared-sync"
    arm = {"policy": policy, "groups": groups, "sharing": w["sharing"]}
    if policy == "shared-sync" and n >= 2 and w["stacks"] != "one":
        arm.update(stacks=2, lockstep=w["stacks"] == "lockstep", offset_stacks=w["stacks"] in ("offset", "hold"),
                   hold_apart=w["hold"] if w["stacks"] == "hold" else 0.0)
    late = [0.0] + w["arrivals"] if w["arrivals"] and not arm.get("lockstep") else [0.0] * 6
    if w["max_active"] and policy != "dedicated" and not arm.get("lockstep"):
        arm["max_active"] = w["max_active"]
    if w["max_lead"] is not None and policy in ("continuous", "overlap"):
        arm["max_lead"] = w["max_lead"]
    return build_config({
        "jobs": [{"task": w["tasks"][i], "steps": w["steps"][i], "prompts_per_step": w["prompts"],
                  "responses_per_prompt": w["responses"], "max_new_tokens": w["max_new"],
                  **({"arrive_s": late[i]} if late[i] else {})} for i in range(n)],
        "arm": arm,
        "engine": {"max_num_seqs": w["max_num_seqs"]},
        "seed": w["seed"]})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_invariants(w):
    cfg = _cfg(w)
    runs = run_spans(cfg, FACTORY)
    spans = [s for r in runs for s in r]
    # On-policy, and a job's own phases never overlap.
    assert audit_on_policy(spans) == []
    assert job_overlaps(spans) == []
    # Every started phase ends, after it started; every job ran all its steps.
    assert all(s.end_s >= s.start_s for s in spans)
    for j in cfg.jobs:
        trains = [s for s in spans if s.job == j.id and s.phase == "train"]
        assert [s.attrs["step"] for s in sorted(trains, key=lambda s: s.start_s)] == list(range(j.steps))
    # Work is conserved: every sampled response is generated once and trained on once.
    for s in spans:
        if s.phase == "generate":
            assert len(s.attrs["response_tokens"]) == s.attrs["n_sequences"]
            assert all(1 <= x <= cfg.jobs[0].max_new_tokens for x in s.attrs["response_tokens"])
    gen = {(s.job, s.attrs["step"]): s.attrs["prompt_tokens"] + sum(s.attrs["response_tokens"])
           for s in spans if s.phase == "generate"}
    tr = {(s.job, s.attrs["step"]): s.attrs["tokens"] for s in spans if s.phase == "train"}
    assert gen == tr
    # At most arm.max_active jobs under way at once: from a job's first generation to its last train.
    if cfg.arm.max_active:
        spans_of = {j.id: [s for s in spans if s.job == j.id and s.phase in ("generate", "train")] for j in cfg.jobs}
        events = sorted([(min(x.start_s for x in v), 1) for v in spans_of.values()]
                        + [(max(x.end_s for x in v), -1) for v in spans_of.values()], key=lambda e: (e[0], e[1]))
        under_way = 0
        for _, d in events:
            under_way += d
            assert under_way <= cfg.arm.max_active
    # arm.max_lead: a job (continuous: its own group) generates step s only once every other job
    # under way in its stack (started, with steps left) has trained step s - max_lead - 1.
    if cfg.arm.max_lead is not None and cfg.arm.policy == "continuous":
        gens = {(s.job, s.attrs["step"]): s.start_s for s in spans if s.phase == "generate"}
        trained = {(s.job, s.attrs["step"]): s.end_s for s in spans if s.phase == "train"}
        first = {j.id: gens[(j.id, 0)] for j in cfg.jobs}
        for (job, step), t in gens.items():
            need = step - cfg.arm.max_lead - 1
            for k in cfg.jobs:
                if k.id != job and need >= 0 and k.steps > need and first[k.id] <= t - 1e-9:
                    assert trained[(k.id, need)] <= t + 1e-9, (job, step, k.id)
    # A job sharing the GPU starts no earlier than it arrives (a dedicated one has its GPU from then).
    if cfg.arm.policy != "dedicated":
        for j in cfg.jobs:
            first = min(s.start_s for s in spans if s.job == j.id and s.phase == "generate")
            assert first >= (j.arrive_s or 0.0) - 1e-9


@settings(max_examples=15, deadline=None)
@given(workloads)
def test_same_seed_same_timeline(w):
    cfg = _cfg(w)
    a = [s.to_dict() for r in run_spans(cfg, FACTORY) for s in r]
    b = [s.to_dict() for r in run_spans(cfg, FACTORY) for s in r]
    assert a == b
