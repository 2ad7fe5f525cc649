"""fp32 linear layers laid out for decoding on a CPU.

Decoding one token per row is a matrix-vector product per layer, bound by streaming the weights
from memory. PyTorch's fp32 `F.linear` (an (out, in) weight) streams about 13 GB/s on a 2-core Zen 5
at one thread and at two (docs/quantize.md): its matrix-vector kernel runs on one thread and reads
the weight row by row. The same product over the weight stored transposed, (in, out), and cut into
P blocks of output columns, one `torch.bmm` batch entry each, streams with all P threads. Over the
weights of a 12-layer d = 768 stack with a 50,304-word head (benchmarks/split_linear.py): 1.67x
F.linear's speed at one row with two threads, 1.2-2.0x at 2-64 rows, 1.03x at 256; with one thread
(P = 1: the transposed layout alone) 1.24x at one row, 1.41x at two, 0.96-1.01x from four on.
Decoding that model runs 1.59-1.80x faster (benchmarks/decode_speed.py --versus-transformers).

With a C compiler the blocks can be KERNEL_WIDTH (32) columns wide and multiplied by a kernel
compiled for the CPU instead (meshlm.kernels.fp32_rows: four blocks from four places at once, where
bmm's speed depends on the block's width), up to KERNEL_ROWS rows; bmm takes longer calls over the
same blocks (0.89-0.92x its speed over 128-column blocks on a 2-core Zen 3).

`split_linears(model)` swaps every plain nn.Linear of a model for a `SplitLinear` holding the same
numbers (`kernel=` for the kernel's blocks), and `split_tied_head(model)` gives a tied MeshLM a
`SharedSplitLinear` head over views of its embedding table; the results agree with F.linear to
fp32 rounding (tests/test_split_linear.py). Only for inference on CPU (the weight is a frozen
buffer); CUDA's kernels need no such layout.

Whether it pays depends on the CPU and the BLAS build, so `split_speedup()` measures it once per
machine (CPU model and flags, torch version, threads; cached by meshlm.machine like the bf16
probe): one-row products over PROBE_MB of weights, split against F.linear, best of a few.
Decoding splits only where the split was at least MIN_SPEEDUP times as fast, and takes the
compiled kernel's blocks where its own probe found it the faster of the three (`paying_kernel`):
`lay_out_for_decoding(model)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm import machine
from meshlm.kernels import fp32_rows
from meshlm.kernels.kernel import operator

# output columns per block below which a further split stops paying
MIN_BLOCK = 256
# meshlm.kernels.fp32_rows' compiled kernel: its blocks' width (fp32_rows.c's TILE) and the most
# rows it takes (decode steps, speculation's verify, served batches); longer calls (prefill
# chunks) go through torch.bmm over the same blocks
KERNEL_WIDTH, KERNEL_ROWS = fp32_rows.WIDTH, 64
# the probe's weights (more than a CPU's caches: decoding streams from memory) and its threshold
PROBE_MB, PROBE_SHAPE, MIN_SPEEDUP = 128, (4096, 1024), 1.1
# the kernel's probe: LAYERS decoder layers of width D (query-key-value, output, the MLP's two),
# 144 MB. Per shape the gain differs (on a 2-core Zen 5 bmm reads 768-column layers slowly, wide
# ones nearly as fast as the kernel): so a whole layer's mix
KERNEL_PROBE_D, KERNEL_PROBE_LAYERS = 1024, 3
KERNEL_PROBE_SHAPES = ((3 * KERNEL_PROBE_D, KERNEL_PROBE_D), (KERNEL_PROBE_D, KERNEL_PROBE_D),
                       (4 * KERNEL_PROBE_D, KERNEL_PROBE_D),
                       (KERNEL_PROBE_D, 4 * KERNEL_PROBE_D)) * KERNEL_PROBE_LAYERS


def blocked_product(rows: torch.Tensor, blocks: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows (M, in) @ blocks (P, in, w) [+ bias (P, 1, w)] -> (M, P·w), block p's columns at
    p·w …: one bmm batch entry, and so one thread, per block. Inside a graph torch.compile traces,
    the operator meshlm::blocked_product: Inductor's own lowering of this bmm ran 0.7x eager's
    speed at d = 768 (meshlm.generate.compiled)."""
    if torch.compiler.is_compiling():
        return torch.ops.meshlm.blocked_product(rows, blocks, bias)
    return _blocked(rows, blocks, bias)


