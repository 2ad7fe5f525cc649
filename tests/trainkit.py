"""Shared pieces of the training tests: a small prepared corpus and a tiny, fast training config."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshlm.train.config import TrainConfig
from meshlm.train.plan import resolve

ROOT = Path(__file__).resolve().parents[1]
CORPUS_CHARS = 400_000  # ~100k tokens: enough windows for every test, prepared in about a second


_PREPARED: list[Path] = []


def make_prepared(tmp_path_factory) -> Path:
    """A prepared-data dir (default tokenizer) cut from the embedded corpus's first documents; made
    once per session (test modules wrap it in their own `prepared` fixture)."""
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


def make_task_data(tmp: Path, tasks: str) -> Path:
    """A small prepared task folder `tmp/<tasks>` (64 training problems, 16 validation, 2 test per
    difficulty)."""
    from meshlm.data.tasks import TaskData, prepare_tasks

    prepare_tasks(TaskData(tasks=tasks, train_examples=64, val_examples=16, test_per_level=2),
                  tmp / tasks)
    return tmp / tasks


def tiny_train(data: Path, out_dir: Path, **overrides) -> TrainConfig:
    """A 6-layer-equivalent MeSH model (d=64) on 32-token sequences: ~20 ms per step."""
    base = dict(model={"preset": "tiny", "vocab_size": 8192}, data=str(data), out_dir=str(out_dir),
                name="run",
                seq_len=32, global_batch=8, micro_batch=4, steps=12, lr=3e-3, warmup=0.1,
                eval_every=0,
                eval_windows=8, save_every=4, keep_last=3, progress=False, tensorboard=False,
                peak_flops=1e11)
    return TrainConfig(**{**base, **overrides})


def run_dir(cfg: TrainConfig) -> Path:
    """The folder `cfg` trains in (its resolved plan's)."""
    return resolve(cfg).run_dir


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
    """Command line and environment to run `meshlm <args>` (optionally under torchrun) from the
    source tree."""
    # see one_thread()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return (launcher or [sys.executable]) + ["-m", "meshlm.cli", *args], env


def cli(*args: str, timeout: float = 300,
        launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `meshlm <args>` in a fresh interpreter."""
    cmd, env = cli_command(*args, launcher=launcher)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
RANK_TIMEOUT_S = 4  # train.collective_timeout of the rank-fault runs


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> PID of the training processes torchrun (PID `launcher`) started."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[-1].split()[1])
            environ = dict(item.split("=", 1)
                           for item in (proc / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError):
            continue
        if parent == launcher and "RANK" in environ:
            found[int(environ["RANK"])] = int(proc.name)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)

def train_with_rank_fault(data: Path, tmp: Path, fault: str) -> tuple[int, str, dict[int, int]]:
    """`meshlm train` under torchrun (2 CPU ranks, gloo, collective_timeout=RANK_TIMEOUT_S); once it
    has logged three steps, rank 1 is stopped (SIGSTOP) or killed. Returns torchrun's exit code,
    what rank 0 wrote to stderr (its own log file, without torchrun's report), and the ranks'
    PIDs."""
    cfg = tiny_train(data, tmp, steps=100_000, save_every=0, collective_timeout=RANK_TIMEOUT_S,
                     dtype="fp32")
    logs = tmp / "torchrun-logs"
    cmd, env = cli_command("train", *as_overrides(cfg),
                           launcher=[*TORCHRUN, "--log-dir", str(logs), "-r", "3"])
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = run_dir(cfg) / "metrics.jsonl"
    try:
        folder = run_dir(cfg)
        wait_until(lambda: metrics.is_file() and len(train_losses(folder)) >= 3, 120, "three steps")
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
        # the old default left rank 0 waiting 30 minutes; now it ends within the timeout and the
        # watchdog's poll
        wait_until(lambda: not alive(ranks[0]), RANK_TIMEOUT_S + 30, "rank 0 to fail")
        if fault == "stopped":
            # spare torchrun's grace period for a process that cannot stop
            os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (rank0,) = logs.glob("*/attempt_0/0/stderr.log")
    return proc.returncode, rank0.read_text(), ranks
