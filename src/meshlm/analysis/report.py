"""`meshlm report RUN…`: one self-contained HTML page comparing runs (images inlined as base64 PNG).

Per run it reads what `meshlm eval` and `meshlm probe` left in the run folder (eval.json,
probe/probe.json) and the model config (from those files, else from the run's checkpoint). Sections:

1. Table 1 of the paper, once per few-shot setting: variant, spec, non-embedding parameters,
   validation perplexity, each task's paper metric (acc or acc_norm, %) and their average (its
   header says how many of the nine tasks it covers); best value per column bold. Without downstream
   results the table still shows perplexity: `meshlm eval`'s, else the trainer's last validation
   (marked †).
2. Training and validation loss against tokens seen, every run (from its metrics.jsonl).
3. Loss vs. loop count (figure and table).
4. Probes overlaid per variant: relative updates, consecutive-stage CKA, effective rank, spectra,
   CKA heatmaps and MeSH routing (meshlm.analysis.plots).
5. Notes: what is missing for which run (and the command that produces it), and runs scored with
   --limit.
"""
from __future__ import annotations

import datetime
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from meshlm import atomic
from meshlm.analysis import plots, reasoning_report
from meshlm.analysis.report_html import cells, html_page, img, percent, table
from meshlm.config import ModelConfig
from meshlm.errors import MeshlmError
from meshlm.evaluation.results import (
    DepthRow,
    EvalResult,
    ExitRow,
    ProbeResult,
    Reasoning,
    Suite,
    read_eval,
    read_probe,
)
from meshlm.evaluation.tasks import PAPER_TASKS
from meshlm.folders import integrity
from meshlm.model.accounting import describe

TASK_TITLES = {"lambada_openai": "LAMBADA", "piqa": "PIQA", "hellaswag": "HellaSwag",
               "winogrande": "WinoGrande",
               "arc_easy": "ARC-E", "arc_challenge": "ARC-C", "sciq": "SciQ", "mmlu": "MMLU",
               "lambada_standard": "LAMBADA-std"}


class ReportError(MeshlmError):
    """A run folder with nothing to report."""


@dataclass
class RunResults:
    name: str
    path: Path
    model: dict | None
    eval: EvalResult | None
    probe: ProbeResult | None
    curves: dict = field(default_factory=dict)  # {"train": [(tokens, loss)], "val": [(tokens,
    # loss)]}

    @property
    def ppl(self) -> tuple[float | None, str]:
        """Validation perplexity and its source: `meshlm eval`'s, else the trainer's last
        validation."""
        if self.eval is not None:
            return self.eval.perplexity.ppl, "eval"
        if self.curves.get("val"):
            return math.exp(min(self.curves["val"][-1][1], 700)), "train"
        return None, ""

    @property
    def variant(self) -> str:
        return (self.model or {}).get("scheme", "?")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.variant})" if self.variant not in self.name else self.name

    @property
    def loops(self) -> list[DepthRow]:
        return self.eval.loops if self.eval else []

    @property
    def exits(self) -> list[ExitRow]:
        return self.eval.exit if self.eval else []

    @property
    def suites(self) -> dict[str, Suite]:
        return self.eval.downstream if self.eval else {}

    @property
    def reasoning(self) -> Reasoning | None:
        return self.eval.reasoning if self.eval else None


def read_curves(run_dir: Path) -> dict:
    """Training and validation loss against tokens from the run's metrics.jsonl ({} without one).

    Validation records written before they carried `tokens` get step × the tokens per step that the
    training records show."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    train = [r for r in records if r.get("kind") == "train" and r.get("tokens") is not None]
    per_step = train[-1]["tokens"] / max(train[-1]["step"], 1) if train else None
    val = [(r.get("tokens", None if per_step is None else r["step"] * per_step), r["val_loss"])
           for r in records if r.get("kind") == "eval"]
    return {"train": [(r["tokens"], r["loss"]) for r in train],
            "val": [(tokens, loss) for tokens, loss in val if tokens is not None]}


def collect(path: str | Path) -> RunResults:
    """A run folder's results (a step-NNNNNN folder means its run)."""
    path = Path(path)
    run_dir = path.parent if path.name.startswith("step-") else path
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; pass run folders (e.g. runs/small-mesh)")
    evaluation = read_eval(run_dir / "eval.json")
    probed = read_probe(run_dir / "probe" / "probe.json")
    model = (evaluation or probed).model if evaluation or probed else None
    if model is None:
        try:
            model = integrity.read_meta(run_dir)["model"]
        except MeshlmError:
            raise ReportError(f"{run_dir} has no eval.json, probe/probe.json or checkpoint; run "
                              "`meshlm eval "
                              f"{run_dir}` and `meshlm probe {run_dir}` first") from None
    return RunResults(run_dir.name, run_dir, model, evaluation, probed, read_curves(run_dir))


