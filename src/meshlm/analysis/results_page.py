"""A study's results page: `results.md` beside its runs (and `report.html` from `meshlm report`).

Each run's eval.json, probe.json and study.json (its training wall time) are read once
(`read_runs`); every table is built from those records:

- Table 1: per variant, spec, scheme, non-embedding parameters, seeds, validation perplexity and
  the 0-shot average accuracy (mean ± std over seeds) and training wall time per run;
- buffer size B for MeSH variants that differ only in B (paper Table 3);
- validation-loss differences paired by seed; loss vs. loop count K'; the reasoning suite's tables
  (meshlm.analysis.reasoning_report); and the probes of the loop states.
"""
from __future__ import annotations

import itertools
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm import atomic
from meshlm.analysis import reasoning_report
from meshlm.analysis.stats import mean_std
from meshlm.analysis.study import Run, Study, meshlm_command
from meshlm.evaluation.results import EvalResult, ProbeResult, read_eval, read_probe
from meshlm.evaluation.tasks import PAPER_TASKS

WALL_TIME = "study.json"  # in each run folder: {"variant", "seed", "train_seconds"}


@dataclass
class RunRecord:
    """What one run of a study left: its evaluation, its probes, its training wall time."""

    run: Run
    eval: EvalResult | None
    probe: ProbeResult | None
    train_seconds: float | None

    @property
    def variant(self) -> str:
        return self.run.variant


def read_runs(study: Study) -> list[RunRecord]:
    """Every run's results, each file read once."""
    return [RunRecord(run, read_eval(run.dir / "eval.json"),
                      read_probe(run.dir / "probe" / "probe.json"), staged_wall_time(run))
            for run in study.runs]


def record_wall_time(run: Run, seconds: float) -> None:
    """Wall time of training, summed over resumed attempts."""
    previous = wall_time(run) or 0.0
    record = {"variant": run.variant, "seed": run.seed, "train_seconds": previous + seconds}
    atomic.write_text(run.dir / WALL_TIME, json.dumps(record))


def wall_time(run: Run) -> float | None:
    path = run.dir / WALL_TIME
    return json.loads(path.read_text()).get("train_seconds") if path.is_file() else None


def staged_wall_time(run: Run) -> float | None:
    """Training time of the run and of every earlier stage it starts from (a variant's `from`):
    what its model cost. None while the run itself has none."""
    own = wall_time(run)
    if own is None or run.source is None:
        return own
    return own + (staged_wall_time(run.source) or 0.0)


def _by_variant(records: list[RunRecord], keep) -> dict[str, list[RunRecord]]:
    """The records `keep` accepts, grouped by variant (in the study's order)."""
    out: dict[str, list[RunRecord]] = {}
    for record in records:
        if keep(record):
            out.setdefault(record.variant, []).append(record)
    return out


def run_row(record: RunRecord) -> dict[str, Any]:
    """The Table-1 numbers of an evaluated run."""
    result = record.eval
    downstream = result.downstream.get("0")
    return {"variant": record.variant, "seed": record.run.seed, "spec": result.model["spec"],
            "slots": (result.model.get("scheme_options") or {}).get("slots"),
            "scheme": result.model["scheme"],
            "non_embedding_params": result.accounting["non_embedding_params"],
            "ppl": result.perplexity.ppl, "avg_acc": downstream.average if downstream else None,
            "avg_tasks": downstream.covered if downstream else 0,
            "train_seconds": record.train_seconds}


def probe_row(probe: ProbeResult) -> dict[str, list[float]] | None:
    """The probe numbers the paper argues from, for a looped run: per loop step t = 1..K the
    relative update of the core pass, the RBF CKA between consecutive loop states h^{t-1} -> h^t,
    and the effective rank of h^t (each the mean over the probed samples)."""
    loops = [i for i, name in enumerate(probe.blocks) if name.startswith("loop")]
    states = [i for i, name in enumerate(probe.stages) if name.startswith("h")]  # h0 … hK
    if len(states) < 3:  # vanilla (one "loop" of all layers) or K = 1: no steps to compare
        return None
    cka, rank = probe.cka_rbf.mean, probe.effective_rank.mean
    return {"update": [probe.update_core.mean[i] for i in loops],
            "cka": [cka[a][b] for a, b in zip(states, states[1:])],
            "rank": [rank[i] for i in states[1:]]}


def _per_step(rows: list[list[float]], digits: int = 2) -> str:
    """Mean ± std over runs of each step's value, steps joined by ' → '."""
    steps = range(min(map(len, rows)))
    return " → ".join(mean_std([row[t] for row in rows], digits) for t in steps)


def probes_markdown(records: list[RunRecord]) -> list[str]:
    looped = _by_variant(records, lambda r: r.probe and probe_row(r.probe))
    rows = {variant: [probe_row(r.probe) for r in rs] for variant, rs in looped.items()}
    if not rows:
        return []
    lines = ["", "Probes of the loop states (mean ± std over seeds of the per-run means; "
             "t = 1 … K):", "", "| variant | runs | relative update of core pass t | "
             "CKA (RBF) h^(t-1) → h^t | effective rank of h^t |", "|---|---|---|---|---|"]
    for variant, rs in rows.items():
        lines.append(f"| {variant} | {len(rs)} | {_per_step([r['update'] for r in rs])} | "
                     f"{_per_step([r['cka'] for r in rs])} | "
                     f"{_per_step([r['rank'] for r in rs], 1)} |")
    return lines


