"""The order of windows: which windows each optimizer step trains on, and the fixed validation set.

The data order is the concatenation of epoch permutations fixed by the seed, so the batch of step s
is the same for any world size and micro-batch split (meshlm.train.batches cuts it up); validation
windows are spread evenly over the split and sliced per rank.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from meshlm.errors import ConfigError


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of all n windows in one epoch, fixed by (seed, epoch)."""
    perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
    perm.flags.writeable = False  # cached and shared between calls
    return perm


def batch_indices(step: int, global_batch: int, seed: int, n_sequences: int) -> list[int]:
    """Window indices of the global batch of optimizer step `step`.

    The data order is the concatenation of epoch permutations; step s takes positions
    [s * global_batch, (s + 1) * global_batch) of it (a batch may straddle two epochs).
    """
    if n_sequences < 1 or global_batch < 1 or step < 0:
        raise ConfigError(f"need n_sequences >= 1, global_batch >= 1, step >= 0 "
                          f"(got {n_sequences}, {global_batch}, {step})")
    positions = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    epochs = positions // n_sequences
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(seed, int(epoch), n_sequences)[positions[mask] % n_sequences]
    return out.tolist()


def window_indices(n_windows: int, max_sequences: int | None) -> list[int]:
    """All windows, or `max_sequences` of them spread evenly (deterministic)."""
    n = n_windows if not max_sequences else min(max_sequences, n_windows)
    return [j * n_windows // n for j in range(n)]


def validation_batches(n_windows: int, max_sequences: int, micro_batch: int, rank: int = 0,
                       world: int = 1
                       ) -> list[tuple[list[int], bool]]:
    """This rank's forwards over the fixed validation set: (window indices, counted) pairs.

    The set is `window_indices(n_windows, max_sequences)` whatever the micro-batch and world size;
    rank r takes the r-th contiguous slice of it (sizes differ by at most one). Every rank runs the
    same number of forwards (FSDP gathers weights in each one), so a rank with fewer windows pads
    with an uncounted one.
    """
    indices = window_indices(n_windows, max_sequences)
    n = len(indices)
    mine = indices[rank * n // world:(rank + 1) * n // world]
    forwards = math.ceil(math.ceil(n / world) / micro_batch)  # the same on every rank
    chunks = [mine[i * micro_batch:(i + 1) * micro_batch] for i in range(forwards)]
    return [(chunk, True) if chunk else ([indices[0]], False) for chunk in chunks]

