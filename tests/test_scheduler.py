"""The scheduler, driven by hand-made results: no GPU, no SimPy."""

import dataclasses
import functools

import pytest

from factories import ScriptedBackend
from nodus.accounting import audit_on_policy, job_overlaps
from nodus.grouping import balance_groups
from nodus.messages import Generate, Publish, Span, Train
from nodus.scheduler import Scheduler, SchedulerError, StaleRolloutError, drive


def _sched(n=4, steps=2, groups=2, **kw):
    ids = [f"j{i}" for i in range(n)]
    parts = [ids[g::groups] for g in range(groups)]
    return Scheduler({j: steps for j in ids}, [(0, p) for p in parts], **kw)


def test_sync_loop_generate_train_publish_in_order():
    s = Scheduler({"a": 2, "b": 2}, [(0, ["a", "b"])], stagger=False)
    b = ScriptedBackend()
    spans = drive(s, b)
    kinds = [type(a).__name__ for a in b.log]
    assert kinds == ["Generate", "Train", "Publish"] * 2
    assert s.done()
    assert not audit_on_policy(spans) and not job_overlaps(spans)
    assert [r.adapter_version for r in b.log[3].requests] == [1, 1]


def test_overlap_staggers_groups_and_trainer_runs_one_group_at_a_time():
    s = _sched(n=4, steps=3, groups=2)
    b = ScriptedBackend()
    drive(s, b)
    first = b.log[0]
    assert isinstance(first, Generate) and first.group == 0
    # Group 1 starts generating only after group 0's first generation finished.
    g1 = next(i for i, a in enumerate(b.log) if isinstance(a, Generate) and a.group == 1)
    assert g1 > 0
    # Train and publish alternate: never two trains without a publish between them.
    tp = [type(a).__name__ for a in b.log if isinstance(a, (Train, Publish))]
    assert all(x != y for x, y in zip(tp, tp[1:]))
    assert sum(isinstance(a, Train) for a in b.log) == 2 * 3


def test_trainer_takes_the_next_group_while_the_engine_loads_the_last_ones_adapters():
    """A Train ends with its adapters saved: the next queued group's Train is issued with the
    finished group's Publish, not after it; that group's own next Generate waits for the Publish.
    (arm.trainer_waits_for_publish false; not the default: slower on the H200, session 6.)"""
    s = _sched(n=2, steps=2, groups=2, trainer_waits_for_publish=False)
    b = ScriptedBackend()

    finish = functools.partial(b.answer, s)  # one action's result, as drive() would get it

    (gen0,) = s.start()
    train0, gen1 = finish(gen0)
    assert isinstance(train0, Train) and isinstance(gen1, Generate) and gen1.group == 1
    assert finish(gen1) == []  # group 1's rollouts queue: the trainer is busy with group 0
    pub0, train1 = finish(train0)
    assert isinstance(pub0, Publish) and pub0.group == 0
    assert isinstance(train1, Train) and train1.group == 1  # not held back by group 0's publish
    (gen0_next,) = finish(pub0)  # group 0 samples again only once its new adapter is published
    assert isinstance(gen0_next, Generate) and gen0_next.group == 0
    assert [r.adapter_version for r in gen0_next.requests] == [1]


def test_trainer_waits_for_publish_holds_the_next_train_until_the_engine_loaded():
    """The default (arm.trainer_waits_for_publish true, how every run before the field ran)."""
    s = _sched(n=2, steps=2, groups=2)
    b = ScriptedBackend()

    finish = functools.partial(b.answer, s)  # one action's result, as drive() would get it

    (gen0,) = s.start()
    train0, gen1 = finish(gen0)
    assert finish(gen1) == []
    (pub0,) = finish(train0)
    train1, gen0_next = finish(pub0)
    assert isinstance(train1, Train) and train1.group == 1 and isinstance(gen0_next, Generate)


