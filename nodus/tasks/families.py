"""Six small generated families: modular, linalg, counting, sorting, multiply, reverse.

Numbers and lists are kept small (one- or two-digit operands, lists of 4-6 items) so that a
character-level policy of a few million parameters can learn them; each item carries a short
worked solution in the same style a model is pretrained on. All answers use the common
`#### <answer>` format of `nodus.tasks.base`; every family here uses the exact-answer check.
"""

from __future__ import annotations

import string

import numpy as np

from nodus.tasks.base import Item, Task, choice, exact_check, randint


def _ints(values) -> str:
    return " ".join(str(v) for v in values)


def make_modular(rng: np.random.Generator) -> Item:
    a, b, m = randint(rng, 2, 30), randint(rng, 2, 30), randint(rng, 2, 9)
    op = choice(rng, ("+", "-", "*"))
    raw = a + b if op == "+" else a - b if op == "-" else a * b
    answer = raw % m  # Python's mod: the result is in [0, m) even for a negative raw value
    work = f"{a} {op} {b} = {raw}\n{raw} mod {m} = {answer}"
    return Item("modular", f"What is ({a} {op} {b}) mod {m}?", str(answer), work)


def _linear(a: int, b: int) -> str:
    """'2x - y' style left side of an equation with nonzero integer coefficients."""
    first = "x" if a == 1 else "-x" if a == -1 else f"{a}x"
    sign = "+" if b > 0 else "-"
    mag = "" if abs(b) == 1 else str(abs(b))
    return f"{first} {sign} {mag}y"


def _p(v: int) -> str:
    """A number as a factor: negatives in parentheses, so '3*(-4)' never reads as '3*-4'."""
    return f"({v})" if v < 0 else str(v)


def _make_system(rng: np.random.Generator) -> Item:
    coefs = [c for c in range(-4, 5) if c != 0]
    while True:
        a, b, c, d = (choice(rng, coefs) for _ in range(4))
        det = a * d - b * c
        if det != 0:
            break
    x, y = randint(rng, -5, 5), randint(rng, -5, 5)
    e, f = a * x + b * y, c * x + d * y
    prompt = f"Solve {_linear(a, b)} = {e} and {_linear(c, d)} = {f}. Answer: x y"
    # Cramer's rule: a fixed sequence of small products a tiny model can imitate step by step.
    work = (f"D = {_p(a)}*{_p(d)} - {_p(b)}*{_p(c)} = {det}\n"
            f"x = ({_p(e)}*{_p(d)} - {_p(b)}*{_p(f)})/{_p(det)} = {x}\n"
            f"y = ({_p(a)}*{_p(f)} - {_p(e)}*{_p(c)})/{_p(det)} = {y}")
    return Item("linalg", prompt, f"{x} {y}", work)


def _make_dot(rng: np.random.Generator) -> Item:
    u = [randint(rng, 0, 9) for _ in range(3)]
    v = [randint(rng, 0, 9) for _ in range(3)]
    products = [p * q for p, q in zip(u, v)]
    total = sum(products)
    prompt = f"Dot product of ({', '.join(map(str, u))}) and ({', '.join(map(str, v))})?"
    work = (" + ".join(f"{p}*{q}" for p, q in zip(u, v)) + " = "
            + " + ".join(map(str, products)) + f" = {total}")
    return Item("linalg", prompt, str(total), work)


def make_linalg(rng: np.random.Generator) -> Item:
    return _make_system(rng) if rng.integers(2) == 0 else _make_dot(rng)


def make_counting(rng: np.random.Generator) -> Item:
    letters = "abcd"  # a small alphabet so the target letter appears a few times
    text = "".join(choice(rng, letters) for _ in range(randint(rng, 6, 10)))
    target = choice(rng, letters)
    positions = [i + 1 for i, ch in enumerate(text) if ch == target]
    work = f"{target} at {_ints(positions) if positions else 'none'}"
    prompt = f"How many times does {target} appear in {text}?"
    return Item("counting", prompt, str(len(positions)), work)


def make_sorting(rng: np.random.Generator) -> Item:
    values = [randint(rng, 0, 20) for _ in range(randint(rng, 4, 6))]
    return Item("sorting", f"Sort ascending: {_ints(values)}", _ints(sorted(values)))


def make_multiply(rng: np.random.Generator) -> Item:
    a, b = randint(rng, 10, 99), randint(rng, 2, 9)
    tens, ones = a - a % 10, a % 10
    work = f"{tens} * {b} = {tens * b}\n{ones} * {b} = {ones * b}\n{tens * b} + {ones * b} = {a * b}"
    return Item("multiply", f"What is {a} * {b}?", str(a * b), work)


def make_reverse(rng: np.random.Generator) -> Item:
    if rng.integers(2) == 0:
        word = "".join(choice(rng, string.ascii_lowercase) for _ in range(randint(rng, 3, 6)))
        return Item("reverse", f"Reverse the letters: {word}", word[::-1])
    values = [randint(rng, 0, 9) for _ in range(randint(rng, 4, 6))]
    return Item("reverse", f"Reverse the list: {_ints(values)}", _ints(values[::-1]))


MODULAR = Task("modular", "(a op b) mod m with a, b in 2..30, op in + - * and m in 2..9",
               make_modular, exact_check)
LINALG = Task("linalg", "solve a 2x2 integer linear system (answer: x y) or a 3-vector dot product",
              make_linalg, exact_check)
COUNTING = Task("counting", "count a letter in a 6-10 letter string", make_counting, exact_check)
SORTING = Task("sorting", "sort 4-6 integers in 0..20 ascending", make_sorting, exact_check)
MULTIPLY = Task("multiply", "two-digit times one-digit multiplication", make_multiply, exact_check)
REVERSE = Task("reverse", "reverse a 3-6 letter string or a list of 4-6 digits", make_reverse,
               exact_check)
