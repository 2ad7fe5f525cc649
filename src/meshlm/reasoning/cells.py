"""Labelled reasoning tasks: a row of cells, each defined from earlier ones, a label at every cell.

Every task here writes `cells` cells of a fixed width, so a sequence has the same length at every
difficulty. Cell i starts with its name, the i-th capital letter, then its content. A cell is either
a *root* (its value is written in it) or a *node* whose content names one or two earlier cells in
small letters (definitions before use), so under a causal mask every position can resolve in the
same loop step as the cells it names: each loop can extend every chain by one step.

    task     a node's content       its value                         a root's content  chance
    chain    `c`                    the value of cell C               `7`               10%
    parity   `c` or `o` (12 cells)  value(C), or 1 − value(C) for `o` `1`               50%
    compose  `c` or `o` (12 cells)  value(C) ∘ s, or value(C) ∘ r     `4`               17%
    addmod   `c4`                   value(C) + 4 mod m                `.4`              1/m
    dagmod   `cf`                   value(C) + value(F) mod m         `.4`              1/m

For example chain `A3B1CaDbEdFc`: cells A = 3, B = 1, C names A, D names B, E names D, F names C;
labels 3 1 3 3 at C, D, E, F with difficulties 1, 1, 2, 2.

The label of a node sits at its last character (a separate target stream, never an input: the
model reads only the cells), and the label of a root is absent (its value is in the input). A
label's *difficulty* is the depth of its cell's formula: a root has depth 0, a node 1 + the deepest
cell it names — the number of parallel resolution rounds the cell needs. `sample(rng, k)` draws a
sequence whose first `roots` cells are roots and whose deepest cell has depth exactly k (a spine of
k nodes, each naming the one before); every other node names earlier cells drawn uniformly among
those shallower than k, so each sequence holds easy and hard positions at once (most of them
shallow).

Why names are written (measured, docs/reasoning.md): with `named=0` a cell is addressed by its
position alone (`31ab…`), and a d = 64 model learns the lookup slowly (depth 4 at 74% after 2,000
steps, one hop 93% at one loop); with names the lookup matches a token and the same model
resolves depth 4 at 100% with 4 loops after the same steps.

`solve(text)` and `difficulty(text)` recompute labels and difficulties from the text alone; the
tests check both against an independent solver. Nothing here imports torch.
"""
from __future__ import annotations

import itertools
import random
import string
from abc import abstractmethod
from dataclasses import dataclass

from meshlm.reasoning.tasks import Task

LETTERS = string.ascii_lowercase
DIGITS = string.digits
ROOT = "."  # the first character of a two-character root cell


@dataclass(frozen=True)
class Sequence:
    """One labelled sequence: `text` (one character a token), and per character its label and the
    label's difficulty (None where the position has no label)."""

    text: str
    labels: tuple[str | None, ...]
    depths: tuple[int | None, ...]
    difficulty: int  # the deepest label's


