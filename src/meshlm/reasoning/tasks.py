"""The reasoning suite's generators: problems where a fixed-depth Transformer runs out of layers.

Each task draws one problem of a given difficulty from a `random.Random`, as a prompt string that
ends with "=" and an answer string (then EOS). Every character is one token of the suite's alphabet
(meshlm.reasoning.vocab), so a model reads the problem exactly as written.

    task       a problem                           difficulty
    chase      a=5,c=a,b=c,d=7,e=d;b=    → 5       hops from the queried variable to its digit
    modsum     0300500010200000=         → 1       non-zero terms of a sum mod 10 (fixed width)
    addition   843+29=                   → 044     digits of the larger operand; operands and answer
               (348 + 92 = 440)                    are written least significant digit first
    dag        c=4,a=c+2,b=a+c,d=6;b=    → 0       depth of the queried variable's formula, mod 10

`chase`, `modsum` and `dag` keep the prompt length fixed across difficulties (a fixed number of
statements or terms, the rest distractors or zeros), so a harder problem needs more depth, not a
longer context; `addition` grows with its difficulty, as in the papers that use it. Every statement
assigns a new variable, and the statements are shuffled, so no left-to-right reading order gives the
answer away.

A task's `difficulty(prompt)` recomputes the label from the prompt alone, and `solve(prompt)` the
answer; the tests check both against an independent solver.
"""
from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
DIGITS = string.digits


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    difficulty: int


class Task(ABC):
    """One generator: `sample(rng, difficulty)` -> Problem; `levels` are the difficulties it can
    make."""

    name: str = ""
    summary: str = ""
    alphabet: str = ""  # every character a prompt or answer can hold
    levels: range = range(1, 2)  # the difficulties the generator supports
    train_levels: range = range(1, 2)  # the default training range
    test_levels: range = range(1, 2)  # the default test range (beyond training)

    @abstractmethod
    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        """One problem of exactly `difficulty`, drawn from `rng` alone (deterministic under its
        seed)."""

    @abstractmethod
    def solve(self, prompt: str) -> str:
        """The answer, recomputed from the prompt alone."""

    @abstractmethod
    def difficulty(self, prompt: str) -> int:
        """The difficulty label, recomputed from the prompt alone."""


def _statements(prompt: str) -> tuple[dict[str, str], str]:
    """'a=5,b=a;b=' -> ({'a': '5', 'b': 'a'}, 'b')."""
    body, query = prompt[:-1].split(";")
    return dict(s.split("=", 1) for s in body.split(",")), query


