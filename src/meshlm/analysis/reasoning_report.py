"""The reasoning suite in the report: figures and tables from eval.json's "reasoning" section.

    heatmap       exact-match accuracy, difficulty × loop count, one panel per variant and task
                  (mean over seeds)
    acc_loops     accuracy against loop count, on the trained difficulties (solid) and beyond them
                  (dashed); the dotted line marks the trained loop count
    exit_levels   under each exit rule, the loop steps spent per answer token against the difficulty
    stability     labelled tasks: accuracy on the positions within the trained depth against loop
                  count, past the trained loop count (does a run keep its answers?)

`runs` everywhere is a list of (variant, [Reasoning of each seed]: meshlm.evaluation.results); a
study's runs <variant>-s<seed> are grouped by the report.
"""
from __future__ import annotations

import html

import numpy as np

from meshlm.analysis.plots import color_of, new_figure
from meshlm.analysis.stats import mean_std
from meshlm.evaluation.results import Reasoning, ReasoningTask

Group = tuple[str, list[Reasoning]]


def _tasks(runs: list[Group]) -> list[str]:
    return list(dict.fromkeys(t for _, results in runs for r in results for t in r.tasks))


def _in_range(level: str, text: str | None) -> bool:
    if not text:
        return True
    low, _, high = text.partition("-")
    return int(low) <= int(level) <= int(high or low)


def _depth(task: ReasoningTask | None, loops: int):
    """The task's row at `loops` loop steps (None if it has none)."""
    return next((row for row in task.loops if row.loops == loops), None) if task else None


def _inside(level: str, task: ReasoningTask) -> bool:
    return _in_range(level, task.train_levels)


def _beyond(level: str, task: ReasoningTask) -> bool:
    return not _in_range(level, task.train_levels)


def _mean_acc(results: list[Reasoning], task: str, loops: int, keep) -> float:
    """Accuracy over the kept levels at `loops`, pooled over a run's problems, then the mean over
    seeds."""
    accs = []
    for r in results:
        t = r.tasks.get(task)
        row = _depth(t, loops)
        if row is None:
            continue
        kept = [v for level, v in row.levels.items() if keep(level, t)]
        n = sum(v.n for v in kept)
        if n:
            accs.append(sum(v.acc * v.n for v in kept) / n)
    return float(np.mean(accs)) if accs else np.nan


def heatmap(runs: list[Group]):
    tasks = _tasks(runs)
    if not tasks:
        return None
    fig = new_figure(max(4.2, 2.6 * len(tasks) + 0.6), 2.2 * len(runs) + 0.5)
    axes = fig.subplots(len(runs), len(tasks), squeeze=False)
    for i, (variant, results) in enumerate(runs):
        for j, task in enumerate(tasks):
            ax = axes[i][j]
            first = next((r.tasks[task] for r in results if task in r.tasks), None)
            if first is None:
                ax.axis("off")
                continue
            counts = [row.loops for row in first.loops]
            levels = list(first.loops[0].levels)
            grid = np.array([[np.nanmean([_level_acc(r, task, k, d) for r in results])
                              for k in counts]
                             for d in levels])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set_xticks(range(len(counts)), counts, fontsize=6)
            ax.set_yticks(range(len(levels)), levels, fontsize=6)
            trained = [n for n, d in enumerate(levels) if _in_range(d, first.train_levels)]
            if trained:
                ax.axhline(trained[-1] + 0.5, color="white", linewidth=1, linestyle="--")
            ax.set_title(f"{variant}: {task}", fontsize=8)
            ax.set_xlabel("loops", fontsize=7)
            ax.set_ylabel("difficulty", fontsize=7)
    images = [ax.images[0] for row in axes for ax in row if ax.images]
    if images:
        fig.colorbar(images[0], ax=axes, shrink=0.6, label="exact match")
    fig.suptitle("Accuracy by difficulty × loops\n(dashed: top of the training range)", fontsize=9)
    return fig


def _number(value: float | None) -> float:
    """None (e.g. an undefined correlation) as nan, for averaging and formatting."""
    return np.nan if value is None else value


def _level_acc(result: Reasoning, task: str, loops: int, level: str) -> float:
    row = _depth(result.tasks.get(task), loops)
    return row.levels[level].acc if row and level in row.levels else np.nan


def _panels(tasks: list[str]):
    """A figure with one panel per task, side by side: (figure, [(task, axes)])."""
    fig = new_figure(3.4 * len(tasks), 3.2)
    return fig, list(zip(tasks, fig.subplots(1, len(tasks), squeeze=False)[0]))


