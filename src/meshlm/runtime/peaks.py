"""The peak FLOP/s that MFU divides by: the peak of the dtype the run actually computes in.

MFU = achieved training FLOP/s (tokens/s × train FLOPs per token, PaLM convention) / (peak ×
devices). The peak is `train.peak_flops` when given. Otherwise:
  CUDA  the datasheet dense bf16 peak of known chips for bf16 runs (the usual MFU convention);
        anything else (fp32 runs, unknown chips) is measured like a CPU.
  CPU   the best a large matmul of that dtype reaches on this machine with this process's threads,
        measured once per machine and cached (meshlm.machine: value, date, method).
        Re-measuring at every start made MFU swing with the machine's load (45% then 28% for one
        configuration); a cached figure makes runs comparable. It is timed on the process's CPU time
        per thread, not the wall clock, so other work on the machine does not lower it (a wall-clock
        figure measured under load once gave a 2-thread peak of 8 GFLOP/s and MFUs over 150%).
        Delete the cache entry to measure again.
"""
from __future__ import annotations

import time

import torch

from meshlm import machine
from meshlm.runtime.precision import BF16_CPU_FLAGS

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of
# torch.cuda.get_device_name().
GPU_BF16_PEAKS = {
    "GB200": 2.5e15, "B200": 2.25e15, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 70e12,
    "A10": 125e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                        seconds: float = 0.5, clock=time.perf_counter) -> float:
    """Best FLOP/s of repeated n×n matmuls over ~`seconds` (after a warm-up), timed with `clock`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = clock()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n**3 / max(clock() - start, 1e-9))
    return best


def device_name(device: torch.device) -> str:
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else machine.cpu_info()["model"])


def device_peak(device: torch.device, dtype: torch.dtype | None,
                override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device for `dtype` (None = fp32), where the figure comes from)."""
    if override > 0:
        return override, "train.peak_flops"
    dtype = dtype or torch.float32
    name = device_name(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        for key, peak in GPU_BF16_PEAKS.items():
            if key in name:
                return peak, f"{name} bf16 datasheet"
    entry = cached_peak(device, dtype)
    return entry["value"], (f"{name}: {entry['method']}, measured {entry['date']}, cached in "
                            f"{machine.path()}")


def cached_peak(device: torch.device, dtype: torch.dtype) -> dict:
    """The machine cache's entry {"value", "date", "method"} for this device, dtype and thread
    count."""
    emulated = device.type == "cpu" and dtype == torch.bfloat16 and not _native_cpu_bf16()
    # emulated bf16: keep it short
    n = 8192 if device.type == "cuda" else (256 if emulated else 2048)
    seconds = 1.0 if device.type == "cuda" else 2.0
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    dname = str(dtype).removeprefix("torch.")
    who = machine.cpu_id() if device.type == "cpu" else device_name(device)
    key = f"peak|{who}|{dname}|threads {threads}|torch {torch.__version__}"
    # CPU time per thread: time the machine gave this process, whatever else runs beside it
    if threads:
        method = (f"best {dname} {n}^3 matmul over {seconds:g} s of wall time, timed on CPU time "
                  f"per thread, {threads} threads")
        clock = lambda: time.process_time() / threads  # noqa: E731
    else:
        method, clock = f"best {dname} {n}^3 matmul over {seconds:g} s", time.perf_counter
    return machine.lookup(key, lambda: measure_matmul_peak(device, dtype, n=n, seconds=seconds,
                                                           clock=clock), method)


def _native_cpu_bf16() -> bool:
    return any(f in machine.cpu_info()["flags"] for f in BF16_CPU_FLAGS)
