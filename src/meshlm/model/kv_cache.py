"""The looped KV cache: one key/value entry per *unrolled* layer, not per module.

A looped model reuses each core layer K times, but every pass attends over different hidden states,
so each pass needs its own keys and values. The cache therefore has one slot per unrolled layer, in
execution order:

    "2+3R2+1":  slot 0 1 │ 2 3 4 │ 5 6 7 │ 8
                prelude  │ core, pass 0 │ core, pass 1 │ coda
                (modules: prelude.0-1, cores.0.0-2, coda.0)

`slot_offsets` gives the first slot of every stage; `MeshLM.forward` hands each stage its offset.
The MeSH buffer, the anchors and every scheme state are per token, so decoding needs no cache for
them (docs/hf.md).

Any object with `update(key, value, layer_idx) -> (keys, values)` and `get_seq_length() -> int`
works as a cache: this `KVCache`, or a `transformers` `DynamicCache` (the public `Cache` API, which
`generate()` passes in). Keys are stored after rotary, so positions are baked in. Shapes: key/value
(B, H, T, hd).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from meshlm.config import Layout


class LayerCache(Protocol):
    """What the attention layers need from a cache (satisfied by transformers' `Cache` too)."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor,
                                                                                      torch.Tensor]:
        ...

    def get_seq_length(self) -> int:
        ...


