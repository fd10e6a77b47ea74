"""Running an arm: plan the groups, drive the scheduler over fresh backends, account the result.

`make_backend(cfg, n_stacks)` builds a backend for a (sub)workload; the runner never asks which
kind it is. The dedicated arm runs each job alone on its own backend (its own GPU), the same
synchronous code path with one job.
"""

from __future__ import annotations

from typing import Callable

from nodus.accounting import add_arrivals, add_slowdowns, summarize
from nodus.backend import Backend
from nodus.config import ArmSpec, RunConfig
from nodus.grouping import balance_groups
from nodus.lengths import predicted_step_tokens
from nodus.messages import Span
from nodus.scheduler import Scheduler, drive

BackendFactory = Callable[[RunConfig, int], Backend]


def plan(cfg: RunConfig, start_versions: dict[str, int] | None = None) -> Scheduler:
    """The scheduler for a (non-dedicated) arm: which jobs form which groups on which stack.
    `start_versions`: jobs resumed from checkpoints start at their last completed step."""
    sv = dict(start_versions or {})
    arr = {j.id: j.arrive_s for j in cfg.jobs if j.arrive_s}  # late jobs (jobs[].arrive_s)
    steps = {j.id: j.steps for j in cfg.jobs}
    work = {j.id: predicted_step_tokens(j) * j.steps for j in cfg.jobs}
    ids = [j.id for j in cfg.jobs]
    policy = cfg.arm.policy
    pinned = all(j.group is not None for j in cfg.jobs)
    waits = cfg.arm.trainer_waits_for_publish

    def split() -> list[list[str]]:
        if pinned:
            return [[j.id for j in cfg.jobs if j.group == g] for g in range(cfg.arm.groups)]
        return balance_groups(work, cfg.arm.groups)

    # Every policy's scheduler: resumed jobs' versions, late jobs' arrivals, the trainer's wait, the
    # cap on jobs under way.
    common = dict(start_versions=sv, arrivals=arr, trainer_waits_for_publish=waits, max_active=cfg.arm.max_active,
                  max_lead=cfg.arm.max_lead)
    if cfg.arm.stacks > 1:
        # Each stack runs the policy over its own jobs: its groups on its engine and trainer.
        per_stack = stack_groups(cfg)
        if policy == "continuous":
            groups = [(s, [j]) for s, gs in enumerate(per_stack) for g in gs for j in g]
        else:  # overlap: the stack's groups; shared-sync: its one group
            groups = [(s, g) for s, gs in enumerate(per_stack) for g in gs]
        return Scheduler(steps, groups, concurrent=True, stagger=policy == "overlap", **common,
                         merge_trains=policy == "continuous", lockstep=cfg.arm.lockstep,
                         offset_stacks=cfg.arm.offset_stacks, hold_apart=cfg.arm.hold_apart)
    if policy in ("shared-sync", "dedicated"):
        return Scheduler(steps, [(0, ids)], concurrent=True, stagger=False, **common)
    if policy == "overlap":
        groups = split()
        return Scheduler(steps, [(0, g) for g in groups], concurrent=True, stagger=True, **common)
    if policy == "continuous":
        # Every job its own group, all generating from the start; the free trainer takes every job
        # whose rollouts are in (one shared batch), and each job generates again as soon as its
        # new adapter is published: the engine's long tails overlap other jobs' training, and the
        # phases of jobs spread by themselves.
        return Scheduler(steps, [(0, [j]) for j in ids], concurrent=True, stagger=False, merge_trains=True, **common)
    if policy == "timeslice":
        # Each stack runs its jobs one after another, dedicated-style; stacks share the GPU.
        stacks = split()
        return Scheduler(steps, [(s, [j]) for s, g in enumerate(stacks) for j in g], concurrent=False, **common)
    raise ValueError(f"unknown policy {policy!r}")


# Adapter slots an engine may have at no measured cost (H200, the shipped LoRA kernel configs, tuned
# for 8): 4 slots ran 8 jobs in 2 groups as fast as 8 (session 22), 16 ran them 11-12% slower and
# 16 jobs in 2 groups 21% slower than 8 (session 23).
FREE_SLOTS = 8