def non_embedding_params(model: dict) -> int:
    return describe(ModelConfig.from_dict(model)).non_embedding_params


# -- sections --------------------------------------------------------------------------------------
def mean_stderr(errors: list[float | None]) -> float | None:
    """The standard error of a mean of independent scores: sqrt(Σ se²) / n (None if one is
    unknown)."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)


def table_one(runs: list[RunResults], shots: str | None) -> str:
    """Variant, spec, non-embedding params, PPL, per-task paper metric (%) and average for one shot
    setting (shots None: no downstream results, the rest of the table still shown)."""
    suites = [r.suites.get(shots) if shots else None for r in runs]
    tasks = [t for t in TASK_TITLES if any(s and t in s.tasks for s in suites)]
    left = [[f"<td class='l'>{html.escape(r.name)}</td>" for r in runs],
            [f"<td class='l'>{html.escape(r.variant)}</td>" for r in runs],
            [f"<td>{html.escape(str((r.model or {}).get('spec', '?')))}</td>" for r in runs],
            [f"<td>{non_embedding_params(r.model):,}</td>" if r.model
             else "<td>—</td>" for r in runs]]
    ppl, sources = zip(*(r.ppl for r in runs))
    ppl_cells = cells(list(ppl), True, "{:.2f}")
    ppl_cells = [c.replace("</td>", "<sup>†</sup></td>") if src == "train" else c
                 for c, src in zip(ppl_cells, sources)]
    columns = left + [ppl_cells]
    def task_field(task: str, name: str) -> list[float | None]:
        return [getattr(s.tasks[task], name) if s and task in s.tasks else None for s in suites]

    for task in tasks:
        columns.append(cells(percent(task_field(task, "score")), False, "{:.2f}",
                             percent(task_field(task, "stderr"))))
    header = ["run", "variant", "spec", "non-emb. params", "val PPL"]
    if tasks:
        # an average only where a suite has every task shown (the same tasks averaged)
        complete = [s is not None and all(t in s.tasks for t in tasks) for s in suites]
        averages = [s.average if ok else None for s, ok in zip(suites, complete)]
        errors = [mean_stderr([s.tasks[t].stderr for t in tasks]) if ok else None
                  for s, ok in zip(suites, complete)]
        columns.append(cells(percent(averages), False, "{:.2f}", percent(errors)))
        metric = {t: next(s.tasks[t].metric for s in suites if s and t in s.tasks) for t in tasks}
        header += [*(f"{TASK_TITLES[t]}<br><small>{metric[t]}</small>" for t in tasks),
                   f"avg<br><small>{len(tasks)} of {PAPER_TASKS} tasks</small>"]
    foot = ("<p class='foot'>± one standard error (lm-eval's, per task; the average's assumes "
            "independent tasks).</p>" if tasks else "")
    foot += ("<p class='foot'><sup>†</sup> the trainer's last validation (train.eval_windows "
             "windows); <code>meshlm eval RUN</code> scores the whole validation split.</p>"
             if "train" in sources else "")
    return (f"<h3>{shots}-shot</h3>" if shots else "") + table(header, columns, len(runs)) + foot


def report_figures(runs: list[RunResults]) -> dict[str, Figure]:
    """The page's figures by name: "curves", "loops", "exit" (where runs have them), the reasoning
    figures and the overlaid probes."""
    figures = {}
    curves = plots.loss_curves_figure([(r.label, r.curves) for r in runs])
    if curves is not None:
        figures["curves"] = curves
    loops = plots.loops_figure([(r.label, r.loops) for r in runs])
    if loops is not None:
        figures["loops"] = loops
    # a study's runs are <variant>-s<seed>
    groups = {r.name: re.sub(r"-s\d+$", "", r.name) for r in runs}
    exits = plots.exit_figure([(g, [r.exits for r in runs if groups[r.name] == g],
                                [r.loops for r in runs if groups[r.name] == g])
                               for g in dict.fromkeys(groups.values())])
    if exits is not None:
        figures["exit"] = exits
    figures.update(reasoning_report.figures(reasoning_groups(runs, groups)))
    probed = [(r.label, r.probe) for r in runs if r.probe]
    figures.update(plots.probe_figures(probed) if probed else {})
    return figures


def reasoning_groups(runs: list[RunResults], groups: dict[str, str]
                     ) -> list[tuple[str, list[Reasoning]]]:
    """(variant, [reasoning result of each seed]) for the runs evaluated on the reasoning suite."""
    out: dict[str, list[Reasoning]] = {}
    for r in runs:
        if r.reasoning:
            out.setdefault(groups[r.name], []).append(r.reasoning)
    return list(out.items())


def reasoning_section(runs: list[RunResults], figures: dict) -> str:
    rows = [(r.name, r.reasoning) for r in runs if r.reasoning]
    if not rows:
        return ("<p>No run was evaluated on the reasoning suite (runs trained on "
                "<code>task:</code> data are).</p>")
    images = "".join(img(figures[name]) for name in reasoning_report.FIGURES if name in figures)
    return ("<p>Exact-match accuracy (%) from greedy cached decoding; 'beyond' = test "
            "difficulties above the training range; ρ = Spearman correlation of exit loops with "
            "difficulty.</p>"
            + reasoning_report.table(rows) + images)


def training_section(runs: list[RunResults], figures: dict) -> str:
    if "curves" not in figures:
        return ("<p>No run has training metrics (<code>meshlm train</code> writes "
                "<code>metrics.jsonl</code>).</p>")
    rows = [f"<li>{html.escape(r.label)}: {r.curves['train'][-1][0]:,} tokens, final training loss "
            f"{r.curves['train'][-1][1]:.4f}" + (f", validation loss {r.curves['val'][-1][1]:.4f}"
                                                  if r.curves.get("val") else "") + "</li>"
            for r in runs if r.curves.get("train")]
    return img(figures["curves"]) + (f"<ul>{''.join(rows)}</ul>" if rows else "")


def loops_section(runs: list[RunResults], figures: dict) -> str:
    series = [(r.label, r.loops) for r in runs]
    if "loops" not in figures:
        return ("<p>No run has a loss-vs-loops sweep (weight-shared models get one from "
                "<code>meshlm eval</code>).</p>")
    counts = sorted({row.loops for _, rows in series for row in rows})
    columns = [[f"<td class='l'>{html.escape(name)}</td>" for name, _ in series],
               [f"<td class='l'>{html.escape(r.variant)}</td>" for r in runs]]
    for k in counts:
        losses = [next((row.loss for row in rows if row.loops == k), None) for _, rows in series]
        columns.append(cells(losses, True, "{:.4f}"))
    return img(figures["loops"]) + table(["run", "variant", *(f"K'={k}" for k in counts)],
                                         columns, len(runs))


def exit_section(runs: list[RunResults], figures: dict) -> str:
    rows = [(r, row) for r in runs for row in r.exits]
    if "exit" not in figures:
        return ("<p>No run was evaluated with adaptive exit (<code>meshlm eval RUN --exit "
                "state:0.1,kl:1e-3</code>).</p>")
    columns = [[f"<td class='l'>{html.escape(r.name)}</td>" for r, _ in rows],
               [f"<td class='l'>{html.escape(row.exit)}</td>" for _, row in rows],
               cells([row.loss for _, row in rows], True, "{:.4f}"),
               cells([row.avg_loops for _, row in rows], True, "{:.2f}"),
               cells([row.flops_ratio for _, row in rows], True, "{:.3f}")]
    header = ["run", "exit rule", "val loss", "avg loops/token", "FLOPs vs. fixed"]
    return img(figures["exit"]) + table(header, columns, len(rows))


def probe_section(runs: list[RunResults], figures: dict) -> str:
    probed = [r.probe for r in runs if r.probe]
    if not probed:
        return "<p>No probe results: run <code>meshlm probe RUN</code> for each run.</p>"
    titles = {"updates": "Relative update per block", "cka_steps": "CKA between consecutive stages",
              "rank": "Effective rank per stage", "spectrum": "Normalised singular values (top 50)",
              "cka": "CKA between all stages", "router": "MeSH routing"}
    parts = [f"<p>{len(probed)} run(s); {probed[0].samples} held-out sequences of "
             f"{probed[0].tokens} tokens each (mean ± std over samples).</p>"]
    for name, title in titles.items():
        if name in figures:
            parts.append(f"<h3>{title}</h3>{img(figures[name])}")
    return "".join(parts)


def gaps(runs: list[RunResults]) -> list[str]:
    """What each run lacks or qualifies, as plain text (`code` in backticks): the page's notes, and
    what `meshlm report` prints on stderr."""
    items = []
    for r in runs:
        if r.eval is None:
            items.append(f"{r.name}: no eval.json — run `meshlm eval {r.path}`")
        if r.probe is None:
            items.append(f"{r.name}: no probe — run `meshlm probe {r.path}`")
        if not r.curves:
            items.append(f"{r.name}: no metrics.jsonl, so no loss curves (the run folder of "
                         "`meshlm train` has one)")
        limits = {s.limit for s in r.suites.values()} - {None}
        if limits:
            items.append(f"{r.name}: tasks scored with --limit "
                         f"{', '.join(map(str, sorted(limits)))} items per task (not comparable "
                         "with full-set numbers)")
    return items


def notes(runs: list[RunResults]) -> str:
    items = [re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(item)) for item in gaps(runs)]
    return ("<ul class='note'>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>" if items
            else "<p>None.</p>")


def _step(r: RunResults) -> str:
    return "" if r.eval is None or r.eval.step is None else f" (step {r.eval.step})"


# -- the page --------------------------------------------------------------------------------------
def render(runs: list[RunResults], title: str = "meshlm report",
           figures: dict[str, bytes] | None = None) -> str:
    """The page; `figures`: PNG bytes by name (default: report_figures, rendered)."""
    if figures is None:
        figures = {name: plots.png_bytes(fig) for name, fig in report_figures(runs).items()}
    shots = sorted({k for r in runs for k in r.suites}, key=int)
    tables = "".join(table_one(runs, s) for s in shots) if shots else (
        table_one(runs, None) + "<p>No downstream results yet: <code>meshlm eval RUN</code> "
                                "scores the tasks.</p>")
    run_list = "".join(f"<li><b>{html.escape(r.name)}</b>: {html.escape(str(r.path))}"
                       f"{_step(r)}"
                       f"</li>" for r in runs)
    body = (f"<h1>{html.escape(title)}</h1><p>Generated "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}.</p><ul>{run_list}</ul><h2 id='table'>Table "
            f"1: validation perplexity and downstream accuracy (%)</h2>{tables}<h2 "
            f"id='training'>Training and validation loss</h2>{training_section(runs, figures)}<h2 "
            f"id='loops'>Loss vs. loop count</h2>{loops_section(runs, figures)}<h2 "
            f"id='exit'>Adaptive exit</h2>{exit_section(runs, figures)}<h2 "
            f"id='reasoning'>Reasoning suite</h2>{reasoning_section(runs, figures)}<h2 "
            f"id='probes'>Probes</h2>{probe_section(runs, figures)}<h2 "
            f"id='notes'>Notes</h2>{notes(runs)}")
    return html_page(title, body)


def write_report(paths: list[str | Path], out: str | Path, title: str = "meshlm report",
                 figures_dir: str | Path | None = None, note=lambda message: None) -> Path:
    """Write the HTML page; with `figures_dir`, also its figures there as PNG, SVG and PDF files."""
    runs = [collect(p) for p in paths]
    for gap in gaps(runs):  # what the page's notes say, for the terminal too
        note(gap)
    figures = report_figures(runs)
    if figures_dir is not None:
        plots.save(figures, figures_dir)
    page = render(runs, title, {name: plots.png_bytes(fig) for name, fig in figures.items()})
    return atomic.write_text(out, page)  # an existing report stays whole until then
