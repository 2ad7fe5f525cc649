"""Which precision a command computes in. `auto` picks bf16 autocast (weights and optimizer stay
fp32) where the hardware multiplies bf16 natively, and plain fp32 everywhere else:

  CUDA  bf16 when torch.cuda.is_bf16_supported() (Ampere and later), else fp32.
  CPU   bf16 only with native bf16 matrix instructions: /proc/cpuinfo lists amx_bf16 or avx512_bf16
        (x86) or bf16 (arm64), AND a short timed probe confirms it: a 512³ bf16 matmul must run at
        least BF16_MIN_SPEEDUP× as fast as fp32. Without the flags PyTorch emulates bf16 (about 70×
        slower than fp32 on an AVX2-only AMD EPYC), so no probe is run. The probe's result is cached
        per machine (meshlm.machine) with its date and figures; a flag without the speed (a
        hypervisor hiding the units, a build without the kernels) falls back to fp32.

`fp32` and `bf16` are always honoured as given.

Decoding (`meshlm generate`, `meshlm serve`: `choose_for_decoding`) resolves `auto` to fp32
everywhere. Under bf16 autocast greedy output depends on the path: a batch's shape, the cache,
speculation's draft-verify split all round differently, and with top logits within a bf16 step of
each other the argmax flips (measured in docs/serve.md). In fp32 it does not, so speculation is
lossless and a batched request decodes as it would alone. It costs little: decoding one token per
row is bound by reading the weights, not by multiplying (docs/serve.md and docs/quantize.md have
the measured ratios). Choosing is all this module does for decoding: meshlm.decoding lays the
weights out for the precision chosen and names what it did on the precision line.

Weights follow the compute precision: where a command computes in bf16 (`for_model` under auto on
bf16 hardware, or `--dtype bf16` anywhere), `store_weights` keeps every nn.Linear's weight and bias
in bf16, so autocast finds them cast already instead of holding an fp32 copy and a bf16 one. The
numbers are bit-identical to autocast over fp32 weights (autocast rounds the same way; norms, the
embedding table and the loss stay fp32; tests/test_weight_precision.py). int8/int4 (`meshlm
quantize`, meshlm.quant; weight-only, or int8 with int8 activation rows) is the smaller step for
decoding: its kernels read int8 or int4 and compute the same per row whatever the batch.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshlm import machine
from meshlm.runtime.options import DTYPE_CHOICES as CHOICES

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# bf16 GEMM over fp32 GEMM throughput below which autocast's casts eat the gain
BF16_MIN_SPEEDUP = 1.3
PROBE_N = 512


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype | None  # the autocast dtype; None = plain fp32
    reason: str  # why, in words (printed on a run's first line)

    @property
    def name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"

    def describe(self) -> str:
        return f"{'bf16 autocast' if self.dtype else 'fp32'} ({self.reason})"


def choose(requested: str, device: torch.device) -> Precision:
    """The precision for `requested` (auto / fp32 / bf16) on `device`."""
    if requested not in CHOICES:
        raise ValueError(f"precision {requested!r} must be one of {', '.join(CHOICES)}")
    if requested != "auto":
        return Precision(torch.bfloat16 if requested == "bf16" else None, "as requested")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, "auto: the GPU has bf16 tensor cores")
        return Precision(None, "auto: this GPU has no native bf16")
    flags = [f for f in BF16_CPU_FLAGS if f in machine.cpu_info()["flags"]]
    if not flags:
        return Precision(None, "auto: this CPU has no native bf16 (no amx_bf16/avx512_bf16), bf16 "
                               "would be emulated")
    probe = cpu_bf16_probe()
    speedup = probe["bf16_gflops"] / max(probe["fp32_gflops"], 1e-9)
    measured = f"bf16 matmul {speedup:.1f}x fp32, probe of {probe['date']}"
    if speedup >= BF16_MIN_SPEEDUP:
        return Precision(torch.bfloat16, f"auto: native bf16 ({', '.join(flags)}; {measured})")
    return Precision(None, f"auto: {', '.join(flags)} listed but {measured} < {BF16_MIN_SPEEDUP}x")


def cpu_bf16_probe() -> dict:
    """{"bf16_gflops", "fp32_gflops", "date"}: best of a few PROBE_N³ matmuls each, cached per
    machine."""
    threads = torch.get_num_threads()
    method = f"best of 5 {PROBE_N}^3 matmuls per dtype, {threads} threads"
    entry = machine.lookup(machine.cpu_key("bf16-probe", threads), _probe, method)
    return {**entry["value"], "date": entry["date"]}


def _probe() -> dict:
    return {"bf16_gflops": _gemm_gflops(torch.bfloat16), "fp32_gflops": _gemm_gflops(torch.float32)}


def _gemm_gflops(dtype: torch.dtype, reps: int = 5) -> float:
    a, b = torch.randn(PROBE_N, PROBE_N, dtype=dtype), torch.randn(PROBE_N, PROBE_N, dtype=dtype)
    # the warm-up lets oneDNN pick and cache its kernel
    return 2 * PROBE_N**3 / machine.best_seconds(lambda: a @ b, reps) / 1e9


def autocast(device: torch.device, precision: Precision):
    """bf16 autocast on `device`, or nothing for fp32."""
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.dtype)


DECODING_FP32 = ("auto: decoding in fp32, where greedy output does not depend on batching or "
                 "speculation")


def choose_for_decoding(requested: str, device: torch.device) -> Precision:
    """The precision to decode in on `device`: `auto` is fp32 (the module docstring), fp32 and bf16
    as requested."""
    return Precision(None, DECODING_FP32) if requested == "auto" else choose(requested, device)


def for_model(requested: str, model: torch.nn.Module) -> tuple[torch.device, Precision]:
    """(the model's device, the precision `requested` resolves to there), with the weights stored in
    it."""
    device = next(model.parameters()).device
    return device, store_weights(model, choose(requested, device))


def store_weights(model: torch.nn.Module, chosen: Precision) -> Precision:
    """Under bf16, every nn.Linear's weight and bias become bf16 in place (what autocast would cast
    them to at each op); the rest (norms, embeddings, MeSH routers) stays fp32. For inference only:
    an optimizer keeps fp32 masters. Returns `chosen`."""
    if chosen.dtype is not None:
        for module in model.modules():
            # not subclasses (meshlm.quant's layers hold their own formats)
            if type(module) is torch.nn.Linear:
                module.to(chosen.dtype)
    return chosen