def paired_markdown(records: list[RunRecord]) -> list[str]:
    """Validation-loss differences between variants trained with the same seeds (same data order),
    per seed: a difference that has one sign on every seed says more than overlapping mean ± std."""
    loss = {variant: {r.run.seed: r.eval.perplexity.loss for r in rs}
            for variant, rs in _by_variant(records, lambda r: r.eval).items()}
    lines = []
    for a, b in itertools.combinations([v for v in loss if len(loss[v]) >= 2], 2):
        seeds = sorted(set(loss[a]) & set(loss[b]))
        if len(seeds) < 2:
            continue
        diffs = [loss[a][s] - loss[b][s] for s in seeds]
        lines.append(f"| {a} − {b} | {len(seeds)} | {mean_std(diffs)} | "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)} | "
                     f"{sum(d < 0 for d in diffs)}/{len(seeds)} |")
    if not lines:
        return []
    return ["", "Paired by seed (same data order): validation loss of one variant minus another "
            "(nats/token):", "", "| pair | seeds | mean ± std | per seed | first lower |",
            "|---|---|---|---|---|", *lines]


def loops_markdown(records: list[RunRecord]) -> list[str]:
    """Validation loss by evaluated loop count K' (eval.json's loss vs. depth)."""
    rows = {variant: [{row.loops: row.loss for row in r.eval.loops} for r in rs]
            for variant, rs in _by_variant(records, lambda r: r.eval and r.eval.loops).items()}
    counts = sorted({k for variant_rows in rows.values() for row in variant_rows for k in row})
    if not counts:
        return []
    lines = ["", "Validation loss vs. loop count K' at evaluation (mean ± std over seeds):", "",
             "| variant | " + " | ".join(f"K' = {k}" for k in counts) + " |",
             "|---|" + "---|" * len(counts)]
    for variant, variant_rows in rows.items():
        cells = [mean_std([row[k] for row in variant_rows if k in row]) for k in counts]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def reasoning_markdown(records: list[RunRecord]) -> list[str]:
    """The reasoning suite's tables (meshlm.analysis.reasoning_report), for runs trained on task
    data."""
    groups = _by_variant(records, lambda r: r.eval and r.eval.reasoning)
    return reasoning_report.markdown([(variant, [r.eval.reasoning for r in rs])
                                      for variant, rs in groups.items()])


def table_one(records: list[RunRecord]) -> list[str]:
    """Table 1 (per variant) and, for MeSH variants that differ in B, the buffer-size table."""
    rows = [run_row(r) for r in records if r.eval is not None]
    lines = ["| variant | spec | scheme | non-emb params | seeds | val PPL (mean ± std) | "
             "0-shot avg acc | train wall time / run |", "|---|---|---|---|---|---|---|---|"]
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    for variant, rs in by_variant.items():
        accs = [r["avg_acc"] for r in rs if r["avg_acc"] is not None]
        # each average says how many tasks it covers
        covered = sorted({r["avg_tasks"] for r in rs if r["avg_acc"] is not None})
        acc = (f"{mean_std(accs)} ({'/'.join(map(str, covered))} of {PAPER_TASKS} tasks)" if accs
               else mean_std(accs))
        walls = [r["train_seconds"] for r in rs if r["train_seconds"]]
        lines.append(f"| {variant} | `{rs[0]['spec']}` | {rs[0]['scheme']} | "
                     f"{rs[0]['non_embedding_params']:,} | {len(rs)} | "
                     f"{mean_std([r['ppl'] for r in rs])} | {acc} | "
                     f"{(statistics.mean(walls) / 60 if walls else 0):.1f} min |")
    return lines + _buffer_sizes([r for r in rows if r["scheme"] == "mesh"])


def _buffer_sizes(mesh: list[dict]) -> list[str]:
    if len({r["slots"] for r in mesh}) <= 1:
        return []
    lines = ["", "Buffer size (MeSH):", "", "| B | runs | val PPL |", "|---|---|---|"]
    for slots in sorted({r["slots"] for r in mesh}, key=lambda s: (s is not None, s or 0)):
        rs = [r for r in mesh if r["slots"] == slots]
        label = slots if slots else "K+3 (default)"
        lines.append(f"| {label} | {len(rs)} | {mean_std([r['ppl'] for r in rs])} |")
    return lines


def results_markdown(study: Study) -> str:
    records = read_runs(study)
    lines = [f"# Study `{study.name}`", "", *table_one(records)]
    lines += (paired_markdown(records) + loops_markdown(records) + reasoning_markdown(records)
              + probes_markdown(records))
    lines += ["", f"Per-run numbers: `{study.dir}/*/eval.json`; probe figures: "
              f"`{study.dir}/*/probe/`; full report with overlaid probes: "
              f"`{study.dir}/report.html`."]
    return "\n".join(lines) + "\n"


def write_results(study: Study) -> Path:
    study.dir.mkdir(parents=True, exist_ok=True)
    out = study.dir / "results.md"
    atomic.write_text(out, results_markdown(study))
    finished = [str(run.dir) for run in study.runs if (run.dir / "eval.json").is_file()]
    if finished:
        report = meshlm_command("report", *finished, "--out", str(study.dir / "report.html"))
        subprocess.check_call(report, stdout=subprocess.DEVNULL)
    return out