def test_stale_rollout_from_engine_raises():
    def tamper(ros):
        return tuple(dataclasses.replace(r, adapter_version=r.adapter_version - 1) if r.step == 1 else r
                     for r in ros)

    with pytest.raises(StaleRolloutError, match="version 0"):
        drive(_sched(n=2, steps=3, groups=1, stagger=False), ScriptedBackend(tamper=tamper))


def test_missing_rollouts_are_an_error():
    with pytest.raises(SchedulerError, match="asked rollouts"):
        drive(_sched(n=2, steps=1, groups=1), ScriptedBackend(tamper=lambda ros: ros[:1]))


def test_unknown_result_is_an_error():
    s = _sched()
    s.start()
    from nodus.messages import PublishDone

    with pytest.raises(SchedulerError, match="unknown action"):
        s.on_result(PublishDone("nope", 0, 0, ()))


def test_failed_job_stops_and_others_continue():
    from nodus.messages import TrainDone

    class FailingBackend(ScriptedBackend):
        def wait(self):
            r = super().wait()
            if isinstance(r, TrainDone):
                r = TrainDone(r.action_id, r.start_s, r.end_s, tuple(
                    dataclasses.replace(u, failed="loss is NaN") if u.job_id == "j0" else u for u in r.updates))
            return r

    s = _sched(n=2, steps=3, groups=1)
    spans = drive(s, FailingBackend())
    assert s.jobs["j0"].failed == "loss is NaN" and s.jobs["j0"].version == 0
    assert s.jobs["j1"].version == 3
    assert not audit_on_policy(spans)


def test_timeslice_runs_each_stacks_jobs_one_after_another():
    s = Scheduler({"a": 2, "b": 2, "c": 2}, [(0, ["a"]), (0, ["b"]), (1, ["c"])], concurrent=False)
    b = ScriptedBackend()
    spans = drive(s, b)
    a_end = max(x.end_s for x in spans if x.job == "a")
    b_start = min(x.start_s for x in spans if x.job == "b")
    assert b_start >= a_end
    assert {a.stack for a in b.log} == {0, 1}


def test_audit_catches_bad_timelines():
    ok = [Span("j", 0, "generate", 0, 1, attrs={"step": 0, "adapter_version": 0}),
          Span("j", 0, "train", 1, 2, attrs={"step": 0, "consumed_version": 0}),
          Span("j", 0, "publish", 2, 3, attrs={"version": 1}),
          Span("j", 0, "generate", 3, 4, attrs={"step": 1, "adapter_version": 1})]
    assert audit_on_policy(ok) == []
    early = ok[:3] + [Span("j", 0, "generate", 2.5, 4, attrs={"step": 1, "adapter_version": 1})]
    assert any("before version 1 was published" in p for p in audit_on_policy(early))
    old = ok[:3] + [Span("j", 0, "generate", 3, 4, attrs={"step": 1, "adapter_version": 0})]
    assert any("sampled from version 0" in p for p in audit_on_policy(old))
    assert job_overlaps(early)


def test_balance_groups_by_work_not_round_robin():
    # Round-robin over [10, 1, 10, 1] would give {10, 10} and {1, 1}.
    groups = balance_groups({"a": 10, "b": 1, "c": 10, "d": 1}, 2)
    loads = sorted(sum({"a": 10, "b": 1, "c": 10, "d": 1}[j] for j in g) for g in groups)
    assert loads == [11, 11]
    assert all(groups)
    with pytest.raises(ValueError, match="groups=3"):
        balance_groups({"a": 1, "b": 1}, 3)


