"""Messages between the scheduler and a backend: small frozen dataclasses, seconds everywhere.

The scheduler emits actions (Generate, Train, Publish); a backend answers each with one result.
Payloads a real backend needs (token ids, logprobs) ride in `data` fields the scheduler never reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class JobShape:
    """What a backend needs to know of a job to run it (no scheduling state)."""

    job_id: str
    task: str
    prompts_per_step: int  # prompts sampled per optimizer step
    responses_per_prompt: int  # GRPO group size
    max_new_tokens: int  # cap on each response, tokens
    prompt_tokens: int  # mean prompt length, tokens
    lora_rank: int
    learning_rate: float
    seed: int


@dataclass(frozen=True)
class RolloutRequest:
    """Sample one step's rollouts for one job from one adapter version."""

    job_id: str
    step: int  # optimizer step these rollouts will feed (0-based)
    adapter_version: int  # the job's adapter version to sample from; on-policy: == step


@dataclass(frozen=True)
class Generate:
    """Generate rollouts for a group of jobs on the shared engine (of `stack`)."""

    action_id: str
    group: int
    stack: int  # engine/trainer pair to use; 0 unless policy is timeslice
    requests: tuple[RolloutRequest, ...]
    # Start no earlier than this time of the backend's clock (arm.hold_apart); None: at once.
    not_before_s: float | None = None


@dataclass(frozen=True)
class Rollouts:
    """One job's rollouts for one step, as sampled."""

    job_id: str
    step: int
    adapter_version: int  # version the engine actually sampled with (audited by the scheduler)
    n_sequences: int
    prompt_tokens: int  # prompt tokens over all sequences
    response_tokens: tuple[int, ...]  # each response's length, tokens
    start_s: float  # first sequence admitted
    end_s: float  # last sequence finished
    mean_reward: float | None = None  # real backend: mean verifiable reward; sim: None
    data: Any = field(default=None, compare=False, repr=False)  # backend payload (token ids, logprobs)


@dataclass(frozen=True)
class Train:
    """One optimizer step for each job in `batches`, in shared batches on the trainer."""

    action_id: str
    group: int
    stack: int
    batches: tuple[Rollouts, ...]
    expected_versions: tuple[int, ...]  # per batch: the job's current version (on-policy check)


@dataclass(frozen=True)
class JobUpdate:
    """One job's optimizer step outcome."""

    job_id: str
    new_version: int  # adapter version after this step
    tokens: int  # tokens trained on (prompt + response)
    loss: float | None = None
    grad_norm: float | None = None
    failed: str | None = None  # reason, when the job failed in this step (its last good state is kept)


@dataclass(frozen=True)
class Publish:
    """Make the jobs' new adapter versions visible to the engine (of `stack`)."""

    action_id: str
    group: int
    stack: int
    versions: tuple[tuple[str, int], ...]  # (job_id, version) pairs


Action = Union[Generate, Train, Publish]


@dataclass(frozen=True)
class GenerateDone:
    action_id: str
    start_s: float
    end_s: float
    rollouts: tuple[Rollouts, ...]


@dataclass(frozen=True)
class TrainDone:
    action_id: str
    start_s: float
    end_s: float
    updates: tuple[JobUpdate, ...]


@dataclass(frozen=True)
class PublishDone:
    action_id: str
    start_s: float
    end_s: float
    versions: tuple[tuple[str, int], ...]  # versions the engine will now serve


Result = Union[GenerateDone, TrainDone, PublishDone]


@dataclass(frozen=True)
class Span:
    """One phase of one job on the timeline; the same schema for sim and real runs."""

    job: str
    group: int
    phase: str  # generate | train | publish
    start_s: float
    end_s: float
    stack: int = 0
    attrs: dict = field(default_factory=dict, compare=False)  # step, adapter_version, tokens, ...

    def to_dict(self) -> dict:
        return {"job": self.job, "group": self.group, "stack": self.stack, "phase": self.phase,
                "start_s": self.start_s, "end_s": self.end_s, "attrs": self.attrs}

    @staticmethod
    def from_dict(d: dict) -> "Span":
        return Span(job=d["job"], group=d["group"], phase=d["phase"], start_s=d["start_s"],
                    end_s=d["end_s"], stack=d.get("stack", 0), attrs=d.get("attrs", {}))
