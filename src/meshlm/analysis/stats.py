"""How the results pages state a spread over runs (one place, so every table says it alike)."""
from __future__ import annotations

import statistics


def mean_std(values: list[float], digits: int = 3, scale: float = 1.0, signed: bool = False) -> str:
    """"m ± s" over runs (s: the sample standard deviation, n − 1), one value alone as it is, "–"
    for none; each value times `scale`; `signed` puts a + on the mean."""
    values = [v * scale for v in values]
    sign = "+" if signed else ""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"
