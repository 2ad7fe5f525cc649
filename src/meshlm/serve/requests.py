"""A request of continuous batching (meshlm.serve.batcher) and the batcher's counters.

A Request carries its settings typed (an ExitRule, a Speculation): text is parsed once where it
comes in (the HTTP body, meshlm.serve.app), and a Request built with text is a TypeError.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshlm.generate import Sampling, Speculation
from meshlm.model.exit import ExitRule

FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error", "shutdown")
_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    sampling: Sampling
    loops: int | None = None  # core passes (single-core specs); None = the trained count
    exit: ExitRule | None = None  # per-token exit rule (meshlm.model.exit)
    speculate: Speculation | None = None  # lossless self-speculation (meshlm.generate.speculative)
    timeout: float | None = None  # seconds from submission until it is stopped with finish
    # "timeout"
    on_tokens: Callable[[Request, list[int]], None] | None = None
    on_done: Callable[[Request], None] | None = None
    tokens: list[int] = field(default_factory=list)  # generated so far (EOS included when it
    # stopped there)
    finish: str | None = None  # one of FINISH_REASONS once done
    error: str | None = None  # with finish "error": what went wrong
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None  # its own random stream, seeded from sampling.seed
    stop_requested: str | None = None  # set by `Batcher.cancel` (any thread); acted on at the next
    # boundary
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if not isinstance(self.exit, ExitRule | None) or \
                not isinstance(self.speculate, Speculation | None):  # a caller's bug, not input
            raise TypeError("Request.exit and .speculate are an ExitRule and a Speculation (parse "
                            "text where it comes in: ExitRule.parse, Speculation.parse)")

    def key(self) -> tuple:
        """Requests with equal keys decode in one cohort. Speculative sampling draws from its
        decoder's one generator, so a sampled speculative request decodes in a cohort of its own."""
        if self.speculate is None:
            return ("plain", self.loops, self.exit)
        s = self.sampling
        alone = self.id if s.temperature > 0 else None
        return ("speculate", self.loops, self.speculate, s.temperature, s.top_k, s.top_p, alone)


@dataclass
class BatcherStats:
    """Counters for /metrics; read from any thread."""

    admitted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    tokens: int = 0  # delivered
    steps: int = 0  # cohort decode steps
    step_rows: int = 0  # rows summed over those steps (mean batch = step_rows / steps)
    loop_steps: int = 0  # core passes per decoded token, summed (exit and loops change it)
    decoded: int = 0  # tokens decoded by steps
