"""arm.hold_apart: offset stacks held apart, a stack's next generation not started within a share of
its cycle of another stack's latest start, through the scheduler, config, CLI, simulator, the real
backend's held generations, the GPU scripts' arm specs and labels, and validation's configurations."""

import json
import time
from collections import deque

import pytest

from experiments import stack_alignment as sa
from experiments.gpu_arms import parse_arm
from experiments.gpu_table import arm_label
from factories import simulate_with_and_without
from nodus.accounting import audit_on_policy
from nodus.config import STACKS_PAIR_PROFILE, ConfigError
from nodus.messages import Publish, PublishDone
from nodus.scheduler import Scheduler
from nodus.simulate import config_from_args
from nodus.timeline import read_jsonl


def _scheduler(hold=0.5, starts=None, now=0.0):
    s = Scheduler({"a": 9, "b": 9}, [(0, ["a"]), (1, ["b"])], stagger=False, offset_stacks=True, hold_apart=hold)
    s._starts, s._now = dict(starts or {}), now
    return s


def test_hold_until_keeps_half_a_cycle_from_the_other_stack():
    # Stack 1 started at 2.2 and 6.2 (a 4 s cycle: a 2 s gap at 0.5); stack 0's latest start was 8.0.
    s = _scheduler(starts={0: [0.0, 4.0, 8.0], 1: [2.2, 6.2]}, now=8.5)
    assert s._hold_until(1) == pytest.approx(10.0)  # 0.5 s after stack 0's start: held to 8.0 + 2
    s._now = 10.5
    assert s._hold_until(1) is None  # 2.5 s after it: apart enough, at once
    s._now, s._starts[0] = 8.5, [0.0, 4.0, 9.0]  # stack 0 held to start at 9.0: go after it
    assert s._hold_until(1) == pytest.approx(11.0)
    assert _scheduler(0.25, {0: [8.0], 1: [2.0, 6.0]}, 8.5)._hold_until(1) == pytest.approx(9.0)  # a 1 s gap
    assert _scheduler(0.0, {0: [8.0], 1: [2.0, 6.0]}, 8.5)._hold_until(1) is None  # not held
    assert _scheduler(0.5, {0: [8.0], 1: [6.0]}, 8.5)._hold_until(1) is None  # no cycle yet


def _held_cycles(natural):
    """Two held stacks (0.5) whose generation becomes ready ``natural(stack, k)`` seconds after its
    k-th start, started through _hold_until as the scheduler starts them: the starts and holds."""
    s = _scheduler(starts={}, now=0.0)
    ready = {0: 0.0, 1: 1.5}
    s._starts, s._holds = {0: [], 1: []}, {0: [], 1: []}
    while min(len(v) for v in s._starts.values()) < 20:
        stack = min(ready, key=lambda k: (ready[k], k))
        s._now = ready[stack]
        start = s._hold_until(stack) or s._now
        s._starts[stack].append(start)
        s._holds[stack].append(start - s._now)
        ready[stack] = start + natural(stack, len(s._starts[stack]) - 1)
    return s._starts, s._holds


def test_a_slow_step_does_not_lengthen_the_held_cycle():
    # Each stack's own cycle is 3 s, but stack 0's step 5 takes 6 s. The holds keep the stacks half
    # a cycle apart through it, then stop: the cycle is the stacks' own, not the hold's. (Counting
    # the holds in the cycle kept the slow step's length for good: session 41 on the H200.)
    starts, holds = _held_cycles(lambda stack, k: 6.0 if (stack, k) == (0, 5) else 3.0)
    for stack in (0, 1):
        gaps = [b - a for a, b in zip(starts[stack][-6:], starts[stack][-5:])]
        assert gaps == pytest.approx([3.0] * 5)
        assert max(holds[stack][-6:]) == pytest.approx(0.0)
    assert max(max(h) for h in holds.values()) >= 0.5  # the slow step held both stacks a while
    phase = [(b - a) % 3.0 for a, b in zip(starts[0][-5:], starts[1][-5:])]
    assert phase == pytest.approx([1.5] * 5)  # half a cycle apart again


def test_a_finished_stack_holds_no_one():
    s = _scheduler(starts={0: [0.0, 4.0, 8.0], 1: [2.2, 6.2]}, now=8.5)
    s._groups[0].state = "done"
    assert s._hold_until(1) is None


