"""Quantized linear layers, stored portably and run through PyTorch's own CPU kernels.

    int8  per output channel, symmetric:  W[n, k] ≈ scale[n] · q[n, k],            q ∈ [−127, 127]
    int4 grouped along k (group g), asymmetric: W[n, k] ≈ scale[n, j] · (q[n, k] − 8) + zero[n, j],
          j = k // g, q ∈ [0, 15]; two values per byte (even k in the low nibble)

Scales and zeros are bf16, the precision the kernels take, so the stored numbers are exactly the
ones computed with. How the activations meet the weight (`activations`):

    "bf16"  weight-only: `torch._weight_int8pack_mm` / `torch._weight_int4pack_mm_for_cpu` on bf16
            activations, fp32 accumulation; decoding on CPU may give a layer meshlm's own kernel
            (meshlm.quant.int4_bf16_kernel, .int8_bf16_kernel: the same bf16 rows, fp32 sums in
            its order)
    "int8"  each activation row rounded to int8 with its own scale,
            x[m, k] ≈ s[m] · a[m, k], s[m] = max_k |x[m, k]| / 127; `torch._int_mm` sums a · q in
            int32 (exact) and y[m, n] = (sum · s[m]) · scale[n] in fp32: the int8 dot-product
            instructions, about 1.5× the weight-only kernel's speed per weight at one token (at
            one row decoding may run the same steps as one compiled call:
            meshlm.quant.row_kernel). On a CPU without them (no AVX512-VNNI, AVX-VNNI or AMX)
            oneDNN's int8 kernels saturate 16-bit pair sums, so a probe (exact_int8_products)
            sends the same rounded activations through the weight-only kernel instead: integers
            up to 127 are exact in bf16, and it sums in fp32; decoding there may give the layer
            the compiled kernel for every row (exact sums: the numbers of the CPUs with them).
            With int4 weights (w4a8) each group's exact integer sums are scaled in fp32, groups
            added in order (int4_int8_products); on CPU decoding gives the layer the compiled
            kernel with the same numbers (meshlm.quant.int4_kernel), at every row count

Off CPU the weight is dequantized into the input's dtype and F.linear runs (on the rounded
activations for "int8"). Every path computes each row on its own, so a row's output does not
depend on what else is in the batch (tests/test_quant.py): cached and uncached decoding,
speculation's verify and a batch see the same numbers.

`clip` (per output row, ≤ 1) shrinks the quantization range: chosen by calibration
(meshlm.quant.calibrate) to minimise the layer's output error on real inputs, trading clipped
outliers for finer steps.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZES = (32, 64, 128, 256)
ACTIVATIONS = ("bf16", "int8")
ALIGNMENT = 64  # bytes: PyTorch's CPU allocator's, which the int8 kernel relies on
# torch._weight_int8pack_mm reads in_features in blocks of 16: past a ragged end it reads out of
# bounds (wrong sums, or a crash: measured), so the weight gets zero columns up to a multiple
INT8PACK_K = 16
INT4PACK_N = 16  # torch._convert_weight_to_int4pack_for_cpu takes out_features in multiples of 16


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, clip: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    """The stored tensors of (N, K) fp32 `w`: {"qweight", "scales"} (int8) or {"qweight", "scales",
    "zeros"}."""
    w = w.float()
    clip = torch.ones(w.shape[0], 1) if clip is None else clip.reshape(-1, 1).float()
    if bits == 8:
        scales = (w.abs().amax(1, keepdim=True) * clip / 127).clamp(min=1e-10).bfloat16()  # (N, 1)
        q = (w / scales.float()).round().clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scales": scales.squeeze(1)}
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)  # (N, K/g, g)
    lo, hi = groups.amin(-1) * clip, groups.amax(-1) * clip  # (N, K/g), clip shrinks toward 0
    scales = ((hi - lo) / 15).clamp(min=1e-10).bfloat16()
    zeros = (lo + 8 * scales.float()).bfloat16()  # the value of q = 8
    q = ((groups - zeros.float()[..., None]) / scales.float()[..., None]
         + 8).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    return {"qweight": q[:, 0::2] | (q[:, 1::2] << 4), "scales": scales, "zeros": zeros}


# 0-dim tensors, not Python numbers: an op given a number wraps it in a new tensor first, which
# took 5 µs a call on a Zen 5 against 2.5 µs (quantize_rows runs ~50 times a decoded token)
_ONE_127TH = torch.tensor(1 / 127, dtype=torch.float32, device="cpu")
_SMALLEST_ROW_SCALE = torch.tensor(1e-30, dtype=torch.float32, device="cpu")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) fp32 -> (int8 (M, K), fp32 (M, 1) scale s): x ≈ s · q, symmetric, one scale per
    row."""
    scale = x.abs().amax(-1, keepdim=True).mul_(_ONE_127TH)  # (M, 1)
    scale.clamp_min_(_SMALLEST_ROW_SCALE)  # an all-zero row: q = 0, not 0/0
    return x.div(scale).round_().to(torch.int8), scale


