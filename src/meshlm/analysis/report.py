"""`meshlm report RUN…`: one self-contained HTML page comparing runs (images inlined as base64 PNG).

Per run it reads what `meshlm eval` and `meshlm probe` left in the run folder (eval.json, probe/probe.json)
and the model config (from those files, else from the run's checkpoint). Sections:

1. Table 1 of the paper, once per few-shot setting: variant, spec, non-embedding parameters, validation
   perplexity, each task's paper metric (acc or acc_norm, %) and their average; best value per column bold.
2. Loss vs. loop count (figure and table).
3. Probes overlaid per variant: relative updates, consecutive-stage CKA, effective rank, spectra, CKA
   heatmaps and MeSH routing (meshlm.analysis.plots).
4. Notes: what is missing for which run (and the command that produces it), and runs scored with --limit.
"""
from __future__ import annotations

import base64
import datetime
import html
import json
from dataclasses import dataclass
from pathlib import Path

from meshlm import checkpoint
from meshlm.analysis import plots
from meshlm.config import ModelConfig
from meshlm.errors import MeshlmError
from meshlm.model.accounting import describe

TASK_TITLES = {"lambada_openai": "LAMBADA", "piqa": "PIQA", "hellaswag": "HellaSwag", "winogrande": "WinoGrande",
               "arc_easy": "ARC-E", "arc_challenge": "ARC-C", "sciq": "SciQ", "mmlu": "MMLU"}
STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}img{max-width:100%;margin:0.5em 0}
.note{color:#a33}code{background:#f5f5f5;padding:1px 4px}"""


class ReportError(MeshlmError):
    """A run folder with nothing to report."""


@dataclass
class RunResults:
    name: str
    path: Path
    model: dict | None
    eval: dict | None
    probe: dict | None

    @property
    def variant(self) -> str:
        return (self.model or {}).get("scheme", "?")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.variant})" if self.variant not in self.name else self.name


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ReportError(f"{path} is unreadable ({err}); re-run the command that wrote it") from None


def collect(path: str | Path) -> RunResults:
    """A run folder's results (a step-NNNNNN folder means its run)."""
    path = Path(path)
    run_dir = path.parent if path.name.startswith("step-") else path
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; pass run folders (e.g. runs/small-mesh)")
    evaluation, probed = _read_json(run_dir / "eval.json"), _read_json(run_dir / "probe" / "probe.json")
    model = (evaluation or probed or {}).get("model")
    if model is None:
        try:
            model = checkpoint.read_meta(run_dir)["model"]
        except MeshlmError:
            raise ReportError(f"{run_dir} has no eval.json, probe/probe.json or checkpoint; run "
                              f"`meshlm eval {run_dir}` and `meshlm probe {run_dir}` first") from None
    return RunResults(run_dir.name, run_dir, model, evaluation, probed)


def non_embedding_params(model: dict) -> int:
    return describe(ModelConfig.from_dict(model)).non_embedding_params


# -- sections ---------------------------------------------------------------------------------------------------
def _cells(values: list[float | None], lower_is_better: bool, fmt: str) -> list[str]:
    present = [v for v in values if v is not None]
    best = (min if lower_is_better else max)(present) if len(present) > 1 else None
    return ["<td>—</td>" if v is None else f"<td>{'<b>' if v == best else ''}{fmt.format(v)}"
            f"{'</b>' if v == best else ''}</td>" for v in values]


def _table(header: list[str], columns: list[list[str]], n_rows: int) -> str:
    head = "".join(f"<th class='l'>{h}</th>" if i < 2 else f"<th>{h}</th>" for i, h in enumerate(header))
    rows = "".join("<tr>" + "".join(col[r] for col in columns) + "</tr>" for r in range(n_rows))
    return f"<table><tr>{head}</tr>{rows}</table>"