def test_simulated_stacks_stay_apart_only_when_held(tmp_path):
    # On the pair's-rate stacks profile offset stacks close in and run in step by their last steps
    # (session 40 measured them fall in step within seven); held at 0.5 they stay half a cycle apart.
    runs = simulate_with_and_without(tmp_path, "hold_apart", 0.5, jobs=8, steps=20, policy="shared-sync",
                                     sharing="mps", seed=1, stacks=2, offset_stacks=True, profile=STACKS_PAIR_PROFILE)
    free, held = runs[False], runs[True]
    free_summary, held_summary = (json.loads((d / "summary.json").read_text()) for d in (free, held))
    phase_free = sa.run_alignment(free)["phase_by_step"][1]
    phase_held = sa.run_alignment(held)["phase_by_step"][1]
    assert min(phase_free[-5:]) < 0.1
    assert min(phase_held[2:]) > 0.45
    spans = [json.loads(x) for x in (held / "spans.jsonl").read_text().splitlines()]
    held_s = [s["attrs"]["held_s"] for s in spans if s["phase"] == "generate" and "held_s" in s["attrs"]]
    assert held_s and all(h > 0 for h in held_s)
    assert not any(audit_on_policy(run) for run in read_jsonl(held / "spans.jsonl"))  # held, never stale
    assert all(j["steps"] == 20 for j in held_summary["per_job"].values())
    assert held_summary["arm"]["hold_apart"] == 0.5 and "hold_apart" not in free_summary["arm"]


def test_config_and_cli(capsys):
    from nodus.cli import main

    with pytest.raises(ConfigError, match="arm.hold_apart=0.5 without arm.offset_stacks"):
        config_from_args({"arm": {"hold_apart": 0.5}}, jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2)
    with pytest.raises(ConfigError, match="less than or equal to 0.5"):
        config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, hold_apart=0.6)
    with pytest.raises(ConfigError, match="arm.hold_apart with arm.stacks=1"):
        config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", hold_apart=0.5)
    cfg = config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, hold_apart=0.5)
    assert cfg.arm.offset_stacks and cfg.arm.hold_apart == 0.5  # --hold-apart starts the stacks apart
    assert main(["sim", "--jobs", "4", "--steps", "3", "--policy", "shared-sync", "--stacks", "2",
                 "--hold-apart", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arm"]["hold_apart"] == 0.5 and out["arm"]["offset_stacks"] is True


class _Inbox(list):
    put = list.append


class _Cluster:
    """The real backend's cluster, as far as held generations and wait() see it."""

    def __init__(self, answers):
        self.engines = [_Inbox(), _Inbox()]
        self.polls: list[float] = []
        self.answers = deque(answers)

    def poll(self, timeout):
        self.polls.append(timeout)
        time.sleep(timeout)
        return self.answers.popleft()

    def get(self):  # nothing held any more: the backend blocks on its workers
        return self.answers.popleft()


def test_real_backend_sends_a_held_generation_when_due():
    from real.backend import RealBackend

    rb = object.__new__(RealBackend)  # no workers: only the hold and wait() paths run
    rb.t0 = time.monotonic()
    pub = Publish("pub-1", 0, 0, (("a", 1),))
    t = rb.now()
    rb.c = _Cluster([None, ("published", "pub-1", rb.t0 + t, rb.t0 + t + 0.01, [("a", 1)])])
    rb._local, rb._pending, rb._versions, rb._stack_of = deque(), {"pub-1": (pub, None)}, {}, {}
    rb._superseded = []  # (stack, job, version) published: older adapter folders go at the next wait
    rb._held = [(t + 0.05, "gen-2", 1, ["request"])]
    done = rb.wait()
    assert isinstance(done, PublishDone) and rb._versions == {"a": 1}
    assert rb.c.engines[1] == [("gen", "gen-2", ["request"])] and rb._held == []
    assert 0.0 < rb.c.polls[0] <= 0.05  # it waited for the worker only until the generation fell due


def test_gpu_arms_hold_spec_label_and_configuration():
    from calibration.validate import config_key, config_label

    assert parse_arm("shared-sync+mps:k2:hold50:s1")[-1] == {"stacks": 2, "hold_apart": 0.5, "offset_stacks": True}
    for bad in ("shared-sync+mps:k2:hold60", "shared-sync+mps:k2:hold0"):
        with pytest.raises(SystemExit, match="is not jN"):
            parse_arm(bad)
    with pytest.raises(SystemExit, match="off starts each stack"):
        parse_arm("shared-sync+mps:hold50")
    arm = {"policy": "shared-sync", "sharing": "mps", "groups": 1, "stacks": 2, "offset_stacks": True}
    assert arm_label({**arm, "hold_apart": 0.5}) == "shared-sync/mps/g1/k2+off+hold50"
    off, held = {"jobs": 8, "arm": arm}, {"jobs": 8, "arm": {**arm, "hold_apart": 0.5}}
    assert config_key(off) != config_key(held)
    assert config_label(held) == "8 jobs shared-sync g=1 mps stacks=2 offset hold=0.5"
