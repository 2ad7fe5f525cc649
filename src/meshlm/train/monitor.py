"""What the trainer reports: metrics as JSON lines (+ TensorBoard if installed), a progress bar, and the
peak FLOP/s that MFU is measured against.

MFU = achieved training FLOP/s (tokens/s × train FLOPs per token, PaLM convention from
meshlm.model.accounting) / (peak per device × devices). The peak is `train.peak_flops` when given;
otherwise on CPU a short fp32 matmul benchmark (the best a large GEMM reaches on this machine, with the
threads this process has), and on GPU the datasheet dense bf16 peak of known chips (else a measured bf16
matmul).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name().
GPU_BF16_PEAKS = {
    "GB200": 2.5e15, "B200": 2.25e15, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "H800": 989e12,
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


def device_peak(device: torch.device, autocast_dtype: torch.dtype | None, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if override > 0:
        return override, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_BF16_PEAKS.items():
            if key in name:
                return peak, f"{name} bf16 datasheet"
        return measure_matmul_peak(device, torch.bfloat16, n=8192), f"{name} measured bf16 matmul"
    dtype = autocast_dtype or torch.float32
    n = 2048 if dtype == torch.float32 else 256  # bf16 is emulated on most CPUs: keep it short
    return measure_matmul_peak(device, dtype, n=n), f"measured {str(dtype).removeprefix('torch.')} matmul"


class Metrics:
    """Appends one JSON object per line to <run>/metrics.jsonl; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop records from steps the killed run did after its last checkpoint."""
        if not (self.enabled and self.path.exists()):
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:  # a line cut short by the kill
                continue
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(self.path)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
        if self.tb is not None:
            kind, step = record.get("kind", "train"), record["step"]
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Progress:
    """tqdm bar on rank 0 showing loss, tokens/s, MFU and (built in) ETA; a no-op elsewhere."""

    def __init__(self, enabled: bool, verbose: bool, total: int, initial: int, desc: str):
        self.bar, self.verbose = None, verbose
        if enabled:
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float, mfu: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% "
                                     f"| lr {lr:.2e}", refresh=False)
            self.bar.update(1)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)  # beside the bar (tqdm draws on stderr)
        elif self.verbose:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
