"""A model made ready to decode (`meshlm generate`, `meshlm serve`): `for_decoding` takes the
precision meshlm.runtime.precision chooses (`auto` is fp32), `prepare` does the weight surgery it
calls for, and the precision line says what was chosen and what prepare did.

fp32 on CPU lays the linear weights out for one-token products where a probe, cached per machine,
finds that faster (meshlm.runtime.split_linear): 128-column blocks multiplied by meshlm's compiled
kernel (meshlm.kernels.fp32_rows; decoding at d = 768 ran 1.6-2.1x F.linear's speed on a 2-core
Zen 5), else one block per thread through torch.bmm (1.6-1.8x); the same fp32 arithmetic, to
rounding. Int8-activation layers take the compiled one-row kernel where it pays
(meshlm.quant.row_kernel), the same numbers bit for bit. Under bf16 the weights are stored in
bf16, and on CPU calls of up to four rows go through meshlm's compiled bf16 kernel where it pays
(meshlm.runtime.bf16_linear: decoding at d = 768 ran 1.43x F.linear's speed on a 2-core Intel
Xeon with AMX, two threads).
A server's and a long generation's weights are collapsed into 2 MB pages where Linux can
(meshlm.runtime.huge_pages; fp32 1.05-1.12x a token at d = 768 on the Zen 5).
A kernel that could not be had is named on the line with its fix, never a silent fallback.
Above runtime and quant, which do not import each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.kernels import bf16_rows, fp32_rows
from meshlm.quant import int4_bf16_kernel, int4_kernel, int8_bf16_kernel, row_kernel
from meshlm.quant.calibrate import describe, structure_of
from meshlm.quant.linear import QuantizedLinear, exact_int8_products
from meshlm.runtime import bf16_linear, huge_pages, precision, split_linear
from meshlm.runtime.precision import Precision

SPLIT_NOTE = "linear weights split per thread for one-token products"
FP32_KERNEL_NOTE = ("linear weights in 128-column blocks, products of up to 64 rows by meshlm's "
                    "kernel compiled for this CPU")
ROW_KERNEL_NOTE = "one-token int8 products by meshlm's kernel compiled for this CPU"
# where torch._int_mm's sums are not exact, or it was slower at many rows too, the kernel takes
# every row (meshlm.quant.row_kernel), for the reason that follows
ROWS_KERNEL_NOTE = "int8 products of every row count by meshlm's kernel compiled for this CPU"
ROWS_INEXACT = "exact sums, which torch._int_mm lacks here"
ROWS_FASTER = f"faster than torch._int_mm here at {row_kernel.BATCH_ROWS} rows too"
INT4_KERNEL_NOTE = "int4 x int8 products by meshlm's kernel compiled for this CPU"
INT4_BF16_KERNEL_NOTE = "int4 weight-only products by meshlm's kernel compiled for this CPU"
INT8_BF16_KERNEL_NOTE = "int8 weight-only products by meshlm's kernel compiled for this CPU"
BF16_KERNEL_NOTE = (f"bf16 products of up to {bf16_linear.KERNEL_ROWS} rows by meshlm's kernel "
                    "compiled for this CPU")
# where its probe found it faster than F.linear at bf16_linear.BATCH_ROWS too
BF16_ROWS_KERNEL_NOTE = "bf16 products of every row count by meshlm's kernel compiled for this CPU"
# where a kernel could not be had (meshlm.kernels.build.why_not): named, never a silent fallback
FP32_KERNEL_MISSING = "meshlm's fp32 kernel unavailable"
ROW_KERNEL_MISSING = "meshlm's int8 kernel unavailable"
INT4_KERNEL_MISSING = "meshlm's int4 x int8 kernel unavailable"
INT4_BF16_KERNEL_MISSING = "meshlm's int4 weight-only kernel unavailable"
INT8_BF16_KERNEL_MISSING = "meshlm's int8 weight-only kernel unavailable"
# the weight-only layers' kernels by their weights' bits: (module, note where taken, where missing)
WEIGHT_ONLY = {4: (int4_bf16_kernel, INT4_BF16_KERNEL_NOTE, INT4_BF16_KERNEL_MISSING),
               8: (int8_bf16_kernel, INT8_BF16_KERNEL_NOTE, INT8_BF16_KERNEL_MISSING)}
BF16_KERNEL_MISSING = "meshlm's bf16 kernel unavailable"
# decode steps from which collapsing the weights into 2 MB pages pays back its time: at d = 768
# in fp32 on a 2-core Zen 5 the collapse took 0.9-1.5 s and saved 0.8-1.0 ms a step, so ~1,000-
# 1,900 steps; about the same at any size, as both scale with the weights' bytes (quantize.md)
HUGE_PAGES_STEPS = 2048


@dataclass(frozen=True)
class Prepared:
    """What prepare did to a model, for the precision line."""
    layout: str | None = None  # fp32 linears: "kernel" (its blocks), "split" (bmm's) or None
    speedup: float = 0.0  # that layout's one-row speed over F.linear here
    fp32_missing: str | None = None  # why the fp32 kernel could not be had (fp32_rows.unavailable)
    quantized: dict | None = None  # the quantized layers (quant.calibrate.structure_of)
    # whether the int8-activation layers took the compiled row kernel: at "one row" or at
    # "every row" count (quant.row_kernel.give_row_kernel), or None
    row_kernel: str | None = None
    row_missing: str | None = None  # why they could not (quant.row_kernel.unavailable)
    bf16_speedup: float = 0.0  # bf16 linears: the kernel's one-row speed over F.linear, if taken
    bf16_every_row: bool = False  # whether they take it at every row count
    bf16_missing: str | None = None  # why the bf16 kernel could not be had (bf16_rows.unavailable)
    int4_kernel: bool = False  # whether the w4a8 layers took their compiled kernel
    int4_missing: str | None = None  # why they could not (quant.int4_kernel.unavailable)
    # weight-only layers, per WEIGHT_ONLY bits: (their compiled kernel's one-row speed over
    # torch's, if taken; why it could not be had: the module's unavailable())
    weight_only: dict[int, tuple[float, str | None]] | None = None
    huge: huge_pages.Backed | None = None  # the weights' memory on 2 MB pages (CPU only)


def for_decoding(requested: str, model: torch.nn.Module,
                 huge: bool = False) -> tuple[torch.device, Precision]:
    """(the model's device, the precision to decode in, its reason naming what prepare did). For
    inference only: the model's plain nn.Linear layers are replaced."""
    device = next(model.parameters()).device
    chosen = precision.choose_for_decoding(requested, device)
    return device, described(chosen, prepare(model, chosen, huge))


def prepare(model: torch.nn.Module, chosen: Precision, huge: bool = False) -> Prepared:
    """Lay `model`'s weights out for decoding in `chosen`: in fp32 on CPU its linear layers where a
    probe found that faster (split_linear.lay_out_for_decoding), its int8-activation layers on CPU
    given the compiled row kernel where it pays (quant.row_kernel.give_row_kernel), its w4a8 layers
    on CPU their compiled kernel where this process has it (quant.int4_kernel.give), its int4
    and int8 weight-only layers on CPU theirs where they pay (WEIGHT_ONLY), under bf16 its
    nn.Linear weights stored in bf16 (precision.store_weights) and, on CPU, multiplied by the
    compiled bf16 kernel at up to four rows where it pays, at every row count where it pays at
    a batch too (bf16_linear.lay_out_for_decoding);
    with `huge`, on CPU, the memory of every tensor a step streams on 2 MB pages where Linux can
    (runtime.huge_pages: up to ~3 s a GB once, for 1.05-1.12x a step in fp32 at d = 768 and
    within the noise at the narrower precisions, so asked for by a server and by a generation of
    HUGE_PAGES_STEPS steps or more). Returns what it did."""
    cpu = next(model.parameters()).device.type == "cpu"
    fp32 = cpu and chosen.dtype is None
    layout, speedup = split_linear.lay_out_for_decoding(model) if fp32 else (None, 0.0)
    quantized = structure_of(model)
    given = cpu and quantized is not None and row_kernel.give_row_kernel(model) > 0
    rows = ("every row" if row_kernel.every_row(model) else "one row") if given else None
    fp32_missing = fp32_rows.unavailable() if fp32 and layout != "kernel" else None
    row_missing = row_kernel.unavailable(model) if cpu and quantized and not given else None
    int4_given = cpu and quantized is not None and int4_kernel.give(model) > 0
    int4_missing = int4_kernel.unavailable(model) if cpu and quantized and not int4_given else None
    weight_only = {bits: (module.give(model), module.unavailable(model))
                   for bits, (module, _, _) in WEIGHT_ONLY.items()} if cpu and quantized else None
    precision.store_weights(model, chosen)
    bf16 = cpu and chosen.dtype == torch.bfloat16
    swapped, bf16_speedup = bf16_linear.lay_out_for_decoding(model) if bf16 else (0, 0.0)
    bf16_missing = bf16_rows.unavailable() if bf16 else None
    backed = _back_weights(model) if cpu and huge else None
    return Prepared(layout, speedup, fp32_missing, quantized, rows, row_missing,
                    bf16_speedup if swapped else 0.0, bf16 and bf16_linear.every_row(model),
                    bf16_missing, int4_given, int4_missing, weight_only, backed)


@torch.no_grad()
def _back_weights(model: torch.nn.Module) -> huge_pages.Backed:
    """Every tensor a decode step streams on 2 MB pages where Linux can (meshlm.runtime.
    huge_pages): the quantized layers' kernel operands built first (one row of ones each: they
    are built at a layer's first call, and are its buffers from then on); not an embedding table's,
    of which a step reads one row a token (a head tied to it streams it, and holds it too)."""
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear) and layer.qweight.is_cpu:
            layer(torch.ones(1, layer.in_features))  # not zeros: an int8 row's scale of 0
    return huge_pages.back([t for m in model.modules() if not isinstance(m, torch.nn.Embedding)
                            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]])