def _blocked(rows: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    batch = rows.expand(blocks.shape[0], *rows.shape)
    # (P, M, w); the bias added by the product itself: one tensor call fewer
    y = torch.bmm(batch, blocks) if bias is None else torch.baddbmm(bias, batch, blocks)
    if rows.shape[0] == 1:  # decoding's one row: (P, 1, w) is already (1, P·w) in memory
        return y.view(1, -1)
    return y.transpose(0, 1).reshape(rows.shape[0], -1)


operator("blocked_product(Tensor rows, Tensor blocks, Tensor? bias) -> Tensor", _blocked,
         lambda rows, blocks, bias: rows.new_empty(rows.shape[0],
                                                   blocks.shape[0] * blocks.shape[2]))


class SplitLinear(nn.Module):
    """y = x Wᵀ + b with W (out, in) stored as `blocks` (P, in, w): block p holds output columns
    p·w ... (p+1)·w − 1, the last zero-padded up to P·w ≥ out (fp32_rows.as_blocks). With a
    `kernel` (fp32_rows: blocks KERNEL_WIDTH wide) calls of up to KERNEL_ROWS rows go through it,
    longer ones through bmm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int):
        super().__init__()
        weight = weight.detach()  # (out, in)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("blocks", fp32_rows.as_blocks(weight, width))
        parts = len(self.blocks)
        self.register_buffer("bias", None if bias is None else bias.detach())
        # the bias as blocks (P, 1, w), zero-padded like the weight; derived, so not saved
        self.register_buffer("bias_blocks", None if bias is None else F.pad(
            bias.detach(), (0, parts * width - self.out_features)).view(parts, 1, width),
                             persistent=False)
        self.padded = parts * width != self.out_features
        self.kernel = None  # a plain attribute: fp32_rows' product, or None for bmm alone

    @classmethod
    def of(cls, linear: nn.Linear, parts: int) -> SplitLinear:
        """`linear` in `parts` blocks (fewer where ceil(out / parts) columns need fewer)."""
        return cls(linear.weight, linear.bias, -(-linear.out_features // parts))

    @classmethod
    def for_kernel(cls, linear: nn.Linear, kernel) -> SplitLinear:
        """`linear` in KERNEL_WIDTH-wide blocks (one narrower block below that width), multiplied
        by `kernel` (meshlm.kernels.fp32_rows) at up to KERNEL_ROWS rows."""
        layer = cls(linear.weight, linear.bias, min(KERNEL_WIDTH, linear.out_features))
        layer.kernel = kernel
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        # the kernel reads fp32 CPU memory and records no autograd graph; anything else (a model
        # moved to CUDA or cast to bf16 after decoding's layout, an input needing grad) takes bmm
        if (self.kernel is not None and rows.shape[0] <= KERNEL_ROWS and rows.is_cpu
                and rows.dtype == self.blocks.dtype == torch.float32 and self.blocks.is_cpu
                and not rows.requires_grad):
            y = self.kernel(rows, self.blocks, self.bias, self.out_features)
        else:
            y = blocked_product(rows, self.blocks, self.bias_blocks)
            if self.padded:
                y = y[:, :self.out_features]  # padding columns dropped
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = ", compiled kernel" if self.kernel is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={self.blocks.shape[0]}, bias={self.bias is not None}{kernel}")


class SharedSplitLinear(nn.Module):
    """y = x Wᵀ for a W that another module owns (a tied head's embedding table), over P blocks of
    W's rows: each block a view, multiplied through its transpose, so nothing is copied and no
    memory is added. Rows past P·w (fewer than P) go through F.linear. On a 2-core Zen 5 a one-row
    product over a 50,304 × 768 table ran 1.9x F.linear's speed (SplitLinear's copy: 2.4x)."""

    def __init__(self, weight: torch.Tensor, parts: int):
        super().__init__()
        self.table = weight.detach()  # a plain attribute: the same storage, not a parameter here
        self.out_features, self.in_features = weight.shape
        self.parts, self.width = parts, self.out_features // parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        split = self.parts * self.width
        blocks = self.table[:split].view(self.parts, self.width, self.in_features)  # (P, w, in)
        y = blocked_product(rows, blocks.transpose(1, 2))  # (M, P·w)
        if split < self.out_features:
            y = torch.cat([y, F.linear(rows, self.table[split:])], 1)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={self.parts}, shared")


def parts_for(out_features: int, threads: int) -> int:
    """Blocks for a layer of `out_features` columns: one per thread, none narrower than
    MIN_BLOCK."""
    return max(1, min(threads, out_features // MIN_BLOCK))


def width_for(out_features: int, threads: int) -> int:
    """The block width parts_for gives a layer of `out_features` columns."""
    return -(-out_features // parts_for(out_features, threads))


def split_linears(model: nn.Module, threads: int | None = None, kernel=None) -> int:
    """Swap every plain fp32 nn.Linear on CPU of `model` (not subclasses such as MeSH's routers or
    meshlm.quant's layers) for a SplitLinear: with one block per thread (default: torch's intra-op
    thread count), or in the compiled `kernel`'s blocks (meshlm.kernels.fp32_rows). With a
    `kernel`, the subclasses that take a `product` (MeSH's and MoE's routers: a forward of their
    own around fp32 logits) get one in the kernel's blocks, so that every linear of the model's own
    layers computes each row as it would alone. Returns how many layers were laid out."""
    threads = threads or torch.get_num_threads()
    laid_out = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
                    and child.weight.device.type == "cpu"):
                continue
            if type(child) is nn.Linear:
                setattr(parent, name, SplitLinear.for_kernel(child, kernel) if kernel else
                        SplitLinear.of(child, parts_for(child.out_features, threads)))
                laid_out += 1
            elif kernel and getattr(child, "product", False) is None:
                child.product = SplitLinear.for_kernel(child, kernel)
                laid_out += 1
    return laid_out


def split_tied_head(model: nn.Module, threads: int | None = None) -> bool:
    """Give a MeshLM whose output layer is its embedding table (tie_embeddings: embed_out None) a
    SharedSplitLinear over that table as embed_out, which the head then calls. Returns whether it
    did."""
    table = getattr(getattr(model, "embed_in", None), "weight", None)
    if getattr(model, "embed_out", False) is not None or table is None or \
            table.dtype != torch.float32 or table.device.type != "cpu":
        return False
    parts = parts_for(table.shape[0], threads or torch.get_num_threads())
    model.embed_out = SharedSplitLinear(table, parts)
    return True


def split_speedup() -> float:
    """This machine's one-row speed split over F.linear, from the cache or measured now."""
    method = (f"best of 5 one-row passes over {PROBE_MB} MB of {PROBE_SHAPE} fp32 weights, "
              f"{machine.COLD}")
    return machine.measured("split-linear", method, _probe)["value"]["split_over_linear"]


def _probe(threads: int, reps: int = 5) -> dict:
    out_features, in_features = PROBE_SHAPE
    count = max(1, PROBE_MB * 2**20 // (4 * out_features * in_features))
    # the values do not matter to the speed (fp32, no denormals): filled, not drawn, to be quick
    weights = [torch.full(PROBE_SHAPE, 0.01) for _ in range(count)]
    split = [SplitLinear(w, None, width_for(out_features, threads)) for w in weights]
    x = torch.full((1, in_features), 0.5)
    return machine.race({"linear": lambda: [F.linear(x, w) for w in weights],
                         "split": lambda: [m(x) for m in split]}, reps, fastest="split",
                        cold=True)


def lay_out_for_decoding(model: nn.Module) -> tuple[str | None, float]:
    """Lay `model`'s fp32 linear layers on CPU out for decoding where a probe, measured once per
    machine, found it faster: ("kernel", its one-row speed over F.linear) in the compiled kernel's
    blocks (paying_kernel), else ("split", that speed) in one block per thread, else (None, the
    split's speed) with the model unchanged."""
    kernel = paying_kernel()
    speedup = kernel_speedup(kernel)["kernel_over_linear"] if kernel else split_speedup()
    if not kernel and speedup < MIN_SPEEDUP:
        return None, speedup
    split_linears(model, kernel=kernel)
    split_tied_head(model)
    return "kernel" if kernel else "split", speedup


def paying_kernel() -> fp32_rows.Product | None:
    """fp32_rows.fp32_rows_kernel() where this machine's probe found it at least
    meshlm.kernels.kernel.MIN_SPEEDUP times as fast as both the split layout's bmm and F.linear
    at one row, else None."""
    return fp32_rows.KERNEL.paying(kernel_speedup)


def kernel_speedup(kernel: fp32_rows.Product) -> dict:
    """This machine's one-row speed of `kernel` over the split layout's bmm and over F.linear,
    from the cache or measured now."""
    method = (f"best of 5 one-row passes over the fp32 weights of {KERNEL_PROBE_LAYERS} decoder "
              f"layers of width {KERNEL_PROBE_D}, {machine.COLD}")
    return machine.measured("fp32-rows-kernel", fp32_rows.KERNEL.probed_by(method),
                            lambda threads: _kernel_probe(kernel, threads))["value"]


def _kernel_probe(kernel: fp32_rows.Product, threads: int, reps: int = 5) -> dict:
    # the values do not matter to the speed (fp32, no denormals): filled, not drawn, to be quick
    weights = [torch.full(shape, 0.01, device="cpu") for shape in KERNEL_PROBE_SHAPES]
    split = [SplitLinear(w, None, width_for(len(w), threads)) for w in weights]
    tiled = [fp32_rows.as_blocks(w, KERNEL_WIDTH) for w in weights]
    x = {w.shape[1]: torch.full((1, w.shape[1]), 0.5, device="cpu") for w in weights}
    return machine.race({
        "linear": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
        "split": lambda: [m(x[m.in_features]) for m in split],
        "kernel": lambda: [kernel(x[b.shape[1]], b, None, len(w)) for b, w in zip(tiled, weights)]},
        reps, fastest="kernel", cold=True)
