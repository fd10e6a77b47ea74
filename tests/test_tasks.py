"""Task families: determinism, answer format, rewards, countdown safety, eval/train split, GSM8K."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodus.tasks import (EVAL_SIZE, TASK_NAMES, TASK_SHAPES, TASKS, Item, eval_set, extract_answer,
                         get_task, load_gsm8k_jsonl, normalize_answer, solution_text, train_items)
from nodus.tasks.catalog import tasks_list, tasks_sample
from nodus.tasks.countdown import ExprError, parse_expression


def make_countdown_item(numbers=(3, 5, 7), target=22, **overrides) -> Item:
    fields = dict(task="countdown", prompt=f"Use {numbers} to make {target}.", answer="3*5+7",
                  data=(*numbers, target))
    return Item(**{**fields, **overrides})


def draw(name: str, seed: int, n: int = 20) -> list[Item]:
    rng = np.random.default_rng(seed)
    return [get_task(name).make_item(rng) for _ in range(n)]


def wrong_answer(item: Item) -> str:
    """An answer that is certainly wrong for the item's family."""
    if item.task == "countdown":
        return f"{item.data[0]}+{item.data[0]}+{item.data[0]}+{item.data[0]}"  # reuses a number
    return item.answer + " 1"


def test_registry_matches_task_names_and_shapes():
    assert tuple(TASKS) == TASK_NAMES
    assert set(TASK_SHAPES) == set(TASK_NAMES)


def test_unknown_task_error_lists_known_names():
    with pytest.raises(KeyError, match="known tasks: gsm8k, countdown"):
        get_task("chess")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generator_is_deterministic_per_seed(name):
    assert draw(name, 7) == draw(name, 7)
    assert draw(name, 7) != draw(name, 8)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_solution_gets_reward_one_and_wrong_answer_zero(name):
    task = get_task(name)
    for item in draw(name, 3, n=200):
        solution = solution_text(item)
        assert solution.endswith(f"#### {item.answer}")
        assert task.reward(item, solution) == 1.0, (item, solution)
        assert task.reward(item, f"#### {wrong_answer(item)}") == 0.0
        assert task.reward(item, item.work) == 0.0  # no answer line: no format credit either


@pytest.mark.parametrize("name", TASK_NAMES)
def test_prompts_are_short(name):
    assert max(len(item.prompt) for item in draw(name, 0, n=200)) <= 120


def test_extract_answer_edge_cases():
    assert extract_answer("no answer here") is None
    assert extract_answer("steps\n####") is None
    assert extract_answer("####   \n") is None
    assert extract_answer("####   42  ") == "42"
    assert extract_answer("#### 1\n#### -7\n") == "-7"  # the last mark wins
    assert extract_answer("#### 12\nQuestion: more text") == "12"  # text after the line is ignored
    assert extract_answer("x ####-3") == "-3"


def test_normalized_comparison():
    assert normalize_answer(" 042 ") == normalize_answer("42")
    assert normalize_answer("-3") == (-3,)
    assert normalize_answer("5.0") == normalize_answer("5")
    assert normalize_answer("1,200") == (1200,)
    assert normalize_answer("1, 2, 3") == normalize_answer("1 2  3")
    assert normalize_answer("abc") != normalize_answer("ABC")


def test_negative_answers_are_rewarded():
    item = Item("linalg", "p", "-4 1")
    assert get_task("linalg").reward(item, "x\n#### -4 1") == 1.0
    assert get_task("linalg").reward(item, "x\n#### 4 1") == 0.0


def test_countdown_reward_rules():
    task, item = get_task("countdown"), make_countdown_item()
    assert task.reward(item, "#### 7+3*5") == 1.0  # any correct expression, not only the stored one
    assert task.reward(item, "#### (5*3)+7") == 1.0
    assert task.reward(item, "#### 3*5+7 = 22") == 0.0  # strict: the answer is the expression
    assert task.reward(item, "#### 5*5-3") == 0.0  # 5 used twice but given once
    assert task.reward(item, "#### 2*11") == 0.0  # numbers that were not given
    assert task.reward(item, "#### 35-13") == 0.0  # digits glued into new numbers
    assert task.reward(item, "#### 3*5") == 0.0  # wrong value
    twice = make_countdown_item(numbers=(5, 5, 1), target=26)
    assert task.reward(twice, "#### 5*5+1") == 1.0  # a number given twice may be used twice


