"""Validation perplexity on prepared data, and loss as a function of the loop count.

Perplexity = exp(mean next-token loss) over the non-overlapping windows of `seq_len` + 1 tokens of a
prepared split (meshlm.data.prepare.PreparedData), every target token counted once; `max_sequences` takes that
many windows spread evenly over the split (all by default).

Loss vs. depth runs the same windows with K' loop steps instead of the trained K (`MeshLM(loops=K')`, a
single-core spec only). What each scheme does beyond its trained steps: the loop is the same code, the core
is simply applied again. MeSH has K + 1 trained router pairs; step t > K reuses the last pair (the one
trained for the final loop step and read into the coda), and the buffer keeps its B = K_train + 3 slots
(meshlm.model.memory). With K' < K, MeSH uses pairs 0 … K' and its last read is produced by pair K'.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from meshlm.data.prepare import PreparedData


def window_indices(n_windows: int, max_sequences: int | None) -> list[int]:
    """All windows, or `max_sequences` of them spread evenly (deterministic)."""
    n = n_windows if not max_sequences else min(max_sequences, n_windows)
    return [j * n_windows // n for j in range(n)]


@torch.no_grad()
def mean_loss(model, data: PreparedData, seq_len: int, batch_size: int = 8, max_sequences: int | None = None,
              loops: int | None = None) -> dict[str, Any]:
    """Token-weighted mean next-token loss over the chosen windows: {"loss", "ppl", "tokens", "sequences"}."""
    device = next(model.parameters()).device
    indices = window_indices(data.num_sequences(seq_len), max_sequences)
    total, count = 0.0, 0
    for start in range(0, len(indices), batch_size):
        windows = [data.sequence(i, seq_len) for i in indices[start:start + batch_size]]
        batch = torch.from_numpy(np.stack(windows)).to(device)  # (b, seq_len + 1)
        loss = model(batch[:, :-1], targets=batch[:, 1:], loops=loops).loss
        total += loss.double().item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": count, "sequences": len(indices)}


def default_loop_counts(model) -> list[int]:
    """1 … 2K for a weight-shared single-core model (K = trained steps); nothing for other layouts."""
    layout = model.config.layout
    if len(layout.cores) != 1 or not layout.shares_weights:
        return []
    return list(range(1, 2 * layout.n_steps + 1))


def loss_vs_loops(model, data: PreparedData, seq_len: int, loop_counts: list[int], **kwargs) -> list[dict]:
    """[{"loops": K', "loss", "ppl", "trained": K' == K}] for each requested loop count."""
    trained = model.config.layout.n_steps
    return [{"loops": k, "trained": k == trained, **mean_loss(model, data, seq_len, loops=k, **kwargs)}
            for k in loop_counts]
