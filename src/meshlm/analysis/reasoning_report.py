"""The reasoning suite in the report: figures and a table from eval.json's "reasoning" section.

    heatmap       exact-match accuracy, difficulty × loop count, one panel per variant and task (mean over seeds)
    acc_loops     accuracy against loop count, on the trained difficulties (solid) and beyond them (dashed);
                  the dotted line marks the trained loop count
    exit_levels   under each exit rule, the loop steps spent per answer token against the difficulty

`runs` everywhere is a list of (variant, [reasoning result of each seed]); a study's runs <variant>-s<seed>
are grouped by the report.
"""
from __future__ import annotations

import html

import numpy as np

from meshlm.analysis.plots import color_of, new_figure

Group = tuple[str, list[dict]]


def _tasks(runs: list[Group]) -> list[str]:
    return list(dict.fromkeys(t for _, results in runs for r in results for t in r["tasks"]))


def _in_range(level: str, text: str | None) -> bool:
    if not text:
        return True
    low, _, high = text.partition("-")
    return int(low) <= int(level) <= int(high or low)


def _mean_acc(results: list[dict], task: str, loops: int, keep) -> float:
    """Accuracy over the kept levels at `loops`, pooled over a run's problems, then the mean over seeds."""
    accs = []
    for r in results:
        t = r["tasks"].get(task)
        row = next((row for row in (t or {}).get("loops", []) if row["loops"] == loops), None)
        if row is None:
            continue
        kept = [v for level, v in row["levels"].items() if keep(level, t)]
        n = sum(v["n"] for v in kept)
        if n:
            accs.append(sum(v["acc"] * v["n"] for v in kept) / n)
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
            first = next((r["tasks"][task] for r in results if task in r["tasks"]), None)
            if first is None:
                ax.axis("off")
                continue
            counts = [row["loops"] for row in first["loops"]]
            levels = list(first["loops"][0]["levels"])
            grid = np.array([[np.nanmean([_level_acc(r, task, k, d) for r in results]) for k in counts]
                             for d in levels])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set_xticks(range(len(counts)), counts, fontsize=6)
            ax.set_yticks(range(len(levels)), levels, fontsize=6)
            trained = [n for n, d in enumerate(levels) if _in_range(d, first.get("train_levels"))]
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


def _level_acc(result: dict, task: str, loops: int, level: str) -> float:
    t = result["tasks"].get(task) or {}
    row = next((row for row in t.get("loops", []) if row["loops"] == loops), None)
    return row["levels"].get(level, {}).get("acc", np.nan) if row else np.nan


def _panels(tasks: list[str]):
    """A figure with one panel per task, side by side: (figure, [(task, axes)])."""
    fig = new_figure(3.4 * len(tasks), 3.2)
    return fig, list(zip(tasks, fig.subplots(1, len(tasks), squeeze=False)[0]))


def acc_loops(runs: list[Group]):
    tasks = _tasks(runs)
    if not tasks:
        return None
    fig, panels = _panels(tasks)
    for task, ax in panels:
        for i, (variant, results) in enumerate(runs):
            first = next((r["tasks"][task] for r in results if task in r["tasks"]), None)
            if first is None:
                continue
            counts = [row["loops"] for row in first["loops"]]
            inside = [_mean_acc(results, task, k, lambda d, t: _in_range(d, t.get("train_levels"))) for k in counts]
            beyond = [_mean_acc(results, task, k, lambda d, t: not _in_range(d, t.get("train_levels")))
                      for k in counts]
            ax.plot(counts, inside, "-o", color=color_of(i), markersize=3, label=variant)
            if not np.all(np.isnan(beyond)):
                ax.plot(counts, beyond, "--", color=color_of(i), linewidth=1)
            ax.axvline(first["trained_loops"], color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}: solid = trained difficulties, dashed = beyond", fontsize=8)
        ax.set_xlabel("loops (dotted: trained)")
        ax.set_ylabel("exact match")
        ax.grid(alpha=0.3)
    panels[0][1].legend(fontsize=6)
    return fig


