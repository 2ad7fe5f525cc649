"""`meshlm reproduce`: a whole study — variants × seeds trained at matched depth and tokens, evaluated,
probed and reported — from one YAML file.

    name: quick                        # runs go to <out_dir>/<name>/<variant>-s<seed>
    out_dir: runs/studies
    config: configs/cpu/small-mesh.yaml  # the train config every run starts from (optional)
    overrides: [train.steps=200]       # dotted overrides for every run
    seeds: [0, 1, 2]
    variants:                          # name -> overrides (and optionally its own seeds)
      vanilla: {overrides: [model.spec=12, model.scheme=vanilla]}
      base:    {overrides: [model.scheme=base]}
      mesh:    {overrides: [model.scheme=mesh]}
      mesh-B3: {overrides: [model.scheme=mesh, model.scheme_options.slots=3], seeds: [0]}
    eval: [--tasks, none, --limit, "200"]   # extra `meshlm eval` arguments
    probe: [--samples, "50"]                # extra `meshlm probe` arguments

Every stage runs as its own `meshlm` process (train → eval → probe), so an interrupted study is simply run
again: a run whose eval.json and probe/probe.json exist is skipped, a half-trained run resumes from its
newest good checkpoint (`meshlm train --resume`). `launcher` (e.g. `torchrun --nproc_per_node=8`) prefixes
training for multi-GPU studies. Before anything runs, the plan is printed with each run's tokens, training
FLOPs and an estimate of its accelerator-hours.

The results page (`results.md` beside the runs, plus `report.html` from `meshlm report`) has a Table-1-like
table with mean ± std over seeds, a buffer-size table for MeSH variants that differ only in B, and wall
time per run.
"""
from __future__ import annotations

import fnmatch
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshlm import atomic
from meshlm.analysis import reasoning_report
from meshlm.data.shards import read_manifest
from meshlm.data.tasks import data_folder, holds_tasks, window_length
from meshlm.errors import ConfigError, Interrupted, MeshlmError
from meshlm.evaluation.tasks import PAPER_TASKS
from meshlm.model.accounting import describe
from meshlm.runtime.peaks import device_peak
from meshlm.runtime.precision import choose
from meshlm.train.config import find_config, load_config
from meshlm.train.plan import resolve_model
from meshlm.yaml_files import load_yaml

STUDY_KEYS = {"name", "out_dir", "config", "overrides", "seeds", "variants", "eval", "probe", "launcher",
              "assumed_mfu", "peak_flops", "gpus"}


@dataclass
class Run:
    variant: str
    seed: int
    overrides: list[str]
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name


@dataclass
class Study:
    name: str
    out_dir: Path
    config: str | None
    runs: list[Run]
    eval_args: list[str] = field(default_factory=list)
    probe_args: list[str] = field(default_factory=list)
    launcher: list[str] = field(default_factory=list)
    assumed_mfu: float = 0.4  # for the GPU-hours estimate
    peak_flops: float = 0.0  # one device's peak FLOP/s; 0: this machine's (meshlm.runtime.peaks: a GPU's
    # datasheet bf16 peak, or the CPU's measured one), so a CPU study's plan is in CPU time
    gpus: int = 1  # GPUs per run (what the launcher starts)

    @property
    def dir(self) -> Path:
        return self.out_dir / self.name


