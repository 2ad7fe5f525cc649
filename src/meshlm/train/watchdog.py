"""Distributed faults: a rank that dies or hangs makes the others fail within
`train.collective_timeout`, with one line naming it, instead of waiting out a 30-minute
process-group timeout.

    watch = RankWatch(env, timeout_s)      # under torchrun; a no-op in one process
    with stop, watch, watch.naming_failures(stop):  # starts the watchdog thread; a failed
                                                    # collective is named
        ... watch.beat(step) at the start of every step ...

Each rank records a heartbeat in the process group's store (the TCPStore torchrun provides) at the
start of every step: the step, its PID and host. What a waiting rank can then say about the others:
  - on this host, from /proc: the rank's process is gone (killed, crashed) or stopped (SIGSTOP, a
    debugger);
  - anywhere: the rank is behind, its heartbeat at an earlier step than this rank's.
Two paths report it:
  - a collective that fails (gloo raises when a peer's connection closes, or at the timeout) becomes
    a DistributedError naming the rank (`failure`);
  - the watchdog thread covers what raises nothing in time (a rank stopped mid-step; NCCL, whose own
    watchdog aborts without naming anyone): once this rank has not started a step for the timeout
    and another rank is found gone, stopped or behind, it prints the line and exits the process (the
    main thread is blocked inside the collective). A long evaluation or checkpoint on every rank
    never fires it: no rank is behind.
The process group's own timeout is the collective timeout plus GRACE, so the named report comes
first.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from meshlm.errors import MeshlmError

GRACE_S = 30.0  # the process group's timeout exceeds the watchdog's by this much
KEY = "meshlm/beat/{rank}"


class DistributedError(MeshlmError):
    """Another rank died or hangs: named, with how to go on."""


def group_timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s + GRACE_S)


# how _diagnose words a rank that runs but has not reached this rank's step
BEHIND = "is stuck behind this rank"


def process_state(pid: int) -> str | None:
    """"gone", "stopped" or None (running, or not readable) for a PID on this host."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[-1].split()[0]  # the field after "(comm)"
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state)


class RankWatch:
    def __init__(self, env, timeout_s: float, out=None):
        self.env, self.timeout_s = env, timeout_s
        self.out = out or sys.stderr
        self.step, self.last_beat = 0, time.monotonic()
        self.host = socket.gethostname()
        self.store = dist.distributed_c10d._get_default_store() if env.distributed else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RankWatch:
        if self.store is not None:
            self.beat(self.step)
            self._thread = threading.Thread(target=self._watch, name="meshlm-rank-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self, step: int) -> None:
        """This rank starts `step` (called by the training loop; cheap: one store write)."""
        self.step, self.last_beat = step, time.monotonic()
        if self.store is not None:
            self.store.set(KEY.format(rank=self.env.rank), f"{step} {os.getpid()} {self.host}")

    # -- what the other ranks are doing ------------------------------------------------------------
    def culprits(self) -> list[str]:
        """The other ranks found gone, stopped or behind, each in words ([] if none is)."""
        found = []
        for rank in range(self.env.world):
            if rank == self.env.rank:
                continue
            words = self._diagnose(rank)
            if words:
                found.append(f"rank {rank} {words}")
        return found

    def _diagnose(self, rank: int) -> str | None:
        key = KEY.format(rank=rank)
        try:
            if not self.store.check([key]):
                return "never started training"
            step, pid, host = self.store.get(key).decode().split()
        except Exception:  # the store itself is gone (its host died): nothing more to learn
            return None
        where = f"(PID {pid} on {host}, at step {step})"
        state = process_state(int(pid)) if host == self.host else None
        if state == "gone":
            return f"{where} has exited (killed or crashed)"
        if state == "stopped":
            return f"{where} is stopped (SIGSTOP or a debugger)"
        if int(step) < self.step:
            return f"{where} {BEHIND} (step {self.step})"
        return None

    @staticmethod
    def _settled(culprits: list[str]) -> bool:
        """Whether `culprits` name a rank gone, stopped or never started (not only ones behind)."""
        return any(BEHIND not in words for words in culprits)

    def message(self, culprits: list[str], why: str) -> str:
        return (f"{'; '.join(culprits)}: rank {self.env.rank} stopped waiting for it ({why}); "
                "check that rank's log, stop the job, then resume with --resume from the last "
                "checkpoint")

    def failure(self, err: BaseException, settle_s: float = 3.0) -> DistributedError:
        """The error to raise for a collective that failed on this rank, naming the ranks at fault.
        A peer's connection closes while its process is still exiting: look again for up to
        `settle_s` seconds."""
        deadline = time.monotonic() + settle_s
        # "behind" may be a rank still exiting (killed, not yet reaped): look on for a firmer word
        # until the deadline (under load the kill can land a few hundred ms after the connection
        # closes)
        while not self._settled(culprits := self.culprits() if self.store is not None else []) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if culprits:
            closed = any(word in str(err)
                         for word in ("Connection closed", "Connection reset", "closed by peer"))
            why = ("its connection closed" if closed
                   else f"train.collective_timeout={self.timeout_s:g}s passed")
            return DistributedError(self.message(culprits, why))
        return DistributedError(f"a collective failed on rank {self.env.rank} "
                                f"({str(err).splitlines()[0][:160]}): another rank died or hangs; "
                                "check the other ranks' logs, then resume with --resume from the "
                                "last checkpoint")

    @contextlib.contextmanager
    def naming_failures(self, stop=None):
        """Inside the block, a collective that fails because a peer went away or timed out is
        re-raised as the DistributedError `failure` makes, printed here first (`reported`): torchrun
        SIGTERMs the survivors as soon as it reaps the dead rank, and once the enclosing
        StopRequest `stop` restores the default handlers on the way out, that signal ends the
        process before the CLI could print anything. `stop` is muted before the line, so that
        signal adds no word after it."""
        try:
            yield
        except Exception as err:
            if self.store is None or not is_collective_failure(err):
                raise
            error = self.failure(err)
            if stop is not None:
                stop.mute()
            self.report(str(error))
            error.reported = True
            raise error from err

    def report(self, message: str) -> None:
        """The CLI's error line, printed by this rank now."""
        print(f"meshlm train: error: {message}", file=self.out, flush=True)

    # -- the watchdog thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            if time.monotonic() - self.last_beat < self.timeout_s:
                continue
            culprits = self.culprits()
            if culprits and not self._stop.is_set():
                why = f"no step for train.collective_timeout={self.timeout_s:g}s"
                self.report(self.message(culprits, why))
                # the main thread is blocked inside the collective: nothing else can end it
                os._exit(1)


def is_collective_failure(err: BaseException) -> bool:
    """A collective that failed because a peer went away or timed out (gloo raises these as
    RuntimeError)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return (isinstance(err, RuntimeError)
            and any(s in text for s in ("Connection closed", "Timed out", "timed out",
                                        "Connection reset",
                                        "gloo")))
