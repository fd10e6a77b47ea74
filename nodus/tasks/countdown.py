"""Countdown: reach a target from three given numbers with + - * and parentheses.

The answer is an expression, so the reward does not compare strings: it parses the expression with
a small recursive-descent parser (integers, + - *, parentheses; nothing else is a token, so no
name, call, power or division can ever run; Python's eval() is never used), checks that it uses
only the given numbers and each given number at most once (a number given twice may be used
twice), and that it evaluates to the target.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from nodus.tasks.base import Item, Task, choice, randint

MAX_EXPR_CHARS = 64  # a longer "expression" cannot be a use of three one-digit numbers
TARGET_RANGE = (1, 100)

_TOKEN = re.compile(r"\s*(\d+|[-+*()])")
_OPS = ("+", "-", "*")


class ExprError(ValueError):
    """The text is not an expression of integers with + - * and parentheses."""


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ExprError(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


def parse_expression(text: str) -> tuple[int, list[int]]:
    """(value, numbers used in order) of an expression; raises ExprError if it is not one."""
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens = _tokenize(text)
    used: list[int] = []
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ExprError("expression ends early")
        pos += 1
        return tokens[pos - 1]

    # Grammar: expr := term (('+'|'-') term)* ; term := factor ('*' factor)* ;
    # factor := INT | '(' expr ')'. No unary minus: it is not one of the allowed operations.
    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term() -> int:
        value = factor()
        while peek() == "*":
            take()
            value *= factor()
        return value

    def factor() -> int:
        tok = take()
        if tok == "(":
            value = expr()
            if take() != ")":
                raise ExprError("missing ')'")
            return value
        if tok.isdigit():
            used.append(int(tok))
            return int(tok)
        raise ExprError(f"unexpected {tok!r}")

    value = expr()
    if pos != len(tokens):
        raise ExprError(f"unexpected {tokens[pos]!r}")
    return value, used


def countdown_check(item: Item, answer: str) -> bool:
    *numbers, target = item.data
    try:
        value, used = parse_expression(answer)
    except ExprError:
        return False
    unused = Counter(numbers)
    unused.subtract(used)
    return value == target and min(unused.values(), default=0) >= 0


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _wrap(text: str, inner_op: str, outer_op: str, inner_is_right: bool) -> str:
    """Parenthesize an inner expression only where precedence or '-' needs it."""
    low = inner_op in "+-"
    if (outer_op == "*" and low) or (inner_is_right and outer_op == "-" and low):
        return f"({text})"
    return text


def make_countdown(rng: np.random.Generator) -> Item:
    while True:
        nums = [randint(rng, 1, 9) for _ in range(3)]
        a, b, c = nums
        op1, op2 = choice(rng, _OPS), choice(rng, _OPS)
        if rng.integers(2) == 0:  # (a op1 b) op2 c
            inner = _apply(a, op1, b)
            target = _apply(inner, op2, c)
            expr = _wrap(f"{a}{op1}{b}", op1, op2, False) + f"{op2}{c}"
            steps = [f"{a}{op1}{b} = {inner}", f"{inner}{op2}{c} = {target}"]
        else:  # a op1 (b op2 c)
            inner = _apply(b, op2, c)
            target = _apply(a, op1, inner)
            expr = f"{a}{op1}" + _wrap(f"{b}{op2}{c}", op2, op1, True)
            steps = [f"{b}{op2}{c} = {inner}", f"{a}{op1}{inner} = {target}"]
        if TARGET_RANGE[0] <= target <= TARGET_RANGE[1]:
            break
    shown = sorted(nums)  # the order the numbers were combined in is part of the solution, not the prompt
    prompt = f"Use {' '.join(map(str, shown))} to make {target} with + - *."
    return Item("countdown", prompt, expr, "\n".join(steps), (*shown, target))


COUNTDOWN = Task(
    name="countdown",
    description="reach a target from 3 one-digit numbers with + - * (answer: an expression)",
    make_item=make_countdown,
    check=countdown_check,
)