class CellTask(Task):
    """`cells` cells of `width` characters, each a root or a node naming `arity` earlier cells;
    subclasses say what a cell holds and how a node's value follows from its parents'."""

    labelled = True
    arity: int = 1
    width: int = 1
    values: str = DIGITS  # the characters a value is written in (roots and labels)

    def __init__(self, cells: int = 16, train_depth: int = 4, roots: int = 4, named: int = 1):
        if not 2 <= cells <= len(LETTERS):
            raise ValueError(f"need 2 <= cells <= {len(LETTERS)} (one letter per cell)")
        if not self.arity <= roots < cells:
            raise ValueError(f"need {self.arity} <= roots < cells ({cells})")
        if not 1 <= train_depth <= cells - roots:
            raise ValueError(f"need 1 <= train_depth <= cells - roots ({cells - roots})")
        self.cells, self.roots, self.named = cells, roots, bool(named)
        # named: each cell starts with its own name in capitals (`Cd`: cell c names cell d), so a
        # lookup matches a name instead of counting positions
        self.content_width = self.width
        self.width += self.named
        self.levels = range(1, cells - roots + 1)  # a depth-k cell needs k nodes before it
        self.train_levels = range(1, train_depth + 1)
        self.test_levels = range(1, min(2 * train_depth, cells - roots) + 1)
        self.alphabet = (LETTERS[:cells] + self.values + (ROOT if self.content_width == 2 else "")
                         + (LETTERS[:cells].upper() if self.named else ""))

    # -- what a subclass defines ----------------------------------------------------------------
    @abstractmethod
    def root(self, rng: random.Random) -> str:
        """A root cell's characters (`width` of them), drawn from rng."""

    @abstractmethod
    def node(self, rng: random.Random, parents: list[int]) -> str:
        """A node cell's characters naming `parents` (cell indices), drawn from rng."""

    @abstractmethod
    def value(self, cell: str, parents: list[str]) -> str:
        """A cell's value from its characters and its parents' values (none for a root)."""

    def parents_of(self, cell: str) -> list[int]:
        """The cells a cell's content names (none for a root)."""
        return [LETTERS.index(c) for c in cell if c in LETTERS]

    # -- shared ---------------------------------------------------------------------------------
    def sample(self, rng: random.Random, difficulty: int) -> Sequence:
        if difficulty not in self.levels:
            raise ValueError(f"difficulty {difficulty} outside {self.levels}")
        # the first `roots` cells are roots, so every sequence holds the same number of written
        # values and no label can be read off the only digit; a spine of `difficulty` nodes, each
        # naming the one before, sets the deepest cell; every other node names earlier cells
        # shallower than `difficulty`
        spine = sorted(rng.sample(range(self.roots, self.cells), difficulty))
        depth: list[int] = []
        parents: list[list[int] | None] = []
        for j in range(self.cells):
            if j < self.roots:
                parents.append(None)
                depth.append(0)
                continue
            at = spine.index(j) if j in spine else None
            shallow = [i for i in range(j) if depth[i] < (difficulty if at is None else at + 1)]
            first = (rng.choice(shallow) if at is None
                     else spine[at - 1] if at else rng.randrange(self.roots))
            chosen = [first] + rng.sample([i for i in shallow if i != first], self.arity - 1)
            rng.shuffle(chosen)
            parents.append(chosen)
            depth.append(1 + max(depth[i] for i in chosen))
        text = "".join((LETTERS[j].upper() if self.named else "")
                       + (self.root(rng) if p is None else self.node(rng, p))
                       for j, p in enumerate(parents))
        return self.labelled_sequence(text)

    def split(self, text: str) -> list[str]:
        if len(text) != self.cells * self.width:
            raise ValueError(f"{self.name}: {len(text)} characters, not {self.cells} cells of "
                             f"{self.width}")
        return [text[i:i + self.width] for i in range(0, len(text), self.width)]

    def resolve(self, text: str) -> tuple[list[str], list[int], list[bool]]:
        """Per cell: its value, its depth, whether it is a node."""
        values: list[str] = []
        depths: list[int] = []
        nodes: list[bool] = []
        for cell in self.split(text):
            cell = cell[self.named:]  # its content, after its name
            named = self.parents_of(cell)
            if any(p >= len(values) for p in named):
                raise ValueError(f"{self.name}: cell {len(values)} names a later cell")
            values.append(self.value(cell, [values[p] for p in named]))
            depths.append(1 + max(depths[p] for p in named) if named else 0)
            nodes.append(bool(named))
        return values, depths, nodes

    def labelled_sequence(self, text: str) -> Sequence:
        values, depths, nodes = self.resolve(text)
        labels: list[str | None] = []
        levels: list[int | None] = []
        for value, depth, node in zip(values, depths, nodes):
            labels += [None] * (self.width - 1) + [value if node else None]
            levels += [None] * (self.width - 1) + [depth if node else None]
        return Sequence(text, tuple(labels), tuple(levels), max(depths))

    def solve(self, text: str) -> tuple[str | None, ...]:
        return self.labelled_sequence(text).labels

    def difficulty(self, text: str) -> int:
        return self.labelled_sequence(text).difficulty


class Chain(CellTask):
    """Chain resolution (k-hop, Sanford et al. 2024): a cell holds a digit or the name of an earlier
    cell; its label is the digit at the end of the chain."""

    name = "chain"
    summary = "chain resolution: a cell holds a digit or an earlier cell's name; label its digit"

    def root(self, rng):
        return rng.choice(DIGITS)

    def node(self, rng, parents):
        return LETTERS[parents[0]]

    def value(self, cell, parents):
        return parents[0] if parents else cell