def described(chosen: Precision, done: Prepared) -> Precision:
    """`chosen` with what prepare did (`done`) added to its reason, which the precision line
    prints (Precision.describe)."""
    notes = [chosen.reason]
    missing = f"{FP32_KERNEL_MISSING} ({done.fp32_missing}), so " if done.fp32_missing else ""
    if done.layout:
        notes.append(missing + _measured(FP32_KERNEL_NOTE if done.layout == "kernel" else
                                         SPLIT_NOTE, done.speedup, "F.linear's"))
    elif missing:
        notes.append(f"{missing}linear layers keep F.linear")
    bf16 = done.bf16_speedup and _measured(
        BF16_ROWS_KERNEL_NOTE if done.bf16_every_row else BF16_KERNEL_NOTE, done.bf16_speedup,
        "F.linear's")
    notes += _kernel(bf16 or None, BF16_KERNEL_MISSING, done.bf16_missing,
                     "linear layers keep F.linear")
    if done.quantized:  # those layers run their own kernels whatever the precision
        notes.append(describe(done.quantized))
        exact = exact_int8_products()
        rows = f"{ROWS_KERNEL_NOTE} ({ROWS_FASTER if exact else ROWS_INEXACT})"
        notes += _kernel({"one row": ROW_KERNEL_NOTE, "every row": rows}.get(done.row_kernel),
                         ROW_KERNEL_MISSING, done.row_missing,
                         "one-token int8 products by torch._int_mm" if exact else
                         "int8 products by torch's weight-only kernel")
        notes += _kernel(INT4_KERNEL_NOTE if done.int4_kernel else None, INT4_KERNEL_MISSING,
                         done.int4_missing,
                         "int4 x int8 products by torch ops (many times slower)")
        for bits, (speedup, missing) in (done.weight_only or {}).items():
            _, note, missing_note = WEIGHT_ONLY[bits]
            notes += _kernel(speedup and _measured(note, speedup, "torch's") or None,
                             missing_note, missing,
                             f"int{bits} weight-only products by torch's kernel")
    if done.huge is not None and done.huge.regions:
        backed = done.huge.bytes / 2**20
        notes.append(f"weights' memory on 2 MB pages ({backed:.0f} MB)" if backed
                     else f"weights on 4 KB pages ({done.huge.why_not})")
    return Precision(chosen.dtype, "; ".join(notes))


def _measured(note: str, ratio: float, against: str) -> str:
    """A kernel's note with its probe's figure."""
    return f"{note} ({ratio:.1f}x {against} one-row speed here, measured once)"


def _kernel(taken: str | None, missing: str, why: str | None, fallback: str) -> list[str]:
    """The notes for one kernel: `taken` where its layers took it; else, where it could not be
    had, `missing` with the reason `why` and what runs instead (`fallback`); else none."""
    if taken:
        return [taken]
    return [f"{missing} ({why}), so {fallback}"] if why else []
