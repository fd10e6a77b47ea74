"""GRPO group-relative advantages: pure numpy, so the core imports without torch.

The option names follow TRL's ``GRPOConfig`` (``scale_rewards``) so a job configured for TRL
means the same thing here.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def group_advantages(rewards: Sequence[float] | np.ndarray, group_size: int,
                     scale_rewards: ScaleRewards = "group", eps: float = 1e-4) -> np.ndarray:
    """Advantage of each completion: its reward minus its prompt group's mean reward, divided by
    the group's std ("group"), the whole batch's std ("batch") or not at all ("none").

    ``rewards`` is laid out prompt-major: the ``group_size`` completions of prompt 0, then of
    prompt 1, ... The std is the unbiased (n-1) one and ``eps`` is added to it, as TRL does.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide len(rewards)={r.size}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} must be one of {SCALE_REWARDS}")
    groups = r.reshape(-1, group_size)
    # The group mean is the baseline: GRPO replaces PPO's learned value function with the mean
    # reward of other samples for the same prompt, so only "better than siblings" is rewarded.
    advantages = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        # Dr. GRPO: dividing by the std up-weights prompts whose rewards barely differ (too easy
        # or too hard), a difficulty bias; leaving it out keeps the raw reward scale.
        return advantages
    if scale_rewards == "group":
        std = groups.std(axis=1, ddof=1) if group_size > 1 else np.zeros(len(groups))
        std = np.repeat(std, group_size)
    else:
        # One std for the batch keeps the relative scale between prompts (less noisy than a
        # per-group std estimated from a handful of samples).
        std = np.full(r.size, r.std(ddof=1) if r.size > 1 else 0.0)
    # eps keeps an all-equal group (std 0, advantage 0) at 0 instead of 0/0.
    return advantages / (std + eps)
