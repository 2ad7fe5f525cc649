"""Per-token adaptive exit: a token stops looping once it has converged, then stops costing compute.

The exit criteria are a registry, as the schemes are: each is one class registered with
`@register_criterion("name")`, which says whether it probes (runs coda + head on every step's
state), what it measures per token and how it decides. A rule `name:τ` picks one. Two training-free
ones are built in, checked after every loop step j = 1 … K (a token always runs at least one step):

    state:τ  ‖h^j − h^{j−1}‖ / ‖h^{j−1}‖ < τ                        cheap: two norms per token
    kl:τ     KL(p_j ‖ p_{j−1}) < τ, p_j = softmax(head(coda(h^j)))  one coda + head "probe" per
                                                                    step, plus one on h⁰ (j = 0)

A new criterion is one class in one file: subclass `Criterion`, decorate it with
`@register_criterion`, and import the file before a rule names it (tests/test_exit.py adds one so
and runs it end to end).

τ = 0 never exits (every measure is >= 0 and the default test is strict), so the logits are exactly
the full-depth ones; τ = ∞ exits every token after one step: the one-loop logits. Without probes the
coda runs once, on each token's exit state; with probes a token's logits are its probe at the step
it exits (its coda cache slots are per probe, so later tokens' probes see the same keys in cached
and uncached runs).

What an exited token leaves behind for the others. Later tokens (and, in a full sequence, other
tokens at deeper steps) attend to it at every loop step. Its keys/values at a step it skipped are
those of the last step it computed, copied forward. This is free (nothing is recomputed), causal,
and identical in a full sequence and in cached decoding, so cached == uncached with exit on
(tests/test_exit.py). Recomputing the layers on its frozen state would cost the compute the exit
saves; zeros would make it invisible to deeper layers. Copying forward keeps its most refined
representation visible.

How compute is skipped. Each step runs the core on the *active* tokens only:
- all tokens active: the ordinary computation (bit-identical to the model without exit);
- few active (fraction < GATHER_BELOW): gather them flat, (N, 1, d), with their rotary tables, so
  the norms, projections and MLP cost the active tokens only; the attention lays the queries out
  per row and reads every token's current keys/values from `ExitKV` (meshlm.model.exit_tokens);
- otherwise mask: compute every token and keep only the active ones' results (cheaper than gathering
  when nearly every token is still active: benchmarks/reasoning_exit.py --gather-below).
In cached decoding at batch 1 a token that exits ends the loop: steps j+1 … K are not run, their
cache slots get its copied-forward keys/values. The scheme's own update is per token and cheap; it
runs on all tokens.

Without exit the loop runs with `NO_EXIT`, the tracker that keeps every token active and probes
nothing, so `MeshLM.advance` takes one path with and without exit.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.model.exit_tokens import ExitKV, Gathered
from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import Rope, attention_mask_from_padding
from meshlm.model.registry import named_into

GATHER_BELOW = 0.9  # gather the active tokens when fewer than this fraction of the batch's tokens
CRITERIA: dict[str, type[Criterion]] = {}


def register_criterion(name: str):
    """Class decorator: the exit criterion called `name` (rules read `name:τ`)."""

    return named_into(CRITERIA, name)


@dataclass
class Seen:
    """What a criterion sees after loop step j, of the tokens the step computed: shapes (N…, d) or
    (N…, vocab), N… = (B, T) when every token was computed, else (N, 1) gathered."""

    before: torch.Tensor | None  # h^{j−1} (None for a criterion that does not see the state)
    after: torch.Tensor | None  # h^j
    logits: torch.Tensor | None = None  # probing criteria: head(coda(h^j))
    previous: torch.Tensor | None = None  # probing criteria: head(coda(h^{j−1}))


class Criterion(abc.ABC):
    """How a token decides after loop step j that it has converged: a value >= 0 per token
    (`measure`), exits below τ (`converged`; strict, so τ = 0 never exits and τ = ∞ exits after one
    step)."""

    name: ClassVar[str] = ""
    example: ClassVar[str] = ""  # a rule for messages, e.g. "state:0.05"
    probes: ClassVar[bool] = False  # needs head(coda(h^j)) after every step j, and once on h⁰
    sees_state: ClassVar[bool] = True  # reads Seen.before and .after (else they are None)

    def __init__(self, threshold: float):
        self.threshold = threshold

    @abc.abstractmethod
    def measure(self, seen: Seen) -> torch.Tensor:
        """(N…) a value >= 0 per computed token."""

    def converged(self, seen: Seen) -> torch.Tensor:
        """(N…) bool: the computed tokens that stop looping."""
        return self.measure(seen) < self.threshold


@register_criterion("state")
class StateChange(Criterion):
    """The relative change of the loop state, ‖h^j − h^{j−1}‖ / ‖h^{j−1}‖: two norms per token."""

    example = "state:0.05"

    def measure(self, seen):
        change = (seen.after - seen.before).float().norm(dim=-1)
        return change / seen.before.float().norm(dim=-1).clamp_min(1e-12)


@register_criterion("kl")
class ProbeKL(Criterion):
    """KL(p_j ‖ p_{j−1}) between successive steps' next-token distributions: a probe per step."""

    example, probes, sees_state = "kl:1e-4", True, False

    def measure(self, seen):
        new, old = (F.log_softmax(x.float(), -1) for x in (seen.logits, seen.previous))
        return (new.exp() * (new - old)).sum(-1).clamp_min(0)  # >= 0 despite rounding