def load_study(path: str | Path, extra_overrides: list[str] = (), only: str | None = None,
               seeds: list[int] | None = None) -> Study:
    """Parse and check a study file (a path, or a shipped name such as studies/quick.yaml); every problem goes
    into one ConfigError. `only`: comma-separated variant names or shell patterns ('chase-*') to keep; `seeds`:
    these seeds instead of the file's (for every variant)."""
    path = find_config(path, "study file")
    raw = load_yaml(path, "study file ")
    problems = [f"unknown key {k!r} (valid: {sorted(STUDY_KEYS)})" for k in sorted(set(raw or {}) - STUDY_KEYS)]
    raw = raw or {}
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not variants:
        problems.append("`variants` must map at least one variant name to {overrides: [...]}")
        variants = {}
    given_seeds = seeds
    seeds = raw.get("seeds", [0]) if given_seeds is None else given_seeds
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
        problems.append(f"`seeds` must be a non-empty list of integers, not {seeds!r}")
    if only is not None and variants:
        patterns = [p.strip() for p in only.split(",") if p.strip()]
        kept = {v: spec for v, spec in variants.items() if any(fnmatch.fnmatchcase(v, p) for p in patterns)}
        if not kept:
            problems.append(f"--only {only!r} matches no variant (variants: {', '.join(variants)})")
        variants = kept
    if problems:
        raise ConfigError(f"study {path}: " + "; ".join(problems))
    name = str(raw.get("name") or path.stem)
    out_dir = Path(raw.get("out_dir", "runs/studies"))
    common = [*map(str, raw.get("overrides", [])), *extra_overrides]
    runs = []
    for variant, spec in variants.items():
        spec = spec or {}
        for seed in (given_seeds or spec.get("seeds", seeds)):  # --seeds override a variant's own list too
            run_dir = out_dir / name / f"{variant}-s{seed}"
            overrides = [*common, *map(str, spec.get("overrides", [])), f"train.seed={seed}",
                         f"train.out_dir={out_dir / name}", f"train.name={run_dir.name}", "train.progress=false"]
            runs.append(Run(variant, seed, overrides, run_dir))
    config = raw.get("config")
    if config is not None:  # resolved now, so every run's `meshlm train --config` finds it from any directory
        try:
            config = str(find_config(config))
        except ConfigError as err:
            raise ConfigError(f"study {path}: {err}") from None
    study = Study(name, out_dir, config, runs, list(map(str, raw.get("eval", []))),
                  list(map(str, raw.get("probe", []))), shlex.split(raw.get("launcher", "")),
                  float(raw.get("assumed_mfu", 0.4)), float(raw.get("peak_flops", 0.0)), int(raw.get("gpus", 1)))
    for run in runs:
        train_config(study, run)  # fail now, not after hours of training, if any run's config is invalid
    return study


def train_config(study: Study, run: Run):
    return load_config(study.config, run.overrides)


def planning_peak(study: Study) -> tuple[float, str]:
    """The per-device peak FLOP/s the estimates divide by, and where it comes from."""
    if study.peak_flops > 0:
        return study.peak_flops, "the study's peak_flops"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device_peak(device, choose("auto", device).dtype)


def estimate(study: Study, run: Run, peak: float | None = None) -> dict[str, Any]:
    """Tokens, training FLOPs and device-hours of one run (at the study's assumed MFU of `peak`)."""
    cfg = train_config(study, run)
    model_cfg, _ = resolve_model(cfg)  # init_from: the folder's model
    seq_len = cfg.sequence_length(model_cfg)
    if holds_tasks(cfg.data):  # one example per window: the task data's block (generated once, cached)
        seq_len = window_length(read_manifest(data_folder(cfg.data)), cfg.seq_len)
    steps = cfg.total_steps(model_cfg)
    tokens = steps * cfg.global_batch * seq_len
    acc = describe(model_cfg, seq_len)
    flops = tokens * acc.train_flops_per_token
    return {"run": run.name, "steps": steps, "tokens": tokens, "non_embedding_params": acc.non_embedding_params,
            "unrolled_layers": acc.unrolled_layers, "train_flops": flops,
            "gpu_hours": flops / ((peak or planning_peak(study)[0]) * study.assumed_mfu) / 3600}


def duration(hours: float) -> str:
    """Hours as a reader wants them: "2.5 h", "14 min" or "40 s" (a CPU study's runs take minutes, not 0.0 h)."""
    if hours >= 1:
        return f"{hours:.1f} h"
    return f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * 3600:.0f} s"


def plan_table(study: Study) -> str:
    peak, source = planning_peak(study)
    rows = [estimate(study, run, peak) for run in study.runs]
    lines = [f"study {study.name}: {len(rows)} runs -> {study.dir}",
             f"{'run':<28} {'non-emb params':>15} {'layers':>6} {'steps':>7} {'tokens':>14} {'train FLOPs':>12} "
             f"{'GPU time':>9} {'wall':>8}"]
    for r in rows:
        lines.append(f"{r['run']:<28} {r['non_embedding_params']:>15,} {r['unrolled_layers']:>6} {r['steps']:>7,} "
                     f"{r['tokens']:>14,} {r['train_flops']:>12.3e} {duration(r['gpu_hours']):>9} "
                     f"{duration(r['gpu_hours'] / study.gpus):>8}")
    total = sum(r["gpu_hours"] for r in rows)
    lines.append(f"GPU-hours in all: {total:.3g} ({duration(total / study.gpus)} on {study.gpus} GPU(s)) at "
                 f"{study.assumed_mfu:.0%} MFU of {peak:.3g} FLOP/s per device ({source}; set peak_flops, gpus "
                 "and assumed_mfu in the study file)")
    return "\n".join(lines)


