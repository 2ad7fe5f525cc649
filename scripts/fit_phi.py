"""Fit the recurrence-equivalence exponent φ per scheme from a finished study (meshlm.analysis.phi).

    meshlm reproduce configs/studies/phi.yaml --jobs 8     # widths x r in {1, 2, 4, 8} x schemes (a
                                                             GPU study)
    python scripts/fit_phi.py runs/studies/phi             # φ, α, R² and residuals per scheme
    meshlm reproduce configs/studies/phi-suite.yaml --jobs 2   # the CPU-sized study on chain
    python scripts/fit_phi.py runs/studies/phi-suite
"""
from __future__ import annotations

import argparse
from pathlib import Path

from meshlm.analysis.phi import fit, study_points
from meshlm.evaluation.results import read_eval


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study_dir")
    args = p.parse_args()
    evals = Path(args.study_dir).glob("*/eval.json")
    schemes = sorted({read_eval(path).model["scheme"] for path in evals})
    for scheme in schemes:
        points = study_points(args.study_dir, scheme)
        if len(points) < 5:
            print(f"{scheme}: {len(points)} runs, too few to fit (need >= 5)")
            continue
        f = fit(points)
        print(f"{scheme}: φ = {f['phi']:.3f}, α = {f['alpha']:.3f}, E = {f['E']:.3f}, R² = "
              f"{f['r2']:.4f} ({f['points']} runs)")
        for (once, rec, r, loss), res in zip(points, f["residuals"]):  # where the fit misses
            print(f"    N_once {once:>9,}  N_rec {rec:>9,}  r {r}  loss {loss:.4f}  "
                  f"residual {res:+.4f}")


if __name__ == "__main__":
    main()
