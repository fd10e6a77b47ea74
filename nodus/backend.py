"""The backend protocol: what the scheduler drives. The sim and the real backend implement it.

A backend runs actions asynchronously: `generate`, `train` and `publish` start work and return at
once; `wait` returns the next finished action's result (a real backend blocks on its workers, the
sim advances simulated time). `now` is the backend's clock in seconds. Nothing outside the
backends asks which one it has.
"""

from __future__ import annotations

from typing import Protocol

from nodus.messages import Generate, Publish, Result, Train


class Backend(Protocol):
    def now(self) -> float:
        """Seconds since the backend started (SimPy time or a monotonic clock)."""

    def generate(self, action: Generate) -> None:
        """Start sampling rollouts for each request from its adapter version."""

    def train(self, action: Train) -> None:
        """Start one optimizer step for every job in the action, in shared batches."""

    def publish(self, action: Publish) -> None:
        """Start making new adapter versions visible to the engine."""

    def wait(self) -> Result:
        """Block until the next started action finishes and return its result."""

    def start_versions(self) -> dict[str, int]:
        """Each job's adapter version at the start: its last checkpointed step when resumed."""

    def evaluate(self) -> dict[str, dict]:
        """Each job's held-out eval of its current adapter ({job: {"accuracy", "correct"}});
        empty when the backend has no model to evaluate (the simulator)."""

    def diagnostics(self) -> dict:
        """Backend-specific evidence for the run's report (e.g. logprob agreement); may be empty."""

    def close(self) -> None:
        """Release engines, trainers, processes and sharing daemons."""
