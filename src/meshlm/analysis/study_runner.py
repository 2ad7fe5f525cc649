"""The process runner of `meshlm reproduce`: every stage of every run (train → eval → probe) as its
own `meshlm` process, `jobs` runs at a time on threads, SIGINT and SIGTERM passed on to the stages
running (meshlm.analysis.study makes the plan; meshlm.analysis.results_page writes the page after).

A finished run (a complete eval.json and a probe.json) is skipped, so an interrupted study is simply
run again; a half-trained run resumes from its newest good checkpoint (`meshlm train --resume`). A
later stage (a run with a source, a variant's `from`) starts once its source has finished, and fails
in one line if its source failed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import torch

from meshlm.analysis.results_page import record_wall_time, write_results
from meshlm.analysis.study import Run, Study, meshlm_command
from meshlm.errors import Interrupted, MeshlmError
from meshlm.evaluation.results import ResultError, read_eval


def execute(study: Study, log=print, jobs: int = 1, keep_going: bool = False) -> None:
    """Train, evaluate and probe every run that is not finished yet, `jobs` runs at a time, then
    write the results page. With jobs > 1 each run's processes get OMP_NUM_THREADS = cores // jobs
    (unless set), and on a machine with several GPUs (and no launcher) the runs are spread over
    them, one GPU per job slot.

    After a failed run no new run starts (with `keep_going`, the others still do), the running ones
    finish, and the first error is raised; after an interrupt the running ones stop on the forwarded
    signal."""
    todo = []
    for i, run in enumerate(study.runs, 1):
        if _evaluated(run) and (run.dir / "probe" / "probe.json").is_file():
            log(f"[{i}/{len(study.runs)}] {run.name}: done, skipped")
        else:
            todo.append((i, run))
    queue = Queue(todo)

    def worker(slot: int) -> None:
        env = job_environment(slot, jobs, bool(study.launcher))
        while True:
            with queue.lock:
                if (queue.errors and not keep_going) or children.received or not queue.pending:
                    return
                item = queue.take()
            if item is None:  # every run left waits for a source still training
                time.sleep(0.2)
                continue
            i, run = item
            try:
                _run_stages(study, run, f"[{i}/{len(study.runs)}]", children, env, log)
                queue.finish(run)
            except Exception as err:  # noqa: BLE001 — Interrupted too; raised from the main thread
                queue.finish(run, err)
                if not isinstance(err, Interrupted):
                    log(f"[{i}/{len(study.runs)}] {run.name}: failed: {err}")

    with Children() as children:
        threads = [threading.Thread(target=worker, args=(slot,), daemon=True)
                   for slot in range(min(jobs, len(todo)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join with a timeout: the main thread stays free for Ctrl-C
                thread.join(0.2)
    write_results(study)
    interrupted = [err for err in queue.errors if isinstance(err, Interrupted)]
    if interrupted or queue.errors:
        raise (interrupted or queue.errors)[0]


class Queue:
    """The runs left, in the plan's order; a later stage (a run with a source) is taken once its
    source has finished, and fails at once if its source failed."""

    def __init__(self, todo: list[tuple[int, Run]]):
        self.pending = list(todo)
        self.unfinished = {run.name for _, run in todo}
        self.failed: set[str] = set()
        self.errors: list[Exception] = []
        self.lock = threading.Lock()

    def finish(self, run: Run, error: Exception | None = None) -> None:
        with self.lock:
            if error is None:
                self.unfinished.discard(run.name)
            else:
                self.errors.append(error)
                self.failed.add(run.name)

    def take(self) -> tuple[int, Run] | None:
        """The first run that can start now (None: each waits for a source); under `lock`. A run
        whose source failed is taken too: _run_stages says why it cannot start."""
        for k, (_, run) in enumerate(self.pending):
            source = run.source.name if run.source else None
            if source is None or source not in self.unfinished or source in self.failed:
                return self.pending.pop(k)
        return None


def _run_stages(study: Study, run: Run, tag: str, children: Children, env: dict[str, str],
                log) -> None:
    """train → eval → probe for one run, each stage its own `meshlm` process."""
    if run.source is not None and not (run.source.dir / "eval.json").is_file():
        raise MeshlmError(f"{run.name} starts from {run.source.name}, which did not finish; fix "
                          f"that run and run the study again (finished runs are skipped)")
    log(f"{tag} {run.name}: training")
    start = time.perf_counter()
    config = ["--config", study.config] if study.config else []
    train = meshlm_command("train", "--resume", *config, *run.overrides)
    command = study.launcher + train[1:] if study.launcher else train
    _check_call(command, run, "train", children, env)
    record_wall_time(run, time.perf_counter() - start)
    log(f"{tag} {run.name}: evaluating and probing")
    # the run's own probe folder: a rerun after an interrupted eval replaces the earlier probe
    for stage, args in (("eval", study.eval_args), ("probe", [*study.probe_args, "--overwrite"])):
        _check_call(meshlm_command(stage, str(run.dir), *args), run, stage, children, env)


def job_environment(slot: int, jobs: int, launcher: bool) -> dict[str, str]:
    """Environment for one job slot's processes: its share of the cores and, with several GPUs, its
    GPU."""
    env = {}
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    if not launcher and "CUDA_VISIBLE_DEVICES" not in os.environ:
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % torch.cuda.device_count())
    return env


def _evaluated(run: Run) -> bool:
    """eval.json is there and complete (meshlm eval writes it after each stage, "complete": false
    until done)."""
    try:
        result = read_eval(run.dir / "eval.json")
    except ResultError:
        return False
    return result is not None and result.complete


def _check_call(command: list[str], run: Run, stage: str, children: Children,
                env: dict[str, str]) -> None:
    """Run one stage in its own session, so Ctrl-C reaches it once, from here: a training run then
    saves its current step; the study stops with advice to run it again (which resumes where it
    stopped)."""
    run.dir.mkdir(parents=True, exist_ok=True)
    with open(run.dir / f"{stage}.log", "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **env} if env else None)
        code = children.wait(proc)
    signum = children.received[0] if children.received else None
    if signum is not None or code in (130, 143, -signal.SIGINT, -signal.SIGTERM):
        saved = " (its current step is saved)" if stage == "train" and code in (130, 143) else ""
        raise Interrupted(f"{stage} of {run.name} stopped{saved}; run the same `meshlm reproduce` "
                          f"command again: finished runs are skipped and {run.name} continues from "
                          f"its last checkpoint", signum or (code - 128 if code > 0 else -code))
    if code:
        raise MeshlmError(f"{stage} of {run.name} failed (exit {code}); see "
                          f"{run.dir / f'{stage}.log'}, fix it and run the study again (finished "
                          f"runs are skipped)")


class Children:
    """The stage processes running now. While open (in the main thread), SIGINT and SIGTERM are
    passed on to every one of them (a second Ctrl-C reaches them too, and aborts them at once);
    `received` lists the signals that came."""

    def __init__(self):
        self.running: set[subprocess.Popen] = set()
        self.received: list[int] = []
        self._lock = threading.Lock()
        self._previous = {}

    def __enter__(self) -> Children:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._forward)
                              for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum, frame) -> None:
        self.received.append(signum)
        with self._lock:
            for proc in self.running:
                if proc.poll() is None:
                    proc.send_signal(signum)

    def wait(self, proc: subprocess.Popen) -> int:
        with self._lock:
            self.running.add(proc)
            if self.received and proc.poll() is None:  # a signal came while it was starting
                proc.send_signal(self.received[0])
        try:
            return proc.wait()
        finally:
            with self._lock:
                self.running.discard(proc)
