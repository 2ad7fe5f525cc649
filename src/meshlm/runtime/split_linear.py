"""fp32 linear layers laid out for decoding on a CPU.

Decoding one token per row is a matrix-vector product per layer, bound by streaming the weights
from memory. PyTorch's fp32 `F.linear` (an (out, in) weight) streams about 13 GB/s on a 2-core Zen 5
at one thread and at two (docs/quantize.md): its matrix-vector kernel runs on one thread and reads
the weight row by row. The same product over the weight stored transposed, (in, out), and cut into
P blocks of output columns, one `torch.bmm` batch entry each, streams with all P threads. Over the
weights of a 12-layer d = 768 stack with a 50,304-word head (benchmarks/split_linear.py): 1.67x
F.linear's speed at one row with two threads, 1.2-2.0x at 2-64 rows, 1.03x at 256; with one thread
(P = 1: the transposed layout alone) 1.24x at one row, 1.41x at two, 0.96-1.01x from four on.
Decoding that model runs 1.72-1.80x faster (benchmarks/decode_speed.py --versus-transformers).

`split_linears(model)` swaps every plain nn.Linear of a model for a `SplitLinear` holding the same
numbers; the results agree with F.linear to fp32 rounding (tests/test_split_linear.py). Only for
inference on CPU (the weight is a frozen buffer); CUDA's kernels need no such layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# output columns per block below which a further split stops paying
MIN_BLOCK = 256


class SplitLinear(nn.Module):
    """y = x Wᵀ + b with W (out, in) stored as `blocks` (P, in, w): block p holds output columns
    p·w ... (p+1)·w − 1, the last zero-padded up to P·w ≥ out."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        self.out_features, self.in_features = weight.shape
        width = -(-self.out_features // parts)
        padded = F.pad(weight, (0, 0, 0, parts * width - self.out_features))  # (P·w, in)
        # (P, w, in) -> (P, in, w), each block contiguous
        self.register_buffer("blocks", padded.reshape(parts, width, -1).transpose(1, 2)
                             .contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, _, width = self.blocks.shape
        rows = x.reshape(-1, self.in_features)  # (M, in)
        # (P, M, in) @ (P, in, w) -> (P, M, w): one batch entry, and so one thread, per block
        y = torch.bmm(rows.expand(parts, *rows.shape), self.blocks)
        y = y.transpose(0, 1).reshape(rows.shape[0], parts * width)[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={self.blocks.shape[0]}, bias={self.bias is not None}")


def parts_for(out_features: int, threads: int) -> int:
    """Blocks for a layer of `out_features` columns: one per thread, none narrower than
    MIN_BLOCK."""
    return max(1, min(threads, out_features // MIN_BLOCK))


def split_linears(model: nn.Module, threads: int | None = None) -> int:
    """Swap every plain fp32 nn.Linear on CPU of `model` (not subclasses such as MeSH's routers or
    meshlm.quant's layers) for a SplitLinear with one block per thread (default: torch's intra-op
    thread count). Returns how many were swapped."""
    threads = threads or torch.get_num_threads()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.float32
                    and child.weight.device.type == "cpu"):
                setattr(parent, name, SplitLinear(child, parts_for(child.out_features, threads)))
                swapped += 1
    return swapped
