"""Figures in the style of the paper's probes (§2), for one run or several overlaid.

Every function takes `runs`: a list of (label, ProbeResult) pairs (meshlm.evaluation.results: what
`meshlm probe` writes to probe.json), and returns a matplotlib Figure built without pyplot (Agg
canvas, no global state, safe in threads and headless). `probe_figures` makes the whole set; `save`
writes PNGs.

    updates      relative update per block (prelude, loops, coda); solid = h → f_core(h), dashed =
                 h^t → h^{t+1}
    cka          CKA heatmaps between all stages, RBF (median bandwidth) and linear, one row per run
    cka_steps    CKA between consecutive stages (e→h⁰, h⁰→h¹, …), the paper's "undifferentiated"
                 signal
    spectrum     top-50 σ_i/σ_0 per stage, log scale, ± std shaded, one panel per run
    rank         entropy effective rank per stage
    router       MeSH only: slot usage (write), slots read per step, write/read entropy per router
                 pair
    loops        validation loss against the loop count (from eval results; `loops_figure`)
    exit         validation loss against average loops per token under adaptive exit (`exit_figure`)
    curves       training and validation loss against tokens seen (from metrics.jsonl;
                 `loss_curves_figure`)
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from meshlm import atomic
from meshlm.evaluation.results import DepthRow, ExitRow, ProbeResult, Spread

Run = tuple[str, ProbeResult]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def color_of(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _errorline(ax, x, stat: Spread, label: str, color: str, style: str = "-o") -> None:
    mean, std = np.asarray(stat.mean, float), np.asarray(stat.std, float)
    ax.errorbar(x, mean, yerr=std, fmt=style, color=color, label=label, capsize=3, markersize=4,
                linewidth=1.4)


def updates(runs: list[Run]) -> Figure:
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    labels = max((r.blocks for _, r in runs), key=len)
    for i, (name, r) in enumerate(runs):
        x = np.arange(len(r.blocks))
        _errorline(ax, x, r.update_core, f"{name}: h → f(h)", color_of(i))
        if not np.allclose(r.update_core.mean, r.update_state.mean):
            _errorline(ax, x + 0.08, r.update_state, f"{name}: h^t → h^(t+1)", color_of(i), "--s")
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set_ylabel("relative update  2‖f(h)−h‖ / (‖f(h)‖+‖h‖)")
    ax.set_title("Relative update magnitude per block")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _heatmap(ax, matrix, names: list[str], title: str, vmin=0.0, vmax=1.0, cmap="viridis",
             fmt="{:.2f}") -> None:
    m = np.asarray(matrix, float)
    image = ax.imshow(m, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    for (row, col), value in np.ndenumerate(m):
        dark = (value - vmin) / max(vmax - vmin, 1e-12) < 0.6
        ax.text(col, row, fmt.format(value), ha="center", va="center", fontsize=7,
                color="white" if dark else "black")
    ax.set_title(title, fontsize=9)
    return image


def cka(runs: list[Run]) -> Figure:
    fig = new_figure(8.0, 3.3 * len(runs))
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for row, (name, r) in enumerate(runs):
        names = r.stages
        for col, kernel in enumerate(("rbf", "linear")):
            ax = axes[row][col]
            image = _heatmap(ax, r.cka(kernel).mean, names, f"{name}: CKA ({kernel})")
            ax.set_xticks(range(len(names)), names)
            ax.set_yticks(range(len(names)), names)
        fig.colorbar(image, ax=axes[row].tolist(), shrink=0.8)
    return fig


def _consecutive(r: ProbeResult, kernel: str) -> Spread:
    m, n = r.cka(kernel), len(r.stages)
    steps = range(n - 1)
    return Spread(mean=[m.mean[i][i + 1] for i in steps], std=[m.std[i][i + 1] for i in steps])


def cka_steps(runs: list[Run]) -> Figure:
    fig = new_figure(9.0, 3.4)
    axes = fig.subplots(1, 2, sharey=True)
    longest = max((r.stages for _, r in runs), key=len)
    pairs = [f"{a}→{b}" for a, b in zip(longest, longest[1:])]
    for col, kernel in enumerate(("rbf", "linear")):
        ax = axes[col]
        for i, (name, r) in enumerate(runs):
            _errorline(ax, np.arange(len(r.stages) - 1), _consecutive(r, kernel), name, color_of(i))
        ax.set_xticks(np.arange(len(pairs)), pairs, fontsize=8)
        ax.set_title(f"CKA between consecutive stages ({kernel})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CKA")
    axes[0].legend(fontsize=7)
    return fig


def spectrum(runs: list[Run]) -> Figure:
    fig = new_figure(4.2 * len(runs), 3.6)
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, (name, r) in zip(axes, runs):
        colors = _stage_colors(len(r.stages))
        for stage, color, mean, std in zip(r.stages, colors, r.spectrum.mean, r.spectrum.std):
            mean, std = np.asarray(mean, float), np.asarray(std, float)
            x = np.arange(len(mean))
            ax.plot(x, mean, color=color, label=stage, linewidth=1.4)
            ax.fill_between(x, np.clip(mean - std, 1e-6, None), mean + std, color=color, alpha=0.15)
        ax.set_yscale("log")
        ax.set_xlabel("singular value index i")
        ax.set_title(f"{name}: top-{len(r.spectrum.mean[0])} σ_i/σ_0", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("σ_i / σ_0")
    return fig


def _stage_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["plasma"]
    return [cmap(0.85 * i / max(n - 1, 1)) for i in range(n)]


def rank(runs: list[Run]) -> Figure:
    fig = new_figure(6.0, 3.4)
    ax = fig.add_subplot()
    longest = max((r.stages for _, r in runs), key=len)
    for i, (name, r) in enumerate(runs):
        _errorline(ax, np.arange(len(r.stages)), r.effective_rank, name, color_of(i))
    ax.set_xticks(np.arange(len(longest)), longest)
    ax.set_ylabel("effective rank exp(H(σ/Σσ))")
    ax.set_title("Entropy effective rank of each stage")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def router(runs: list[Run]) -> Figure | None:
    """Slot usage and read patterns for the runs that have routers (MeSH); None if none has."""
    meshes = [(name, r) for name, r in runs if r.write_usage is not None]
    if not meshes:
        return None
    fig = new_figure(12.0, 3.2 * len(meshes))
    axes = fig.subplots(len(meshes), 3, squeeze=False)
    for row, (name, r) in enumerate(meshes):
        pairs = [f"pair {p}" + (" (in)" if p == 0 else f" (loop {p})")
                 for p in range(len(r.write_usage.mean))]
        for col, kind in enumerate(("write", "read")):
            ax = axes[row][col]
            title = f"{name}: mean {kind} weight per slot"
            _heatmap(ax, getattr(r, f"{kind}_usage").mean, [], title, cmap="magma")
            ax.set_xticks(range(r.slots), [f"m{b}" for b in range(r.slots)])
            ax.set_yticks(range(len(pairs)), pairs, fontsize=8)
        ax = axes[row][2]
        x = np.arange(len(pairs))
        for offset, kind, color in ((-0.18, "write", color_of(0)), (0.18, "read", color_of(1))):
            stat = getattr(r, f"{kind}_entropy")
            ax.bar(x + offset, stat.mean, width=0.36, yerr=stat.std, color=color, label=kind,
                   capsize=2)
        ax.axhline(r.max_entropy, color="gray", linestyle=":", label="uniform (log B)")
        ax.set_xticks(x, [p.split(" (")[0] for p in pairs], fontsize=8)
        ax.set_ylabel("entropy (nats)")
        ax.set_title(f"{name}: routing entropy per pair", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def loops_figure(runs: list[tuple[str, list[DepthRow]]]) -> Figure | None:
    """Validation loss vs. loop count; `runs` = (label, EvalResult.loops); the trained K circled."""
    runs = [(name, rows) for name, rows in runs if rows]
    if not runs:
        return None
    fig = new_figure(5.6, 3.4)
    ax = fig.add_subplot()
    for i, (name, rows) in enumerate(runs):
        ax.plot([r.loops for r in rows], [r.loss for r in rows], "-o", color=color_of(i),
                label=name,
                markersize=4)
        trained = [r for r in rows if r.trained]
        ax.plot([r.loops for r in trained], [r.loss for r in trained], "o", markersize=11,
                markerfacecolor="none", color=color_of(i))
    ax.set_xticks(sorted({r.loops for _, rows in runs for r in rows}))
    ax.set_xlabel("loop steps K' (circled: as trained)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Loss vs. loop count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def exit_figure(runs: list[tuple[str, list[list[ExitRow]], list[list[DepthRow]]]]) -> Figure | None:
    """Quality vs. compute under per-token adaptive exit: validation loss against average loop steps
    per token.

    `runs` = (variant, [EvalResult.exit of each seed], [EvalResult.loops of each seed]); points are
    means over seeds.
    Dashed: fixed depth K' = 1 … the exit's most loops (the frontier exit has to beat); solid:
    `state` rules, dotted: `kl` rules (which also pay a coda + head per step: see the flops_ratio in
    eval.json)."""
    runs = [(name, exits, sweeps) for name, exits, sweeps in runs if any(exits)]
    if not runs:
        return None
    fig = new_figure(5.6, 3.6)
    ax = fig.add_subplot()
    for i, (name, exits, sweeps) in enumerate(runs):
        top = max(row.max_loops for rows in exits for row in rows)
        fixed = _mean_by(sweeps, "loops", "loops", "loss", lambda row, top=top: row.loops <= top)
        ax.plot(*fixed, "--", color=color_of(i), linewidth=1, alpha=0.8)
        for criterion, style in (("state", "-o"), ("kl", ":^")):
            xs, ys = _mean_by(exits, "exit", "avg_loops", "loss",
                              lambda row, c=criterion: row.exit.startswith(c))
            if xs:
                ax.plot(xs, ys, style, color=color_of(i), markersize=4,
                        label=f"{name} ({criterion})")
    ax.set_xlabel("average loop steps per token (dashed: fixed depth)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Adaptive exit: quality vs. average loops")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def token_count(n: float) -> str:
    """Tick label for a token count: 0, 512, 10K, 2.5M, 1.2B."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.0f}"


