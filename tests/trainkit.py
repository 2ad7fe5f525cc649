"""Shared pieces of the training tests: a small prepared corpus and a tiny, fast training config."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from meshlm.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CORPUS_CHARS = 400_000  # ~100k tokens: enough windows for every test, prepared in about a second


_PREPARED: list[Path] = []


def make_prepared(tmp_path_factory) -> Path:
    """A prepared-data dir (default tokenizer) cut from the embedded corpus's first documents; made once
    per session (test modules wrap it in their own `prepared` fixture)."""
    from meshlm.data.corpus import default_documents
    from meshlm.data.prepare import prepare

    if _PREPARED:
        return _PREPARED[0]
    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, doc in enumerate(itertools.islice(default_documents(), 40)):
        text = doc["text"][:20_000]
        (root / f"doc{i:02d}.txt").write_text(text)
        total += len(text)
        if total > CORPUS_CHARS:
            break
    out = root / "prepared"
    prepare(sorted(root.glob("*.txt")), out, "default", val_fraction=0.1, progress=False)
    _PREPARED.append(out)
    return out


def tiny_train(data: Path, out_dir: Path, **overrides) -> TrainConfig:
    """A 6-layer-equivalent MeSH model (d=64) on 32-token sequences: ~20 ms per step."""
    base = dict(model={"preset": "tiny", "vocab_size": 8192}, data=str(data), out_dir=str(out_dir), name="run",
                seq_len=32, global_batch=8, micro_batch=4, steps=12, lr=3e-3, warmup=0.1, eval_every=0,
                eval_windows=8, save_every=4, keep_last=3, progress=False, tensorboard=False, peak_flops=1e11)
    return TrainConfig(**{**base, **overrides})


def as_overrides(cfg: TrainConfig) -> list[str]:
    """The same config as command-line overrides (for subprocess runs)."""
    out = [f"model.{k}={v}" for k, v in cfg.model.items()]
    for k, v in cfg.to_dict().items():
        if k != "model":
            out.append(f"{k}={json.dumps(v) if isinstance(v, list) else v}")
    return out


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (train and skipped steps)."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if record["kind"] in ("train", "skip"):
            losses[record["step"]] = record["loss"]
    return losses


def cli_command(*args: str, launcher: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Command line and environment to run `meshlm <args>` (optionally under torchrun) from the source tree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}  # see one_thread()
    return (launcher or [sys.executable]) + ["-m", "meshlm.cli", *args], env


def cli(*args: str, timeout: float = 300, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `meshlm <args>` in a fresh interpreter."""
    cmd, env = cli_command(*args, launcher=launcher)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
