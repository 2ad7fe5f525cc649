"""A batch being decoded: its looped KV cache, the padding mask over it, each row's pending token.

Self-speculative decoding (meshlm.generate.rounds) and continuous batching (meshlm.serve.cohorts)
share it. Between two decoding steps the cache holds exactly `cached` positions in every slot, the
mask's width; a step feeds positions past it and `settle` says which of them stay real. Rows that
accepted fewer drafted tokens than others leave holes (padding, mask 0), which attention ignores and
default positions skip, exactly like left padding; `compact` squeezes them out. Rows join (prefilled
in a cache of their own, right-aligned) and leave at token boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.model.kv_cache import KVCache

JOIN_ROOM = 8  # spare positions a joined cache gets, so the next steps append in place


@dataclass
class Batch:
    kv: KVCache
    mask: torch.Tensor  # (B, W) 1 = real token, 0 = padding, over every cached position
    pending: torch.Tensor  # (B,) each row's next token: sampled by the full model, not yet fed

    def __len__(self) -> int:
        return self.mask.shape[0]

    @property
    def cached(self) -> int:
        return self.mask.shape[1]

    def settle(self, keep: torch.Tensor, pending: torch.Tensor) -> None:
        """After a step fed new positions: row r keeps the first keep[r] of them real, the others
        become padding; the cache keeps the most any row kept (at least one); `pending` (B,) are the
        rows' next tokens."""
        width = max(int(keep.max()), 1)
        self.kv.crop(self.cached + width)  # every slot: prelude, loops, coda
        columns = torch.arange(width, device=keep.device)[None] < keep[:, None]  # (B, width)
        self.mask = torch.cat([self.mask, columns.to(self.mask.dtype)], 1)
        self.pending = pending

    def compact(self) -> None:
        """Move every row's padding (left padding and rollback holes) to the left, in order, then
        drop the columns that are padding in every row. Attention ignores padding and positions
        count real tokens, so nothing a later token computes changes."""
        real = self.mask.bool()
        order = torch.sort(real.long(), dim=1, stable=True).indices  # (B, W): padding, then real
        order = order[:, int((~real).sum(1).min()):]
        self.kv.reorder(order)
        self.mask = self.mask.gather(1, order)

    def join(self, other: Batch) -> None:
        """Add another batch's rows below these, right-aligned (the shorter side is left-padded)."""
        width = max(self.cached, other.cached)
        self.kv = KVCache.stack([self.kv, other.kv], room=JOIN_ROOM)
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        self.pending = torch.cat([self.pending, other.pending])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in order); forget the columns that are padding in all of them."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        unused = int(mask.bool().any(0).long().argmax()) if rows else 0  # first column still read
        self.kv.select(index, start=unused)  # copies the kept rows' columns from there on only
        self.mask, self.pending = mask[:, unused:], self.pending[index]


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], 1)
