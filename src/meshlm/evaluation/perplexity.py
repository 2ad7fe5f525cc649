"""Validation perplexity on prepared data, and loss as a function of the loop count.

Perplexity = exp(mean next-token loss) over the non-overlapping windows of `seq_len` + 1 tokens of a
prepared split (meshlm.data.prepare.PreparedData), every target token counted once; `max_sequences`
takes that many windows spread evenly over the split (all by default).

Loss vs. depth runs the same windows with K' loop steps instead of the trained K
(`MeshLM(loops=K')`, a single-core spec only). What each scheme does beyond its trained steps: the
loop is the same code, the core is simply applied again. MeSH has K + 1 trained router pairs; step t
> K reuses the last pair (the one trained for the final loop step and read into the coda), and the
buffer keeps its B = K_train + 3 slots (meshlm.model.memory). With K' < K, MeSH uses pairs 0 … K'
and its last read is produced by pair K'.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from meshlm.data.order import window_indices
from meshlm.data.prepare import PreparedData
from meshlm.model.accounting import depth_flops_per_token
from meshlm.model.exit import ExitRule

__all__ = ["default_loop_counts", "loss_vs_loops", "mean_loss", "window_indices"]


@torch.no_grad()
def mean_loss(model, data: PreparedData, seq_len: int, batch_size: int = 8,
              max_sequences: int | None = None,
              loops: int | None = None, exit: ExitRule | None = None) -> dict[str, Any]:
    """Token-weighted mean next-token loss over the chosen windows: {"loss", "ppl", "tokens",
    "sequences"}; with `exit` (e.g. "state:0.05", meshlm.model.exit) also the average loop steps and
    coda probes per token."""
    device = next(model.parameters()).device
    indices = window_indices(data.num_sequences(seq_len), max_sequences)
    total, count, positions, loops_run, probes = 0.0, 0, 0, 0, 0
    for start in range(0, len(indices), batch_size):
        chunk = indices[start:start + batch_size]
        # (b, seq_len)
        x, y = (torch.from_numpy(a).to(device) for a in data.inputs_targets(chunk, seq_len))
        out = model(x, targets=y, loops=loops, exit=exit)
        scored = int((y != -100).sum())  # every target, or task data's answer tokens
        total += out.loss.double().item() * scored
        count, positions = count + scored, positions + y.numel()
        if exit is not None:  # every position loops, scored or not
            loops_run += int(out.exit_loops.sum())
            probes += int(out.exit_probes.sum())
    loss = total / count
    result = {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": count,
              "sequences": len(indices)}
    if exit is not None:
        result.update(avg_loops=loops_run / positions, avg_probes=probes / positions)
    return result


def is_looped(model) -> bool:
    """One weight-shared core: the only layout whose loop count can change at evaluation."""
    layout = model.config.layout
    return len(layout.cores) == 1 and layout.shares_weights


def default_loop_counts(model) -> list[int]:
    """1 … 2K for a weight-shared single-core model (K = trained steps); nothing for other
    layouts."""
    return list(range(1, 2 * model.config.layout.n_steps + 1)) if is_looped(model) else []


def exit_frontier(model, data: PreparedData, seq_len: int, rules: list[ExitRule],
                  loops: int | None = None,
                  **kwargs) -> list[dict]:
    """[{"exit", "max_loops", "loss", "ppl", "avg_loops", "avg_probes", "flops_ratio"}] per exit
    rule, at most `loops` steps (default K). flops_ratio: forward FLOPs per token against fixed
    depth `loops` (kl counts its coda + head probes)."""
    k = loops or model.config.layout.n_steps
    fixed = depth_flops_per_token(model, k, 1.0, seq_len)
    rows = []
    for rule in rules:
        row = {"exit": str(rule), "max_loops": k,
               **mean_loss(model, data, seq_len, loops=k, exit=rule, **kwargs)}
        cost = depth_flops_per_token(model, row["avg_loops"], row["avg_probes"] or 1.0, seq_len)
        rows.append({**row, "flops_ratio": cost / fixed})
    return rows


def loss_vs_loops(model, data: PreparedData, seq_len: int, loop_counts: list[int],
                  **kwargs) -> list[dict]:
    """[{"loops": K', "loss", "ppl", "trained": K' == K}] for each requested loop count."""
    trained = model.config.layout.n_steps
    return [{"loops": k, "trained": k == trained,
             **mean_loss(model, data, seq_len, loops=k, **kwargs)}
            for k in loop_counts]
