"""What the trainer reports: metrics as JSON lines (+ the trackers of train.loggers) and progress (a
bar on a terminal, else periodic log lines).

MFU = achieved training FLOP/s (tokens/s × train FLOPs per token, PaLM convention from
meshlm.model.accounting) / (peak per device × devices), with the peak of the dtype the run computes
in (meshlm.runtime.peaks: measured once per machine and cached, or the GPU's datasheet bf16 peak).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshlm import atomic
from meshlm.errors import storage_error
from meshlm.train import trackers


class Metrics:
    """Appends one JSON object per line to <run>/metrics.jsonl; mirrors them to the trackers in
    `loggers` (meshlm.train.trackers): the run's settings once as hyperparameters (`hparams`), every
    other record's numbers as metrics at its step."""

    def __init__(self, run_dir: Path, enabled: bool, loggers: list[str] = ("tensorboard",),
                 name: str = ""):
        self.run_dir, self.path = run_dir, run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.trackers = ([self._open(kind, run_dir, name or run_dir.name) for kind in loggers]
                         if enabled else [])
        self.trackers = [t for t in self.trackers if t is not None]

    def _open(self, kind: str, run_dir: Path, name: str):
        tracker = trackers.TRACKERS[kind]
        try:
            return tracker(run_dir, name)  # other packages: checked by the trainer's preflight
        except OSError as err:  # e.g. a full disk under the first event record
            raise self._fault(err, tracker) from None
        except ImportError:
            if kind != "tensorboard":
                raise
        print("train.loggers has tensorboard but the tensorboard package is not installed, so no "
              "TensorBoard events are written (metrics.jsonl has everything); install it with pip "
              "install -c "
              "constraints.txt -e '.[tensorboard]' or drop it from train.loggers", file=sys.stderr)
        return None  # the default tracker: say so once, keep training

    @property
    def tb(self):
        """The TensorBoard tracker, if one is open."""
        return next((t for t in self.trackers if isinstance(t, trackers.TensorBoard)), None)

    def hparams(self, params: dict[str, Any]) -> None:
        """The run's settings, to every tracker (flattened: "train.lr", "model.d_model", ...)."""
        flat = trackers.flatten(params)
        self._each(lambda tracker: tracker.hparams(flat))

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
        atomic.write_text(self.path, "".join(line + "\n" for line in keep))
        self._each(lambda tracker: getattr(tracker, "truncate_after", lambda _: None)(step))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")
        # a failed write names no file: say which, and its filesystem's free space
        except OSError as err:
            raise storage_error(err, self.path, "appending to") from None
        # settings, not curves: they go to the trackers through hparams()
        if record.get("kind") == "run":
            return
        values = trackers.scalars(record)
        self._each(lambda tracker: tracker.log(record["step"], values))

    def close(self) -> None:
        self._each(lambda tracker: tracker.close())
        self.trackers = []

    def _each(self, use) -> None:
        """`use(tracker)` for every tracker. A tracker whose writes fail (a full disk; TensorBoard's
        thread raises it here) is one StorageError naming its folder, and that tracker is off from
        then on."""
        for tracker in list(self.trackers):
            try:
                use(tracker)
            except OSError as err:
                self.trackers.remove(tracker)
                raise self._fault(err, tracker) from None

    def _fault(self, err: OSError, tracker) -> Exception:
        """A tracker's failed write as one StorageError naming its folder of the run and that disk's
        space."""
        return storage_error(err, self.run_dir / tracker.subfolder, f"writing {tracker.what} to")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Rank 0's progress: loss, tokens/s, MFU, lr and ETA; a no-op elsewhere.

    On a terminal, a tqdm bar. Without one (a log file, a batch job) a bar redraws itself with
    carriage returns into one ever-growing line, so instead one plain line is printed every
    `total/20` steps or `every_s` seconds, whichever comes first, and at the last step."""

    def __init__(self, enabled: bool, verbose: bool, total: int, initial: int, desc: str,
                 stream=None, every_s: float = 60.0):
        self.bar, self.verbose, self.enabled = None, verbose, enabled
        self.stream = stream or sys.stderr
        self.total, self.step, self.desc = total, initial, desc
        self.every_steps, self.every_s = max(1, (total - initial) // 20), every_s
        self.start = self.last = time.monotonic()
        self.first = initial
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=self.stream)

    def update(self, loss: float, tokens_per_s: float, mfu: float, lr: float) -> None:
        self.step += 1
        stats = f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | lr {lr:.2e}"
        if self.bar is not None:
            self.bar.set_postfix_str(stats, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        due = (self.step - self.first) % self.every_steps == 0 or now - self.last >= self.every_s
        if self.enabled and (due or self.step == self.total):
            self.last = now
            elapsed = now - self.start
            eta = elapsed / max(self.step - self.first, 1) * (self.total - self.step)
            print(f"{self.desc}: step {self.step}/{self.total} "
                  f"({100 * self.step / max(self.total, 1):.0f}%) | {stats} | elapsed "
                  f"{_duration(elapsed)}, eta {_duration(eta)}", file=self.stream,
                  flush=True)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.stream)  # beside the bar
        elif self.verbose:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
