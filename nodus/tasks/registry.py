"""The task families by name, their fixed held-out eval sets, and training draws that avoid them.

Each eval set is 64 distinct items drawn from a fixed seed derived from the family name (crc32, so
it is the same in every process and does not move if families are reordered). Training items are
drawn from the job's seed and skip any item whose prompt is in the eval set, so eval accuracy
measures generalization to unseen prompts rather than memorization.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

from nodus.tasks.base import Item, Task
from nodus.tasks.countdown import COUNTDOWN
from nodus.tasks.families import COUNTING, LINALG, MODULAR, MULTIPLY, REVERSE, SORTING
from nodus.tasks.gsm8k import GSM8K

TASKS: dict[str, Task] = {t.name: t for t in (
    GSM8K, COUNTDOWN, MODULAR, LINALG, COUNTING, SORTING, MULTIPLY, REVERSE)}

EVAL_SIZE = 64
EVAL_SEED = 8_675_309
# A family whose item space is so small that this many draws miss is a bug, not bad luck.
MAX_DRAWS_PER_ITEM = 1000


def get_task(name: str | Task) -> Task:
    """The family called `name` (a Task passes through); KeyError listing the known names otherwise."""
    if isinstance(name, Task):
        return name
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


@lru_cache(maxsize=None)
def _eval_items(name: str) -> tuple[Item, ...]:
    task = get_task(name)
    rng = np.random.default_rng([EVAL_SEED, zlib.crc32(name.encode())])
    items: dict[str, Item] = {}
    for _ in range(EVAL_SIZE * MAX_DRAWS_PER_ITEM):
        item = task.make_item(rng)
        items.setdefault(item.prompt, item)
        if len(items) == EVAL_SIZE:
            return tuple(items.values())
    raise RuntimeError(f"task {name!r}: could not draw {EVAL_SIZE} distinct eval items")


def eval_set(task_name: str) -> list[Item]:
    """The fixed held-out eval items of a family, in a fixed order (eval results index into it)."""
    return list(_eval_items(get_task(task_name).name))


@lru_cache(maxsize=None)
def eval_prompts(task_name: str) -> frozenset[str]:
    return frozenset(item.prompt for item in _eval_items(task_name))


def train_items(task: str | Task, seed: int, n: int) -> list[Item]:
    """n training items drawn from `seed` (repeats allowed), none with an eval-set prompt."""
    task = get_task(task)
    held_out = eval_prompts(task.name)
    rng = np.random.default_rng(seed)
    items: list[Item] = []
    for _ in range(max(n, 1) * MAX_DRAWS_PER_ITEM):
        if len(items) >= n:
            break
        item = task.make_item(rng)
        if item.prompt not in held_out:
            items.append(item)
    if len(items) < n:
        raise RuntimeError(f"task {task.name!r}: could not draw {n} training items outside the eval set")
    return items
