"""The recurrence-equivalence exponent φ (Schwethelm et al., arXiv 2604.21106): how much a loop is
worth.

At a fixed token budget, a looped model with N_once unshared and N_rec recurrent (core) parameters,
run r times, reaches the loss of a model with N_once + r^φ · N_rec unique parameters:

    L = E + A · (N_once + r^φ · N_rec)^(−α)

φ = 1: a loop is worth a new layer; φ = 0: it is worth nothing. The paper measured 0.46 for plain
looping and 0.38 with truncated backprop. MeSH's claim, in this language, is that φ goes up.

`fit` takes (N_once, N_rec, r, loss) points, e.g. a study over widths × r ∈ {1, 2, 4, 8} at matched
tokens (configs/studies/phi.yaml), and fits (E, A, α, φ): for each (φ, α) on a grid, E and A follow
by linear least squares; the grid is refined around the best cell three times. No optimiser library,
no initial guesses.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from meshlm.config import ModelConfig
from meshlm.evaluation.results import read_eval


def loop_params(model: dict, acc: dict) -> tuple[int, int, int]:
    """(N_once, N_rec, r) of a model (its config and accounting dicts, as in eval.json): the core's
    parameters are N_rec, every other non-embedding parameter (prelude, coda, final norm, scheme) is
    N_once, r the trained loop steps."""
    layout = ModelConfig.from_dict(model).layout
    per_layer = (acc["non_embedding_params"] - acc["scheme_params"] - 2 * model["d_model"]) \
        // acc["unique_layers"]
    n_rec = sum(layout.cores) * per_layer if layout.shares_weights else 0
    return acc["non_embedding_params"] - n_rec, n_rec, layout.n_steps


def _sse(x: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """Least squares loss = E + A·x: (sse, E, A)."""
    design = np.stack([np.ones_like(x), x], axis=1)
    (e, a), *_ = np.linalg.lstsq(design, loss, rcond=None)
    return float(((design @ [e, a] - loss) ** 2).sum()), float(e), float(a)


def fit(points: list[tuple[float, float, float, float]]) -> dict:
    """(N_once, N_rec, r, loss) points -> {"phi", "alpha", "E", "A", "r2", "points", "residuals"
    (each point's loss minus the fit's, in the points' order)}; needs >= 5 points."""
    if len(points) < 5:
        raise ValueError(f"fitting E, A, α and φ needs at least 5 runs, got {len(points)}")
    once, rec, r, loss = (np.asarray(c, dtype=float) for c in zip(*points))
    phis, alphas = np.linspace(0, 1.5, 61), np.linspace(0.02, 1.5, 75)
    best = None
    for _ in range(4):
        for phi in phis:
            size = once + r ** phi * rec
            for alpha in alphas:
                sse, e, a = _sse(size ** -alpha, loss)
                if a > 0 and (best is None or sse < best[0]):
                    best = (sse, phi, alpha, e, a)
        _, phi, alpha, _, _ = best
        dphi, dalpha = phis[1] - phis[0], alphas[1] - alphas[0]
        phis = np.linspace(max(0.0, phi - 2 * dphi), phi + 2 * dphi, 41)
        alphas = np.linspace(max(1e-3, alpha - 2 * dalpha), alpha + 2 * dalpha, 41)
    sse, phi, alpha, e, a = best
    total = float(((loss - loss.mean()) ** 2).sum())
    predicted = e + a * (once + r ** phi * rec) ** -alpha
    return {"phi": float(phi), "alpha": float(alpha), "E": e, "A": a,
            "r2": 1 - sse / total if total else float("nan"),
            "points": len(points), "residuals": (loss - predicted).tolist()}


def study_points(study_dir: str | Path,
                 scheme: str | None = None) -> list[tuple[int, int, int, float]]:
    """(N_once, N_rec, r, validation loss) of every evaluated run under a study folder (one scheme,
    if given)."""
    points = []
    for path in sorted(Path(study_dir).glob("*/eval.json")):
        result = read_eval(path)
        if scheme is None or result.model["scheme"] == scheme:
            points.append((*loop_params(result.model, result.accounting), result.perplexity.loss))
    return points
