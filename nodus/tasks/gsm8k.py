"""GSM8K-style word problems: a templated generator and a loader for the real GSM8K JSONL files.

The generator writes one- and two-step grade-school problems with small numbers (a tiny policy
cannot learn the real GSM8K); the loader reads the real dataset's format, one JSON object a line,
`{"question": ..., "answer": "<steps> #### <number>"}`, into the same `Item`s, so either source
can feed a job and share the numeric check.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from nodus.tasks.base import ANSWER_MARK, Item, Task, choice, exact_check, randint
from nodus.tasks.datasets import jsonl_records

NAMES = ("Ann", "Ben", "Cal", "Dee", "Eva", "Finn", "Gus", "Ivy", "Jo", "Kim", "Leo", "Mia")
THINGS = ("apples", "pens", "books", "cards", "eggs", "shells", "stickers", "marbles")

_CALC = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>


def _problem(rng: np.random.Generator) -> tuple[str, list[str], int]:
    """(question, worked steps, answer) from one of eight templates."""
    n, t = choice(rng, NAMES), choice(rng, THINGS)
    kind = randint(rng, 0, 7)
    if kind == 0:
        a, b = randint(rng, 2, 20), randint(rng, 2, 20)
        return (f"{n} has {a} {t}. {n} gets {b} more. How many {t} does {n} have now?",
                [f"{a} + {b} = {a + b}"], a + b)
    if kind == 1:
        a = randint(rng, 5, 30)
        b = randint(rng, 1, a - 1)
        return f"{n} has {a} {t} and gives away {b}. How many {t} are left?", [f"{a} - {b} = {a - b}"], a - b
    if kind == 2:
        a, b = randint(rng, 2, 9), randint(rng, 2, 9)
        return f"{n} has {a} bags with {b} {t} in each. How many {t} in all?", [f"{a} * {b} = {a * b}"], a * b
    if kind == 3:
        a, b = randint(rng, 2, 9), randint(rng, 2, 9)
        return (f"{n} shares {a * b} {t} equally among {b} friends. How many {t} does each friend get?",
                [f"{a * b} / {b} = {a}"], a)
    if kind == 4:
        a, b, c = randint(rng, 1, 20), randint(rng, 2, 5), randint(rng, 2, 9)
        return (f"{n} has {a} {t} and buys {b} packs of {c}. How many {t} does {n} have now?",
                [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}"], a + b * c)
    if kind == 5:
        a = randint(rng, 5, 30)
        b, c = randint(rng, 1, a - 1), randint(rng, 1, 20)
        return (f"{n} has {a} {t}, gives away {b}, then finds {c}. How many {t} does {n} have now?",
                [f"{a} - {b} = {a - b}", f"{a - b} + {c} = {a - b + c}"], a - b + c)
    if kind == 6:
        a, b = randint(rng, 1, 9), randint(rng, 2, 5)
        c = randint(rng, a * b + 1, a * b + 20)
        return (f"A pen costs {a} dollars. {n} buys {b} pens and pays with {c} dollars. How much change?",
                [f"{a} * {b} = {a * b}", f"{c} - {a * b} = {c - a * b}"], c - a * b)
    a, b, c = randint(rng, 2, 9), randint(rng, 2, 7), randint(rng, 1, 20)
    return (f"{n} reads {a} pages a day for {b} days, then {c} more pages. How many pages in all?",
            [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"], a * b + c)


def make_gsm8k(rng: np.random.Generator) -> Item:
    question, steps, answer = _problem(rng)
    return Item("gsm8k", question, str(answer), "\n".join(steps))


def _final_answer(answer_text: str) -> str:
    # GSM8K writes thousands with commas ("#### 1,200"); keep the canonical answer a plain number.
    return answer_text.rsplit(ANSWER_MARK, 1)[1].strip().replace(",", "")


def load_gsm8k_jsonl(path: str | Path) -> list[Item]:
    """Items from a GSM8K JSONL file; blank lines are skipped. Raises FileNotFoundError for a
    missing file and ValueError naming the file and line for a malformed one."""
    items = []
    for where, record in jsonl_records(path, "GSM8K", "'question' and 'answer'"):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: missing or non-string field {key!r}")
        if ANSWER_MARK not in record["answer"]:
            raise ValueError(f"{where}: answer has no '{ANSWER_MARK} <number>' final line")
        final = _final_answer(record["answer"])
        if not final:
            raise ValueError(f"{where}: empty final answer after '{ANSWER_MARK}'")
        work = _CALC.sub("", record["answer"].rsplit(ANSWER_MARK, 1)[0]).strip()
        items.append(Item("gsm8k", record["question"].strip(), final, work))
    if not items:
        raise ValueError(f"{path}: no GSM8K records")
    return items


GSM8K = Task(
    name="gsm8k",
    description="templated 1-2 step grade-school word problems with small numbers",
    make_item=make_gsm8k,
    check=exact_check,
)