def table_one(runs: list[RunResults], shots: str) -> str:
    """Variant, spec, non-embedding params, PPL, per-task paper metric (%) and average for one shot setting."""
    suites = [(r.eval or {}).get("downstream", {}).get(shots) for r in runs]
    tasks = [t for t in TASK_TITLES if any(s and t in s["tasks"] for s in suites)]
    left = [[f"<td class='l'>{html.escape(r.name)}</td>" for r in runs],
            [f"<td class='l'>{html.escape(r.variant)}</td>" for r in runs],
            [f"<td>{html.escape(str((r.model or {}).get('spec', '?')))}</td>" for r in runs],
            [f"<td>{non_embedding_params(r.model):,}</td>" if r.model else "<td>—</td>" for r in runs]]
    ppl = [((r.eval or {}).get("perplexity") or {}).get("ppl") for r in runs]
    columns = left + [_cells(ppl, True, "{:.2f}")]
    for task in tasks:
        scores = [(s["tasks"].get(task) or {}).get("score") if s else None for s in suites]
        columns.append(_cells([None if v is None else 100 * v for v in scores], False, "{:.2f}"))
    complete = [s is not None and all(t in s["tasks"] for t in tasks) for s in suites]  # same tasks averaged
    averages = [s["average"] if ok else None for s, ok in zip(suites, complete)]
    columns.append(_cells([None if v is None else 100 * v for v in averages], False, "{:.2f}"))
    metric = {t: next(s["tasks"][t]["metric"] for s in suites if s and t in s["tasks"]) for t in tasks}
    header = ["run", "variant", "spec", "non-emb. params", "val PPL",
              *(f"{TASK_TITLES[t]}<br><small>{metric[t]}</small>" for t in tasks), "avg"]
    return f"<h3>{shots}-shot</h3>" + _table(header, columns, len(runs))


def report_figures(runs: list[RunResults]) -> dict[str, bytes]:
    """The page's figures as PNG bytes by name: "loops" (if any run has a sweep) and the overlaid probes."""
    figures = {}
    loops = plots.loops_figure([(r.label, (r.eval or {}).get("loops") or []) for r in runs])
    if loops is not None:
        figures["loops"] = loops
    variants = list(dict.fromkeys(r.variant for r in runs))
    exits = plots.exit_figure([(v, [(r.eval or {}).get("exit") or [] for r in runs if r.variant == v],
                                [(r.eval or {}).get("loops") or [] for r in runs if r.variant == v]) for v in variants])
    if exits is not None:
        figures["exit"] = exits
    probed = [(r.label, r.probe) for r in runs if r.probe]
    figures.update(plots.probe_figures(probed) if probed else {})
    return {name: plots.png_bytes(fig) for name, fig in figures.items()}


def loops_section(runs: list[RunResults], figures: dict) -> str:
    series = [(r.label, (r.eval or {}).get("loops") or []) for r in runs]
    if "loops" not in figures:
        return "<p>No run has a loss-vs-loops sweep (weight-shared models get one from <code>meshlm eval</code>).</p>"
    counts = sorted({row["loops"] for _, rows in series for row in rows})
    columns = [[f"<td class='l'>{html.escape(name)}</td>" for name, _ in series],
               [f"<td class='l'>{html.escape(r.variant)}</td>" for r in runs]]
    for k in counts:
        columns.append(_cells([next((row["loss"] for row in rows if row["loops"] == k), None) for _, rows in series],
                              True, "{:.4f}"))
    return _img(figures["loops"]) + _table(["run", "variant", *(f"K'={k}" for k in counts)], columns, len(runs))


def exit_section(runs: list[RunResults], figures: dict) -> str:
    rows = [(r, row) for r in runs for row in (r.eval or {}).get("exit") or []]
    if "exit" not in figures:
        return "<p>No run was evaluated with adaptive exit (<code>meshlm eval RUN --exit state:0.1,kl:1e-3</code>).</p>"
    columns = [[f"<td class='l'>{html.escape(r.name)}</td>" for r, _ in rows],
               [f"<td class='l'>{html.escape(row['exit'])}</td>" for _, row in rows],
               _cells([row["loss"] for _, row in rows], True, "{:.4f}"),
               _cells([row["avg_loops"] for _, row in rows], True, "{:.2f}"),
               _cells([row["flops_ratio"] for _, row in rows], True, "{:.3f}")]
    header = ["run", "exit rule", "val loss", "avg loops/token", "FLOPs vs. fixed"]
    return _img(figures["exit"]) + _table(header, columns, len(rows))