@pytest.mark.parametrize("text", [
    "__import__('os').system('echo hacked')", "2**10", "7/7", "-3+25", "3 5", "(3+5", "3+", "",
    "1" * 100, "abs(-22)", "0x16",
])
def test_countdown_rejects_non_expressions(text):
    with pytest.raises(ExprError):
        parse_expression(text)
    assert get_task("countdown").reward(make_countdown_item(), f"#### {text}") == 0.0


def test_countdown_parser_never_calls_eval(monkeypatch):
    import builtins

    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec must not be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert parse_expression("(2+3)*4-1") == (19, [2, 3, 4, 1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5),
       st.lists(st.sampled_from("+-*"), min_size=4, max_size=4))
def test_countdown_parser_agrees_with_python_arithmetic(numbers, ops):
    text = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:]))
    value, used = parse_expression(text)
    assert value == _reference_value(text)
    assert used == numbers


def _reference_value(text: str) -> int:
    """Independent evaluation of a +-* chain: products first, then left-to-right sums."""
    total, sign = 0, 1
    for chunk in text.replace("-", " - ").replace("+", " + ").split():
        if chunk in "+-":
            sign = 1 if chunk == "+" else -1
        else:
            total += sign * int(np.prod([int(x) for x in chunk.split("*")]))
    return total


@pytest.mark.parametrize("name", TASK_NAMES)
def test_eval_set_is_fixed_distinct_and_disjoint_from_training(name):
    items = eval_set(name)
    assert len(items) == EVAL_SIZE
    assert len({item.prompt for item in items}) == EVAL_SIZE
    assert eval_set(name) == items
    held_out = {item.prompt for item in items}
    assert not held_out & {item.prompt for item in train_items(name, seed=0, n=2000)}


def test_train_items_skip_eval_prompts_even_from_the_eval_stream():
    # Drawing from the raw generator would hit eval prompts often for a small item space;
    # train_items must filter them out.
    name = "counting"
    held_out = {item.prompt for item in eval_set(name)}
    train = train_items(name, seed=0, n=500)
    assert len(train) == 500 and not held_out & {item.prompt for item in train}
    assert train_items(name, seed=0, n=50) == train[:50]


def test_eval_set_rejects_unknown_task():
    with pytest.raises(KeyError, match="unknown task"):
        eval_set("nope")


def test_importing_tasks_does_not_import_torch():
    # A fresh interpreter: another test in the same session may have imported torch itself.
    code = "import sys, nodus, nodus.tasks, nodus.tasks.catalog; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def write_jsonl(path, records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def test_load_gsm8k_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
        "",
        {"question": "Big?", "answer": "It is big.\n#### 1,200"},
    ])
    items = load_gsm8k_jsonl(path)
    assert [i.answer for i in items] == ["72", "1200"]
    assert "<<" not in items[0].work and items[0].work.startswith("In May")
    task = get_task("gsm8k")
    assert all(task.reward(i, solution_text(i)) == 1.0 for i in items)
    assert task.reward(items[1], "#### 1,200") == 1.0
    assert task.reward(items[0], "#### 71") == 0.0


def test_load_gsm8k_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_gsm8k_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question": "q"}', "'answer'"),
    ('{"question": "q", "answer": "no mark"}', "no '####"),
    ('{"question": "q", "answer": "x ####  "}', "empty final answer"),
])
def test_load_gsm8k_malformed(tmp_path, line, message):
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(ValueError, match=message) as err:
        load_gsm8k_jsonl(path)
    assert "bad.jsonl:2" in str(err.value)


def test_load_gsm8k_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no GSM8K records"):
        load_gsm8k_jsonl(tmp_path / "empty.jsonl")


def test_catalog_text():
    rows = json.loads(tasks_list(as_json=True))
    assert [r["name"] for r in rows] == list(TASK_NAMES)
    assert all(r["eval_items"] == EVAL_SIZE and r["description"] for r in rows)
    assert "countdown" in tasks_list(as_json=False)
    sample = tasks_sample("multiply", n=2, seed=1)
    assert sample.count("reward: 1.0") == 2 and sample == tasks_sample("multiply", n=2, seed=1)