def meshlm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshlm.cli", *args]


def execute(study: Study, log=print, jobs: int = 1, keep_going: bool = False) -> None:
    """Train, evaluate and probe every run that is not finished yet, `jobs` runs at a time, then write the
    results page. With jobs > 1 each run's processes get OMP_NUM_THREADS = cores // jobs (unless set), and on a
    machine with several GPUs (and no launcher) the runs are spread over them, one GPU per job slot.

    After a failed run no new run starts (with `keep_going`, the others still do), the running ones finish,
    and the first error is raised; after an interrupt the running ones stop on the forwarded signal."""
    todo = []
    for i, run in enumerate(study.runs, 1):
        if _evaluated(run) and (run.dir / "probe" / "probe.json").is_file():
            log(f"[{i}/{len(study.runs)}] {run.name}: done, skipped")
        else:
            todo.append((i, run))
    queue, lock, errors = list(reversed(todo)), threading.Lock(), []

    def worker(slot: int) -> None:
        env = job_environment(slot, jobs, bool(study.launcher))
        while True:
            with lock:
                if (errors and not keep_going) or children.received or not queue:
                    return
                i, run = queue.pop()
            try:
                _run_stages(study, run, f"[{i}/{len(study.runs)}]", children, env, log)
            except Exception as err:  # noqa: BLE001 — Interrupted included; raised from the main thread below
                with lock:
                    errors.append(err)
                if not isinstance(err, Interrupted):
                    log(f"[{i}/{len(study.runs)}] {run.name}: failed: {err}")

    with Children() as children:
        threads = [threading.Thread(target=worker, args=(slot,), daemon=True) for slot in range(min(jobs, len(todo)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join with a timeout: the main thread stays free to take Ctrl-C
                thread.join(0.2)
    write_results(study)
    interrupted = [err for err in errors if isinstance(err, Interrupted)]
    if interrupted or errors:
        raise (interrupted or errors)[0]


def _run_stages(study: Study, run: Run, tag: str, children: Children, env: dict[str, str], log) -> None:
    """train → eval → probe for one run, each stage its own `meshlm` process."""
    log(f"{tag} {run.name}: training")
    start = time.perf_counter()
    train = meshlm_command("train", "--resume", *(["--config", study.config] if study.config else []),
                           *run.overrides)
    _check_call(study.launcher + train[1:] if study.launcher else train, run, "train", children, env)
    _record_wall_time(run, time.perf_counter() - start)
    log(f"{tag} {run.name}: evaluating and probing")
    _check_call(meshlm_command("eval", str(run.dir), *study.eval_args), run, "eval", children, env)
    _check_call(meshlm_command("probe", str(run.dir), *study.probe_args), run, "probe", children, env)


def job_environment(slot: int, jobs: int, launcher: bool) -> dict[str, str]:
    """Environment for one job slot's processes: its share of the cores and, with several GPUs, its GPU."""
    env = {}
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    if not launcher and "CUDA_VISIBLE_DEVICES" not in os.environ:
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % torch.cuda.device_count())
    return env


def _evaluated(run: Run) -> bool:
    """eval.json is there and complete (meshlm eval writes it after each stage, "complete": false until done)."""
    try:
        return json.loads((run.dir / "eval.json").read_text()).get("complete", True) is not False
    except (OSError, ValueError):
        return False


def _check_call(command: list[str], run: Run, stage: str, children: Children, env: dict[str, str]) -> None:
    """Run one stage in its own session, so Ctrl-C reaches it once, from here: a training run then saves its
    current step; the study stops with advice to run it again (which resumes where it stopped)."""
    run.dir.mkdir(parents=True, exist_ok=True)
    with open(run.dir / f"{stage}.log", "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env} if env else None)
        code = children.wait(proc)
    signum = children.received[0] if children.received else None
    if signum is not None or code in (130, 143, -signal.SIGINT, -signal.SIGTERM):
        saved = " (its current step is saved)" if stage == "train" and code in (130, 143) else ""
        raise Interrupted(f"{stage} of {run.name} stopped{saved}; run the same `meshlm reproduce` command again: "
                          f"finished runs are skipped and {run.name} continues from its last checkpoint",
                          signum or (code - 128 if code > 0 else -code))
    if code:
        raise MeshlmError(f"{stage} of {run.name} failed (exit {code}); see {run.dir / f'{stage}.log'}, fix it and "
                          f"run the study again (finished runs are skipped)")


class Children:
    """The stage processes running now. While open (in the main thread), SIGINT and SIGTERM are passed on to
    every one of them (a second Ctrl-C reaches them too, and aborts them at once); `received` lists the
    signals that came."""

    def __init__(self):
        self.running: set[subprocess.Popen] = set()
        self.received: list[int] = []
        self._lock = threading.Lock()
        self._previous = {}

    def __enter__(self) -> Children:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
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


def _record_wall_time(run: Run, seconds: float) -> None:
    """Wall time of training, summed over resumed attempts."""
    path = run.dir / "study.json"
    previous = json.loads(path.read_text()).get("train_seconds", 0.0) if path.is_file() else 0.0
    atomic.write_text(path, json.dumps({"variant": run.variant, "seed": run.seed, "train_seconds": previous + seconds}))


# -- results -------------------------------------------------------------------------------------------------
def run_row(run: Run) -> dict[str, Any] | None:
    path = run.dir / "eval.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    wall = json.loads((run.dir / "study.json").read_text()) if (run.dir / "study.json").is_file() else {}
    downstream = result.get("downstream", {}).get("0", {})
    return {"variant": run.variant, "seed": run.seed, "spec": result["model"]["spec"],
            "slots": (result["model"].get("scheme_options") or {}).get("slots"),
            "scheme": result["model"]["scheme"],
            "non_embedding_params": result["accounting"]["non_embedding_params"],
            "ppl": result["perplexity"]["ppl"], "avg_acc": downstream.get("average"),
            "avg_tasks": downstream.get("covered", len(downstream.get("tasks", {}))),
            "train_seconds": wall.get("train_seconds")}


def mean_std(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def probe_row(run: Run) -> dict[str, list[float]] | None:
    """The probe numbers the paper argues from, for a looped run: per loop step t = 1..K the relative update
    of the core pass, the RBF CKA between consecutive loop states h^{t-1} -> h^t, and the effective rank of
    h^t (each the mean over the probed samples)."""
    path = run.dir / "probe" / "probe.json"
    if not path.is_file():
        return None
    probe = json.loads(path.read_text())
    loops = [i for i, name in enumerate(probe["blocks"]) if name.startswith("loop")]
    states = [i for i, name in enumerate(probe["stages"]) if name.startswith("h")]  # h0 … hK
    if len(states) < 3:  # vanilla (one "loop" of all layers) or K = 1: nothing to compare across steps
        return None
    cka, rank = probe["cka_rbf"]["mean"], probe["effective_rank"]["mean"]
    return {"update": [probe["update_core"]["mean"][i] for i in loops],
            "cka": [cka[a][b] for a, b in zip(states, states[1:])],
            "rank": [rank[i] for i in states[1:]]}


def loops_row(run: Run) -> dict[int, float]:
    """Validation loss by evaluated loop count K' (eval.json's loss vs. depth), {} if not evaluated."""
    path = run.dir / "eval.json"
    rows = json.loads(path.read_text()).get("loops") or [] if path.is_file() else []
    return {r["loops"]: r["loss"] for r in rows}


def _per_step(rows: list[list[float]], digits: int = 2) -> str:
    """Mean ± std over runs of each step's value, steps joined by ' → '."""
    return " → ".join(mean_std([row[t] for row in rows], digits) for t in range(min(map(len, rows))))


def probes_markdown(study: Study) -> list[str]:
    by_variant: dict[str, list[dict]] = {}
    for run in study.runs:
        if (row := probe_row(run)) is not None:
            by_variant.setdefault(run.variant, []).append(row)
    if not by_variant:
        return []
    lines = ["", "Probes of the loop states (mean ± std over seeds of the per-run means; t = 1 … K):", "",
             "| variant | runs | relative update of core pass t | CKA (RBF) h^(t-1) → h^t | effective rank of h^t |",
             "|---|---|---|---|---|"]
    for variant, rows in by_variant.items():
        lines.append(f"| {variant} | {len(rows)} | {_per_step([r['update'] for r in rows])} | "
                     f"{_per_step([r['cka'] for r in rows])} | {_per_step([r['rank'] for r in rows], 1)} |")
    return lines


def paired_markdown(study: Study) -> list[str]:
    """Validation-loss differences between variants trained with the same seeds (same data order), per seed:
    a difference that has one sign on every seed says more than overlapping mean ± std."""
    loss: dict[str, dict[int, float]] = {}
    for run in study.runs:
        if (path := run.dir / "eval.json").is_file():
            loss.setdefault(run.variant, {})[run.seed] = json.loads(path.read_text())["perplexity"]["loss"]
    lines = []
    for a, b in itertools.combinations([v for v in loss if len(loss[v]) >= 2], 2):
        seeds = sorted(set(loss[a]) & set(loss[b]))
        if len(seeds) < 2:
            continue
        diffs = [loss[a][s] - loss[b][s] for s in seeds]
        lines.append(f"| {a} − {b} | {len(seeds)} | {mean_std(diffs)} | "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)} | {sum(d < 0 for d in diffs)}/{len(seeds)} |")
    if not lines:
        return []
    return ["", "Paired by seed (same data order): validation loss of one variant minus another (nats/token):", "",
            "| pair | seeds | mean ± std | per seed | first lower |", "|---|---|---|---|---|", *lines]


def loops_markdown(study: Study) -> list[str]:
    by_variant: dict[str, list[dict[int, float]]] = {}
    for run in study.runs:
        if row := loops_row(run):
            by_variant.setdefault(run.variant, []).append(row)
    counts = sorted({k for rows in by_variant.values() for row in rows for k in row})
    if not counts:
        return []
    lines = ["", "Validation loss vs. loop count K' at evaluation (mean ± std over seeds):", "",
             "| variant | " + " | ".join(f"K' = {k}" for k in counts) + " |", "|---|" + "---|" * len(counts)]
    for variant, rows in by_variant.items():
        cells = [mean_std([row[k] for row in rows if k in row]) for k in counts]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def reasoning_markdown(study: Study) -> list[str]:
    """The reasoning suite's tables (meshlm.analysis.reasoning_report), for runs trained on task data."""
    groups: dict[str, list[dict]] = {}
    for run in study.runs:
        path = run.dir / "eval.json"
        if path.is_file() and (result := json.loads(path.read_text()).get("reasoning")):
            groups.setdefault(run.variant, []).append(result)
    return reasoning_report.markdown(list(groups.items()))


def results_markdown(study: Study) -> str:
    rows = [r for r in (run_row(run) for run in study.runs) if r is not None]
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    lines = [f"# Study `{study.name}`", "",
             "| variant | spec | scheme | non-emb params | seeds | val PPL (mean ± std) | 0-shot avg acc | "
             "train wall time / run |", "|---|---|---|---|---|---|---|---|"]
    for variant, rs in by_variant.items():
        accs = [r["avg_acc"] for r in rs if r["avg_acc"] is not None]
        covered = sorted({r["avg_tasks"] for r in rs if r["avg_acc"] is not None})  # each average says its tasks
        acc = f"{mean_std(accs)} ({'/'.join(map(str, covered))} of {PAPER_TASKS} tasks)" if accs else mean_std(accs)
        walls = [r["train_seconds"] for r in rs if r["train_seconds"]]
        lines.append(f"| {variant} | `{rs[0]['spec']}` | {rs[0]['scheme']} | {rs[0]['non_embedding_params']:,} | "
                     f"{len(rs)} | {mean_std([r['ppl'] for r in rs])} | {acc} | "
                     f"{(statistics.mean(walls) / 60 if walls else 0):.1f} min |")
    mesh = [r for r in rows if r["scheme"] == "mesh"]
    if len({r["slots"] for r in mesh}) > 1:  # a buffer-size ablation (paper Table 3)
        lines += ["", "Buffer size (MeSH):", "", "| B | runs | val PPL |", "|---|---|---|"]
        for slots in sorted({r["slots"] for r in mesh}, key=lambda s: (s is not None, s or 0)):
            rs = [r for r in mesh if r["slots"] == slots]
            label = slots if slots else "K+3 (default)"
            lines.append(f"| {label} | {len(rs)} | {mean_std([r['ppl'] for r in rs])} |")
    lines += paired_markdown(study) + loops_markdown(study) + reasoning_markdown(study) + probes_markdown(study)
    lines += ["", f"Per-run numbers: `{study.dir}/*/eval.json`; probe figures: `{study.dir}/*/probe/`; "
              f"full report with overlaid probes: `{study.dir}/report.html`."]
    return "\n".join(lines) + "\n"


def write_results(study: Study) -> Path:
    study.dir.mkdir(parents=True, exist_ok=True)
    out = study.dir / "results.md"
    atomic.write_text(out, results_markdown(study))
    finished = [str(run.dir) for run in study.runs if (run.dir / "eval.json").is_file()]
    if finished:
        subprocess.check_call(meshlm_command("report", *finished, "--out", str(study.dir / "report.html")),
                              stdout=subprocess.DEVNULL)
    return out