def scaled_int8_products(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows (M, K) fp32, weight (K, N) int8 -> (M, N) fp32: each row rounded to int8 with its own
    scale (quantize_rows), its exact int32 sums (torch._int_mm), times that scale."""
    q, scale = quantize_rows(rows)
    return torch._int_mm(q, weight) * scale


def weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """(N,) int32: each output's sum of its int8 weights (weight (K, N)), which the one-row kernel
    (meshlm.quant.row_kernel) takes from its caller, once per layer, not from every call."""
    return weight.sum(0, dtype=torch.int32)


@functools.cache
@torch.compiler.assume_constant_result  # a compiled decode step takes its answer as a constant
def exact_int8_products() -> bool:
    """Whether torch._int_mm sums int8 products exactly on this CPU: oneDNN's VNNI and AMX kernels
    do; its older x86 kernels saturate 16-bit pair sums (measured: every output of a random
    (3, 768) × (768, 64) product wrong with oneDNN held to AVX2 or AVX-512 without VNNI)."""
    g = torch.Generator().manual_seed(0)  # on the CPU whatever the default device
    a = torch.randint(-127, 128, (2, 256), dtype=torch.int8, generator=g, device="cpu")
    w = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g, device="cpu")
    a[0], w[0] = 127, 127  # the largest pair sums
    return torch.equal(torch._int_mm(a, w.t()).long(), a.long() @ w.long().t())


def int4_int8_products(rows: torch.Tensor, stored: dict[str, torch.Tensor],
                       group_size: int) -> torch.Tensor:
    """rows (M, K) fp32 times int4 weights (N, K) -> (M, N) fp32, the activations rounded to int8
    (quantize_rows, x ≈ s · a): for each group g the exact sums P = Σ (q − 8) · a and A = Σ a,
    then acc = acc + (scale · P + zero · A) over the groups in order (each product and sum
    rounded in fp32, no fused multiply-add), y = acc · s. The numbers of meshlm/kernels/int4_rows.c,
    which runs them fast; these torch ops are its reference and the path without it."""
    a, s = quantize_rows(rows)
    q = stored["qweight"]
    n, (m, k) = q.shape[0], rows.shape
    groups = k // group_size
    values = torch.stack([q & 15, q >> 4], -1).reshape(n, k).float() - 8  # (N, K)
    a = a.float().reshape(m, groups, group_size).transpose(0, 1)  # (G, M, g)
    # integers below 2**24 throughout, so fp32 sums them exactly, in any order; not under bf16
    # autocast, whose bf16 product would round the sums
    with torch.autocast(rows.device.type, enabled=False):
        sums = torch.bmm(a, values.reshape(n, groups, group_size).permute(1, 2, 0))  # (G, M, N)
    totals = a.sum(-1, keepdim=True)  # (G, M, 1)
    scales, zeros = stored["scales"].float().t(), stored["zeros"].float().t()  # (G, N)
    acc = torch.zeros(m, n, dtype=torch.float32, device=rows.device)
    for g in range(groups):
        acc = acc + (scales[g] * sums[g] + zeros[g] * totals[g])
    return acc * s


def dequantize(stored: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """The (N, K) fp32 weight the stored tensors stand for."""
    q, scales = stored["qweight"], stored["scales"].float()
    if q.dtype == torch.int8:
        return q.float() * scales[:, None]
    values = torch.stack([q & 15, q >> 4], -1).reshape(q.shape[0], -1).float() - 8  # (N, K)
    n, k = values.shape
    grouped = values.reshape(n, k // group_size,
                             group_size) * scales[..., None] + stored["zeros"].float()[..., None]
    return grouped.reshape(n, k)


class QuantizedLinear(nn.Module):
    """An nn.Linear(in_features, out_features) whose weight is int8 (per channel) or int4 (grouped),
    meeting bf16 or int8-rounded activations (module docstring); the bias, if any,
    stays fp32. Build with `from_linear`, or empty (then load a state dict)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int,
                 group_size: int = 64, activations: str = "bf16"):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, not {bits}")
        if bits == 4 and in_features % group_size:
            raise ValueError(f"int4 needs in_features ({in_features}) divisible by the group size "
                             f"{group_size}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r}: take {' or '.join(ACTIVATIONS)}")
        if bits == 4 and activations == "int8" and group_size % 8:
            raise ValueError(f"int4 weights with int8 activations need a group size divisible by "
                             f"8, not {group_size}")
        self.in_features, self.out_features, self.bits, self.group_size = (
            in_features, out_features, bits, group_size)
        self.activations = activations
        if bits == 8:
            self.register_buffer("qweight",
                                 torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16))
        else:
            groups = in_features // group_size
            self.register_buffer("qweight",
                                 torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.bfloat16))
            self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # the CPU kernels' operands, built on first use: kernel name -> (tensors, their names)
        self._operands: dict[str, tuple[tuple, tuple]] = {}
        # int8 activations: a compiled drop-in with the same numbers that decoding may give the
        # layer, for int8 weights at one row (meshlm.quant.row_kernel: scaled_int8_products), for
        # int4 at every row (meshlm.quant.int4_kernel: int4_int8_products); bf16 activations:
        # meshlm's weight-only kernel at every row (meshlm.quant.int4_bf16_kernel and
        # .int8_bf16_kernel: fp32 sums in their own order); None: torch ops
        self.row_kernel = None
        # int8 weights: the row kernel takes every row count, not one row only (where torch.
        # _int_mm's sums are not exact it always does); the same numbers either way
        self.kernel_every_row = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 64,
                    clip: torch.Tensor | None = None, activations: str = "bf16") -> QuantizedLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, bits,
                    group_size, activations)
        for name, value in quantize_weight(linear.weight.detach(), bits, group_size, clip).items():
            getattr(layer, name).copy_(value)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach().float())
        return layer.to(linear.weight.device)

    def stored(self) -> dict[str, torch.Tensor]:
        names = ("qweight", "scales") if self.bits == 8 else ("qweight", "scales", "zeros")
        return {name: getattr(self, name) for name in names}

    def weight_fp32(self) -> torch.Tensor:
        """The dequantized (out, in) weight: what this layer multiplies by."""
        return dequantize(self.stored(), self.group_size)

    def _load_from_state_dict(self, *args, **kwargs):
        for _, names in self._operands.values():  # new weights: repack on the next call
            for name in names:
                if name is not None and name.startswith("_"):
                    del self._buffers[name]
        self._operands = {}
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, in) -> (…, out), in x's dtype
        # decoding calls this ~50 times a token with one row: each tensor call here costs ~1 µs,
        # about as much as a small layer's product, hence is_cpu and no no-op casts
        rows = x.reshape(-1, self.in_features)
        if not x.is_cpu:
            y = self._dequantized_product(rows)
        elif self.activations == "int8":
            y = self._int8_product(rows)
        else:
            y = self._weight_only_product(rows)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _dequantized_product(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        if self.activations == "int8":
            q, scale = quantize_rows(rows.float())
            rows = (q.float() * scale).to(rows.dtype)
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        return F.linear(rows, self.weight_fp32().to(rows.dtype), bias)

    def _int8_product(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out) fp32
        rows = rows if rows.dtype == torch.float32 else rows.float()
        if self.bits == 4:
            y = self._packed_int4_product(rows) if self.row_kernel is not None else \
                int4_int8_products(rows, self.stored(), self.group_size)
            return y if self.bias is None else y + self.bias
        exact = exact_int8_products()
        if exact or self.row_kernel is not None:
            weight, scales, bias, sums = self._cached("int_mm", self._int_mm_operands)
            # (M, out): each row's exact int32 sums times its scale, the same numbers either way;
            # the kernel takes every row where torch._int_mm's are not exact or slower at a batch
            if self.row_kernel is not None and (rows.shape[0] == 1 or not exact
                                                or self.kernel_every_row):
                products = self.row_kernel(rows, weight, sums)
            else:
                products = scaled_int8_products(rows, weight)
            factor = scales
        else:  # the rounded activations through the weight-only kernel (module docstring)
            q, row_scale = quantize_rows(rows)
            products, factor, bias = self._bf16_kernel(q.to(torch.bfloat16)), row_scale, self.bias
        if bias is None:
            return products * factor
        return torch.addcmul(bias, products, factor)  # fewer calls: decoding's cost

    def _weight_only_product(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        if self.row_kernel is not None:  # the rows in bf16, fp32 sums (module docstring)
            y = self._packed_int4_product(rows) if self.bits == 4 else \
                self.row_kernel(rows, self.qweight, self.scales)
            return y if self.bias is None else y + self.bias
        y = self._bf16_kernel(rows.to(torch.bfloat16)).to(rows.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _packed_int4_product(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        """An int4 layer's rows through the kernel decoding gave it (`row_kernel`, w4a8 or
        weight-only), on the packed operands both kernels read; fp32, no bias."""
        packed, sz = self._cached("int4rows", self._int4_rows_operands)
        return self.row_kernel(rows, packed, sz, self.out_features, self.group_size)

    def _bf16_kernel(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) bf16 -> (M, out) bf16
        if self.bits == 8:
            weight, scales, pad = self._cached("int8pack", self._int8pack_operands)
            rows = F.pad(rows, (0, pad)) if pad else rows  # zero columns meet zero columns
            return torch._weight_int8pack_mm(rows, weight, scales)
        packed, scales_zeros, pad = self._cached("int4pack", self._int4pack_operands)
        y = torch._weight_int4pack_mm_for_cpu(rows, packed, self.group_size, scales_zeros)
        return y[:, :self.out_features].contiguous() if pad else y

    def _cached(self, kernel: str, build) -> tuple:
        """`build()`'s operands for `kernel`, built at the first call. Each tensor among them is
        the layer's under a name: its own weight or bias, or a non-persistent buffer
        `_{kernel}_{i}` (not in the state dict). Traced (torch.compile, torch.export), they are
        read through those names, so a graph exported from the layer (meshlm.generate.ahead)
        takes them as the layer's tensors and reads them in place rather than keeping a copy;
        eager, the built tuple (one dict lookup a call)."""
        operands = self._operands.get(kernel)
        if operands is None:
            operands = self._operands[kernel] = self._hold(kernel, build())
        values, names = operands
        if not torch.compiler.is_compiling():
            return values
        held = {**self._parameters, **self._buffers}
        return tuple(v if n is None else held[n] for v, n in zip(values, names))

    def _hold(self, kernel: str, values: tuple) -> tuple[tuple, tuple]:
        """(`values`, the name each tensor among them has in the layer, None for the rest): the
        layer's own tensors keep theirs, new ones become non-persistent buffers."""
        own = {id(t): n for n, t in [*self._parameters.items(), *self._buffers.items()]
               if t is not None}
        names = []
        for i, value in enumerate(values):
            name = None
            if isinstance(value, torch.Tensor):
                name = own.get(id(value))
                if name is None:  # built here: the layer's buffer from now on
                    name = f"_{kernel}_{i}"
                    self.register_buffer(name, value, persistent=False)
            names.append(name)
        return tuple(values), tuple(names)

    def _int_mm_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                        torch.Tensor]:
        """(the (in, out) int8 view of qweight torch._int_mm multiplies by, (out,) fp32 scales,
        the bias, the weights' own sums the one-row kernel takes): one dict lookup a call instead
        of several module attribute lookups, built at the first call (a prompt's, eager: never
        inside a compiled step's first trace, which would trace it twice)."""
        weight = self.qweight.contiguous().t()
        return weight, self.scales.float(), self.bias, weight_sums(weight)

    def _int8pack_operands(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(qweight with in_features padded to INT8PACK_K, scales, the padding), 64-byte aligned:
        views into a memory-mapped file (transformers' from_pretrained) can sit at any offset, and
        the kernel's vector loads crash off PyTorch's alignment."""
        pad = -self.in_features % INT8PACK_K
        weight = F.pad(self.qweight, (0, pad)) if pad else self.qweight
        weight = weight.clone() if weight.data_ptr() % ALIGNMENT else weight
        scales = self.scales.clone() if self.scales.data_ptr() % ALIGNMENT else self.scales
        return weight, scales, pad

    def _int4pack_operands(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the kernel's packed weight, its (in/g, out, 2) scales and zeros, the padding):
        out_features padded to INT4PACK_N with rows whose outputs are cut off again."""
        pad = -self.out_features % INT4PACK_N
        q = torch.stack([self.qweight & 15, self.qweight >> 4], -1).reshape(self.out_features, -1)
        packed = torch._convert_weight_to_int4pack_for_cpu(F.pad(q.to(torch.int32), (0, 0, 0, pad)),
                                                            1)
        scales_zeros = F.pad(torch.stack([self.scales.T, self.zeros.T], -1), (0, 0, 0, pad))
        return packed, scales_zeros.contiguous(), pad

    def _int4_rows_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int4_rows.c's layout (its header): blocks of 16 outputs (zero rows past the end), k in
        chunks of 8, each lane 4 bytes of two nibbles; the bf16 scales and zeros per block and
        group."""
        q = torch.stack([self.qweight & 15, self.qweight >> 4], -1).reshape(self.out_features, -1)
        pad = -self.out_features % 16
        q = F.pad(q, (0, 0, 0, pad)).reshape(-1, 16, self.in_features // 8, 8)  # (B, 16, K/8, 8)
        packed = (q[..., :4] | (q[..., 4:] << 4)).permute(0, 2, 1, 3)  # (B, K/8, 16, 4)
        packed = packed.contiguous()
        groups = self.in_features // self.group_size
        scales, zeros = (F.pad(t, (0, 0, 0, pad)).reshape(-1, 16, groups).transpose(1, 2)
                         for t in (self.scales, self.zeros))
        return packed.reshape(-1), torch.stack([scales, zeros], 2).contiguous()  # (B, G, 2, 16)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        activations = ", int8 activations" if self.activations == "int8" else ""  # w8a8, w4a8
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}{group}{activations}")


def cpu_int8_activation_layers(model: nn.Module, bits: int) -> list[QuantizedLinear]:
    """`model`'s QuantizedLinear layers on the CPU with `bits`-bit weights and int8 activations:
    the layers a compiled kernel may be given (meshlm.quant.row_kernel and .int4_kernel)."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == bits
            and m.activations == "int8" and m.qweight.is_cpu]