def size_engine_slots(cfg: RunConfig) -> RunConfig:
    """A new run's engine adapter slots (vLLM ``max_loras``): left unset, an overlap run of more
    jobs than ``FREE_SLOTS`` gets as many as its largest group has jobs (``plan``'s groups), or
    ``FREE_SLOTS`` if that is more, not one per job.

    A group generates with its own adapters only. Slots past those cost the engine's steps, used or
    not, and the trainer's beside it under MPS (H200, 512-token graphs, one host a day: 16 jobs in 2
    groups 8326 steps per GPU-hour on 8 slots against 6574 on 16; 8 jobs in 2 groups 6511 / 6036 on
    8 against 5792 / 5303 on 16; session 23). Up to ``FREE_SLOTS`` none was measured (8 jobs on 4
    slots as on 8, session 22), while fewer slots than two overlapping generations' adapters (a
    group's tail beside the next group's start) queue the later requests: the simulator puts 2 jobs
    on 1 slot 8% below 2 slots. Shared-sync, continuous, dedicated and timeslice runs keep one slot
    per job (every job of a batch generates at once). On ``arm.stacks`` > 1 each engine gets slots for
    its own stack's jobs (by the overlap rule within a stack). A set ``engine.max_loras`` is kept. Only new
    configs are sized (``nodus.simulate.config_from_args``: ``nodus sim``, ``run``, ``sweep``, also
    from a config file); ``nodus validate`` and ``fit`` replay a recorded run with its own slots."""
    n = len(cfg.jobs)
    cap = cfg.arm.max_active
    if cfg.engine.max_loras is None and cap is not None and cap < n and cfg.arm.policy != "timeslice":
        # At most max_active jobs run at once: an adapter slot each (the engine keeps every job's
        # adapter on the host, max_cpu_loras, so a queued job's is loaded when it starts).
        return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_loras": cap})})
    if cfg.engine.max_loras is None and cfg.arm.stacks > 1 and cfg.arm.policy != "timeslice":
        # An engine per stack serves its own stack's jobs only: slots for those (an overlap stack's
        # by the rule below, within the stack), not one per job of the run.
        per_stack = stack_groups(cfg)
        most = max(sum(len(g) for g in gs) for gs in per_stack)
        if cfg.arm.policy == "overlap" and most > FREE_SLOTS:
            most = min(most, max(max(len(g) for gs in per_stack for g in gs), FREE_SLOTS))
        if most >= n:
            return cfg
        return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_loras": most})})
    if cfg.engine.max_loras is not None or cfg.arm.policy != "overlap" or cfg.arm.groups < 2 or n <= FREE_SLOTS:
        return cfg
    slots = max(max(len(g) for _, g in plan(cfg).groups), FREE_SLOTS)
    if slots >= n:
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_loras": slots})})


def max_jobs_per_train(sched: Scheduler, stack: int) -> int:
    """The most jobs one Train of ``stack`` can hold: its largest group, or every job of the stack
    when the trainer merges queued groups (continuous)."""
    sizes = [len(ids) for s, ids in sched.groups if s == stack]
    return sum(sizes) if sched.merge_trains else max(sizes)


def n_stacks(cfg: RunConfig) -> int:
    """Engine + trainer stacks on the GPU: timeslice's groups, else ``arm.stacks``."""
    return cfg.arm.groups if cfg.arm.policy == "timeslice" else cfg.arm.stacks


def stack_groups(cfg: RunConfig) -> list[list[list[str]]]:
    """Each of ``arm.stacks`` stacks' groups of job ids (a shared policy's; overlap: ``arm.groups``
    a stack, else one). Pinned jobs (``jobs[].stack``, and ``jobs[].group`` within it for overlap:
    ``nodus validate`` replays a run's own) keep their pins; otherwise the jobs are balanced by
    predicted work into stacks x groups groups (``nodus.grouping.balance_groups``, so every group
    has a job), and the groups go to the stacks heaviest first, each to the lightest stack with
    room."""
    jobs = cfg.resolved().jobs
    k, per = cfg.arm.stacks, cfg.arm.groups if cfg.arm.policy == "overlap" else 1
    if all(j.stack is not None for j in jobs):
        return [[[j.id for j in jobs if j.stack == s and (per == 1 or j.group == g)] for g in range(per)]
                for s in range(k)]
    work = {j.id: predicted_step_tokens(j) * j.steps for j in jobs}
    groups = balance_groups(work, k * per)
    load = [sum(work[j] for j in g) for g in groups]
    mine: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(groups)), key=lambda i: (-load[i], i)):
        s = min((s for s in range(k) if len(mine[s]) < per), key=lambda s: (sum(load[x] for x in mine[s]), s))
        mine[s].append(i)
    return [[groups[i] for i in sorted(m)] for m in mine]


def stack_jobs(cfg: RunConfig) -> list[list[str]]:
    """The job ids of each of ``arm.stacks`` stacks, in job order (``stack_groups``)."""
    order = {j.id: i for i, j in enumerate(cfg.resolved().jobs)}
    return [sorted((j for g in gs for j in g), key=order.get) for gs in stack_groups(cfg)]


def run_spans(cfg: RunConfig, make_backend: BackendFactory, on_progress=None,
              extras: dict | None = None) -> list[list[Span]]:
    """The spans of each GPU's run: one run for a shared arm, one per job for dedicated.
    `extras`, if given, collects each job's final eval and the backends' diagnostics."""
    # A dedicated job has its GPU from its arrival: its run starts then (arrive_s does not apply).
    solos = ([cfg.model_copy(update={"jobs": [j.model_copy(update={"arrive_s": None})]}) for j in cfg.jobs]
             if cfg.arm.policy == "dedicated" else [cfg])
    return [_one(c, make_backend, on_progress, extras) for c in solos]