class KVCache:
    """A per-slot key/value store that grows in place. Slots are created on first use, so a `loops`
    override works.

    A slot holds (B, H, capacity, hd) buffers whose first `length` positions are filled. An append
    writes its positions in place, and the buffers double when full, so a decode step copies only
    its own keys/values: appending with torch.cat copied the slot's whole history at every step,
    O(T²) memory traffic over a generation. Under autograd an append concatenates instead, so
    nothing autograd saved is written over. `keys` and `values` are the filled (B, H, length, hd)
    views."""

    def __init__(self) -> None:
        self._keys: list[torch.Tensor | None] = []  # per slot: (B, H, capacity, hd)
        self._values: list[torch.Tensor | None] = []
        self._lengths: list[int] = []

    @property
    def keys(self) -> list[torch.Tensor | None]:
        return [None if k is None else k[..., :n, :] for k, n in zip(self._keys, self._lengths)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return [None if v is None else v[..., :n, :] for v, n in zip(self._values, self._lengths)]

    def slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot i's filled (B, H, length, hd) keys and values."""
        n = self._lengths[i]
        return self._keys[i][..., :n, :], self._values[i][..., :n, :]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor,
                                                                                      torch.Tensor]:
        """Append this step's (B, H, T, hd) key/value to slot `layer_idx`; return the slot's full
        history."""
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
            self._lengths.append(0)
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            return self.concatenate(layer_idx, key, value)
        return self.write(layer_idx, key, value)

    def write(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """Append in place (growing the buffers when full); returns views of slot i's buffers."""
        n, t = self._lengths[i], key.shape[-2]
        if self._keys[i] is not None and self._keys[i].shape[:2] != key.shape[:2]:
            raise ValueError(f"cache slot {i} holds batch × heads "
                             f"{tuple(self._keys[i].shape[:2])}, the new keys "
                             f"{tuple(key.shape[:2])}; start a new cache for another batch")
        if self._keys[i] is None or n + t > self._keys[i].shape[-2]:
            self._grow(i, key, value, n + t)
        self._keys[i][..., n:n + t, :] = key
        self._values[i][..., n:n + t, :] = value
        self._lengths[i] = n + t
        return self.slot(i)

    def reserve(self, t: int) -> None:
        """Room for t more positions in every slot, grown now (as `write` would grow it), so that
        the next write stays in place: a compiled step then always takes the same branch."""
        for i, k in enumerate(self._keys):
            if k is not None and self._lengths[i] + t > k.shape[-2]:
                self._grow(i, k[..., :1, :], self._values[i][..., :1, :], self._lengths[i] + t)

    def concatenate(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor,
                                                                                   torch.Tensor]:
        """Append by concatenation: new tensors, so that nothing autograd saved is written over."""
        if self._lengths[i]:
            key, value = (torch.cat([old, new], -2) for old, new in zip(self.slot(i), (key, value)))
        self._keys[i], self._values[i], self._lengths[i] = key, value, key.shape[-2]
        return key, value

    def _grow(self, i: int, key: torch.Tensor, value: torch.Tensor, needed: int) -> None:
        """New buffers for slot i with room for at least `needed` positions (twice the old room),
        the filled positions copied over."""
        old_k, old_v, n = self._keys[i], self._values[i], self._lengths[i]
        capacity = max(needed, 2 * (0 if old_k is None else old_k.shape[-2]))
        self._keys[i] = key.new_empty(*key.shape[:-2], capacity, key.shape[-1])
        self._values[i] = value.new_empty(*value.shape[:-2], capacity, value.shape[-1])
        if n:
            self._keys[i][..., :n, :], self._values[i][..., :n, :] = old_k[..., :n, :], old_v[...,
                                                                                              :n, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already cached (every slot holds the same number after a full forward)."""
        return self._lengths[layer_idx] if layer_idx < len(self._lengths) else 0

    def __len__(self) -> int:
        return len(self._keys)

    def crop(self, length: int, slots: range | None = None) -> None:
        """Forget every token after the first `length` in `slots` (default: all), as transformers'
        `DynamicCache.crop`; speculative decoding rolls rejected draft tokens back with it."""
        for i in range(len(self._keys)) if slots is None else slots:
            if i < len(self._keys):
                self._lengths[i] = min(self._lengths[i], length)

    def select(self, index: torch.Tensor, start: int = 0) -> None:
        """Keep only the batch rows in `index` (e.g. drop finished sequences) and, of them, the
        positions from `start` on (columns no kept row reads): one copy of the filled positions
        that stay, not of the buffers' spare room or of the dropped columns."""
        for i, (k, v) in enumerate(zip(self._keys, self._values)):
            if k is not None:
                n = self._lengths[i]
                self._keys[i] = k[..., start:n, :][index]
                self._values[i] = v[..., start:n, :][index]
                self._lengths[i] = max(n - start, 0)

    @classmethod
    def stack(cls, caches: list[KVCache], room: int = 0) -> KVCache:
        """The rows of `caches` (each filled to its own length in every slot) in one cache,
        right-aligned: a shorter cache's rows are left-padded with zeros, which the batch's padding
        mask must cover. Buffers get `room` spare positions, so the next appends write in place.
        Continuous batching joins a prefilled request to a running batch with it
        (meshlm.serve.batcher)."""
        width = max(c.get_seq_length() for c in caches)
        out = cls()
        for i in range(max(len(c) for c in caches)):
            keys, values = zip(*(c.slot(i) for c in caches))
            out._keys.append(_left_padded(keys, width, room))
            out._values.append(_left_padded(values, width, room))
            out._lengths.append(width)
        return out

    def repeated(self, copies: int, length: int) -> RepeatedView:
        """A read-only view of the first `length` positions for `copies` copies of the batch."""
        return RepeatedView(self, copies, length)

    def reorder(self, order: torch.Tensor) -> None:
        """Keep, in every slot, the positions `order` (B, T') of each row, in that order (T' ≤
        length)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None:
                continue
            index = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            # new tensors: safe to write back in place
            k, v = k.gather(2, index), v.gather(2, index)
            self._keys[i][..., :k.shape[-2], :], self._values[i][..., :v.shape[-2], :] = k, v
            self._lengths[i] = k.shape[-2]


class RepeatedView:
    """A read-only LayerCache over a KVCache's first `length` positions for C copies of its batch
    (rows r, B + r, 2B + r … are row r): a layer sees each row's cached keys/values followed by its
    own, which are not stored. Self-speculative decoding reads C candidate drafts out at once
    through it (meshlm.generate.rounds)."""

    def __init__(self, cache: KVCache, copies: int, length: int):
        self.cache, self.copies, self.length = cache, copies, length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length == 0:
            return key, value
        past = self.cache.slot(layer_idx)  # (B, H, T_cached, hd)
        return tuple(torch.cat([t[..., :self.length, :].repeat(self.copies, 1, 1, 1), new], -2)
                     for t, new in zip(past, (key, value)))

    def get_seq_length(self) -> int:
        return self.length


class StaticKVCache(nn.Module):
    """A LayerCache of fixed shape, for a decode step compiled once (meshlm.generate.compiled):
    every slot holds (B, H, capacity, hd) keys and values, preallocated, and a decode step writes
    its one token in place, so the step's shapes never change.

    `column` is the next free column: `update` writes the step's token there (an index_copy_ at the
    position the `at` buffer holds, so the column is data, not a shape, and one compiled step serves
    every column), and the caller's (B, capacity) padding mask marks the filled columns and that one
    real, so the model's own mask and positions (get_seq_length() = capacity − 1, one new token;
    positions count real columns) attend to the cached tokens and the new one, as over a growing
    cache. `advance()`, after the step, moves `column` (and `at`) on: one small op a token, where
    writing the token at the last column and copying it to its own afterwards took two a slot (24
    at 12 layers, ~0.15 ms a token on a CPU). Built from an eager prefill's KVCache (`of`).
    Buffers, so a compiled step updates them in place.

    `window`, where the caller sets one, is the step's (B, W) padding mask over the first W
    columns (W > column + 1): the step then attends over those W columns alone, as if the
    capacity were W (get_seq_length() = W − 1, its last column the query's nominal one), while the
    token is still written into the full buffers. The caller marks W dynamic
    (torch._dynamo.mark_dynamic), so one compiled step serves every width: a step reads the
    columns filled so far (rounded up), not the whole capacity, which at a long generation's start
    cost twice the weights' time (meshlm.generate.compiled). The buffers hold one spare column
    past the capacity, never attended: a window is then never the whole buffer, whose contiguity
    would specialise the compiled step to that width."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: int):
        super().__init__()
        for i, (k, v) in enumerate(zip(keys, values)):
            self.register_buffer(f"k{i}", k)
            self.register_buffer(f"v{i}", v)
        self.register_buffer("at", torch.tensor([column], device=keys[0].device))
        self.column = column
        self.window: torch.Tensor | None = None  # the step's padding window, if any

    @classmethod
    def of(cls, cache: KVCache, capacity: int) -> StaticKVCache:
        """`cache`'s filled positions in buffers of `capacity` columns (more than it holds)."""
        length = cache.get_seq_length()
        if capacity <= length:
            raise ValueError(f"a static cache of {capacity} columns cannot hold {length} cached "
                             "tokens and the one decoded")
        keys, values = [], []
        for i in range(len(cache)):
            for filled, out in zip(cache.slot(i), (keys, values)):
                buffer = filled.new_zeros(*filled.shape[:2], capacity + 1, filled.shape[-1])
                buffer[..., :length, :] = filled
                out.append(buffer)
        return cls(keys, values, length)

    @property
    def capacity(self) -> int:
        return self.k0.shape[-2] - 1  # the spare column past it (the class docstring)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = getattr(self, f"k{layer_idx}"), getattr(self, f"v{layer_idx}")
        k.index_copy_(2, self.at, key)
        v.index_copy_(2, self.at, value)
        width = self._width()
        return k[:, :, :width], v[:, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width() - 1

    def _width(self) -> int:
        """The columns a step attends over: the window's, else the capacity."""
        return self.capacity if self.window is None else self.window.shape[-1]

    def advance(self) -> None:
        """After a step: its token is cached at `column`; the next goes one column on."""
        self.at += 1
        self.column += 1


def _left_padded(parts: tuple[torch.Tensor, ...], width: int, room: int) -> torch.Tensor:
    """(B_i, H, T_i, hd) tensors -> one (ΣB_i, H, width + room, hd) buffer, each part's positions
    ending at `width`, zeros before them and in the spare room."""
    first = parts[0]
    out = first.new_zeros(sum(p.shape[0] for p in parts), first.shape[1], width + room,
                          first.shape[-1])
    row = 0
    for p in parts:
        out[row:row + p.shape[0], :, width - p.shape[-2]:width] = p
        row += p.shape[0]
    return out


def slot_offsets(layout: Layout, schedule: tuple[int, ...]) -> tuple[int, list[int], int, int]:
    """First cache slot of the prelude, of each loop step, of the coda, and the total slot count."""
    step_offsets, next_slot = [], layout.prelude
    for core_index in schedule:
        step_offsets.append(next_slot)
        next_slot += layout.cores[core_index]
    return 0, step_offsets, next_slot, next_slot + layout.coda
