"""Verifiable task families for GRPO jobs.

Each family has a seeded prompt generator, an answer extractor, a 0/1 reward and a fixed held-out
eval set. `TASK_NAMES` is the list the config validates against; the sim uses `TASK_SHAPES` for the
default prompt and response lengths of a family.

Every completion ends with `#### <answer>` (see `nodus.tasks.base` for the extractor and how
answers compare). `get_task(name)` gives a family; `eval_set(name)` its fixed 64 held-out items;
`train_items(name, seed, n)` training items that never repeat an eval prompt; `solution_text(item)`
a correct worked completion.
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

# Imported after the constants above, so a submodule that imports them from here finds them.
from nodus.tasks.base import Item, Task, extract_answer, normalize_answer, solution_text  # noqa: E402
from nodus.tasks.gsm8k import load_gsm8k_jsonl  # noqa: E402
from nodus.tasks.registry import EVAL_SIZE, TASKS, eval_set, get_task, train_items  # noqa: E402

__all__ = [
    "TASK_NAMES", "TASK_SHAPES", "TASKS", "EVAL_SIZE", "Item", "Task", "eval_set", "extract_answer",
    "get_task", "load_gsm8k_jsonl", "normalize_answer", "solution_text", "train_items",
]
