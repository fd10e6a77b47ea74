"""The backend-agnostic scheduler: which group generates, trains and publishes when.

A pure state machine in the shape of vLLM v1's scheduler: `start()` and `on_result()` return the
actions to issue; `drive()` glues it to a backend. It knows nothing of SimPy, torch or vLLM.

Each group loops generate -> train -> publish. The trainer of a stack runs one Train at a time;
groups waiting for it queue in arrival order (with `merge_trains`, the trainer takes every queued
group in one Train, and one Publish follows it: the "continuous" policy, one job per group). A
Train ends with its adapters saved, so the trainer takes the next group's Train while the engine
loads them (the Publish): a group's own next Generate still waits for its Publish. The engine
accepts Generate actions from several groups at once (continuous batching joins them).

Jobs may arrive late (``arrivals``, RunConfig ``jobs[].arrive_s``): a job takes no part in its
group's generations before its arrival and joins the first one that starts after it, at a step
boundary; a group none of whose unfinished jobs has arrived generates when the first of them does
(``Generate.not_before_s``). Staggered and timesliced groups start in order of arrival. With
``max_active`` at most that many jobs are under way (first generation to last train); the rest
queue by arrival, then job order, and a group with none to run waits until a slot frees.

Strictly on-policy: a job's rollouts for step s are sampled from adapter version s, only after
version s was published to the engine; the trainer consumes only rollouts tagged with the job's
current version. Any violation raises StaleRolloutError before it can corrupt a job.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from nodus.messages import (
    Action, Generate, GenerateDone, JobUpdate, Publish, PublishDone, Result, RolloutRequest, Rollouts,
    Span, Train, TrainDone,
)


class StaleRolloutError(RuntimeError):
    """A rollout was (or would be) sampled from, or trained against, a non-current adapter."""


class SchedulerError(RuntimeError):
    """The backend answered with something the scheduler did not ask for."""


@dataclass
class _Job:
    id: str
    steps: int
    version: int = 0  # adapter version = optimizer steps completed
    published: int = 0  # newest version the engine serves
    failed: str | None = None
    started: bool = False  # in a Generate yet (max_active counts the started jobs still running)

    @property
    def active(self) -> bool:
        return self.failed is None and self.version < self.steps


@dataclass
class _Group:
    index: int
    stack: int
    jobs: list[str]
    # pending | generating | queued | training | publishing | holding | leading (max_lead) | waiting
    # (for a slot) | done
    state: str = "pending"
    rollouts: tuple[Rollouts, ...] = ()
    generations: int = 0


@dataclass
class Scheduler:
    """groups: list of (stack, job ids). Groups of one stack run concurrently when `concurrent`,
    else one after another (timeslice: each stack runs its jobs dedicated-style, in turn)."""

    steps: dict[str, int]
    groups: list[tuple[int, list[str]]]
    concurrent: bool = True
    stagger: bool = True  # overlap: group g starts generating when group g-1's first generation ends
    trainer_waits_for_publish: bool = True  # hold the trainer until a group's Publish is done
    merge_trains: bool = False  # the free trainer takes every queued group at once (one Train, one Publish)
    # Stacks in lockstep: a group's next Generate after its Publish waits until no group of any stack
    # is generating, training or publishing, then every waiting group generates at once.
    lockstep: bool = False
    # Stacks started out of step: stack k > 0 starts when stack k-1's first generation ends (it
    # generates while stack k-1 trains); after that each stack goes at its own pace.
    offset_stacks: bool = False
    # Stacks held apart (RunConfig arm.hold_apart): a stack's next Generate carries a not-before time
    # that keeps its start this share of its cycle (times 2 / stacks) from every other stack's latest
    # start (_hold_until). 0: never held.
    hold_apart: float = 0.0
    start_versions: dict[str, int] = field(default_factory=dict)  # resumed jobs: last completed step
    # Seconds of the backend's clock at which each job arrives (missing: 0, at the start).
    arrivals: dict[str, float] = field(default_factory=dict)
    # The most jobs under way at once (RunConfig arm.max_active; None: no cap): a job arrived beyond
    # it queues (by arrival, then job order) and joins its group's first generation after a slot frees.
    max_active: int | None = None
    # A group's lead bound (RunConfig arm.max_lead; None: unbounded): its next Generate waits while
    # its jobs would be more than this many steps ahead of the least advanced job under way in its
    # stack, and goes once that job's training step lands. With the continuous policy, jobs whose
    # responses are short would otherwise run ahead and finish early, leaving the run's last
    # seconds to fewer jobs. 0: every job of a stack generates step s only once each has trained
    # step s - 1 (each still trains as soon as its own rollouts are in).
    max_lead: int | None = None
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.jobs = {j: _Job(j, s) for j, s in self.steps.items()}
        for j, v in self.start_versions.items():
            # A resumed job starts from its checkpoint, already published to the engine.
            self.jobs[j].version = self.jobs[j].published = v
            self.jobs[j].started = v > 0
        if self.max_active is not None and self.max_active < 1:
            raise ValueError(f"max_active={self.max_active}: at least one job must be able to run")
        if self.max_lead is not None and self.max_lead < 0:
            raise ValueError(f"max_lead={self.max_lead}: a lead bound is a number of steps >= 0")
        self._order = {j: i for i, (_, ids) in enumerate(self.groups) for j in ids}
        self._groups = [_Group(i, stack, list(ids)) for i, (stack, ids) in enumerate(self.groups)]
        seen = [j for _, ids in self.groups for j in ids]
        if sorted(seen) != sorted(self.jobs):
            raise ValueError(f"every job must be in exactly one group; groups hold {seen}")
        unknown = sorted(set(self.arrivals) - set(self.jobs))
        if unknown:
            raise ValueError(f"arrivals name jobs that are in no group: {unknown}")
        bad = {j: t for j, t in self.arrivals.items() if not t >= 0}
        if bad:
            raise ValueError(f"arrival times must be seconds >= 0; got {bad}")
        self._group_of = {j: g for g in self._groups for j in g.jobs}
        # action id -> (the groups it serves, the action): a merged Train or Publish serves several.
        self._inflight: dict[str, tuple[list[_Group], Action]] = {}
        self._trainer_busy: dict[int, bool] = {}
        self._train_queue: dict[int, deque[_Group]] = {}
        for g in self._groups:
            self._trainer_busy.setdefault(g.stack, False)
            self._train_queue.setdefault(g.stack, deque())
        self._next_id = 0
        self._holding: list[_Group] = []  # lockstep: groups published, waiting for the other stacks
        self._now = 0.0  # the backend's clock as the latest result told it
        self._starts: dict[int, list[float]] = {}  # stack -> when each of its Generates was set to start
        self._holds: dict[int, list[float]] = {}  # stack -> seconds each of those starts was held
        self._held_s: dict[str, float] = {}  # Generate action id -> seconds it was held (hold_apart)
        # hold_apart: Generate action id -> its start as the hold rule counts it (the scheduler's
        # clock at dispatch, plus any hold), on its spans as released_s: a backend's engine may start
        # it later (a busy host), and the rule's gaps are between these, not the engine's starts.
        self._released_s: dict[str, float] = {}
        self._stack_seq = self._stack_order()  # the order offset stacks start in, each cueing the next

    # -- public interface -------------------------------------------------------------------
    def start(self) -> list[Action]:
        actions: list[Action] = []
        for j, v in sorted(self.start_versions.items()):
            if v > 0:
                self.spans.append(Span(j, self._group_of[j].index, "publish", 0.0, 0.0,
                                       self._group_of[j].stack, {"version": v, "resumed": True}))
        stacks = self._stack_seq
        for stack in stacks[:1] if self.offset_stacks else stacks:
            actions += self._start_stack(stack)
        return actions

    def _stack_order(self) -> list[int]:
        """The order offset stacks start in: by the first of their jobs in the queue for a slot
        (arrival, then job order; ``_admissible``), so the first stack to start holds a job that
        can start. Stack order when every job arrives at once. (By stack index, a first stack whose
        jobs arrive later, or queue behind another stack's under ``max_active``, would never
        generate, and the stacks it cues would never start.)"""
        def head(stack: int) -> tuple:
            return min(((self._arrival(j), self._order[j]) for g in self._groups if g.stack == stack
                        for j in g.jobs if self.jobs[j].active), default=(math.inf, math.inf))
        return sorted(self._trainer_busy, key=lambda k: (head(k), k))

    def _start_stack(self, stack: int) -> list[Action]:
        """A stack's first Generate(s): its first group to arrive (timeslice, overlap's stagger),
        else all."""
        groups = self._pending(stack)
        if not self.concurrent or self.stagger:
            groups = groups[:1]
        return [x for g in groups for x in self._generate(g)]

    def _slots_free(self) -> float:
        """max_active less the jobs under way (started, not finished or failed); inf without a cap."""
        if self.max_active is None:
            return float("inf")
        return self.max_active - sum(1 for j in self.jobs.values() if j.started and j.active)

    def _admissible(self, fresh: list[_Job], t: float) -> list[_Job]:
        """Of ``fresh`` (a group's jobs not yet started), those arrived by ``t`` that a free slot
        takes now: the free slots go to every group's waiting jobs in order of arrival, then of job."""
        arrived = [j for j in fresh if self._arrival(j.id) <= t + 1e-9]
        if self.max_active is None or not arrived:
            return arrived
        queue = sorted((j for j in self.jobs.values() if not j.started and j.active
                        and self._arrival(j.id) <= t + 1e-9),
                       key=lambda j: (self._arrival(j.id), self._order[j.id]))
        first = {j.id for j in queue[:max(int(self._slots_free()), 0)]}
        return [j for j in arrived if j.id in first]

    def _wake(self) -> list[Action]:
        """max_active: every group waiting for a slot tries again (a job may have ended, or the job
        queued before its own may have started); max_lead: so does every group held at its lead bound
        (the least advanced job of its stack may have trained)."""
        if self.max_active is None and self.max_lead is None:
            return []
        return [x for g in self._groups if g.state in ("waiting", "leading") for x in self._generate(g)]

    def _arrival(self, job_id: str) -> float:
        """When the job arrives; a job resumed from a checkpoint was under way before: at once."""
        return 0.0 if self.start_versions.get(job_id) else self.arrivals.get(job_id, 0.0)

    def _pending(self, stack: int) -> list[_Group]:
        """The stack's groups yet to start, the first to have an unfinished job arrive first (in
        group order where they arrive together, as without arrivals)."""
        def first(g: _Group) -> float:
            return min((self._arrival(j) for j in g.jobs if self.jobs[j].active), default=0.0)
        return sorted((g for g in self._groups if g.stack == stack and g.state == "pending"),
                      key=lambda g: (first(g), g.index))

    def _cue_next_stack(self, stack: int) -> list[Action]:
        """offset_stacks: the stack after ``stack`` starts, if it has not (its groups all pending)."""
        if not self.offset_stacks:
            return []
        later = self._stack_seq[self._stack_seq.index(stack) + 1:]
        if not later:
            return []
        if all(g.state == "pending" for g in self._groups if g.stack == later[0]):
            return self._start_stack(later[0])
        return []

    def on_result(self, result: Result) -> list[Action]:
        try:
            groups, action = self._inflight.pop(result.action_id)
        except KeyError:
            raise SchedulerError(f"result for unknown action {result.action_id!r}") from None
        self._now = max(self._now, result.end_s)
        if isinstance(result, GenerateDone):
            actions = self._on_generated(groups[0], action, result)
        elif isinstance(result, TrainDone):
            actions = self._on_trained(groups, action, result)
        elif isinstance(result, PublishDone):
            actions = self._on_published(groups, action, result)
        else:
            raise SchedulerError(f"unknown result type {type(result).__name__}")
        return actions + self._wake()

    def done(self) -> bool:
        return not self._inflight and all(g.state == "done" for g in self._groups)

    # -- transitions ------------------------------------------------------------------------
    def _id(self, kind: str) -> str:
        self._next_id += 1
        return f"{kind}-{self._next_id}"

    def _generate(self, g: _Group, not_before: float | None = None) -> list[Action]:
        active = [self.jobs[j] for j in g.jobs if self.jobs[j].active]
        if not active:
            g.state = "done"
            return self._after_group_done(g)
        if self._too_far_ahead(g):
            g.state = "leading"  # tried again after each result (_wake), as a group waiting for a slot
            return []
        # Jobs yet to arrive (or, under max_active, yet to get a slot) wait for a later generation.
        # A group with none to run waits for the first arrival, or, all slots taken, for a slot.
        t = max(self._now, not_before if not_before is not None else self._now)
        running = [j for j in active if j.started]
        eligible = running + self._admissible([j for j in active if not j.started], t)
        if not eligible and all(self._arrival(j.id) > t + 1e-9 for j in active):
            t = not_before = min(self._arrival(j.id) for j in active)  # none arrived: the first to
            eligible = self._admissible(active, t)
        if not eligible:  # arrived, but every slot is taken or goes to a job queued before them
            g.state = "waiting"  # tried again after each result (_wake)
            return []
        chosen = {j.id for j in eligible}
        active = [j for j in active if j.id in chosen]  # in the group's job order
        for job in active:
            job.started = True
        reqs = []
        for job in active:
            if job.published != job.version:
                raise StaleRolloutError(
                    f"job {job.id}: engine serves version {job.published} but the current adapter is "
                    f"version {job.version}; refusing to sample")
            reqs.append(RolloutRequest(job.id, step=job.version, adapter_version=job.version))
        a = Generate(self._id("gen"), g.index, g.stack, tuple(reqs), not_before)
        held = 0.0 if not_before is None else not_before - self._now
        self._starts.setdefault(g.stack, []).append(self._now + held)
        self._holds.setdefault(g.stack, []).append(held)
        if not_before is not None:
            self._held_s[a.action_id] = held
        if self.hold_apart > 0:
            self._released_s[a.action_id] = self._now + held
        g.state = "generating"
        self._inflight[a.action_id] = ([g], a)
        return [a]

    def _on_generated(self, g: _Group, a: Generate, r: GenerateDone) -> list[Action]:
        asked = {q.job_id: q for q in a.requests}
        got = {ro.job_id: ro for ro in r.rollouts}
        if set(got) != set(asked):
            raise SchedulerError(f"{a.action_id}: asked rollouts for {sorted(asked)}, got {sorted(got)}")
        for ro in r.rollouts:
            job = self.jobs[ro.job_id]
            if ro.adapter_version != job.version or ro.step != job.version:
                raise StaleRolloutError(
                    f"job {ro.job_id}: rollouts sampled from version {ro.adapter_version} for step "
                    f"{ro.step}, but the current version is {job.version}")
            self.spans.append(Span(ro.job_id, g.index, "generate", ro.start_s, ro.end_s, g.stack, {
                "step": ro.step, "adapter_version": ro.adapter_version, "n_sequences": ro.n_sequences,
                "prompt_tokens": ro.prompt_tokens, "response_tokens": list(ro.response_tokens),
                "mean_reward": ro.mean_reward,
                **({"held_s": round(self._held_s[a.action_id], 6)} if a.action_id in self._held_s else {}),
                **({"released_s": round(self._released_s[a.action_id], 6)} if a.action_id in self._released_s
                   else {})}))
        self._held_s.pop(a.action_id, None)
        self._released_s.pop(a.action_id, None)
        g.rollouts = r.rollouts
        g.generations += 1
        g.state = "queued"
        self._train_queue[g.stack].append(g)
        actions = self._pump_trainer(g.stack)
        if g.generations == 1:
            actions += self._cue_next_stack(g.stack)
        if self.concurrent and self.stagger and g.generations == 1:
            nxt = self._pending(g.stack)
            if nxt:
                actions += self._generate(nxt[0])
        return actions

    def _pump_trainer(self, stack: int) -> list[Action]:
        if self._trainer_busy[stack] or not self._train_queue[stack]:
            return []
        q = self._train_queue[stack]
        groups = [q.popleft() for _ in range(len(q) if self.merge_trains else 1)]
        expected, batches = [], []
        for g in groups:
            for ro in g.rollouts:
                job = self.jobs[ro.job_id]
                if ro.adapter_version != job.version:
                    raise StaleRolloutError(f"job {ro.job_id}: trainer would consume version {ro.adapter_version} "
                                            f"rollouts but the current version is {job.version}")
                expected.append(job.version)
                batches.append(ro)
            g.state = "training"
        a = Train(self._id("train"), groups[0].index, stack, tuple(batches), tuple(expected))
        self._trainer_busy[stack] = True
        self._inflight[a.action_id] = (groups, a)
        return [a]

    def _on_trained(self, groups: list[_Group], a: Train, r: TrainDone) -> list[Action]:
        ups: dict[str, JobUpdate] = {u.job_id: u for u in r.updates}
        if set(ups) != {b.job_id for b in a.batches}:
            raise SchedulerError(f"{a.action_id}: trained {sorted(ups)}, asked {[b.job_id for b in a.batches]}")
        stack = groups[0].stack
        versions = []
        for b, expected in zip(a.batches, a.expected_versions):
            job, u = self.jobs[b.job_id], ups[b.job_id]
            attrs = {"step": b.step, "consumed_version": b.adapter_version, "tokens": u.tokens,
                     "loss": u.loss, "grad_norm": u.grad_norm, "jobs_in_batch": len(a.batches)}
            if u.failed:
                job.failed = u.failed
                attrs["failed"] = u.failed
            else:
                if u.new_version != expected + 1:
                    raise SchedulerError(f"job {b.job_id}: trainer returned version {u.new_version} "
                                         f"after step on version {expected}")
                job.version = u.new_version
                versions.append((job.id, job.version))
            attrs["new_version"] = job.version
            self.spans.append(Span(b.job_id, self._group_of[b.job_id].index, "train", r.start_s, r.end_s, stack,
                                   attrs))
        for g in groups:
            g.rollouts = ()
        if not versions:
            self._trainer_busy[stack] = False
            return self._pump_trainer(stack) + self._next_generation(groups)
        a2 = Publish(self._id("pub"), groups[0].index, stack, tuple(versions))
        for g in groups:
            g.state = "publishing"
        self._inflight[a2.action_id] = (groups, a2)
        if self.trainer_waits_for_publish:
            return [a2]
        # The trainer's part is done (the adapters are saved): it takes the next queued group now.
        self._trainer_busy[stack] = False
        return [a2] + self._pump_trainer(stack)

    def _on_published(self, groups: list[_Group], a: Publish, r: PublishDone) -> list[Action]:
        if set(r.versions) != set(a.versions):
            raise SchedulerError(f"{a.action_id}: published {r.versions}, asked {a.versions}")
        stack = groups[0].stack
        for job_id, v in r.versions:
            self.jobs[job_id].published = v
            self.spans.append(Span(job_id, self._group_of[job_id].index, "publish", r.start_s, r.end_s, stack,
                                   {"version": v}))
        if self.trainer_waits_for_publish:
            self._trainer_busy[stack] = False
            pumped = self._pump_trainer(stack)
            return pumped + self._next_generation(groups)
        return self._next_generation(groups)

    def _next_generation(self, groups: list[_Group]) -> list[Action]:
        """The groups' next Generate; in lockstep, held until no group of any stack is mid-step,
        then every held group's at once."""
        if not self.lockstep:
            return [x for g in groups for x in self._generate(g, self._hold_until(g.stack))]
        for g in groups:
            g.state = "holding"
        self._holding += groups
        if any(g.state in ("generating", "queued", "training", "publishing") for g in self._groups):
            return []
        held, self._holding = self._holding, []
        return [x for g in held for x in self._generate(g)]

    def _too_far_ahead(self, g: _Group) -> bool:
        """max_lead: whether the group's next step is more than max_lead steps past the least
        advanced job under way (started, neither finished nor failed) in its stack, outside it."""
        if self.max_lead is None:
            return False
        own = [self.jobs[j].version for j in g.jobs if self.jobs[j].active]
        others = [self.jobs[j].version for o in self._groups if o.stack == g.stack and o is not g
                  for j in o.jobs if self.jobs[j].active and self.jobs[j].started]
        return bool(own and others) and min(own) - min(others) > self.max_lead

    def _hold_until(self, stack: int) -> float | None:
        """hold_apart: when the stack's next generation may start, or None for now. Its cycle is the
        mean time between its last (up to four) generation starts, less the time those starts were
        held: the stack's own pace, not the hold's. (A cycle that counted the holds would keep any
        slow step's length for good: each hold would make the next one, as on the H200 in session 41,
        where held stacks kept a 3.68 s cycle by holding up to 1.1 s a step.) The gap is hold_apart x
        cycle x 2 / stacks (half a cycle with two stacks at 0.5). A start within the gap of another
        stack's latest start (past, or set in the future by its own hold) moves to that start plus
        the gap, until no other stack's start is that close. Before a stack has started twice (no
        cycle) it is not held."""
        own = self._starts.get(stack, [])
        if self.hold_apart <= 0 or len(own) < 2:
            return None
        recent = own[-4:]
        held = sum(self._holds.get(stack, [])[-len(recent) + 1:])  # the holds of recent[1:]
        cycle = max(recent[-1] - recent[0] - held, 0.0) / (len(recent) - 1)
        gap = self.hold_apart * cycle * 2 / len(self._trainer_busy)
        live = {g.stack for g in self._groups if g.state != "done"}  # a finished stack holds no one
        others = [st[-1] for o, st in self._starts.items() if o != stack and st and o in live]
        t = self._now
        for _ in range(len(others) + 1):
            close = [x for x in others if abs(t - x) < gap - 1e-9]
            if not close:
                break
            t = max(close) + gap
        return t if t > self._now + 1e-9 else None

    def _after_group_done(self, g: _Group) -> list[Action]:
        # Timeslice: the stack's next job starts. Overlap: a staggered group whose predecessor had
        # no step to run never got its cue.
        # offset_stacks: a stack none of whose jobs had a step to run cues the next stack itself.
        nxt = self._pending(g.stack)
        return (self._generate(nxt[0]) if nxt else []) + (self._cue_next_stack(g.stack) if g.generations == 0 else [])


def drive(scheduler: Scheduler, backend, on_progress=None) -> list[Span]:
    """Run the scheduler against a backend until every group is done; return the spans."""
    actions = scheduler.start()
    while True:
        for a in actions:
            if isinstance(a, Generate):
                backend.generate(a)
            elif isinstance(a, Train):
                backend.train(a)
            else:
                backend.publish(a)
        if scheduler.done():
            return scheduler.spans
        result = backend.wait()
        actions = scheduler.on_result(result)
        if on_progress is not None:
            on_progress(scheduler)
