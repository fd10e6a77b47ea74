"""Text for the `nodus tasks list` and `nodus tasks sample` commands (the CLI only prints these)."""

from __future__ import annotations

import json

from nodus.tasks.base import solution_text
from nodus.tasks.registry import TASKS, eval_set, get_task, train_items


def tasks_list(as_json: bool = False) -> str:
    """Every family with its eval-set size and one-line description, as a table or JSON."""
    rows = [{"name": t.name, "eval_items": len(eval_set(t.name)), "description": t.description}
            for t in TASKS.values()]
    if as_json:
        return json.dumps(rows, indent=2)
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'task':<{width}}  eval  description"]
    lines += [f"{r['name']:<{width}}  {r['eval_items']:>4}  {r['description']}" for r in rows]
    return "\n".join(lines)


def tasks_sample(task: str, n: int = 3, seed: int = 0) -> str:
    """n training items of a family: prompt, a worked solution, and the reward that solution gets."""
    family = get_task(task)
    blocks = []
    for i, item in enumerate(train_items(family, seed, n)):
        solution = solution_text(item)
        blocks.append(f"--- {family.name} #{i} (seed {seed})\n"
                      f"prompt:\n{family.prompt(item)}\n"
                      f"solution:\n{solution}\n"
                      f"reward: {family.reward(item, solution):.1f}")
    return "\n".join(blocks)
