"""Verifiable task families for GRPO jobs.

Each family has a seeded prompt generator, an answer extractor, a 0/1 reward and a fixed held-out
eval set. `TASK_NAMES` is the list the config validates against; the sim uses `TASK_SHAPES` for the
default prompt and response lengths of a family.
"""

TASK_NAMES: tuple[str, ...] = (
    "gsm8k", "countdown", "modular", "linalg", "counting", "sorting", "multiply", "reverse",
)

# Default token shapes per family for the simulator: mean prompt tokens, and the median and
# log-space spread of response lengths (long-tailed; capped at max_new_tokens by the job).
# Assumptions until a real run's trace replaces them (ReplayLengths).
TASK_SHAPES: dict[str, dict[str, float]] = {
    "gsm8k": {"prompt_tokens": 140, "median_tokens": 150, "sigma": 0.55},
    "countdown": {"prompt_tokens": 90, "median_tokens": 120, "sigma": 0.7},
    "modular": {"prompt_tokens": 70, "median_tokens": 60, "sigma": 0.6},
    "linalg": {"prompt_tokens": 120, "median_tokens": 110, "sigma": 0.6},
    "counting": {"prompt_tokens": 80, "median_tokens": 50, "sigma": 0.7},
    "sorting": {"prompt_tokens": 80, "median_tokens": 70, "sigma": 0.5},
    "multiply": {"prompt_tokens": 60, "median_tokens": 80, "sigma": 0.6},
    "reverse": {"prompt_tokens": 70, "median_tokens": 50, "sigma": 0.5},
}
