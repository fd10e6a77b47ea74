"""The shared shape of a task family: an item, the answer format, the extractor and the 0/1 reward.

Answer format, the same for every family: a completion ends with a line `#### <answer>`. The
extractor takes the rest of the line after the LAST `####`, stripped (text on later lines is
ignored, so a model that keeps generating after its answer line is not punished for it, but a
later `####` line overrides an earlier one). Answers compare normalized: tokens split on
whitespace and commas, tokens that are numbers compare as numbers (`042` == `42`, `5.0` == `5`),
other tokens compare as exact strings (case matters). A whole answer like `1,234` is one number
(GSM8K writes thousands that way). Rewards are 1.0 for a correct final answer and 0.0 otherwise:
no format credit, because partial credit for the format is what a small policy learns first and
then stops there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

ANSWER_MARK = "####"

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+")


@dataclass(frozen=True)
class Item:
    """One problem of a family."""

    task: str  # family name, a key of TASKS
    prompt: str  # the text the policy sees
    answer: str  # canonical final answer, as written after `####`
    work: str = ""  # worked steps before the answer line ("" when the answer is the whole solution)
    data: tuple[int, ...] = field(default=())  # family-specific integers a reward needs
    # beyond `answer` (countdown: the given numbers, then the target)


@dataclass(frozen=True)
class Task:
    """A family: its generator and the check of an extracted answer against an item."""

    name: str
    description: str  # one line, shown by `nodus tasks list`
    make_item: Callable[[np.random.Generator], Item]  # draws one item from the given rng
    check: Callable[[Item, str], bool]  # is this extracted answer correct for the item?

    def prompt(self, item: Item) -> str:
        return item.prompt

    def extract_answer(self, text: str) -> str | None:
        return extract_answer(text)

    def reward(self, item: Item, completion_text: str) -> float:
        """1.0 if the completion's final answer is correct, else 0.0."""
        answer = extract_answer(completion_text)
        return 1.0 if answer is not None and self.check(item, answer) else 0.0


def extract_answer(text: str) -> str | None:
    """The answer after the last `####` (to the end of that line), stripped; None if absent or empty."""
    at = text.rfind(ANSWER_MARK)
    if at < 0:
        return None
    answer = text[at + len(ANSWER_MARK):].split("\n", 1)[0].strip()
    return answer or None


def _token(tok: str) -> int | float | str:
    if _INT.fullmatch(tok):
        return int(tok)
    if _FLOAT.fullmatch(tok):
        return float(tok)
    return tok


def normalize_answer(answer: str) -> tuple[int | float | str, ...]:
    """Answer tokens for comparison: numbers as numbers, anything else as exact strings."""
    answer = answer.strip()
    if _THOUSANDS.fullmatch(answer):
        return (int(answer.replace(",", "")),)
    return tuple(_token(t) for t in answer.replace(",", " ").split())


def answers_match(got: str, expected: str) -> bool:
    want = normalize_answer(expected)
    return bool(want) and normalize_answer(got) == want


def exact_check(item: Item, answer: str) -> bool:
    """The check for every family whose answer is a value (all but countdown)."""
    return answers_match(answer, item.answer)


def solution_text(item: Item) -> str:
    """A correct worked completion for the item, ending with `#### <answer>`."""
    last = f"{ANSWER_MARK} {item.answer}"
    return f"{item.work}\n{last}" if item.work else last


def randint(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A Python int uniform in [lo, hi], both ends included."""
    return int(rng.integers(lo, hi + 1))


def choice(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]
