"""Factories for tests: configs with overrides and a hand-driven backend (no GPU, no SimPy)."""

from __future__ import annotations

from collections import deque

from nodus.config import RunConfig, build_config
from nodus.messages import (
    Generate, GenerateDone, JobUpdate, Publish, PublishDone, Rollouts, Train, TrainDone,
)


def create_config(jobs: int = 4, steps: int = 3, policy: str = "overlap", groups: int = 2,
                  sharing: str = "mps", seed: int = 1, **job_fields) -> RunConfig:
    tasks = ["gsm8k", "countdown", "modular", "linalg", "counting", "sorting", "multiply", "reverse"]
    return build_config({
        "jobs": [{"task": tasks[i % 8], "steps": steps, **job_fields} for i in range(jobs)],
        "arm": {"policy": policy, "groups": groups, "sharing": sharing},
        "seed": seed,
    })


class ScriptedBackend:
    """Finishes actions in submission order, each taking `dt` seconds; `tamper(rollouts)` may
    rewrite what the 'engine' returns (to test the scheduler's on-policy guard)."""

    def __init__(self, dt: float = 1.0, tamper=None):
        self.t, self.dt, self.tamper = 0.0, dt, tamper
        self.queue: deque = deque()
        self.log: list = []

    def now(self) -> float:
        return self.t

    def generate(self, a: Generate) -> None:
        self.log.append(a)
        self.queue.append(a)

    def train(self, a: Train) -> None:
        self.log.append(a)
        self.queue.append(a)

    def publish(self, a: Publish) -> None:
        self.log.append(a)
        self.queue.append(a)

    def answer(self, scheduler, action):
        """The backend's answer to one action alone, as drive() would get it: the scheduler's next
        actions (tests that drive a schedule by hand, one result at a time)."""
        self.queue.clear()
        self.queue.append(action)
        return scheduler.on_result(self.wait())

    def wait(self):
        a = self.queue.popleft()
        start, self.t = self.t, self.t + self.dt
        if isinstance(a, Generate):
            ro = tuple(Rollouts(r.job_id, r.step, r.adapter_version, 4, 40, (5, 6, 7, 8), start, self.t)
                       for r in a.requests)
            if self.tamper:
                ro = self.tamper(ro)
            return GenerateDone(a.action_id, start, self.t, ro)
        if isinstance(a, Train):
            return TrainDone(a.action_id, start, self.t, tuple(
                JobUpdate(b.job_id, v + 1, tokens=66) for b, v in zip(a.batches, a.expected_versions)))
        return PublishDone(a.action_id, start, self.t, a.versions)

    def start_versions(self) -> dict:
        return {}

    def evaluate(self) -> dict:
        return {}

    def diagnostics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class TimedPair:
    """A stand-in for calibration.corun's engine-and-trainer pair, with no processes: a task 'takes'
    a time set by its size (engine batch, trainer tokens), the sharing mode and whether the other
    side runs (`SLOW`: co-run time over alone time; `MPS_ALONE`: MPS-alone time over alone time).
    `stop_after` buckets in all (over the modes, shared through `counter`), the next one raises,
    as a run cut off by a time limit does."""

    SLOW = {"none": {"engine": 2.0, "trainer": 4.0}, "mps": {"engine": 1.25, "trainer": 2.0}}
    MPS_ALONE = {"engine": 1.25, "trainer": 1.0}

    def __init__(self, model, sharing, *_, stop_after: int | None = None, counter: list | None = None):
        self.sharing, self.stop_after = sharing, stop_after
        self.counter = counter if counter is not None else [0]
        self._bucket = None  # the (engine work, trainer work) of the bucket being timed

    def gen_request(self, batch, prompt, length):
        return ("engine", batch)

    def train_batches(self, tokens):
        return ("trainer", tokens)

    def _alone_s(self, work) -> float:
        side, size = work
        t = size / 100 if side == "engine" else size / 10000
        return t * (self.MPS_ALONE[side] if self.sharing == "mps" else 1.0)

    def alone(self, side, work, repeats):
        return self._alone_s(work)

    def corun(self, fg, fg_work, bg_work, repeats):
        if fg == "engine" and (fg_work, bg_work) != self._bucket:  # a bucket's first timing
            if self.stop_after is not None and self.counter[0] >= self.stop_after:
                raise RuntimeError("time limit")
            self.counter[0] += 1
            self._bucket = (fg_work, bg_work)
        return self._alone_s(fg_work) / (self.MPS_ALONE[fg] if self.sharing == "mps" else 1.0) \
            * self.SLOW[self.sharing][fg]

    def close(self):
        pass


def run_on_pool(pool, cfg: RunConfig, opts):
    """``run_arm(cfg)`` (no baseline) on a module's shared ``ClusterPool`` with ``opts`` (RealOptions):
    (summary, runs). A failed run stops the pool's processes, so the next test starts fresh ones
    instead of meeting its leftovers."""
    from nodus.runner import run_arm
    from real.backend import with_audit

    cfg, opts = with_audit(cfg, opts)  # an audit set in the options is the run's (its config records it)
    pool.opts = opts
    try:
        return run_arm(cfg, pool, baseline=False)
    except BaseException:
        pool.close()
        raise


def simulate_with_and_without(tmp_path, flag: str, value=True, **kw) -> dict:
    """Two simulated runs of the arm ``kw`` (nodus.simulate.config_from_args' keywords), without and
    with the arm setting ``flag`` (``lockstep``, ``offset_stacks``; ``hold_apart`` at ``value``), each
    checked to carry it; their run folders under ``tmp_path``, keyed False and True."""
    from nodus.simulate import config_from_args, simulate

    runs = {}
    for on in (False, True):
        cfg = config_from_args(**kw, **{flag: value if on else None})
        assert getattr(cfg.arm, flag) == (value if on else type(value)())
        runs[on] = tmp_path / f"{flag}-{on}"
        simulate(cfg, runs[on])
    return runs
