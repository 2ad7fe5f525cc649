"""Per-variant figures of a depth study (mean ± std over seeds), for docs/depth.md:

    python scripts/study_figures.py runs/studies/elastic docs/figures/elastic

loops.png  validation loss against the loop count K' (every `<variant>-s<seed>/eval.json` "loops"
           row)
exit.png   adaptive exit: loss change against fixed depth at the trained mean, against average loops
           per token, one point per rule (the "exit" rows), per variant

`meshlm report` overlays every run; with several seeds per variant that is unreadable, so these
average.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshlm.evaluation.results import EvalResult, read_eval  # noqa: E402


def load(study: Path) -> dict[str, list[EvalResult]]:
    """variant -> its runs' eval.json contents."""
    runs = defaultdict(list)
    for path in sorted(study.glob("*-s*/eval.json")):
        runs[path.parent.name.rsplit("-s", 1)[0]].append(read_eval(path))
    return dict(runs)


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def loops_figure(runs: dict[str, list[EvalResult]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for variant, evals in runs.items():
        counts = sorted({row.loops for e in evals for row in e.loops})
        stats = [spread([row.loss for e in evals for row in e.loops if row.loops == k])
                 for k in counts]
        ax.errorbar(counts, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", ms=3,
                    capsize=2,
                    label=f"{variant} ({len(evals)})", ls="--" if "fixed" in variant else "-")
    ax.set(xlabel="loop steps K' at evaluation (trained: K = 4, or mean 4)",
           ylabel="validation loss (nats/token)",
           title="Loss vs. loop count, mean ± std over seeds", xscale="log", ylim=(5.3, 5.9))
    ax.set_xticks([1, 2, 3, 4, 6, 8, 12, 16], ["1", "2", "3", "4", "6", "8", "12", "16"])
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out / "loops.png", dpi=120)


def exit_figure(runs: dict[str, list[EvalResult]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for variant, evals in runs.items():
        rules = [row.exit for row in evals[0].exit]
        points = []
        for rule in rules:
            deltas, loops = [], []
            for e in evals:
                reference = next(row.loss for row in e.loops if row.loops == 4)
                row = next(row for row in e.exit if row.exit == rule)
                deltas.append(row.loss - reference)
                loops.append(row.avg_loops)
            points.append((statistics.mean(loops), statistics.mean(deltas), rule))
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=variant,
                ls="--" if "fixed" in variant else "-")
    ax.axhline(0.01, color="grey", lw=0.8, ls=":")
    ax.axvline(0.7 * 4, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="average loop steps per token (at most 4)",
           ylabel="loss − loss at 4 loops (nats)",
           title="Adaptive exit, mean over seeds (dotted: 0.01 nats; 70% of 4 loops)")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_ylim(-0.003, 1.5)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out / "exit.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", type=Path, help="the study's run folder (runs/studies/NAME)")
    p.add_argument("out", type=Path, help="where loops.png and exit.png go")
    args = p.parse_args()
    study, out = args.study, args.out
    out.mkdir(parents=True, exist_ok=True)
    runs = load(study)
    loops_figure(runs, out)
    exit_figure(runs, out)
    print(f"{out / 'loops.png'} and {out / 'exit.png'} from {sum(map(len, runs.values()))} runs")


if __name__ == "__main__":
    main()
