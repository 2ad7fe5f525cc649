"""A study file of `meshlm reproduce`: variants × seeds trained at matched depth and tokens,
evaluated, probed and reported, as a plan of runs from one YAML file.

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
      mesh-long: {from: mesh, overrides: [train.steps=400]}  # a second stage (below)
    eval: [--tasks, none, --limit, "200"]   # extra `meshlm eval` arguments
    probe: [--samples, "50"]                # extra `meshlm probe` arguments

`launcher` (e.g. `torchrun --nproc_per_node=8`) prefixes training for multi-GPU studies. Before
anything runs, the plan is printed with each run's tokens, training FLOPs and an estimate of its
accelerator-hours (`plan_table`).

A variant with `from: <variant>` is a later stage of training: each seed's run starts from the
newest checkpoint of that variant's run with the same seed (`train.init_from`), which is planned
too (whatever `--only` selects) and trained first. Its model is its source's: the study's `model.*`
overrides do not apply to it, only its own. The results page counts the sources' training time in
its wall time.

The study's three parts: this file (the study file → a plan), meshlm.analysis.study_runner (every
stage its own `meshlm` process: threads, signals, resuming) and meshlm.analysis.results_page (the
Markdown page, with mean ± std over seeds).
"""
from __future__ import annotations

import fnmatch
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshlm.data.shards import read_manifest
from meshlm.data.tasks import data_folder, holds_tasks, window_length
from meshlm.errors import ConfigError
from meshlm.folders.integrity import holds_checkpoints
from meshlm.model.accounting import describe
from meshlm.runtime.peaks import device_peak
from meshlm.runtime.precision import choose
from meshlm.train.config import find_config, load_config
from meshlm.train.plan import resolve_model
from meshlm.yaml_files import load_yaml

STUDY_KEYS = {"name", "out_dir", "config", "overrides", "seeds", "variants", "eval", "probe",
              "launcher",
              "assumed_mfu", "peak_flops", "gpus"}
VARIANT_KEYS = {"overrides", "seeds", "from"}


@dataclass
class Run:
    variant: str
    seed: int
    overrides: list[str]
    dir: Path
    source: Run | None = None  # the run whose newest checkpoint this one starts from (`from`)

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
    peak_flops: float = 0.0  # one device's peak FLOP/s; 0: this machine's (meshlm.runtime.peaks: a
    # GPU's datasheet bf16 peak, or the CPU's measured one), so a CPU study's plan is in CPU time
    gpus: int = 1  # GPUs per run (what the launcher starts)

    @property
    def dir(self) -> Path:
        return self.out_dir / self.name


def load_study(path: str | Path, extra_overrides: list[str] = (), only: str | None = None,
               seeds: list[int] | None = None) -> Study:
    """Parse and check a study file (a path, or a shipped name such as studies/quick.yaml); every
    problem goes into one ConfigError. `only`: comma-separated variant names or shell patterns
    ('chase-*') to keep; `seeds`: these seeds instead of the file's (for every variant)."""
    path = find_config(path, "study file")
    raw = load_yaml(path, "study file ")
    problems = [f"unknown key {k!r} (valid: {sorted(STUDY_KEYS)})"
                for k in sorted(set(raw or {}) - STUDY_KEYS)]
    raw = raw or {}
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not variants:
        problems.append("`variants` must map at least one variant name to {overrides: [...]}")
        variants = {}
    study_seeds = raw.get("seeds", [0]) if seeds is None else seeds
    if not (isinstance(study_seeds, list) and study_seeds
            and all(isinstance(s, int) for s in study_seeds)):
        problems.append(f"`seeds` must be a non-empty list of integers, not {study_seeds!r}")
    problems += stage_problems(variants)
    selected = variants
    if only is not None and variants:
        selected = selected_variants(variants, only, problems)
    if problems:
        raise ConfigError(f"study {path}: " + "; ".join(problems))
    name = str(raw.get("name") or path.stem)
    out_dir = Path(raw.get("out_dir", "runs/studies"))
    common = [*map(str, raw.get("overrides", [])), *extra_overrides]
    runs = plan_runs(variants, out_dir / name, common, study_seeds, seeds, list(selected))
    study = Study(name, out_dir, shared_config(raw.get("config"), path), runs,
                  list(map(str, raw.get("eval", []))),
                  list(map(str, raw.get("probe", []))), shlex.split(raw.get("launcher", "")),
                  float(raw.get("assumed_mfu", 0.4)), float(raw.get("peak_flops", 0.0)),
                  int(raw.get("gpus", 1)))
    for run in runs:
        # fail now, not after hours of training, if any run's config is invalid
        train_config(study, run)
    return study


def selected_variants(variants: dict, only: str, problems: list[str]) -> dict:
    """The variants whose names match one of `only`'s comma-separated names or shell patterns
    (none matching: a problem appended)."""
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    kept = {v: spec
            for v, spec in variants.items() if any(fnmatch.fnmatchcase(v, p) for p in patterns)}
    if not kept:
        problems.append(f"--only {only!r} matches no variant (variants: {', '.join(variants)})")
    return kept


