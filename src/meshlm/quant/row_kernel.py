"""The int8-activation product compiled on this machine (meshlm/kernels/int8_rows.c), for
decoding, and the int8-activation layers given it.

A decoded token rounds one activation row to int8 and multiplies it by every int8 weight: a
matrix-vector product bound by streaming the weights. At one row oneDNN's `torch._int_mm` reads
them at ~60% of a core's bandwidth on a 2-core Zen 5; a plain C loop that the compiler vectorises
for this CPU reads ~80% (1.4x the speed over a 12-layer d = 768 stack, docs/quantize.md), and one
call also does the row's rounding and scaling, eight tensor ops in meshlm.quant.linear. Its sums
are the exact int32 integers and every other step the same IEEE fp32 operation, so a layer can
take either path at any row and its outputs stay the same numbers bit for bit.

KERNEL is it, checked against scaled_int8_products with exact integer sums, a row alone the same
as in a batch. `give_row_kernel` gives it to the layers where a probe over PROBE_MB of weights
found them faster with it: that depends on the CPU (oneDNN may have a better kernel for it, AMX
for one) and on the OpenMP runtime torch was built with. Where torch._int_mm's sums are exact the
kernel takes one row and _int_mm the others (the same numbers), or every row where the probe found
it faster at BATCH_ROWS too (a 2-core Zen 3 EPYC, AVX2 without VNNI, sums exactly through oneDNN
at 1/9 of the kernel's speed at one row and 1/23 at 16: a 32-token prefill took 2.2 s of a
64-token generation's 2.8); where they are not (a CPU without VNNI whose oneDNN saturates) it takes
every row, in place of the weight-only kernel the layers fall back to there, so those CPUs get the
exact sums too (on a 2-core Zen 5 held to AVX2: 1.8x the fallback at one row, 1.9x at 16, 1.7x at
512). `unavailable` names why a layer goes without it. Defined here, beside the arithmetic it
repeats: meshlm.quant.linear, which a Hugging Face export carries (meshlm.hf.remote), imports no
kernel code.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from meshlm import machine
from meshlm.kernels.fp32_rows import rows_apart
from meshlm.kernels.kernel import MIN_SPEEDUP, Kernel
from meshlm.quant.linear import (
    QuantizedLinear,
    cpu_int8_activation_layers,
    exact_int8_products,
    quantize_rows,
    scaled_int8_products,
    weight_sums,
)

CPU = torch.device("cpu")
# the probe's weights (more than a CPU's caches: decoding streams from memory)
PROBE_MB, PROBE_SHAPE = 64, (3072, 768)
# the widest row whose sums int8_rows.c keeps exact in int32: k * 255 * 128 <= 2**31 - 1
MAX_K = (2**31 - 1) // (255 * 128)
# a served batch's rows: where the layers take the kernel at every row count (torch._int_mm's
# sums not exact), it must not lose much there to the weight-only kernel it replaces
BATCH_ROWS, BATCH_FLOOR = 16, 0.85
# (x (M, K) fp32, weight (K, N) int8, the transposed view of a contiguous (N, K), and optionally
# weight_sums(weight)) -> (M, N) fp32
Product = Callable[..., torch.Tensor]


def _product(function) -> Product:
    """The bound C function as a drop-in for scaled_int8_products where its sums are exact, bit for
    bit; `sums` (weight_sums(weight)) computed here where the caller has none."""
    def product(x: torch.Tensor, weight: torch.Tensor,
                sums: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[1] > MAX_K:  # its int32 sums could overflow: the torch ops' (no layer that
            # wide gets the kernel, give_row_kernel)
            return scaled_int8_products(x, weight)
        rows = weight.t()  # (N, K): the stored qweight (QuantizedLinear's operands: contiguous)
        rows, x = rows.contiguous(), x.contiguous()  # no copies when they are, as C reads them
        sums = (weight_sums(weight) if sums is None else sums).contiguous()
        # fp32 on the CPU, whatever torch's default dtype and device: C writes floats there
        y = torch.empty(x.shape[0], rows.shape[0], dtype=torch.float32, device=CPU)
        if function(x.data_ptr(), rows.data_ptr(), sums.data_ptr(), y.data_ptr(), x.shape[0],
                    rows.shape[0], rows.shape[1], torch.get_num_threads()):
            raise MemoryError(f"int8 row product: no memory for {rows.shape[1]} int8 values")
        return y

    return product


def _same_numbers(product: Product) -> bool:
    """Whether `product` gives scaled_int8_products' numbers with exact sums, bit for bit, on
    ragged shapes, rows of very different scales, all-zero rows and the extreme weights, three
    rows at once and each alone."""
    g = torch.Generator(device=CPU).manual_seed(0)
    spread = torch.tensor([[1.0], [1e-2], [30.0]], device=CPU)  # three rows' magnitudes
    for (n, k), size in zip(((37, 200), (64, 768), (5, 1), (16, 64)), (1.0, 1e-3, 50.0, 0.0)):
        x = torch.randn(3, k, generator=g, dtype=torch.float32, device=CPU) * size * spread
        if k >= 8:  # max 127: the scale is 1.0 exactly, so x/s = 2.5 etc. are ties (to even)
            x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5], device=CPU)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g, device=CPU)
        weight[0] = 127  # the largest sums
        q, scale = quantize_rows(x)
        exact = (q.long() @ weight.long().t()).float() * scale  # the sums without torch._int_mm
        if not torch.equal(product(x, weight.t()), exact) or \
                not rows_apart(lambda rows, w=weight: product(rows, w.t()), x):
            return False
    return True


KERNEL = Kernel("int8_rows.c", "int8_row_product",
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], _product,
                _same_numbers, "exact integer sums",
                "int8_row(Tensor x, Tensor weight, Tensor? sums=None) -> Tensor",
                lambda x, weight, sums=None: x.new_empty(x.shape[0], weight.shape[1],
                                                         dtype=torch.float32))
int8_row_kernel = KERNEL.product  # () -> Product | None, once per process (.cache_clear())


def give_row_kernel(model: nn.Module) -> int:
    """Give every int8-activation layer of `model` on the CPU the compiled kernel where this
    machine has it and its probe found it the faster (kernel_speedup): where torch._int_mm's sums
    are exact, at one row, and at every row count where it was faster at BATCH_ROWS too (the
    other rows take _int_mm, the same numbers); at every row count where they are not (it
    replaces the weight-only kernel the layers take there, so it must not lose much at
    BATCH_ROWS). Returns how many layers got it."""
    # wider rows than MAX_K keep the layers' own path (its int32 sums could overflow)
    layers = [m for m in _cpu_int8_layers(model) if m.in_features <= MAX_K]
    exact = exact_int8_products()
    floors = None if exact else {"batch_kernel_over_torch": BATCH_FLOOR}
    kernel = KERNEL.paying(kernel_speedup, floors) if layers else None
    if kernel is None:
        return 0
    every_row = not exact or kernel_speedup(kernel)["batch_kernel_over_torch"] >= MIN_SPEEDUP
    for layer in layers:
        layer.row_kernel, layer.kernel_every_row = kernel, every_row
    return len(layers)


def every_row(model: nn.Module) -> bool:
    """Whether `model`'s int8-activation layers on the CPU take the kernel at every row count
    (give_row_kernel), not at one row only."""
    return any(m.row_kernel is not None and m.kernel_every_row for m in _cpu_int8_layers(model))


def unavailable(model: nn.Module) -> str | None:
    """Why `model`'s int8-activation layers on the CPU go without the compiled kernel because this
    process could not have it (KERNEL.unavailable: the reason and its fix, in one line); None
    where it has it or has no such layer."""
    return KERNEL.unavailable() if _cpu_int8_layers(model) else None


def _cpu_int8_layers(model: nn.Module) -> list[QuantizedLinear]:
    return cpu_int8_activation_layers(model, 8)


def kernel_speedup(kernel: Product) -> dict:
    """This machine's speed of int8-activation layers with `kernel` over the same layers without
    it (torch._int_mm where its sums are exact, else the weight-only kernel) at one row
    (kernel_over_torch) and at BATCH_ROWS (batch_kernel_over_torch), from the cache or measured
    now."""
    exact = exact_int8_products()
    method = (f"best of 5 passes of 1 and of {BATCH_ROWS} rows through "
              f"{PROBE_MB} MB of {PROBE_SHAPE} int8 layers against "
              f"{'torch._int_mm' if exact else 'the weight-only kernel'}, {machine.COLD}")
    return machine.measured("int8-row-kernel", KERNEL.probed_by(method),
                            lambda threads: _probe(kernel))["value"]


def _probe(kernel: Product, reps: int = 5) -> dict:
    out, k = PROBE_SHAPE
    count = max(1, PROBE_MB * 2**20 // (out * k))
    # the values do not matter to the speed: the layers' zeros
    layers = [QuantizedLinear(k, out, False, 8, activations="int8").to(CPU) for _ in range(count)]

    def through(product: Product | None, x: torch.Tensor):
        def passes() -> list[torch.Tensor]:
            for layer in layers:  # the kernel at every row count: what each count costs
                layer.row_kernel, layer.kernel_every_row = product, True
            return [layer(x) for layer in layers]
        return passes

    def steps(rows: int) -> dict:
        x = torch.full((rows, k), -0.5, dtype=torch.float32, device=CPU)
        return {"torch": through(None, x), "kernel": through(kernel, x)}
    return machine.race_rows(steps, BATCH_ROWS, reps)