def _one(cfg: RunConfig, make_backend: BackendFactory, on_progress, extras: dict | None) -> list[Span]:
    backend = make_backend(cfg, n_stacks(cfg))
    try:
        spans = drive(plan(cfg, backend.start_versions()), backend, on_progress)
        if extras is not None:
            extras.setdefault("eval", {}).update(backend.evaluate())
            extras.setdefault("diagnostics", []).append(backend.diagnostics())
        return spans
    finally:
        backend.close()


def late_arrivals(cfg: RunConfig) -> bool:
    """Whether a shared run's jobs start apart: some arrive late (``jobs[].arrive_s``; a dedicated
    job's GPU starts at its arrival, so its run never has one) or queue for a slot (``arm.max_active``
    below the jobs)."""
    capped = cfg.arm.max_active is not None and cfg.arm.max_active < len(cfg.jobs)
    return cfg.arm.policy != "dedicated" and (capped or any(j.arrive_s for j in cfg.jobs))


def dedicated_of(cfg: RunConfig) -> RunConfig:
    """The baseline arm for a config: the same jobs, each alone on its own GPU, no MPS. The arm's
    adapter slots are not the baseline's (``size_engine_slots`` sizes an overlap arm's to its
    groups): its engine gets one slot per job of the arm (``nodus.realrun.baseline_pool``) whatever
    the arm. Its CUDA-graph size stays the arm's, so that an arm without MPS and its baseline share
    one engine (the simulator gives 16 jobs' baseline 2446 steps per GPU-hour with 1024-token graphs
    and with vLLM's 512 alike)."""
    engine = cfg.engine.model_copy(update={"max_loras": None})
    return cfg.model_copy(update={"arm": ArmSpec(policy="dedicated", groups=1, sharing="none"), "engine": engine})


def run_arm(cfg: RunConfig, make_backend: BackendFactory, baseline: bool = True,
            on_progress=None) -> tuple[dict, list[list[Span]]]:
    """Summary (with ratio_vs_dedicated and per-job slowdowns when `baseline`) and the spans."""
    extras: dict = {}
    runs = run_spans(cfg, make_backend, on_progress, extras)
    summary = summarize(runs, late_arrivals=late_arrivals(cfg))
    for job, ev in extras.get("eval", {}).items():
        summary["per_job"][job]["eval"] = ev
    for job in cfg.jobs:
        summary["per_job"][job.id].update(task=job.task, seed=job.seed)
    if late_arrivals(cfg):  # each late or queued job's arrival and wait to start
        capped = cfg.arm.max_active is not None
        add_arrivals(summary, {j.id: j.arrive_s or 0.0 for j in cfg.jobs if j.arrive_s or capped})
    summary["diagnostics"] = extras.get("diagnostics", [])
    summary["arm"] = {"policy": cfg.arm.policy, "groups": cfg.arm.groups, "sharing": cfg.arm.sharing,
                      **({"stacks": cfg.arm.stacks, "stack_jobs": [len(ids) for ids in stack_jobs(cfg)]}
                         if cfg.arm.stacks > 1 else {}),
                      **({"lockstep": True} if cfg.arm.lockstep else {}),
                      **({"offset_stacks": True} if cfg.arm.offset_stacks else {}),
                      **({"hold_apart": cfg.arm.hold_apart} if cfg.arm.hold_apart else {}),
                      **({"max_active": cfg.arm.max_active} if cfg.arm.max_active else {}),
                      **({"max_lead": cfg.arm.max_lead} if cfg.arm.max_lead is not None else {})}
    # Flat copies of the arm, the layout `nodus compare` reads.
    summary.update(policy=cfg.arm.policy, groups=cfg.arm.groups, sharing=cfg.arm.sharing)
    summary["jobs"] = len(cfg.jobs)
    summary["seed"] = cfg.seed
    if baseline:
        if cfg.arm.policy == "dedicated" and cfg.arm.sharing == "none":
            base = summary
        else:
            base = summarize(run_spans(dedicated_of(cfg), make_backend))
        summary["dedicated_steps_per_gpu_hour"] = base["steps_per_gpu_hour"]
        summary["ratio_vs_dedicated"] = (summary["steps_per_gpu_hour"] / base["steps_per_gpu_hour"]
                                         if base["steps_per_gpu_hour"] else None)
        base_pace = (base.get("pace") or {}).get("pace_steps_per_gpu_hour")
        pace = (summary.get("pace") or {}).get("pace_steps_per_gpu_hour")
        summary["pace_ratio_vs_dedicated"] = pace / base_pace if pace and base_pace else None
        add_slowdowns(summary, base)
    return summary, runs