class Chase(Task):
    """k-hop variable tracking: `statements` single assignments (a digit or another variable). The
    queried chain has exactly k assignments; the other statements form `distractors` chains of
    random lengths, so every prompt holds distractors + 1 digits whatever k (the answer cannot be
    read off the only digit)."""

    name = "chase"
    summary = "pointer chasing: follow k assignments from the queried variable to its digit"
    alphabet = LETTERS + DIGITS + "=,;"

    def __init__(self, statements: int = 12, distractors: int = 4):
        if not 1 <= distractors < statements <= len(LETTERS):
            raise ValueError(f"need 1 <= distractors < statements <= {len(LETTERS)} (one letter "
                             "per variable)")
        self.statements, self.distractors = statements, distractors
        self.levels = range(1, statements - distractors + 1)
        self.train_levels = range(1, (statements - distractors) // 2 + 1)
        self.test_levels = self.levels

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        names = rng.sample(LETTERS, self.statements)
        # >= distractors: split into that many chains of length >= 1
        left = self.statements - difficulty
        cuts = sorted(rng.sample(range(1, left), self.distractors - 1))
        chains = [difficulty] + [b - a for a, b in zip([0, *cuts], [*cuts, left])]
        statements, used = [], 0
        for length in chains:
            chain = names[used:used + length]
            used += length
            statements.append(f"{chain[0]}={rng.choice(DIGITS)}")
            statements += [f"{b}={a}" for a, b in zip(chain, chain[1:])]
        query = names[difficulty - 1]  # the end of the first chain
        rng.shuffle(statements)
        prompt = f"{','.join(statements)};{query}="
        return Problem(prompt, self.solve(prompt), difficulty)

    def _follow(self, prompt: str) -> tuple[str, int]:
        values, name = _statements(prompt)
        hops = 1
        while values[name] not in DIGITS:
            name, hops = values[name], hops + 1
        return values[name], hops

    def solve(self, prompt: str) -> str:
        return self._follow(prompt)[0]

    def difficulty(self, prompt: str) -> int:
        return self._follow(prompt)[1]


class ModSum(Task):
    """State tracking: the sum mod 10 of `width` digits, of which `difficulty` are non-zero (the
    others are the identity 0), so the prompt length is the same at every difficulty."""

    name = "modsum"
    summary = "state tracking: the sum mod 10 of a fixed-width digit string with k non-zero terms"
    alphabet = DIGITS + "="

    def __init__(self, width: int = 12):
        if width < 1:
            raise ValueError("need width >= 1")
        self.width = width
        self.levels = range(1, width + 1)
        self.train_levels = range(1, width // 2 + 1)
        self.test_levels = range(1, width + 1)

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        terms = ["0"] * self.width
        for position in rng.sample(range(self.width), difficulty):
            terms[position] = rng.choice(DIGITS[1:])
        prompt = "".join(terms) + "="
        return Problem(prompt, self.solve(prompt), difficulty)

    def solve(self, prompt: str) -> str:
        return str(sum(map(int, prompt[:-1])) % 10)

    def difficulty(self, prompt: str) -> int:
        return sum(c != "0" for c in prompt[:-1])


class Addition(Task):
    """Two-operand addition, digits reversed (least significant first, McLeish et al. 2024): the
    larger operand has exactly `difficulty` digits, the other 1 … difficulty; the answer is the
    reversed sum."""

    name = "addition"
    summary = "addition with reversed digits: the larger operand has n digits"
    alphabet = DIGITS + "+="
    levels = range(1, 21)
    train_levels = range(1, 7)
    test_levels = range(1, 11)

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        a = rng.randint(10 ** (difficulty - 1) if difficulty > 1 else 0, 10 ** difficulty - 1)
        b_digits = rng.randint(1, difficulty)
        b = rng.randint(10 ** (b_digits - 1) if b_digits > 1 else 0, 10 ** b_digits - 1)
        if rng.random() < 0.5:
            a, b = b, a
        prompt = f"{str(a)[::-1]}+{str(b)[::-1]}="
        return Problem(prompt, self.solve(prompt), difficulty)

    def solve(self, prompt: str) -> str:
        a, b = prompt[:-1].split("+")
        return str(int(a[::-1]) + int(b[::-1]))[::-1]

    def difficulty(self, prompt: str) -> int:
        return max(len(operand) for operand in prompt[:-1].split("+"))


class Dag(Task):
    """Small DAG evaluation, i-GSM-like (Saunshi et al. 2025): `statements` variables, each a digit,
    another variable plus a digit, or the sum of two variables, all mod 10. The queried variable's
    formula has depth `difficulty` (a digit has depth 0; a sum, 1 + its deepest operand); the others
    are distractors."""

    name = "dag"
    summary = "DAG evaluation mod 10: the queried variable's formula has depth k"
    alphabet = LETTERS + DIGITS + "=+,;"

    def __init__(self, statements: int = 10):
        if not 3 <= statements <= len(LETTERS):
            raise ValueError(f"need 3 <= statements <= {len(LETTERS)} (one letter per variable)")
        self.statements = statements
        self.levels = range(1, statements)
        self.train_levels = range(1, statements // 3 + 1)
        self.test_levels = range(1, statements * 2 // 3 + 1)

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        names = rng.sample(LETTERS, self.statements)
        depth: dict[str, int] = {}
        formulas: dict[str, str] = {}
        # chain[i] has depth i: the spine that sets the query's depth
        chain = names[:difficulty + 1]
        formulas[chain[0]], depth[chain[0]] = rng.choice(DIGITS), 0
        # distractors, defined on the spine's root or each other
        for name in names[difficulty + 1:]:
            self._define(rng, name, [n for n in depth if depth[n] < difficulty], formulas, depth)
        for i, name in enumerate(chain[1:], 1):
            shallower = [n for n in depth if depth[n] < i - 1]
            other = (rng.choice(shallower) if shallower
                     and rng.random() < 0.5 else rng.choice(DIGITS))
            formulas[name], depth[name] = f"{chain[i - 1]}+{other}", i
        statements = [f"{name}={formula}" for name, formula in formulas.items()]
        rng.shuffle(statements)
        prompt = f"{','.join(statements)};{chain[-1]}="
        return Problem(prompt, self.solve(prompt), difficulty)

    @staticmethod
    def _define(rng: random.Random, name: str, known: list[str], formulas: dict,
                depth: dict) -> None:
        kind = rng.random()
        if kind < 0.3 or not known:
            formulas[name], depth[name] = rng.choice(DIGITS), 0
            return
        a = rng.choice(known)
        b = rng.choice(known) if kind < 0.65 else rng.choice(DIGITS)
        formulas[name] = f"{a}+{b}"
        depth[name] = 1 + max(depth[a], depth.get(b, 0))

    def _evaluate(self, prompt: str) -> tuple[int, int]:
        formulas, query = _statements(prompt)
        memo: dict[str, tuple[int, int]] = {}

        def value(term: str) -> tuple[int, int]:  # (value, depth)
            if term in DIGITS:
                return int(term), 0
            if term not in memo:
                parts = [value(t) for t in formulas[term].split("+")]
                memo[term] = ((sum(v for v, _ in parts) % 10, 0) if len(parts) == 1 else
                              (sum(v for v, _ in parts) % 10, 1 + max(d for _, d in parts)))
            return memo[term]

        return value(query)

    def solve(self, prompt: str) -> str:
        return str(self._evaluate(prompt)[0])

    def difficulty(self, prompt: str) -> int:
        return self._evaluate(prompt)[1]