def _loops_axes(ax, title: str, ylabel: str) -> None:
    """An accuracy-against-loops panel: log2 loop axis, accuracy 0 … 1."""
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("loops (dotted: trained)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def acc_loops(runs: list[Group]):
    tasks = _tasks(runs)
    if not tasks:
        return None
    fig, panels = _panels(tasks)
    for task, ax in panels:
        for i, (variant, results) in enumerate(runs):
            first = next((r.tasks[task] for r in results if task in r.tasks), None)
            if first is None:
                continue
            counts = [row.loops for row in first.loops]
            inside = [_mean_acc(results, task, k, _inside) for k in counts]
            beyond = [_mean_acc(results, task, k, _beyond) for k in counts]
            ax.plot(counts, inside, "-o", color=color_of(i), markersize=3, label=variant)
            if not np.all(np.isnan(beyond)):
                ax.plot(counts, beyond, "--", color=color_of(i), linewidth=1)
            ax.axvline(first.trained_loops, color="gray", linestyle=":", linewidth=1)
        _loops_axes(ax, f"{task}: solid = trained difficulties, dashed = beyond", "exact match")
    panels[0][1].legend(fontsize=6)
    return fig


def _exit_rows(results: list[Reasoning], task: str) -> list:
    return [row for r in results if task in r.tasks for row in r.tasks[task].exit]


def exit_levels(runs: list[Group]):
    tasks = [t for t in _tasks(runs) if any(_exit_rows(rs, t) for _, rs in runs)]
    if not tasks:
        return None
    fig, panels = _panels(tasks)
    for task, ax in panels:
        for i, (variant, results) in enumerate(runs):
            rules = list(dict.fromkeys(row.exit for row in _exit_rows(results, task)))
            for k, rule in enumerate(rules):
                rows = [row for row in _exit_rows(results, task) if row.exit == rule]
                levels = sorted({int(d) for row in rows for d in row.levels})
                ys = [np.nanmean([_number(row.levels[str(d)].answer_loops) if str(d) in row.levels
                                  else np.nan for row in rows]) for d in levels]
                ax.plot(levels, ys, ["-o", "--s", ":^", "-.v"][k % 4], color=color_of(i),
                        markersize=3,
                        label=f"{variant} {rule}")
        ax.set_title(f"{task}: loops per answer token under exit", fontsize=8)
        ax.set_xlabel("difficulty")
        ax.set_ylabel("loop steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return fig


def stability(runs: list[Group]):
    tasks = [t for t in _tasks(runs)
             if any(r.tasks[t].stability for _, rs in runs for r in rs if t in r.tasks)]
    if not tasks:
        return None
    fig, panels = _panels(tasks)
    for task, ax in panels:
        for i, (variant, results) in enumerate(runs):
            rows = [r.tasks[task] for r in results if task in r.tasks and r.tasks[task].stability]
            if not rows:
                continue
            counts = sorted({int(k) for t in rows for k in t.stability})
            ys = [np.nanmean([t.stability[str(k)].acc if str(k) in t.stability else np.nan
                              for t in rows]) for k in counts]
            ax.plot(counts, ys, "-o", color=color_of(i), markersize=3, label=variant)
            ax.axvline(rows[0].trained_loops, color="gray", linestyle=":", linewidth=1)
        _loops_axes(ax, f"{task}: positions within the trained depth", "accuracy")
    panels[0][1].legend(fontsize=6)
    return fig


FIGURES = {"reasoning_heatmap": heatmap, "reasoning_loops": acc_loops,
           "reasoning_exit": exit_levels, "reasoning_stability": stability}


def figures(runs: list[Group]) -> dict:
    return {name: fig for name, make in FIGURES.items() if (fig := make(runs)) is not None}


def table(rows: list[tuple[str, Reasoning]]) -> str:
    """One row per run and task: accuracy at 1 loop and at the trained depth K on the trained
    difficulties, beyond the training range at K and at the best K' > K, and each exit rule's
    accuracy and loops."""
    lines = []
    for name, result in rows:
        for task, t in result.tasks.items():
            s = run_summary(result, task)
            exits = "; ".join(f"{row.exit}: {100 * row.acc:.1f}% at {row.avg_loops:.2f} "
                              f"loops/token (ρ={_number(row.spearman):.2f})" for row in t.exit)
            cells = [100 * s[key] for key in ("one", "trained", "beyond_k", "beyond_best")]
            lines.append(f"<tr><td class='l'>{html.escape(name)}</td><td "
                         f"class='l'>{task}</td><td>{s['k']}</td>"
                         + "".join(f"<td>{c:.1f}</td>" for c in cells[:3])
                         + f"<td>{cells[3]:.1f} (K'={s['best']})</td><td "
                           f"class='l'>{exits}</td></tr>")
    return ("<table><tr><th>run</th><th>task</th><th>K</th><th>trained difficulties, 1 "
            "loop</th><th>trained difficulties, K</th><th>beyond, K</th><th>beyond, best "
            "K'</th><th>exit</th></tr>"
            + "".join(lines) + "</table>")


# -- the study's results page (meshlm.analysis.results_page) -------------------------------------
def _percent(values: list[float | None], scale: float = 100.0, digits: int = 1,
             signed: bool = False) -> str:
    """mean ± std over seeds of the measured values (None or NaN: not measured), as percent."""
    return mean_std([v for v in values if v is not None and not np.isnan(v)], digits, scale, signed)


def run_summary(result: Reasoning, task: str) -> dict:
    """The numbers the study's targets are read from, for one run and task (fractions; loops as
    counts)."""
    t = result.tasks[task]
    k = t.trained_loops
    hardest = (t.train_levels or "").partition("-")[2] or t.train_levels
    at_hardest = lambda d, t: d == hardest  # noqa: E731
    deeper = [row.loops for row in t.loops if row.loops > k]

    def best_past_k(which) -> int | None:  # the loop count past K where `which` scores best
        score = lambda n: np.nan_to_num(_mean_acc([result], task, n, which), nan=-1)  # noqa: E731
        return max(deeper, key=score) if deeper else None

    best = best_past_k(_beyond)

    def fixed(loops: int) -> float:  # every test problem at fixed depth: what exit is read against
        return _mean_acc([result], task, loops, lambda d, t: True)

    exits = [{"exit": row.exit, "change": row.acc - fixed(row.max_loops),
              "share": row.avg_loops / row.max_loops, "rho": _number(row.spearman)}
             for row in t.exit]
    # test-time depth: twice the hardest trained difficulty, at the best loop count beyond K
    double = str(2 * int(hardest)) if hardest else ""
    at_double = lambda d, t: d == double  # noqa: E731
    double_best = best_past_k(at_double) if double else None
    held = t.stability or {}
    return {"k": k, "one": _mean_acc([result], task, 1, _inside),
            "trained": _mean_acc([result], task, k, _inside),
            "hardest_one": _mean_acc([result], task, 1, at_hardest),
            "hardest_k": _mean_acc([result], task, k, at_hardest),
            "beyond_k": _mean_acc([result], task, k, _beyond),
            "beyond_best": _mean_acc([result], task, best, _beyond) if best else np.nan,
            "best": best,
            "double_k": _mean_acc([result], task, k, at_double) if double else np.nan,
            "double_best": (_mean_acc([result], task, double_best, at_double) if double_best
                            else np.nan),
            "double_loops": double_best,
            "stable_k": held[str(k)].acc if str(k) in held else np.nan,
            "stable_4k": held[str(4 * k)].acc if str(4 * k) in held else np.nan,
            "exits": exits}


MARKDOWN_INTRO = ("accuracy (%: per labelled position on labelled tasks, exact match per problem "
                  "on answer-only ones), mean ± std over seeds; 'hardest' = the top trained "
                  "difficulty, 'beyond' = test difficulties above the training range, best K' > K "
                  "chosen per run; exit: accuracy against fixed depth at its cap (points), loop "
                  "steps per token (the compute) as a share of the cap, Spearman ρ of a scored "
                  "answer's (or labelled position's) loops with its difficulty; '2× hardest' = "
                  "twice the top trained difficulty; 'within depth' = labelled positions no "
                  "deeper than K, run at K and at 4K loops:")
MARKDOWN_HEADER = ("| variant | seeds | K | trained, 1 loop | trained, K | hardest, 1 loop "
                   "| hardest, K | beyond, K | beyond, best K' | 2× hardest, K | 2× hardest, best "
                   "K' | within depth, K → 4K | exit |")


def markdown(groups: list[Group]) -> list[str]:
    """Per task: each variant's accuracy (mean ± std over seeds, %) at 1 loop and at its trained
    depth, on the hardest trained difficulty, beyond the training range, and under exit."""
    lines = []
    for task in _tasks(groups):
        lines += ["", f"Reasoning task `{task}`: {MARKDOWN_INTRO}", "", MARKDOWN_HEADER,
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for variant, results in groups:
            rows = [run_summary(r, task) for r in results if task in r.tasks]
            if rows:
                lines.append(_markdown_row(variant, rows))
    return lines


def _markdown_row(variant: str, rows: list[dict]) -> str:
    rules = dict.fromkeys(e["exit"] for r in rows for e in r["exits"])
    exits = "; ".join(_exit_cell(rule, [e for r in rows for e in r["exits"] if e["exit"] == rule])
                      for rule in rules) or "–"
    bests = "/".join(map(str, sorted({r["best"] for r in rows if r["best"]}))) or "–"
    cells = [_percent([r[key] for r in rows])
             for key in ("one", "trained", "hardest_one", "hardest_k", "beyond_k", "beyond_best",
                         "double_k", "double_best", "stable_k", "stable_4k")]
    doubles = "/".join(map(str, sorted({r["double_loops"] for r in rows
                                        if r["double_loops"]}))) or "–"
    return (f"| {variant} | {len(rows)} | {rows[0]['k']} | " + " | ".join(cells[:5])
            + f" | {cells[5]} (K'={bests}) | {cells[6]} | {cells[7]} (K'={doubles}) | "
              f"{cells[8]} → {cells[9]} | {exits} |")


def _exit_cell(rule: str, runs: list[dict]) -> str:
    return (f"{rule}: {_percent([e['change'] for e in runs], signed=True)} at "
            f"{_percent([e['share'] for e in runs], 100, 0)}%, "
            f"ρ {_percent([e['rho'] for e in runs], 1, 2)}")
