"""What the trainer reports: metrics as JSON lines (+ TensorBoard) and progress (a bar on a terminal, else
periodic log lines).

MFU = achieved training FLOP/s (tokens/s × train FLOPs per token, PaLM convention from
meshlm.model.accounting) / (peak per device × devices), with the peak of the dtype the run computes in
(meshlm.runtime.peaks: measured once per machine and cached, or the GPU's datasheet bf16 peak).
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshlm import atomic
from meshlm.errors import storage_error


class Metrics:
    """Appends one JSON object per line to <run>/metrics.jsonl; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tb, self.tb_dir = None, run_dir / "tensorboard"
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional (setup.sh installs it): say so once, keep training
                print("train.tensorboard is on but the tensorboard package is not installed, so no TensorBoard "
                      "events are written (metrics.jsonl has everything); install it with pip install -c "
                      "constraints.txt -e '.[tensorboard]' or set train.tensorboard=false", file=sys.stderr)
                return
            quiet_tensorboard_thread()
            self.tb = self._tensorboard(lambda _: SummaryWriter(str(self.tb_dir)))

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

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")
        except OSError as err:  # a failed write names no file: say which, and its filesystem's free space
            raise storage_error(err, self.path, "appending to") from None
        if self.tb is not None:
            kind, step = record.get("kind", "train"), record["step"]
            scalars = {f"{kind}/{key}": value for key, value in record.items() if key not in ("kind", "step")
                       and isinstance(value, (int, float)) and math.isfinite(value)}
            self._tensorboard(lambda tb: [tb.add_scalar(tag, value, step) for tag, value in scalars.items()])

    def close(self) -> None:
        if self.tb is not None:
            self._tensorboard(lambda tb: tb.close())
            self.tb = None

    def _tensorboard(self, use):
        """`use(writer)`; a failure of the writer (its thread's, raised here) is one StorageError naming the
        events folder, and TensorBoard is off from then on."""
        try:
            return use(self.tb)
        except OSError as err:
            self.tb = None
            raise storage_error(err, self.tb_dir, "writing TensorBoard events to") from None


def quiet_tensorboard_thread() -> None:
    """TensorBoard writes events from a thread that, on a failed write, prints its traceback before the main
    thread sees the error: silence that thread's filesystem errors (Metrics reports them as one line)."""
    previous = threading.excepthook
    if getattr(previous, "meshlm_quiet", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError)):
            previous(args)
    hook.meshlm_quiet = True
    threading.excepthook = hook


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Rank 0's progress: loss, tokens/s, MFU, lr and ETA; a no-op elsewhere.

    On a terminal, a tqdm bar. Without one (a log file, a batch job) a bar redraws itself with carriage returns
    into one ever-growing line, so instead one plain line is printed every `total/20` steps or `every_s`
    seconds, whichever comes first, and at the last step."""

    def __init__(self, enabled: bool, verbose: bool, total: int, initial: int, desc: str,
                 stream=None, every_s: float = 60.0):
        self.bar, self.verbose, self.enabled = None, verbose, enabled
        self.stream = stream or sys.stderr
        self.total, self.step, self.desc = total, initial, desc
        self.every_steps, self.every_s = max(1, (total - initial) // 20), every_s
        self.start = self.last = time.monotonic()
        self.first = initial
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=self.stream)

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
            print(f"{self.desc}: step {self.step}/{self.total} ({100 * self.step / max(self.total, 1):.0f}%) | "
                  f"{stats} | elapsed {_duration(elapsed)}, eta {_duration(eta)}", file=self.stream, flush=True)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.stream)  # beside the bar
        elif self.verbose:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