def stage_problems(variants: dict) -> list[str]:
    """What is wrong with the variants' `from` (a name not in the study, a cycle) and their keys."""
    problems = []
    for variant, spec in variants.items():
        unknown = sorted(set(spec or {}) - VARIANT_KEYS)
        if unknown:
            problems.append(f"variant {variant}: unknown key {unknown[0]!r} (valid: "
                            f"{sorted(VARIANT_KEYS)})")
        seen, current = [variant], (spec or {}).get("from")
        while current is not None:
            if current not in variants:
                problems.append(f"variant {seen[-1]}: `from: {current}` names no variant of this "
                                f"study (variants: {', '.join(variants)})")
                break
            if current in seen:
                problems.append(f"variant {variant}: `from` goes round in a circle "
                                f"({' -> '.join([*seen, current])})")
                break
            seen.append(current)
            current = (variants[current] or {}).get("from")
    return problems


def plan_runs(variants: dict, study_dir: Path, common: list[str], seeds: list[int],
              given_seeds: list[int] | None, selected: list[str] | None = None) -> list[Run]:
    """Every selected variant × seed as a run in <study_dir>/<variant>-s<seed>: the study's
    overrides, then the variant's, then its seed, folder and name. A variant's own seeds replace
    the study's, and `given_seeds` (--seeds) replace both. A variant with `from` gets its source's
    run of the same seed planned before it, and starts from it (module docstring)."""
    runs: dict[tuple[str, int], Run] = {}

    def plan(variant: str, seed: int) -> Run:
        if (variant, seed) not in runs:
            spec = variants[variant] or {}
            source = plan(spec["from"], seed) if spec.get("from") else None
            run_dir = study_dir / f"{variant}-s{seed}"
            shared = common if source is None else [o for o in common if not o.startswith("model.")]
            start = [f"train.init_from={source.dir}"] if source else []
            overrides = [*shared, *map(str, spec.get("overrides", [])), *start,
                         f"train.seed={seed}", f"train.out_dir={study_dir}",
                         f"train.name={run_dir.name}", "train.progress=false"]
            runs[variant, seed] = Run(variant, seed, overrides, run_dir, source)
        return runs[variant, seed]

    for variant in selected or list(variants):
        for seed in (given_seeds or (variants[variant] or {}).get("seeds", seeds)):
            plan(variant, seed)
    return list(runs.values())


def shared_config(config: str | None, path: Path) -> str | None:
    """The study's train config resolved now, so every run's `meshlm train --config` finds it from
    any directory (None: none)."""
    if config is None:
        return None
    try:
        return str(find_config(config))
    except ConfigError as err:
        raise ConfigError(f"study {path}: {err}") from None


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
    model_cfg = planned_model(study, run)
    seq_len = cfg.sequence_length(model_cfg)
    # one example per window: the task data's block (generated once, cached)
    if holds_tasks(cfg.data):
        seq_len = window_length(read_manifest(data_folder(cfg.data)), cfg.seq_len)
    steps = cfg.total_steps(model_cfg)
    tokens = steps * cfg.global_batch * seq_len
    acc = describe(model_cfg, seq_len)
    flops = tokens * acc.train_flops_per_token
    return {"run": run.name, "steps": steps, "tokens": tokens,
            "non_embedding_params": acc.non_embedding_params,
            "unrolled_layers": acc.unrolled_layers, "train_flops": flops,
            "gpu_hours": flops / ((peak or planning_peak(study)[0]) * study.assumed_mfu) / 3600}


def planned_model(study: Study, run: Run):
    """The model `run` trains: its config's, or init_from's; a later stage whose source has no
    checkpoint yet, its source's."""
    source = run
    while source.source is not None and not holds_checkpoints(source.source.dir):
        source = source.source
    return resolve_model(train_config(study, source))[0]


def duration(hours: float) -> str:
    """Hours as a reader wants them: "2.5 h", "14 min" or "40 s" (a CPU study's runs take minutes,
    not 0.0 h)."""
    if hours >= 1:
        return f"{hours:.1f} h"
    return f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * 3600:.0f} s"


def plan_table(study: Study) -> str:
    peak, source = planning_peak(study)
    rows = [estimate(study, run, peak) for run in study.runs]
    lines = [f"study {study.name}: {len(rows)} runs -> {study.dir}",
             f"{'run':<28} {'non-emb params':>15} {'layers':>6} {'steps':>7} {'tokens':>14} "
             f"{'train FLOPs':>12} {'GPU time':>9} {'wall':>8}"]
    for r in rows:
        lines.append(f"{r['run']:<28} {r['non_embedding_params']:>15,} {r['unrolled_layers']:>6} "
                     f"{r['steps']:>7,} {r['tokens']:>14,} {r['train_flops']:>12.3e} "
                     f"{duration(r['gpu_hours']):>9} {duration(r['gpu_hours'] / study.gpus):>8}")
    total = sum(r["gpu_hours"] for r in rows)
    lines.append(f"GPU-hours in all: {total:.3g} ({duration(total / study.gpus)} on {study.gpus} "
                 f"GPU(s)) at {study.assumed_mfu:.0%} MFU of {peak:.3g} FLOP/s per device "
                 f"({source}; set peak_flops, gpus and assumed_mfu in the study file)")
    return "\n".join(lines)


def meshlm_command(*args: str) -> list[str]:
    """A `meshlm` command line run by this interpreter (what every stage of a study runs)."""
    return [sys.executable, "-m", "meshlm.cli", *args]
