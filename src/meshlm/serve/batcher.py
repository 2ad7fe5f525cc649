"""Continuous batching without HTTP: requests join running batches at token boundaries and leave
when done.

    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=16, max_queue=64)
    batcher.submit(Request(prompt_ids, Sampling(max_new_tokens=32, temperature=0), on_tokens=...))
    while batcher.step(): ...            # or batcher.serve(stop_event) in a thread of its own

Every `step` is one token boundary: requests that were cancelled, timed out or finished leave (their
rows, and the cache columns no one else needs, are freed at once); waiting requests are admitted
while fewer than `max_batch` rows decode (a cohort's newcomers prefilled together, then joined:
meshlm.serve.cohorts); then every running cohort decodes once. Requests with the same `loops`,
`exit` and `speculate` share a cohort; different settings decode in separate cohorts, one after the
other within the step. `submit` refuses work past `max_queue` waiting requests (QueueFull: the
server's 429).

A row's tokens do not depend on its neighbours: its padding is masked and its positions count its
own tokens only, and it samples with its own generator (seeded per request). Greedy output equals
`meshlm.generate` of the same request alone, up to floating-point differences between batch shapes,
which at fp32 never changed a token in the tests (docs/serve.md states what holds at bf16).

`on_tokens(request, tokens)` and `on_done(request)` are called from the thread running `step`.
"""
from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from meshlm.errors import ConfigError, MeshlmError
from meshlm.generate import Batch, check_loops, check_room
from meshlm.model import MeshLM
from meshlm.serve.cohorts import Cohort, PlainCohort, Prefill, SpeculativeCohort, warm
from meshlm.serve.requests import FINISH_REASONS, BatcherStats, Request

__all__ = ["FINISH_REASONS", "Batcher", "BatcherStats", "QueueFull", "Request"]

class QueueFull(MeshlmError):
    """The waiting queue holds max_queue requests: try again later (HTTP 429)."""


