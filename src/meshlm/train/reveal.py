"""`train.reveal=S` on labelled task data: each training sequence's given values are hidden from
the loop for its first s steps, s drawn uniformly from 0 … S (meshlm.model.reveal).

The given values are the input tokens that are also some position's label (a chain's root values,
the digits its nodes resolve to), each replaced by the tokenizer's `<|unk|>`. A problem of
difficulty d then resolves at loop step s + d instead of d: trained with loop counts of at least
the deepest difficulty + S, every position still gets its answer, but the step count no longer says
when it resolves (docs/reasoning.md, "Test-time depth").

The draws are a function of (seed, step) over the global batch, cut by rank and micro-batch as the
batch itself is (meshlm.train.batches), so a step's reveal is the same for any world size and
micro-batch split, and after `--resume`.
"""
from __future__ import annotations

import torch

from meshlm.config import canonical_scheme
from meshlm.data.examples import label_ids
from meshlm.data.prepare import PreparedData
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.model.reveal import Reveal
from meshlm.model.schemes import SCHEMES
from meshlm.reasoning.vocab import UNK_TOKEN
from meshlm.train.batches import rank_part

SALT = 0x5EE1  # keeps the reveal's stream apart from the loop count's (meshlm.train.depth)


def check_reveal(plan, data: PreparedData) -> None:
    """ConfigError (or DataError) unless the plan's train.reveal can run: a scheme that re-injects
    its input, labelled data, a tokenizer with `<|unk|>`. Nothing to check at train.reveal=0."""
    most = plan.cfg.reveal
    if not most:
        return
    if not getattr(SCHEMES.get(canonical_scheme(plan.model.scheme)), "reinjects", False):
        raise ConfigError(f"train.reveal={most} needs a scheme that re-injects its input at every "
                          f"loop step (anchor, anchor-emb, residual+anchor, the mixes), not "
                          f"{plan.model.scheme!r}; set model.scheme=anchor or train.reveal=0")
    RevealDraws(data, most, plan.cfg.seed)


class RevealDraws:
    def __init__(self, data: PreparedData, most: int, seed: int):
        if data.labels is None:
            raise ConfigError(f"train.reveal={most} hides the given values of labelled task data, "
                              f"but {data.dir} has no labels; prepare a labelled task (meshlm "
                              "prepare task:chain) or set train.reveal=0")
        tokenizer = load_tokenizer(data.dir / data.manifest["tokenizer"]["file"])
        hidden = tokenizer.hf.token_to_id(UNK_TOKEN)
        if hidden is None:
            raise DataError(f"train.reveal needs a tokenizer with {UNK_TOKEN} to stand for a "
                            f"hidden value, and {data.dir}'s has none; prepare the data with "
                            "`meshlm prepare task:NAME`")
        self.most, self.seed, self.hidden = most, seed, hidden
        self.values = torch.as_tensor(label_ids(data.labels, data.shards[0].dtype).astype("int64"))

    def steps(self, step: int, global_batch: int, rank: int, world: int,
              micro_batches: int) -> list[torch.Tensor]:
        """Each of this rank's micro-batches' hidden step counts, (micro_batch,) each."""
        key = ((SALT * 1_000_003 + self.seed) * 1_000_003 + step) % 2**63
        generator = torch.Generator().manual_seed(key)
        drawn = torch.randint(0, self.most + 1, (global_batch,), generator=generator)
        return list(rank_part(drawn, rank, world).chunk(micro_batches))

    def reveal(self, x: torch.Tensor, steps: torch.Tensor) -> Reveal:
        """The Reveal of inputs x (B, T): the given values hidden, for steps (B,) loop states."""
        given = torch.isin(x, self.values.to(x.device))
        return Reveal(early_ids=x.masked_fill(given, self.hidden), steps=steps.to(x.device))
