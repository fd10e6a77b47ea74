"""A customer's own problems for a job (``jobs[].dataset``): JSONL files of questions and answers,
scored by the job's task family's answer check.

One JSON object a line: the question under ``question`` (or ``prompt``), the answer under ``answer``:
either the bare final answer (``"42"``, ``42``, ``"3 5"``) or GSM8K's worked form, steps then a
``#### <answer>`` line (the steps are kept as the item's work). Blank lines are skipped. A bad file
is an error naming the file and line.

The held-out eval set is the ``eval`` file, else the last ``eval_size`` items of the training file;
a training item whose question is also an eval question is dropped, so eval accuracy measures
unseen prompts, as the built-in families' eval sets do.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from nodus.tasks.base import ANSWER_MARK, Item

# Families whose check compares a value answer (every one but countdown, whose check needs the
# item's numbers): a dataset can be scored by them.
NO_DATASET_TASKS = ("countdown",)


def jsonl_records(path: str | Path, what: str, keys: str):
    """(``file:line``, object) for each non-blank line of a JSONL file of ``what`` records (named in
    errors; ``keys`` says what an object holds). FileNotFoundError for a missing file; ValueError
    naming the file and line for a line that is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with {keys}")
        yield where, record


def load_items_jsonl(path: str | Path, task: str) -> list[Item]:
    """Items of ``task`` from a JSONL file (module docstring). FileNotFoundError for a missing
    file; ValueError naming the file and line for a malformed one, or the file for an empty one."""
    items = []
    for where, record in jsonl_records(path, "dataset", "'question' (or 'prompt') and 'answer'"):
        question = record.get("question", record.get("prompt"))
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: missing or empty 'question' (or 'prompt') string")
        answer = record.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
        answer, work = str(answer), ""
        if ANSWER_MARK in answer:  # GSM8K's form: worked steps, then the final answer
            work, answer = (x.strip() for x in answer.rsplit(ANSWER_MARK, 1))
            answer = answer.split("\n", 1)[0].strip()
        answer = answer.strip()
        if not answer:
            raise ValueError(f"{where}: empty final answer")
        items.append(Item(task, question.strip(), answer, work))
    if not items:
        raise ValueError(f"{path}: no records")
    return items


def _stamp(path: str) -> tuple[str, float, int]:
    """The file's identity for the cache: a changed file is read again."""
    st = os.stat(path) if os.path.isfile(path) else None
    return (os.path.abspath(path), st.st_mtime if st else 0.0, st.st_size if st else -1)


@lru_cache(maxsize=64)
def _split(train: tuple, eval_: tuple | None, eval_size: int, task: str) -> tuple[tuple[Item, ...], tuple[Item, ...]]:
    items = load_items_jsonl(train[0], task)
    if eval_ is not None:
        held = load_items_jsonl(eval_[0], task)
    else:
        if len(items) <= eval_size:
            raise ValueError(f"dataset {train[0]}: {len(items)} items; holding out the last eval_size={eval_size} "
                             "for eval leaves none to train on (lower dataset.eval_size or give dataset.eval)")
        items, held = items[:-eval_size], items[-eval_size:]
    held_out = {it.prompt for it in held}
    kept = tuple(it for it in items if it.prompt not in held_out)
    if not kept:
        raise ValueError(f"dataset {train[0]}: every training question is also an eval question")
    return kept, tuple(held)


def dataset_split(spec, task: str) -> tuple[tuple[Item, ...], tuple[Item, ...]]:
    """(training items, eval items) of a job's ``dataset`` (nodus.config.DatasetSpec)."""
    return _split(_stamp(spec.train), _stamp(spec.eval) if spec.eval else None, spec.eval_size, task)


def check_datasets(jobs) -> None:
    """Read every job's dataset (a bad one raises naming the job and the problem): before a run
    starts its processes."""
    for j in jobs:
        if j.dataset is not None:
            try:
                dataset_split(j.dataset, j.task)
            except (FileNotFoundError, ValueError) as err:
                raise type(err)(f"job {j.id or j.task}: {err}") from None