def test_continuous_trainer_takes_every_queued_job_in_one_train_and_publish():
    """merge_trains (policy continuous: a group per job, none staggered): every job generates from
    the start; a job whose rollouts arrive while the trainer is busy queues, and the free trainer
    takes all queued jobs in one Train, then one Publish; each job samples again only after it."""
    s = Scheduler({j: 2 for j in "abc"}, [(0, ["a"]), (0, ["b"]), (0, ["c"])], stagger=False, merge_trains=True)
    b = ScriptedBackend()

    finish = functools.partial(b.answer, s)  # one action's result, as drive() would get it

    gens = s.start()
    assert [a.group for a in gens] == [0, 1, 2]  # all at once
    (train_a,) = finish(gens[0])
    assert [r.job_id for r in train_a.batches] == ["a"]
    assert finish(gens[1]) == [] and finish(gens[2]) == []  # b and c queue behind a's train
    (pub_a,) = finish(train_a)
    train_bc, gen_a = finish(pub_a)
    assert isinstance(train_bc, Train) and [r.job_id for r in train_bc.batches] == ["b", "c"]
    assert isinstance(gen_a, Generate) and [r.adapter_version for r in gen_a.requests] == [1]
    (pub_bc,) = finish(train_bc)
    assert isinstance(pub_bc, Publish) and sorted(pub_bc.versions) == [("b", 1), ("c", 1)]
    gen_b, gen_c = finish(pub_bc)
    assert (gen_b.group, gen_c.group) == (1, 2)
    assert all(r.adapter_version == 1 for g in (gen_b, gen_c) for r in g.requests)
    spans = drive_rest(s, b, [gen_a, gen_b, gen_c])
    assert s.done() and not audit_on_policy(spans) and not job_overlaps(spans)
    # A merged train's spans carry each job's own group, and how many jobs shared the batch.
    merged = [sp for sp in spans if sp.phase == "train" and sp.attrs["jobs_in_batch"] == 2]
    assert sorted((sp.job, sp.group) for sp in merged[:2]) == [("b", 1), ("c", 2)]


def drive_rest(s, b, pending):
    """Finish a hand-driven schedule: answer the pending actions, then whatever follows."""
    b.queue.clear()
    actions = pending
    while True:
        for a in actions:
            {Generate: b.generate, Train: b.train, Publish: b.publish}[type(a)](a)
        if s.done():
            return s.spans
        actions = s.on_result(b.wait())


@pytest.mark.parametrize("lockstep", [False, True])
def test_lockstep_holds_a_stacks_next_generation_for_the_other_stacks_publish(lockstep):
    """arm.lockstep: stack 0 finishes its step (generate, train, publish) while stack 1 is still
    generating; free, stack 0 generates again at once; in lockstep it waits, and both stacks'
    next generations go out together when stack 1 has published."""
    s = Scheduler({"a": 2, "b": 2}, [(0, ["a"]), (1, ["b"])], stagger=False, lockstep=lockstep)
    b = ScriptedBackend()

    finish = functools.partial(b.answer, s)  # one action's result, as drive() would get it

    gen_a, gen_b = s.start()
    assert (gen_a.stack, gen_b.stack) == (0, 1)
    (train_a,) = finish(gen_a)
    (pub_a,) = finish(train_a)
    after_a = finish(pub_a)
    if not lockstep:
        assert [(type(x).__name__, x.stack) for x in after_a] == [("Generate", 0)]
        return
    assert after_a == []  # held: stack 1 is mid-step
    (train_b,) = finish(gen_b)
    (pub_b,) = finish(train_b)
    both = finish(pub_b)
    assert [(type(x).__name__, x.stack) for x in both] == [("Generate", 0), ("Generate", 1)]
    assert all(r.adapter_version == 1 for g in both for r in g.requests)
    spans = drive_rest(s, b, both)
    assert s.done() and not audit_on_policy(spans) and not job_overlaps(spans)
    # Every generation of step 1 begins after every publish of step 0.
    pub0 = max(sp.end_s for sp in spans if sp.phase == "publish" and sp.attrs["version"] == 1)
    assert min(sp.start_s for sp in spans if sp.phase == "generate" and sp.attrs["step"] == 1) >= pub0


def test_lockstep_releases_when_the_other_stacks_jobs_are_done():
    """A stack whose jobs finished never holds the other one: lockstep waits only for stacks mid-step."""
    s = Scheduler({"a": 3, "b": 1}, [(0, ["a"]), (1, ["b"])], stagger=False, lockstep=True)
    spans = drive(s, ScriptedBackend())
    assert s.done()
    assert sum(sp.phase == "train" and sp.job == "a" for sp in spans) == 3
    assert not audit_on_policy(spans)
