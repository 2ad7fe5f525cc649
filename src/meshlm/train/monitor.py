"""What the trainer reports: metrics as JSON lines (+ TensorBoard if installed) and a progress bar.

MFU = achieved training FLOP/s (tokens/s × train FLOPs per token, PaLM convention from
meshlm.model.accounting) / (peak per device × devices), with the peak of the dtype the run computes in
(meshlm.runtime.peaks: measured once per machine and cached, or the GPU's datasheet bf16 peak).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


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
