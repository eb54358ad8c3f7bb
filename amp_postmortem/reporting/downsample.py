"""Downsampling for display: a million steps become a few thousand points
without hiding what a post-mortem looks for.

A line keeps, per step bucket, the points holding the bucket's smallest and
largest value (a spike survives any zoom-out); marked steps (skipped,
non-finite) are kept one by one up to a cap, then one per fine bucket with
the number of marked steps it stands for. Pure numpy; no plotting here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_LINE_BUCKETS = 2000   # a line: at most 2 points per bucket -> 4,000 points
MAX_MARKERS = 5000        # marked steps shown one by one up to this many


def bucket_of(steps: np.ndarray, first: int, last: int, buckets: int) -> np.ndarray:
    """Bucket index (0..buckets-1) of each step in [first, last], equal widths."""
    span = max(int(last) - int(first) + 1, 1)
    b = (np.asarray(steps, dtype=np.int64) - int(first)) * int(buckets) // span
    return np.clip(b, 0, int(buckets) - 1)


def minmax_line(steps, values, *, first: int, last: int, buckets: int = MAX_LINE_BUCKETS
                ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the finite points kept for display, in step order:
    every point when there are at most 2 x `buckets`, else the minimum and
    the maximum of each bucket."""
    steps = np.asarray(steps, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(values)
    steps, values = steps[ok], values[ok]
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    if len(steps) <= 2 * buckets:
        return steps, values
    b = bucket_of(steps, first, last, buckets)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])  # steps are sorted: buckets are runs
    lo = np.minimum.reduceat(values, starts)
    hi = np.maximum.reduceat(values, starts)
    # Index of the first min / max inside each run.
    run_id = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(steps)]))
    is_lo = values == lo[run_id]
    is_hi = values == hi[run_id]
    first_lo = _first_per_run(is_lo, run_id)
    first_hi = _first_per_run(is_hi, run_id)
    keep = np.unique(np.r_[first_lo, first_hi])
    return steps[keep], values[keep]


def _first_per_run(flags: np.ndarray, run_id: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(flags)
    _, first = np.unique(run_id[idx], return_index=True)  # idx ascending: first hit per run
    return idx[first]


@dataclass
class Markers:
    """Marked steps kept for display: `steps[i]` stands for `counts[i]`
    marked steps (1 unless the cap grouped them)."""
    steps: np.ndarray
    counts: np.ndarray

    @property
    def grouped(self) -> bool:
        return bool(len(self.counts)) and int(self.counts.max()) > 1


def marked_steps(steps, *, first: int, last: int, cap: int = MAX_MARKERS) -> Markers:
    """Every marked step up to `cap`; above it, the first marked step of each
    of `cap` equal step buckets, with how many it stands for."""
    steps = np.unique(np.asarray(steps, dtype=np.int64))
    if len(steps) <= cap:
        return Markers(steps, np.ones(len(steps), dtype=np.int64))
    b = bucket_of(steps, first, last, cap)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    counts = np.diff(np.r_[starts, len(steps)])
    return Markers(steps[starts], counts)
