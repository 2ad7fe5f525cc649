"""Stage timing for the speculation planner, as a wrapper around the model (wrap, don't weave).

`Timed(model, costs)` has MeshLM's three stages, `start`, `advance` and `readout`: each call runs
the model's own and adds its seconds to `costs` (meshlm.generate.planner.Costs) under its stage and
token count, so measuring costs no extra forward. Decoding code (meshlm.generate.rounds) runs on the
model itself or on this wrapper and cannot tell them apart. `overhead(stage, n)` times what a block
spends outside the stages (sampling, cache bookkeeping, Python).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from meshlm.model import MeshLM
from meshlm.model.run import LoopRun


class Clock:
    """Stage timer. On CPU this thread's CPU time: on a shared machine other jobs' load barely moves
    it, only ratios of stage costs matter, and it costs ~1 µs (process CPU time costs 0.1-20 ms a
    call on some systems). On CUDA wall time, synchronising so a stage's kernels count in it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()


class Span:
    """The seconds a timed block took, set when it ends."""

    seconds = 0.0


class Timed:
    """A MeshLM whose stages are timed into `costs` (anything with `add(stage, n, seconds)`)."""

    def __init__(self, model: MeshLM, costs):
        self.model, self.costs = model, costs
        self.clock = Clock(next(model.parameters()).device)
        self.seconds = 0.0  # stage time so far

    def _timed(self, stage: object, n: int, fn, *args):
        start = self.clock()
        out = fn(*args)
        seconds = self.clock() - start
        self.costs.add(stage, n, seconds)
        self.seconds += seconds
        return out

    def start(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
              cache=None, exit=None) -> LoopRun:
        """MeshLM.start (embed, prelude, exit tracker), timed as the stage "enter"."""
        return self._timed("enter", input_ids.shape[1], self.model.start, input_ids, padding_mask,
                           cache, exit)

    def advance(self, run: LoopRun, schedule: tuple[int, ...], stop: int | None = None) -> LoopRun:
        """MeshLM.advance, one step at a time: loop step k is the stage ("step", k)."""
        for step in range(run.step, len(schedule) if stop is None else stop):
            self._timed(("step", step), run.h.shape[1], self.model.advance, run, schedule, step + 1)
        return run

    def readout(self, run: LoopRun, schedule: tuple[int, ...], last: int | None = None
                ) -> torch.Tensor:
        return self._timed("readout", run.h.shape[1], self.model.readout, run, schedule, last)

    @contextmanager
    def overhead(self, stage: object, n: int) -> Iterator[Span]:
        """Time the block; add the part of it spent outside the stages to `costs` as `stage`."""
        span, start, before = Span(), self.clock(), self.seconds
        yield span
        span.seconds = self.clock() - start
        self.costs.add(stage, n, max(span.seconds - (self.seconds - before), 0.0))
