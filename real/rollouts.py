"""What a job samples each step, and how its samples are scored: the workload side of a rollout.

Two modes. `tasks`: text prompts from the job's task family, verifiable 0/1 rewards from the
completions (learning runs). `synthetic`: random prompt token ids and response lengths forced to
the job's length model, rewards drawn at random (timing runs on a model with random weights,
whose own lengths and answers mean nothing). Both are seeded per (job seed, step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nodus.config import JobSpec
from nodus.lengths import prompt_tokens, sample_response_tokens
from nodus.tasks import get_task, train_items
from nodus.tasks.base import Item


def step_seed(job_seed: int, step: int) -> int:
    return int(np.random.SeedSequence([job_seed, step]).generate_state(1)[0])


@dataclass(frozen=True)
class StepPrompts:
    """The prompts of one job's step and what is needed to score them."""

    prompts: tuple  # strings (tasks) or token-id tuples (synthetic)
    items: tuple[Item, ...] | None  # tasks mode: the items, for rewards
    forced_lengths: tuple[int, ...] | None  # synthetic mode: per response, prompt-major


def step_prompts(job: JobSpec, step: int, mode: str, vocab_size: int) -> StepPrompts:
    seed = step_seed(job.seed, step)
    if mode == "tasks":
        pool = None  # a finite training set, each step sampling its prompts from it
        if job.dataset is not None:  # the job's own problems: the dataset's training split
            from nodus.tasks.datasets import dataset_split

            pool = dataset_split(job.dataset, job.task)[0]
        elif job.prompt_pool:  # drawn once from the job's seed
            pool = train_items(job.task, seed=job.seed, n=job.prompt_pool)
        if pool is not None:
            pick = np.random.default_rng(seed).permutation(len(pool))
            repeats = job.prompts_per_step // len(pool) + 1
            items = tuple(pool[i] for i in (list(pick) * repeats)[:job.prompts_per_step])
        else:
            items = tuple(train_items(job.task, seed=seed, n=job.prompts_per_step))
        task = get_task(job.task)
        return StepPrompts(tuple(task.prompt(it) + "\n" for it in items), items, None)
    rng = np.random.default_rng(seed)
    n_tok = prompt_tokens(job)
    # Token ids from a low range avoid special tokens at the top of real vocabularies.
    hi = max(2, min(vocab_size, 32000) - 1)
    prompts = tuple(tuple(int(t) for t in rng.integers(1, hi, size=n_tok)) for _ in range(job.prompts_per_step))
    lengths = sample_response_tokens(job, step, np.random.default_rng([job.seed, step]))
    return StepPrompts(prompts, None, tuple(lengths))


def rewards(job: JobSpec, step: int, sp: StepPrompts, texts, n: int) -> list[float]:
    """One reward per response, prompt-major. texts: [prompt][response] completions (tasks mode)."""
    if sp.items is not None:
        task = get_task(job.task)
        return [float(task.reward(item, t)) for item, per in zip(sp.items, texts) for t in per]
    rng = np.random.default_rng([job.seed, step, 7])
    return rng.integers(0, 2, size=len(sp.prompts) * n).astype(float).tolist()
