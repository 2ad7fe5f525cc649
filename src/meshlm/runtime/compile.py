"""Whether the trainer compiles each layer with torch.compile. `true` and `false` are honoured as
given; `auto` compiles only where the compile time is paid back within the run
(benchmarks/compile_speed.py measures the break-even; docs/benchmarks.md has the figures):

  CUDA  compile when the run has at least CUDA_MIN_STEPS steps.
  CPU   never: on the development CPU compiled steps were not faster enough to repay the compile
        within any run length meshlm trains on a CPU (see CPU_REASON).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHOICES = ("auto", "true", "false")
CUDA_MIN_STEPS = 1000
CPU_REASON = "auto: on CPU compile does not pay back its compile time (benchmarks/compile_speed.py)"


@dataclass(frozen=True)
class Compile:
    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"compile {'on' if self.enabled else 'off'} ({self.reason})"


def choose(requested: str, device: torch.device, steps: int) -> Compile:
    """The compile decision for `requested` (auto / true / false), a run of `steps` steps on
    `device`."""
    if requested not in CHOICES:
        raise ValueError(f"compile {requested!r} must be one of {', '.join(CHOICES)}")
    if requested != "auto":
        return Compile(requested == "true", "as requested")
    if device.type == "cuda":
        if steps >= CUDA_MIN_STEPS:
            return Compile(True, f"auto: {steps} steps on a GPU (>= {CUDA_MIN_STEPS})")
        return Compile(False, f"auto: {steps} steps on a GPU are too few to repay compiling (< "
                              f"{CUDA_MIN_STEPS})")
    return Compile(False, CPU_REASON)
