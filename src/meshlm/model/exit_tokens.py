"""What the layers compute on under exit: the active tokens gathered flat, and the cache that keeps
every token's current keys/values (meshlm.model.exit drives both).

A gathered step computes N active tokens of a (B, T) batch as a (N, 1, d) input: the norms,
projections and MLP cost N tokens, however unevenly the rows hold them. Attention needs each query's
own row of keys, so `ExitKV.attend` lays the N queries out per row, padded to the busiest row (R
rows with an active token, m = that row's count; padding repeats the row's last active token),
runs one attention over the R rows' keys and takes the N real outputs back. Only the queries and
outputs move (N · d each), never a row of keys per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.model.kv_cache import LayerCache
from meshlm.model.layers import attend


@dataclass
class Gathered:
    """The active tokens of a step: positions `rows`, `cols` (N,) and `flat` (N,) = rows · T + cols,
    and their attention layout per row: `row_ids` (R,) the rows, `pad` (R, m) the flat index at
    each padded slot, `unpad` (N,) each token's index into the flattened (R · m) slots,
    `cols_padded` (R, m) the column at each slot. Tokens move by `index_select`/`index_copy_` on
    the (B · T) dimension: several times faster on CPU than indexing by (rows, cols)."""

    rows: torch.Tensor
    cols: torch.Tensor
    flat: torch.Tensor
    row_ids: torch.Tensor
    pad: torch.Tensor
    unpad: torch.Tensor
    cols_padded: torch.Tensor
    mask: torch.Tensor | None = None  # (R, 1, m, P + T) "may attend", set by the tracker
    rope: tuple[torch.Tensor, ...] = ()  # the tokens' rotary tables (N, 1, r), set by the tracker

    @classmethod
    def of(cls, active: torch.Tensor) -> Gathered:
        """The active tokens of a (B, T) bool mask, in row-major order."""
        rows, cols = active.nonzero().unbind(1)  # (N,) each
        row_ids, counts = torch.unique_consecutive(rows, return_counts=True)  # (R,)
        m = int(counts.max())
        first = counts.cumsum(0) - counts  # (R,) the flat index of each row's first token
        row_pos = torch.repeat_interleave(counts)  # (N,) each token's row among the R
        rank = torch.arange(len(rows), device=active.device) - first[row_pos]
        # per row, padded with the row's last token
        pad = torch.minimum(first[:, None] + torch.arange(m, device=active.device),
                            (first + counts - 1)[:, None])  # (R, m)
        return cls(rows=rows, cols=cols, flat=rows * active.shape[1] + cols, row_ids=row_ids,
                   pad=pad, unpad=row_pos * m + rank, cols_padded=cols[pad])

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, …) -> the gathered tokens (N, 1, …); x of batch 1 stands for every row."""
        if x.shape[0] == 1:
            return x[0].index_select(0, self.cols).unsqueeze(1)
        return x.flatten(0, 1).index_select(0, self.flat).unsqueeze(1)

    def put(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """base (B, T, …), contiguous, with the gathered tokens set to x (N, 1, …), in place."""
        base.view(-1, *base.shape[2:]).index_copy_(0, self.flat, x.flatten(0, 1))
        return base


class ExitKV:
    """The cache the layers see during loop steps under exit: it keeps every layer's *current*
    keys/values for all new tokens (active ones just computed, exited ones from their last computed
    step) and appends them to the real cache's slot for that step, so deeper steps and later tokens
    attend to the same thing.

    `stage(group, first_slot, sel)` points it at one stage (a core pass or a coda probe); `sel` is
    None when every token is computed, else the `Gathered` tokens. A gathered step writes its
    tokens into the current keys/values in place once they are this cache's own copy (without
    autograd: nothing else holds them; a real cache copies what it is given)."""

    def __init__(self, inner: LayerCache | None, active: torch.Tensor):
        self.inner, self.active = inner, active  # active: (B, T) bool, shared with the tracker
        self.everyone = True  # every token active this step (set by the tracker: its `count`)
        self.latest: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.owned: set[tuple[str, int]] = set()  # latest entries that are copies of our own
        self.group, self.first, self.sel = "core", 0, None

    def stage(self, group: str, first_slot: int, sel: Gathered | None) -> ExitKV:
        self.group, self.first, self.sel = group, first_slot, sel
        return self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               slot: int) -> torch.Tensor:
        """meshlm.model.layers.attend for the computed tokens: q, k, v (B, H, T, hd), or (N, H, 1,
        hd) gathered."""
        keys, values = self.update(k, v, slot)  # (B, H, P + T, hd)
        g = self.sel
        if g is None:
            return attend(q, keys, values, mask, None, slot)
        per_row = q[:, :, 0][g.pad].transpose(1, 2)  # (R, H, m, hd)
        if len(g.row_ids) < keys.shape[0]:
            keys, values = (x.index_select(0, g.row_ids) for x in (keys, values))
        y = attend(per_row, keys, values, g.mask, None, slot)
        return y.transpose(1, 2).flatten(0, 1)[g.unpad].unsqueeze(2)  # (N, H, 1, hd)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value of the computed tokens -> every new token's current ones, with a cache the
        slot's history too: (B, H, P + T, hd)."""
        name = (self.group, layer_idx - self.first)
        old = self.latest.get(name)
        mine = name in self.owned and not torch.is_grad_enabled()
        self.owned.discard(name)
        if old is None or (self.sel is None and self.everyone):
            new = key, value  # every token computed and kept: exactly the model without exit
        elif self.sel is None:  # masked: keep the computed ones of active tokens only
            keep = self.active[:, None, :, None]
            new = torch.where(keep, key, old[0]), torch.where(keep, value, old[1])
            self.owned.add(name)
        else:  # gathered: scatter the computed tokens into the current keys/values
            new = tuple(self._scatter(_tokens_major(o, mine), x) for o, x in zip(old, (key, value)))
            self.owned.add(name)
        self.latest[name] = new
        return new if self.inner is None else self.inner.update(*new, layer_idx)

    def _scatter(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """base (B, H, T, hd), tokens-major in memory, with the gathered tokens set to x (N, H, 1,
        hd), in place."""
        self.sel.put(base.transpose(1, 2), x.transpose(1, 2))  # (B, T, H, hd) is contiguous
        return base

    def get_seq_length(self) -> int:
        return 0 if self.inner is None else self.inner.get_seq_length()

    def copy_forward(self, group: str, first_slot: int) -> None:
        """Append the current keys/values of `group` to the real cache's slots from first_slot (a
        skipped stage)."""
        if self.inner is None:
            return
        for (g, i), (k, v) in sorted(self.latest.items(), key=lambda item: item[0][1]):
            if g == group:
                self.inner.update(k, v, first_slot + i)


def _tokens_major(x: torch.Tensor, writable: bool) -> torch.Tensor:
    """x (B, H, T, hd) laid out (B, T, H, hd) in memory: itself if it is so and writable, else a
    copy. A token's heads are then one block, so tokens are written by one index_copy_."""
    if writable and x.transpose(1, 2).is_contiguous():
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)