class _Folded(CellTask):
    """One-character cells whose node names its parent in one of `ops` alphabets of `cells`
    letters each: letter `LETTERS[g * cells + p]` names cell p with operation g (with 12 cells, `c`
    names cell C with the first operation, `o` with the second). Folding the operation into the
    name keeps a cell one character wide, as chain's: a cell that writes its parent and an operand
    as two characters learns far slower (docs/reasoning.md)."""

    ops: int = 2

    def __init__(self, cells: int = 12, train_depth: int = 4, roots: int = 4, named: int = 1):
        if not 2 <= cells <= len(LETTERS) // self.ops:
            raise ValueError(f"need 2 <= cells <= {len(LETTERS) // self.ops} ({self.ops} letters "
                             "per cell)")
        super().__init__(cells, train_depth, roots, named)
        self.alphabet += LETTERS[cells:self.ops * cells]  # the other operations' names

    def parents_of(self, cell):
        return [LETTERS.index(c) % self.cells for c in cell if c in LETTERS]

    def root(self, rng):
        return rng.choice(self.values)

    def node(self, rng, parents):
        return LETTERS[parents[0] + self.cells * rng.randrange(self.ops)]

    def value(self, cell, parents):
        return self.apply(parents[0], LETTERS.index(cell) // self.cells) if parents else cell

    @abstractmethod
    def apply(self, value: str, op: int) -> str:
        """A node's value from its parent's and the operation its letter names."""


class Parity(_Folded):
    """A chain of copies and negations (parity along a path): a cell holds a bit or the name of an
    earlier cell, as its small letter (the same bit) or as the letter `cells` places on (the bit
    flipped). A label is the parity of the negations along its cell's chain, so it depends on every
    step of the chain, not only its end."""

    name = "parity"
    summary = "a chain of copies and negations: label the bit at its end, flipped once per negation"
    values = "01"

    def apply(self, value, op):
        return str(int(value) ^ op)


class _Operand(CellTask):
    """Two-character cells: a root is `.v` (value v), a node names its parent(s) and, with arity 1,
    an operand: `cv`."""

    width = 2

    def root(self, rng):
        return ROOT + rng.choice(self.values)

    def node(self, rng, parents):
        if self.arity == 2:
            return "".join(LETTERS[p] for p in parents)
        return LETTERS[parents[0]] + rng.choice(self.values)


# S3 as the permutations of (0, 1, 2) in lexicographic order, element i written as digit i;
# a ∘ b applies a, then b
_S3 = list(itertools.permutations(range(3)))
S3_TABLE = [[_S3.index(tuple(b[a[x]] for x in range(3))) for b in _S3] for a in _S3]


# S3's generators: a swap (the permutation (1, 0, 2)) and a rotation ((1, 2, 0))
S3_GENERATORS = (_S3.index((1, 0, 2)), _S3.index((1, 2, 0)))


class Compose(_Folded):
    """Running composition in the non-abelian group S3 along a chain (Merrill & Sabharwal 2025): a
    cell holds an element (root, 0-5) or an earlier cell named with a generator, its small letter
    for the swap s and the letter `cells` on for the rotation r; its value is the parent's value
    composed with that generator. s and r do not commute, so a model must follow the chain in
    order, not count."""

    name = "compose"
    summary = "composition in S3 along a chain: value(parent) ∘ s or ∘ r, labelled at every cell"
    values = "012345"

    def apply(self, value, op):
        return str(S3_TABLE[int(value)][S3_GENERATORS[op]])


class _Modular(_Operand):
    """Values are digits mod `modulus` (2 … 10; the default is the class's `default_modulus`)."""

    default_modulus = 10

    def __init__(self, cells: int = 16, train_depth: int = 4, roots: int = 4, named: int = 1,
                 modulus: int | None = None):
        modulus = self.default_modulus if modulus is None else modulus
        if not 2 <= modulus <= 10:
            raise ValueError("need 2 <= modulus <= 10 (one digit a value)")
        self.modulus, self.values = modulus, DIGITS[:modulus]
        super().__init__(cells, train_depth, roots, named)


class AddMod(_Modular):
    """A chain that adds: a cell holds a digit (root) or an earlier cell and a digit; its value is
    the parent's value plus its digit, mod `modulus` (default 10)."""

    name = "addmod"
    summary = "a chain of additions mod m: value(parent) + digit"

    def value(self, cell, parents):
        return str((int(parents[0]) + int(cell[1])) % self.modulus if parents else int(cell[1]))


class DagMod(_Modular):
    """DAG evaluation mod m with a label per statement (i-GSM-like, Saunshi et al. 2025): a cell
    holds a digit (root) or two earlier cells; its value is their sum mod `modulus` (default 2).
    Two lookups a step, so every value depends on all its ancestors."""

    name = "dagmod"
    summary = "DAG evaluation mod m: a cell is the sum of two earlier cells"
    arity = 2
    default_modulus = 2

    def value(self, cell, parents):
        return str(sum(map(int, parents)) % self.modulus) if parents else cell[1]