def probe_section(runs: list[RunResults], figures: dict) -> str:
    probed = [r.probe for r in runs if r.probe]
    if not probed:
        return "<p>No probe results: run <code>meshlm probe RUN</code> for each run.</p>"
    titles = {"updates": "Relative update per block", "cka_steps": "CKA between consecutive stages",
              "rank": "Effective rank per stage", "spectrum": "Normalised singular values (top 50)",
              "cka": "CKA between all stages", "router": "MeSH routing"}
    parts = [f"<p>{len(probed)} run(s); {probed[0]['samples']} held-out sequences of "
             f"{probed[0]['tokens']} tokens each (mean ± std over samples).</p>"]
    for name, title in titles.items():
        if name in figures:
            parts.append(f"<h3>{title}</h3>{_img(figures[name])}")
    return "".join(parts)


def notes(runs: list[RunResults]) -> str:
    items = []
    for r in runs:
        name, path = html.escape(r.name), html.escape(str(r.path))
        if r.eval is None:
            items.append(f"{name}: no eval.json — run <code>meshlm eval {path}</code>")
        if r.probe is None:
            items.append(f"{name}: no probe — run <code>meshlm probe {path}</code>")
        limits = {s.get("limit") for s in ((r.eval or {}).get("downstream") or {}).values()} - {None}
        if limits:
            items.append(f"{name}: tasks scored with --limit {', '.join(map(str, sorted(limits)))} "
                         f"items per task (not comparable with full-set numbers)")
    return "<ul class='note'>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>" if items else "<p>None.</p>"


def _img(png: bytes) -> str:
    return f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"


# -- the page -------------------------------------------------------------------------------------------------
def render(runs: list[RunResults], title: str = "meshlm report", figures: dict[str, bytes] | None = None) -> str:
    figures = report_figures(runs) if figures is None else figures
    shots = sorted({k for r in runs for k in ((r.eval or {}).get("downstream") or {})}, key=int)
    tables = "".join(table_one(runs, s) for s in shots) or "<p>No downstream results yet.</p>"
    run_list = "".join(f"<li><b>{html.escape(r.name)}</b>: {html.escape(str(r.path))}"
                       f"{' (step ' + str(r.eval['step']) + ')' if r.eval and r.eval.get('step') is not None else ''}"
                       f"</li>" for r in runs)
    body = (f"<h1>{html.escape(title)}</h1><p>Generated {datetime.datetime.now():%Y-%m-%d %H:%M}.</p>"
            f"<ul>{run_list}</ul>"
            f"<h2 id='table'>Table 1: perplexity and downstream accuracy (%)</h2>{tables}"
            f"<h2 id='loops'>Loss vs. loop count</h2>{loops_section(runs, figures)}"
            f"<h2 id='exit'>Adaptive exit</h2>{exit_section(runs, figures)}"
            f"<h2 id='probes'>Probes</h2>{probe_section(runs, figures)}"
            f"<h2 id='notes'>Notes</h2>{notes(runs)}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")


def write_report(paths: list[str | Path], out: str | Path, title: str = "meshlm report",
                 figures_dir: str | Path | None = None) -> Path:
    """Write the HTML page; with `figures_dir`, also its figures as PNG files there."""
    runs = [collect(p) for p in paths]
    figures = report_figures(runs)
    if figures_dir is not None:
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
        for name, png in figures.items():
            (Path(figures_dir) / f"{name}.png").write_bytes(png)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs, title, figures), encoding="utf-8")
    return out
