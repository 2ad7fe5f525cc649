"""A delayed reveal of the input: each row's loop starts from a partial input and sees the whole
one only some steps later.

    model(x, targets=y, loops=K, reveal=Reveal(early_ids, steps))

Row r's states h⁰ … h^{steps[r] − 1} are computed from `early_ids[r]` (the loop starts from its
prelude output and re-injects it), and from h^{steps[r]} on from the true input; steps[r] = 0 is
the plain forward. Only a scheme that reads its input at every step (`Scheme.reinjects`: anchor,
anchor-emb, the mixes) can be revealed to after the loop has started; a run is refused otherwise.

Why (docs/reasoning.md, "Test-time depth"): trained on problems whose every answer resolves within
the first few loop steps, a looped model may learn *when* answers resolve (by its step count) rather
than *that* a cell resolves once its parent has. Hiding the given values (the training wrapper,
meshlm.train.reveal, puts `<|unk|>` in their place) for a random number of steps moves every
resolution later by that many steps, so the step count stops predicting it, while each problem stays
inside the trained difficulties. Trained so, the loop goes on resolving past the deepest trained
problem when run longer.

A training setting: it cannot be combined with a cache or exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.model.schemes import LoopContext, map_contexts


@dataclass(frozen=True)
class Reveal:
    early_ids: torch.Tensor  # (B, T) the input before the reveal
    steps: torch.Tensor  # (B,) long: how many states of each row see early_ids

    def hidden(self, state: int) -> torch.Tensor:
        """(B, 1, 1) bool: whether each row's state h^state is computed from the early input."""
        return (self.steps > state).view(-1, 1, 1)


@dataclass
class Revealing:
    """A run's two inputs: the contexts the scheme built from each, and when each row switches."""

    reveal: Reveal
    true: LoopContext
    early: LoopContext

    def start(self, h: torch.Tensor, h_early: torch.Tensor) -> torch.Tensor:
        """h⁰ of each row: the early input's where it starts hidden."""
        return torch.where(self.reveal.hidden(0), h_early, h)

    def context(self, step: int) -> LoopContext:
        """The context loop step `step` (computing h^{step + 1}) reads: per row, the early input's
        while h^{step + 1} is still hidden, else the true input's."""
        hidden = self.reveal.hidden(step + 1)
        return map_contexts(lambda parts: torch.where(hidden, parts[1], parts[0]),
                            [self.true, self.early])
