"""Robust trend of a series: the Theil-Sen slope with its confidence interval,
shared by the loss-scale and headroom analyses."""
from __future__ import annotations

import numpy as np
from scipy import stats


def theil_sen(x, y, *, alpha: float, max_points: int) -> tuple[float, float, float]:
    """(slope, low, high) of y over x at confidence 1 - alpha. Theil-Sen is
    O(n^2) in the number of points: above `max_points` it is fitted on an
    evenly spaced subsample, which keeps the slope's robustness."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) > max_points:
        idx = np.linspace(0, len(x) - 1, max_points).round().astype(int)
        x, y = x[idx], y[idx]
    res = stats.theilslopes(y, x, alpha=1 - alpha)
    return float(res[0]), float(res[2]), float(res[3])