def exit_levels(runs: list[Group]):
    tasks = [t for t in _tasks(runs) if any(r["tasks"].get(t, {}).get("exit") for _, rs in runs for r in rs)]
    if not tasks:
        return None
    fig, panels = _panels(tasks)
    for task, ax in panels:
        for i, (variant, results) in enumerate(runs):
            rules = list(dict.fromkeys(row["exit"] for r in results
                                       for row in r["tasks"].get(task, {}).get("exit", [])))
            for k, rule in enumerate(rules):
                rows = [row for r in results for row in r["tasks"].get(task, {}).get("exit", []) if row["exit"] == rule]
                levels = sorted({int(d) for row in rows for d in row["levels"]})
                ys = [np.nanmean([_number(row["levels"].get(str(d), {}).get("answer_loops")) for row in rows])
                      for d in levels]
                ax.plot(levels, ys, ["-o", "--s", ":^", "-.v"][k % 4], color=color_of(i), markersize=3,
                        label=f"{variant} {rule}")
        ax.set_title(f"{task}: loops per answer token under exit", fontsize=8)
        ax.set_xlabel("difficulty")
        ax.set_ylabel("loop steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return fig


FIGURES = {"reasoning_heatmap": heatmap, "reasoning_loops": acc_loops, "reasoning_exit": exit_levels}


def figures(runs: list[Group]) -> dict:
    return {name: fig for name, make in FIGURES.items() if (fig := make(runs)) is not None}


def table(rows: list[tuple[str, dict]]) -> str:
    """One row per run and task: accuracy at 1 loop and at the trained depth K on the trained difficulties,
    beyond the training range at K and at the best K' > K, and each exit rule's accuracy and loops."""
    lines = []
    for name, result in rows:
        for task, t in result["tasks"].items():
            s = run_summary(result, task)
            exits = "; ".join(f"{row['exit']}: {100 * row['acc']:.1f}% at {row['avg_loops']:.2f} loops/token "
                              f"(ρ={_number(row['spearman']):.2f})" for row in t.get("exit", []))
            cells = [100 * s[key] for key in ("one", "trained", "beyond_k", "beyond_best")]
            lines.append(f"<tr><td class='l'>{html.escape(name)}</td><td class='l'>{task}</td><td>{s['k']}</td>"
                         + "".join(f"<td>{c:.1f}</td>" for c in cells[:3])
                         + f"<td>{cells[3]:.1f} (K'={s['best']})</td><td class='l'>{exits}</td></tr>")
    return ("<table><tr><th>run</th><th>task</th><th>K</th><th>trained difficulties, 1 loop</th>"
            "<th>trained difficulties, K</th><th>beyond, K</th><th>beyond, best K'</th><th>exit</th></tr>"
            + "".join(lines) + "</table>")


# -- the study's results page (meshlm.analysis.study) ------------------------------------------------------------
def _mean_std(values: list[float], scale: float = 100.0, digits: int = 1, signed: bool = False) -> str:
    values = [v * scale for v in values if v is not None and not np.isnan(v)]
    sign = "+" if signed else ""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{np.mean(values):{sign}.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def run_summary(result: dict, task: str) -> dict:
    """The numbers the study's targets are read from, for one run and task (fractions; loops as counts)."""
    t = result["tasks"][task]
    k = t["trained_loops"]
    inside = lambda d, t: _in_range(d, t.get("train_levels"))  # noqa: E731
    beyond = lambda d, t: not _in_range(d, t.get("train_levels"))  # noqa: E731
    hardest = t.get("train_levels", "").partition("-")[2] or t.get("train_levels")
    at_hardest = lambda d, t: d == hardest  # noqa: E731
    deeper = [row["loops"] for row in t["loops"] if row["loops"] > k]
    best = max(deeper, key=lambda n: np.nan_to_num(_mean_acc([result], task, n, beyond), nan=-1)) if deeper else None
    def fixed(loops: int) -> float:  # all test problems at fixed depth: what exit with that cap is read against
        return _mean_acc([result], task, loops, lambda d, t: True)

    exits = [{"exit": row["exit"], "change": row["acc"] - fixed(row["max_loops"]),
              "share": row["avg_loops"] / row["max_loops"], "rho": _number(row["spearman"])}
             for row in t.get("exit", [])]
    return {"k": k, "one": _mean_acc([result], task, 1, inside), "trained": _mean_acc([result], task, k, inside),
            "hardest_one": _mean_acc([result], task, 1, at_hardest),
            "hardest_k": _mean_acc([result], task, k, at_hardest),
            "beyond_k": _mean_acc([result], task, k, beyond),
            "beyond_best": _mean_acc([result], task, best, beyond) if best else np.nan, "best": best,
            "exits": exits}


def markdown(groups: list[Group]) -> list[str]:
    """Per task: each variant's accuracy (mean ± std over seeds, %) at 1 loop and at its trained depth, on the
    hardest trained difficulty, beyond the training range, and under exit."""
    lines = []
    for task in _tasks(groups):
        lines += ["", f"Reasoning task `{task}`: exact match (%), mean ± std over seeds; 'hardest' = the top trained "
                  "difficulty, 'beyond' = test difficulties above the training range, best K' > K chosen per run; "
                  "exit: accuracy against fixed depth at its cap (points), loop steps per token (the compute) as a "
                  "share of the cap, Spearman ρ of the answer's loops with difficulty:", "",
                  "| variant | seeds | K | trained, 1 loop | trained, K | hardest, 1 loop | hardest, K | beyond, K | "
                  "beyond, best K' | exit |", "|---|---|---|---|---|---|---|---|---|---|"]
        for variant, results in groups:
            rows = [run_summary(r, task) for r in results if task in r["tasks"]]
            if not rows:
                continue
            exits = "; ".join(_exit_cell(rule, [e for r in rows for e in r["exits"] if e["exit"] == rule])
                              for rule in dict.fromkeys(e["exit"] for r in rows for e in r["exits"])) or "–"
            bests = sorted({r["best"] for r in rows if r["best"]})
            lines.append(f"| {variant} | {len(rows)} | {rows[0]['k']} | {_mean_std([r['one'] for r in rows])} | "
                         f"{_mean_std([r['trained'] for r in rows])} | {_mean_std([r['hardest_one'] for r in rows])} | "
                         f"{_mean_std([r['hardest_k'] for r in rows])} | {_mean_std([r['beyond_k'] for r in rows])} | "
                         f"{_mean_std([r['beyond_best'] for r in rows])} (K'={'/'.join(map(str, bests)) or '–'}) | "
                         f"{exits} |")
    return lines


def _exit_cell(rule: str, runs: list[dict]) -> str:
    return (f"{rule}: {_mean_std([e['change'] for e in runs], signed=True)} at "
            f"{_mean_std([e['share'] for e in runs], 100, 0)}%, "
            f"ρ {_mean_std([e['rho'] for e in runs], 1, 2)}")
