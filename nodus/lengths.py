"""Response-length models: expected lengths (for balancing groups) and seeded sampling (for the sim).

Pure functions over numpy; replay of recorded lengths reads a spans JSONL written by any backend.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from nodus.config import ConfigError, FixedLengths, JobSpec, LognormalLengths, ReplayLengths
from nodus.tasks import TASK_SHAPES
from nodus.timeline import read_text, stored


def length_model(job: JobSpec):
    """The job's response-length model, falling back to its task's default shape."""
    if job.lengths is not None:
        return job.lengths
    shape = TASK_SHAPES[job.task]
    return LognormalLengths(median_tokens=shape["median_tokens"], sigma=shape["sigma"])


def prompt_tokens(job: JobSpec) -> int:
    return job.prompt_tokens or int(TASK_SHAPES[job.task]["prompt_tokens"])


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def expected_response_tokens(job: JobSpec) -> float:
    """E[min(L, max_new_tokens)] under the job's length model."""
    m = length_model(job)
    cap = job.max_new_tokens
    if isinstance(m, FixedLengths):
        return float(min(m.tokens, cap))
    if isinstance(m, ReplayLengths):
        lens = [x for step in _replay_table(m.trace, m.job or job.id).values() for x in step]
        return float(np.mean(np.minimum(lens, cap))) if lens else float(cap)
    mu, s = math.log(m.median_tokens), m.sigma
    if s == 0:
        return float(min(m.median_tokens, cap))
    # Mean of a lognormal truncated from above at `cap` plus the mass piled up at the cap.
    lc = math.log(cap)
    return math.exp(mu + s * s / 2) * _phi((lc - mu - s * s) / s) + cap * (1 - _phi((lc - mu) / s))


def predicted_step_tokens(job: JobSpec) -> float:
    """Predicted tokens one optimizer step of the job generates and trains on (balancing key)."""
    n = job.prompts_per_step * job.responses_per_prompt
    return n * (prompt_tokens(job) + expected_response_tokens(job))


def sample_response_tokens(job: JobSpec, step: int, rng: np.random.Generator) -> list[int]:
    """Lengths of the step's prompts_per_step * responses_per_prompt responses, each >= 1."""
    m = length_model(job)
    n = job.prompts_per_step * job.responses_per_prompt
    cap = job.max_new_tokens
    if isinstance(m, FixedLengths):
        return [min(m.tokens, cap)] * n
    if isinstance(m, ReplayLengths):
        table = _replay_table(m.trace, m.job or job.id)
        if not table:
            raise ConfigError(f"lengths.trace={m.trace!r} has no generate spans for job {m.job or job.id!r}")
        steps = sorted(table)
        lens = table[steps[step % len(steps)]]
        return [max(1, min(int(x), cap)) for x in (lens * (n // len(lens) + 1))[:n]]
    x = rng.lognormal(mean=math.log(m.median_tokens), sigma=m.sigma, size=n)
    return np.clip(np.rint(x), 1, cap).astype(int).tolist()


@lru_cache(maxsize=64)
def _replay_table_cached(path: str, mtime: float, job: str) -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for line in read_text(path).splitlines():
        d = json.loads(line)
        if d.get("phase") == "generate" and d.get("job") == job:
            table[int(d["attrs"]["step"])] = list(d["attrs"]["response_tokens"])
    return table


def _replay_table(path: str, job: str) -> dict[int, list[int]]:
    p = stored(path)  # a recorded spans.jsonl, or its .gz
    if not p.is_file():
        raise ConfigError(f"lengths.trace={path!r} does not exist")
    try:
        return _replay_table_cached(str(p), p.stat().st_mtime, job)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"lengths.trace={path!r} is not a spans JSONL with response_tokens: {err}") from None


def recorded_step_lengths(run_dir: str | Path, step: int) -> dict[str, tuple[int, list[int]]]:
    """job -> (prompt tokens per sequence, response lengths) of ``step`` in a recorded run's
    ``spans.jsonl`` (its generate spans): the rows a bench or a fit rebuilds a step from."""
    path = stored(Path(run_dir) / "spans.jsonl")
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no spans.jsonl there (a run folder of nodus run / gpu_arms)")
    out = {}
    for line in read_text(path).splitlines():
        span = json.loads(line)
        attrs = span.get("attrs") or {}
        if span.get("phase") == "generate" and attrs.get("step") == step and attrs.get("response_tokens"):
            n = attrs.get("n_sequences") or len(attrs["response_tokens"])
            out[span["job"]] = (round(attrs.get("prompt_tokens", 0) / max(n, 1)), list(attrs["response_tokens"]))
    if not out:
        raise ConfigError(f"{run_dir}: no generate span of step {step} with response lengths")
    return out
