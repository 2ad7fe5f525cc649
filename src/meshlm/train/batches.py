"""The batches of one optimizer step, per rank and micro-batch, as tensors.

The data order is meshlm.data.prepare's (`batch_indices`: epoch permutations fixed by the seed), so
the batch of step s is the same for any world size and micro-batch split; this module only cuts it
up and makes tensors (it is here, not in meshlm.data, so that preparing data never imports torch).
"""
from __future__ import annotations

import torch

from meshlm.data.order import batch_indices
from meshlm.data.prepare import PreparedData
from meshlm.errors import ConfigError


def get_batch(data: PreparedData, step: int, global_batch: int, seq_len: int, seed: int,
              rank: int = 0, world: int = 1, micro_batches: int = 1,
              n_sequences: int | None = None) -> list:
    """This rank's part of step `step`'s global batch, as `micro_batches` (x, y) LongTensor pairs.

    Rank r takes the r-th contiguous slice of global_batch / world windows (so the ranks' slices, in
    rank order, are the single-process batch) and cuts it into micro-batches of global_batch /
    (world * micro_batches) windows; x = window[:-1] and y = window[1:], each (micro_batch,
    seq_len). `n_sequences` draws from the first n windows only (a curriculum's opened prefix).
    """
    if (world < 1 or micro_batches < 1 or not 0 <= rank < world
        or global_batch % (world * micro_batches)):
        raise ConfigError(f"global batch {global_batch} must split evenly over {world} ranks x "
                          f"{micro_batches} micro-batches (rank {rank}); change global_batch or "
                          "micro_batches")
    indices = batch_indices(step, global_batch, seed, n_sequences or data.num_sequences(seq_len))
    x, y = windows_xy(data, rank_part(indices, rank, world), seq_len)  # (per_rank, seq_len) each
    return list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))


def rank_part(batch, rank: int, world: int):
    """Rank `rank`'s contiguous slice of a global batch's rows (a list or a tensor), in rank order:
    the cut `get_batch` makes, and anything drawn per row of the batch must make too."""
    per_rank = len(batch) // world
    return batch[rank * per_rank:(rank + 1) * per_rank]


def windows_xy(data: PreparedData, indices: list[int], seq_len: int) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
    """Windows `indices` as (x, y) LongTensors (len(indices), seq_len): inputs and next-token
    targets, the targets -100 (cross-entropy's ignore_index) where task data's answer mask leaves a
    token out of the loss."""
    return tuple(torch.from_numpy(a) for a in data.inputs_targets(indices, seq_len))
