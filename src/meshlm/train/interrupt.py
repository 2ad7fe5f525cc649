"""Ctrl-C and SIGTERM during training: finish the step, save a checkpoint, say how to resume.

    with StopRequest(log) as stop:
        while ...:
            train_step()
            if stop.requested(env):      # agreed by every rank under torchrun
                save(); raise stop.error(...)

The first SIGINT or SIGTERM only sets a flag (and says so); the loop saves at the end of the current
step and raises `Interrupted` (exit 130 for SIGINT, 143 for SIGTERM). A second signal raises
KeyboardInterrupt at once, wherever the process is: the atomic writer leaves no partial checkpoint
behind, so this is safe. Handlers can only be installed from the main thread; elsewhere the context
does nothing.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import torch

from meshlm.errors import Interrupted
from meshlm.train import parallel

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # the second signal: abort now
        self.signal = signum
        self.log(f"\n{signal.Signals(signum).name}: stopping after this step and saving a "
                 "checkpoint (press Ctrl-C again to abort at once, losing the steps since the "
                 "last checkpoint)")

    def mute(self) -> None:
        """Signals from now on are recorded without a word: the run has failed and said why, and
        torchrun's SIGTERM to the survivors must not print a promise of a checkpoint after that."""
        self.log = lambda message: None

    def requested(self, env=None) -> bool:
        """True when any rank got a signal (one tiny all-reduce per step under torchrun)."""
        if env is None or not env.distributed:
            return self.signal is not None
        flag = torch.tensor(float(self.signal or 0), device=env.device)
        got = int(parallel.all_max(flag, env).item())
        self.signal = self.signal or (got or None)
        return got != 0

    def error(self, message: str) -> Interrupted:
        return Interrupted(message, self.signal or signal.SIGINT)