def _known() -> str:
    return ", ".join(CRITERIA)


def _examples() -> str:
    return " or ".join(c.example or f"{c.name}:0.1" for c in CRITERIA.values())


@dataclass(frozen=True)
class ExitRule:
    criterion: str  # a name in CRITERIA
    threshold: float  # τ >= 0 (inf allowed)

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ConfigError(f"exit criterion {self.criterion!r} is unknown; use one of: "
                              f"{_known()} (e.g. {_examples()})")
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0):
            raise ConfigError(f"exit threshold {self.threshold!r} must be a number >= 0 (0 = never "
                              f"exit, inf = after one loop), e.g. {_examples()}")

    @classmethod
    def parse(cls, text: str | ExitRule) -> ExitRule:
        """"state:0.05", "kl:1e-4" -> ExitRule."""
        if isinstance(text, ExitRule):
            return text
        criterion, sep, value = str(text).strip().partition(":")
        try:
            threshold = float(value)
        except ValueError:
            threshold = None
        if not sep or threshold is None or math.isnan(threshold):
            raise ConfigError(f"exit rule {text!r} is not CRITERION:THRESHOLD with CRITERION one "
                              f"of {_known()} and a number >= 0, e.g. {_examples()}")
        return cls(criterion.lower(), threshold)

    def build(self) -> Criterion:
        return CRITERIA[self.criterion](self.threshold)

    def __str__(self) -> str:
        return f"{self.criterion}:{self.threshold:g}"


