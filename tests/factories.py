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
