"""Turn one step's raw hook rows into table columns (writer thread).

A step may hold several micro-batches (gradient accumulation) and a module
may have several output tensors; their rows share the key
(name, kind, phase, call) and are merged here: maxima by max, counts by sum,
means and shares weighted by the number of values.
"""
from __future__ import annotations

import numpy as np

from . import schema

_NAN = float("nan")

# Kind of a raw row that only counts a tensor's NaN/Inf for another row's
# `input_nonfinite` (an input no watched row produced); never written.
COUNT_KIND = "_count"
_NONFINITE = (schema.CHEAP_STATS.index("nan_count"), schema.CHEAP_STATS.index("inf_count"))
_INPUT = schema.CHEAP_STATS.index("input_nonfinite")


def fill_input_nonfinite(meta: list[tuple], stats: np.ndarray):
    """Fill each raw row's `input_nonfinite` from the rows that hold its
    inputs (`meta[i][7]`: row indices, or None for null) and drop the
    count-only rows. The hooks record where a module's inputs came from
    instead of adding counts on the device: no tensor op per module."""
    if not meta or len(meta[0]) < 8:
        return meta, stats
    # Python floats: a numpy sum per row cost more than the step's other
    # writer work (the counts are whole numbers, so the order of the
    # additions changes nothing).
    bad = (stats[:, _NONFINITE[0]] + stats[:, _NONFINITE[1]]).tolist()
    inputs = stats[:, _INPUT].tolist()
    for i, m in enumerate(meta):
        sources = m[7]
        if sources is not None:
            total = 0.0
            for j in sources:
                total += bad[j]
            inputs[i] = total
    stats[:, _INPUT] = inputs
    keep = [i for i, m in enumerate(meta) if m[1] != COUNT_KIND]
    if len(keep) == len(meta):
        return meta, stats
    return [meta[i] for i in keep], stats[keep]


def merge_rows(meta: list[tuple], stats: np.ndarray) -> dict[str, np.ndarray | list]:
    """`meta[i]` = (name, kind, phase, order, call, dtype, numel[, inputs]);
    `stats[i]` the statistics vector of that row. Returns the non-constant
    columns of the tensors table (everything but step and rank), one row
    per key."""
    meta, stats = fill_input_nonfinite(meta, stats)
    n, width = stats.shape if len(meta) else (0, len(schema.FULL_STATS))
    keys: dict[tuple, int] = {}
    first: list[int] = []
    inverse = np.empty(n, dtype=np.int64)
    for i, m in enumerate(meta):
        k = (m[0], m[1], m[2], m[4])
        j = keys.get(k)
        if j is None:
            j = keys[k] = len(first)
            first.append(i)
        inverse[i] = j
    g = len(first)
    numel_rows = np.array([m[6] for m in meta], dtype=np.float64)
    order_rows = np.array([m[3] for m in meta], dtype=np.int64)

    # Every key once (one micro-batch, one output tensor per module: the
    # usual step): keys are in first-seen order, so row i is key i, and
    # each merge below would return its one part (a NaN part stays null):
    # the columns are taken as they are.
    single = g == n
    if single:
        numel, order = numel_rows, order_rows
    else:
        numel = np.zeros(g)
        np.add.at(numel, inverse, numel_rows)
        order = np.full(g, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(order, inverse, order_rows)

    out: dict[str, np.ndarray | list] = {
        "name": [meta[i][0] for i in first],
        "kind": [meta[i][1] for i in first],
        "phase": [meta[i][2] for i in first],
        "order": order.astype(np.int32),
        "call": np.array([meta[i][4] for i in first], dtype=np.int32),
        "dtype": [meta[i][5] for i in first],
        "numel": numel.astype(np.int64),
    }
    col = {name: idx for idx, name in enumerate(schema.FULL_STATS[:width])}

    def reduce(name, how):
        v = stats[:, col[name]]
        if single:
            return v.copy()
        if how == "max":
            r = np.full(g, -np.inf)
            np.fmax.at(r, inverse, v)
            r[np.isneginf(r)] = _NAN
        elif how == "min":
            r = np.full(g, np.inf)
            np.fmin.at(r, inverse, v)
            r[np.isposinf(r)] = _NAN
        elif how == "sum":
            # A null (NaN) part stays null only when every part is null.
            r = np.zeros(g)
            np.add.at(r, inverse, np.nan_to_num(v, nan=0.0))
            seen = np.zeros(g)
            np.add.at(seen, inverse, (~np.isnan(v)).astype(np.float64))
            r[seen == 0] = _NAN
        else:  # numel-weighted mean; "rms" combines mean squares
            w = numel_rows
            vv = v * v if how == "rms" else v
            r = np.zeros(g)
            np.add.at(r, inverse, np.nan_to_num(vv * w, nan=0.0))
            ww = np.zeros(g)
            np.add.at(ww, inverse, np.where(np.isnan(v), 0.0, w))
            with np.errstate(invalid="ignore", divide="ignore"):
                r = r / ww
            if how == "rms":
                r = np.sqrt(r)
        return r

    out["absmax"] = reduce("absmax", "max")
    out["nan_count"] = reduce("nan_count", "sum").astype(np.int64)
    out["inf_count"] = reduce("inf_count", "sum").astype(np.int64)
    out["input_nonfinite"] = reduce("input_nonfinite", "sum")
    full = width >= len(schema.FULL_STATS)
    for name, how in (("min", "min"), ("max", "max"), ("mean", "mean"), ("rms", "rms"),
                      ("zero_share", "mean"), ("below_normal_share", "mean"),
                      ("below_subnormal_share", "mean"), ("near_overflow_share", "mean")):
        out[name] = reduce(name, how) if full else np.full(g, _NAN)
    # Shares stay numel-weighted (each part's sample stands for its values);
    # the sample sizes add up like numel.
    out["share_sample_size"] = reduce("share_sample_size", "sum") if full else np.full(g, _NAN)
    # Keep the table in execution order: phase, then order.
    phase_rank = np.array([0 if p == "forward" else 1 for p in out["phase"]])
    perm = np.lexsort((out["order"], phase_rank))
    return {k: ([v[i] for i in perm] if isinstance(v, list) else v[perm]) for k, v in out.items()}