def _expand(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, T) -> broadcastable against like (B, T, …)."""
    return active.view(*active.shape, *([1] * (like.dim() - 2)))


class NoExit:
    """The tracker of a loop without exit: every token computes every step, nothing is probed,
    nothing is counted. `MeshLM.advance` runs it through the same calls as `ExitTracker`; each hands
    back what it was given, so the loop is the model's plain computation."""

    probing = finished = False
    logits = loops = probes = None  # no probe logits, no per-token loop or probe counts

    def step_inputs(self, run, first_slot: int):
        """(x, rope, mask, kv, router logits list) for a core pass: the run's own."""
        return run.h, run.rope, run.mask, run.cache, run.routed

    def merge(self, computed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return computed

    def advance(self, h_old: torch.Tensor, h_new: torch.Tensor) -> torch.Tensor:
        return h_new


NO_EXIT = NoExit()


class ExitTracker:
    """Which tokens are still looping, how many steps each ran, and each step's gathered views."""

    def __init__(self, rule: ExitRule, h0: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                 padding_mask: torch.Tensor | None, cache: LayerCache | None, past: int):
        b, t, _ = h0.shape
        self.criterion = rule.build()
        self.probing = self.criterion.probes
        self.active = torch.ones(b, t, dtype=torch.bool, device=h0.device)
        # how many are active, counted once a step when it changes (`advance`): the one read of
        # the tokens' state a step makes (a compiled step breaks its graph there, meshlm.generate.
        # steps; reading it per layer broke it at every layer)
        self.count = b * t
        self.loops = torch.zeros(b, t, dtype=torch.long, device=h0.device)  # steps run per token
        self.probes = torch.zeros(b, t, dtype=torch.long, device=h0.device)  # coda + head runs
        self.kv = ExitKV(cache, self.active)
        self.rope, self.mask, self.padding_mask, self.past = rope, mask, padding_mask, past
        self.logits: torch.Tensor | None = None  # probing: (B, T, V) each token's latest probe
        self.previous: torch.Tensor | None = None  # probing: the computed tokens' probe before it
        self.sel = None
        # tensors this tracker made and handed to no one: a gathered step writes into them in place
        self._merged: torch.Tensor | None = None  # the step's merged core output
        self._own_logits = False

    # -- one step's view ---------------------------------------------------------------------------
    def select(self) -> None:
        """Choose how this step computes: all tokens (sel None) or the active ones gathered."""
        self.sel = None
        b, t = self.active.shape
        self.kv.everyone = self.count == b * t
        if self.kv.everyone or self.count >= GATHER_BELOW * b * t:
            return
        self.sel = Gathered.of(self.active)
        # the step's core pass and probe read these: gathered once
        self.sel.mask = self._full_mask()[self.sel.row_ids[:, None], 0,
                                          self.sel.cols_padded].unsqueeze(1)  # (R, 1, m, P + T)
        self.sel.rope = tuple(self.sel.take(r) for r in self.rope)

    def step_inputs(self, run, first_slot: int):
        """Choose this step's computed tokens, then (x, rope, mask, kv, router logits list) for its
        core pass (router logits of gathered tokens are not kept: exit is an inference setting)."""
        self.select()
        return *self.inputs(run.h, "core", first_slot), []

    def skip(self, core_slots: list[int], probe_slots: list[int]) -> None:
        """Every token exited: fill the skipped steps' cache slots with their copied-forward
        keys/values."""
        for slot in core_slots:
            self.kv.copy_forward("core", slot)
        for slot in probe_slots if self.probing else ():
            self.kv.copy_forward("probe", slot)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, …) -> the computed tokens: itself, or (N, 1, …) gathered."""
        return x if self.sel is None else self.sel.take(x)

    def inputs(self, h: torch.Tensor, group: str, first_slot: int):
        """(x, rope, mask, kv) for a stage (core pass or coda probe) over the computed tokens (a
        gathered stage's attention mask is the tracker's own, `ExitKV` applies it)."""
        kv = self.kv.stage(group, first_slot, self.sel)
        if self.sel is None:
            return h, self.rope, self.mask, kv
        return self.view(h), self.sel.rope, None, kv

    def _full_mask(self) -> torch.Tensor:
        """(B, 1, T, P + T) "may attend" mask of every new token (built once, gathered from)."""
        if self.mask is None or self.mask.shape[-2] != self.active.shape[1]:
            b, t = self.active.shape
            pad = self.padding_mask
            if pad is None:
                pad = torch.ones(b, self.past + t, dtype=torch.long, device=self.active.device)
            self.mask = attention_mask_from_padding(pad, self.past)
        return self.mask

    def merge(self, computed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The core's output: the computed tokens' placed into a (B, T, d) tensor, the exited
        tokens' from `like` (the state)."""
        self._merged = self._merge(computed, like)
        return self._merged

    def _merge(self, computed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Computed tokens' outputs placed into a (B, T, …) tensor; exited tokens keep `like`'s."""
        if self.sel is None:
            if self.kv.everyone:
                return computed
            return torch.where(_expand(self.active, like), computed, like)
        return self.sel.put(like.clone(memory_format=torch.contiguous_format), computed)

    # -- after a step ------------------------------------------------------------------------------
    def probe(self, logits: torch.Tensor) -> None:
        """Record the computed tokens' probe logits (N, 1, V) or (B, T, V) of this step's state."""
        self.previous = None if self.logits is None else self.view(self.logits)
        if self.sel is not None and self._own_logits and not torch.is_grad_enabled():
            self.sel.put(self.logits, logits)
        else:
            self.logits = logits if self.logits is None else self._merge(logits, self.logits)
            self._own_logits = True
        self.probes += self.active

    def final_logits(self) -> torch.Tensor | None:
        """Probing: each token's probe where it exited (B, T, V), handed out: later probes no longer
        write into it."""
        self._own_logits = False
        return self.logits

    def advance(self, h_old: torch.Tensor, h_new: torch.Tensor) -> torch.Tensor:
        """Count the step, decide who exits, and return the state with exited tokens frozen."""
        self.loops += self.active
        state = self.criterion.sees_state
        seen = Seen(self.view(h_old) if state else None, self.view(h_new) if state else None,
                    None if self.logits is None else self.view(self.logits), self.previous)
        self.previous = None  # a probe lives one step longer, for the comparison only
        converged = self._merge(self.criterion.converged(seen), torch.zeros_like(self.active))
        # the scheme handed back the merged core output itself (the base recursion): its exited
        # tokens already hold h_old's
        h = h_new if h_new is self._merged else self._merge(self.view(h_new), h_old)
        self._merged = None
        self.active &= ~converged  # in place: ExitKV shares this tensor
        self.count = int(self.active.sum())
        return h

    @property
    def finished(self) -> bool:
        return self.count == 0