def loss_curves_figure(runs: list[tuple[str, dict]]) -> Figure | None:
    """Training (solid) and validation (dashed, dots) loss against tokens seen; `runs` = (label,
    curves) with curves = {"train": [(tokens, loss)], "val": [(tokens, loss)]} as
    meshlm.analysis.report reads them."""
    runs = [(name, c) for name, c in runs if c.get("train") or c.get("val")]
    if not runs:
        return None
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    for i, (name, curves) in enumerate(runs):
        if curves.get("train"):
            tokens, loss = zip(*curves["train"])
            ax.plot(tokens, loss, "-", color=color_of(i), linewidth=1.2, alpha=0.85,
                    label=f"{name}: train")
        if curves.get("val"):
            tokens, loss = zip(*curves["val"])
            ax.plot(tokens, loss, "--o", color=color_of(i), markersize=4, linewidth=1.2,
                    label=f"{name}: validation")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training and validation loss")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: token_count(x)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _mean_by(groups: list[list], key: str, x: str, y: str, keep) -> tuple[list[float], list[float]]:
    """Rows of every seed grouped by `key`, averaged: (mean x, mean y) sorted by x."""
    by: dict = {}
    for rows in groups:
        for row in rows:
            if keep(row):
                by.setdefault(getattr(row, key), []).append((getattr(row, x), getattr(row, y)))
    points = sorted((float(np.mean([a for a, _ in v])), float(np.mean([b for _, b in v])))
                    for v in by.values())
    return [a for a, _ in points], [b for _, b in points]


FIGURES = {"updates": updates, "cka": cka, "cka_steps": cka_steps, "spectrum": spectrum,
           "rank": rank,
           "router": router}


def probe_figures(runs: list[Run]) -> dict[str, Figure]:
    """Every probe figure that applies to these runs (the router figure only if some run has
    routers)."""
    figures = {name: make(runs) for name, make in FIGURES.items()}
    return {name: fig for name, fig in figures.items() if fig is not None}


FORMATS = ("png", "svg", "pdf")  # raster for pages, vector for papers


def figure_bytes(fig: Figure, fmt: str = "png") -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt)
    return buffer.getvalue()


def png_bytes(fig: Figure) -> bytes:
    return figure_bytes(fig, "png")


def save(figures: dict[str, Figure], folder: str | Path,
         formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Each figure as <name>.png, .svg and .pdf in `folder`; the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [atomic.write_bytes(folder / f"{name}.{fmt}", figure_bytes(fig, fmt))
            for name, fig in figures.items() for fmt in formats]