class Batcher:
    """`prefill_chunk`: while other rows decode, a plain cohort's newcomers whose prompts are longer
    prefill this many columns per token boundary (None: whole prompts at once). `loop_slice`: while
    other cohorts decode, a plain cohort runs at most this many loop steps per boundary, so that a
    request asking for many loops spreads its token over several boundaries instead of stalling
    everyone's (None: the trained loop count; 0: never slice)."""

    def __init__(self, model: MeshLM, eos_id: int, pad_id: int, max_batch: int = 16,
                 max_queue: int = 64, prefill_chunk: int | None = None,
                 max_loops: int | None = None, loop_slice: int | None = None,
                 compile: bool = False):
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch={max_batch} must be >= 1 and max_queue={max_queue} >= 0")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk={prefill_chunk} must be >= 1 (or None: whole "
                              "prompts)")
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.max_loops = max_loops  # a request's loops cap (None: meshlm.generate.loop_cap's rule)
        self.loop_slice = len(model.schedule()) if loop_slice is None else loop_slice
        self.compile = compile  # plain cohorts decode through the compiled step
        self.waiting: deque[Request] = deque()
        self.cohorts: dict[tuple, Cohort] = {}
        self.prefilling: list[Prefill] = []  # prompts part-prefilled, one group per cohort key
        self.stats = BatcherStats()
        self._wake = threading.Condition()

    def warm(self) -> str:
        """With `compile`: compile the plain step before serving, time it against the eager one at
        max_batch rows, and keep it only if it is faster (requests asking for other `loops`
        compile theirs at first use). What was found, as a line for the log."""
        if not self.compile:
            return ""
        seconds, compiled, eager = warm(self.model, self.pad_id, rows=self.max_batch)
        self.compile = compiled < eager
        return (f"compiled the decode step in {seconds:.0f} s; a step of {self.max_batch} rows "
                f"takes {compiled:.1f} ms compiled, {eager:.1f} ms eager: decoding "
                f"{'compiled' if self.compile else 'eagerly (compiling does not pay here)'}")

    # -- any thread --------------------------------------------------------------------------------
    def check(self, r: Request) -> None:
        """ConfigError (one line, naming the fix) unless the model can serve r as asked."""
        check_room(self.model, [r.prompt], r.sampling)
        if any(not 0 <= t < self.model.config.vocab_size for t in r.prompt):
            raise ConfigError(f"prompt token ids must be in 0 … {self.model.config.vocab_size - 1}")
        check_loops(self.model, r.loops, self.max_loops)
        schedule = self.model.schedule(r.loops)
        if r.speculate is not None:
            if r.exit is not None:
                raise ConfigError("speculate decodes at the full depth: it cannot be combined "
                                  "with exit; drop one")
            r.speculate.check(self.model, schedule)

    def submit(self, r: Request) -> None:
        """Queue r (after `check`); QueueFull when max_queue requests already wait."""
        self.check(r)
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting "
                                f"(max_queue={self.max_queue}); retry later")
            self.waiting.append(r)
            self._wake.notify()

    def cancel(self, r: Request, reason: str = "cancelled") -> None:
        """Stop r at the next token boundary (its slot is freed then) with finish `reason`."""
        if r.stop_requested is None:  # the first reason given is the one recorded
            r.stop_requested = reason
        with self._wake:
            self._wake.notify()

    def requests(self) -> list[Request]:
        """Every request not finished: waiting, prefilling or decoding (a snapshot, any thread)."""
        with self._wake:
            waiting = list(self.waiting)
        live = [r for c in list(self.cohorts.values()) for r in list(c.requests)]
        live += [r for p in list(self.prefilling) for r in list(p.requests)]
        return [r for r in waiting + live if r.finish is None]

    @property
    def running(self) -> int:
        """Admitted requests: decoding, or prefilling their prompts."""
        return sum(len(c) for c in self.cohorts.values()) + sum(map(len, self.prefilling))

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # -- the decoding thread -----------------------------------------------------------------------
    def step(self) -> bool:
        """One token boundary: retire, admit, decode every cohort once. False when there was nothing
        to do."""
        self._retire_stopped()
        self._admit()
        self._advance_prefills()
        for key, cohort in list(self.cohorts.items()):
            if not cohort.busy:
                self._leave(cohort)  # requests done at admission (one token, or EOS first)
            if len(cohort):
                self._decode_or_fail(cohort)
            if not len(cohort):
                del self.cohorts[key]
        return bool(self.cohorts or self.waiting or self.prefilling)

    def serve(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Decode until `stop` is set, sleeping while there is no work. A bug that escapes a step
        ends the running requests with finish "error" (its traceback on stderr) and decoding goes
        on."""
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as err:  # noqa: BLE001 - the thread must outlive one bad step
                traceback.print_exc()
                self._fail_running(err)
                busy = True
            if not busy:
                with self._wake:
                    if not self.waiting and not stop.is_set():
                        self._wake.wait(idle_wait)

    def _fail_running(self, err: Exception) -> None:
        for group in [c.requests for c in self.cohorts.values()] + \
                [p.requests for p in self.prefilling]:
            self._fail(group, err)
        self.cohorts.clear()
        self.prefilling.clear()

    def _fail(self, requests: list[Request], err: Exception) -> None:
        for r in requests:
            if r.finish is None:
                r.error = f"{type(err).__name__}: {err}"
                self._finish(r, "error")

    def _admit(self) -> None:
        """Take waiting requests while rows are free; each cohort prefills its newcomers in one
        batch."""
        joining: dict[tuple, list[Request]] = {}
        later: list[Request] = []
        with self._wake:
            while self.waiting and self.running + sum(map(len, joining.values())) < self.max_batch:
                r = self.waiting.popleft()
                if self._stopped(r):
                    self._finish(r, r.stop_requested)
                elif self._busy(r.key()):
                    later.append(r)
                else:
                    joining.setdefault(r.key(), []).append(r)
            self.waiting.extendleft(reversed(later))  # they join once the sliced step ends
        for key, group in joining.items():
            self._isolated(group, lambda g, key=key: self._start(key, g))

    def _isolated(self, group: list[Request], start: Callable[[list[Request]], None]) -> None:
        """start(group); if that fails, start(each one alone), so that only the requests that fail
        by themselves end with finish "error" (a failed start leaves the running batch as it
        was)."""
        try:
            start(group)
        except Exception as err:  # noqa: BLE001 - a failure of some requests must not stop the others
            if len(group) == 1:
                self._fail(group, err)
                return
            for r in group:
                self._isolated([r], start)

    def _start(self, key: tuple, group: list[Request]) -> None:
        device = self.model.embed_in.weight.device
        for r in group:
            seed = r.sampling.seed
            r.generator = None if seed is None else torch.Generator(device).manual_seed(seed)
        chunk, first = self.prefill_chunk, group[0]
        long = chunk is not None and max(len(r.prompt) for r in group) > chunk
        deep = (self.loop_slice and len(self.model.schedule(first.loops)) > self.loop_slice
                and bool(self.cohorts or self.prefilling))  # its prefill would stall the others
        if first.speculate is None and (long or deep):
            self.prefilling.append(Prefill.of(group, self.pad_id, device))
            return
        cohort = self._cohort(key, group[0])
        # only now part of the cohort: a failed prefill leaves the batch as it was
        tokens = cohort.admit(group)
        self.cohorts[key] = cohort
        self._admitted(group, tokens)

    def _cohort(self, key: tuple, first: Request) -> Cohort:
        """The running cohort of `key`, or a new one for requests like `first` (not yet
        registered)."""
        if key in self.cohorts:
            return self.cohorts[key]
        if first.speculate is None:
            return PlainCohort(self.model, first.loops, first.exit, self.pad_id, self.compile)
        return SpeculativeCohort(self.model, first.loops, first.speculate, self.pad_id, first)

    def _admitted(self, group: list[Request], tokens: list[int]) -> None:
        self.stats.admitted += len(group)
        for r, token in zip(group, tokens):  # stopped during a sliced prefill: no token, and
            if self._stopped(r):  # its row leaves at the next boundary
                self._finish(r, r.stop_requested)
            else:
                self._deliver(r, [token])

    def _advance_prefills(self) -> None:
        """Prefill one more chunk of every part-prefilled group (all of it when no row is decoding:
        then nothing waits on it); a complete group joins its cohort and gets its first tokens.
        Requests stopped meanwhile leave first."""
        chunk = self.prefill_chunk if self.cohorts else None
        loop_slice = (self.loop_slice or None) if self.cohorts or len(self.prefilling) > 1 else None
        for prefill in list(self.prefilling):
            self._drop_stopped(prefill)
            if not len(prefill):
                self.prefilling.remove(prefill)
                continue
            first = prefill.requests[0]  # all of a group share the key, and so loops and exit
            if self._busy(first.key()):  # it would end by joining a cohort whose step is sliced
                continue
            try:
                batch = prefill.advance(self.model, first.loops, first.exit, chunk, loop_slice)
                if batch is not None:
                    self.prefilling.remove(prefill)
                    self._join(first.key(), prefill.requests, batch)
            except Exception as err:  # noqa: BLE001 - one broken prefill must not stop the others
                if prefill in self.prefilling:
                    self.prefilling.remove(prefill)
                if len(prefill) == 1:
                    self._fail(prefill.requests, err)
                else:  # prefill each one again alone: only what fails by itself fails
                    self.prefilling.extend(Prefill.of([r], self.pad_id, self.model.embed_in.weight
                                                      .device) for r in prefill.requests)

    def _drop_stopped(self, prefill: Prefill) -> None:
        """Finish the requests of `prefill` that were cancelled or timed out; free their rows
        (once its sliced forward, if any, has ended)."""
        if prefill.flight is not None:
            return
        for r in prefill.requests:
            if self._stopped(r):
                self._finish(r, r.stop_requested)
        live = [i for i, r in enumerate(prefill.requests) if r.finish is None]
        if len(live) < len(prefill):
            prefill.keep(live)

    def _join(self, key: tuple, group: list[Request], batch: Batch) -> None:
        cohort = self._cohort(key, group[0])
        cohort.join(group, batch)
        self.cohorts[key] = cohort
        self._admitted(group, batch.pending.tolist())

    def _decode_or_fail(self, cohort: Cohort) -> None:
        """Decode the cohort once; if that fails, its requests end with finish "error" (the others
        go on)."""
        try:
            self._decode(cohort)
        except Exception as err:  # noqa: BLE001 - one broken batch must not stop the server
            self._fail(cohort.requests, err)
            cohort.requests.clear()

    def _decode(self, cohort: Cohort) -> None:
        steps_before, tokens_before = cohort.loop_steps, cohort.tokens
        others = len(self.cohorts) > 1 or self.prefilling  # whom a deep step would stall
        emitted = cohort.step(self.loop_slice if self.loop_slice and others else None)
        if emitted is None:  # a slice of a deep step: its tokens come at a later boundary
            return
        for row, err in cohort.failed.items():  # rows whose own sampling failed: they alone end
            self._fail([cohort.requests[row]], err)
        self.stats.steps += 1
        self.stats.step_rows += len(cohort)
        self.stats.loop_steps += cohort.loop_steps - steps_before
        self.stats.decoded += cohort.tokens - tokens_before
        for r, tokens in zip(list(cohort.requests), emitted):
            if r.finish is None:
                self._deliver(r, tokens)
        self._leave(cohort)

    def _deliver(self, r: Request, tokens: list[int]) -> None:
        """Give r its new tokens (no more than max_new_tokens, none after EOS); finish it when
        done."""
        s = r.sampling
        new = tokens[:s.max_new_tokens - len(r.tokens)]
        if s.stop_at_eos and self.eos_id in new:
            new = new[:new.index(self.eos_id) + 1]
        r.tokens.extend(new)
        self.stats.tokens += len(new)
        if r.on_tokens is not None and new:
            r.on_tokens(r, new)
        if s.stop_at_eos and new and new[-1] == self.eos_id:
            self._finish(r, "stop")
        elif len(r.tokens) >= s.max_new_tokens:
            self._finish(r, "length")

    def _stopped(self, r: Request) -> bool:
        if (r.stop_requested is None and r.timeout is not None
            and time.monotonic() - r.submitted > r.timeout):
            r.stop_requested = "timeout"
        return r.stop_requested is not None

    def _busy(self, key: tuple) -> bool:
        """The cohort of `key` is in the middle of a sliced step (rows neither join nor leave)."""
        return key in self.cohorts and self.cohorts[key].busy

    def _retire_stopped(self) -> None:
        for cohort in self.cohorts.values():
            if cohort.busy:  # they leave when the sliced step ends
                continue
            for r in cohort.requests:
                if r.finish is None and self._stopped(r):
                    self._finish(r, r.stop_requested)
            self._leave(cohort)

    def _leave(self, cohort: Cohort) -> None:
        """Free the rows of finished requests."""
        if any(r.finish is not None for r in cohort.requests):
            cohort.keep([i for i, r in enumerate(cohort.requests) if r.finish is None])

    def _finish(self, r: Request, reason: str) -> None:
        r.finish = reason
        self.stats.finished[reason] += 1
        r.done.set()
        if r.on_done is not None:
            r.on_done(r)
