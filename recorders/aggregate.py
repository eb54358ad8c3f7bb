"""Turn one step's raw hook rows into table columns (writer thread).

A step may hold several micro-batches (gradient accumulation) and a module
may have several output tensors; their rows share the key
(name, kind, phase, call) and are merged here: maxima by max, counts by sum,
means and shares weighted by the number of values.
"""
from __future__ import annotations

import numpy as np

from .format import schema

_NAN = float("nan")

# Kind of a raw row that only counts a tensor's NaN/Inf for another row's
# `input_nonfinite` (an input no watched row produced); never written.
COUNT_KIND = "_count"
_NONFINITE = (schema.CHEAP_STATS.index("nan_count"), schema.CHEAP_STATS.index("inf_count"))
_INPUT = schema.CHEAP_STATS.index("input_nonfinite")


class MergePlan:
    """The structure of a step's rows, worked out once and reused while the
    steps keep it: a static model's steps have the same rows in the same
    order (names, kinds, calls, dtypes, sizes, where inputs came from), and
    grouping, ordering and the string columns were most of the writer
    thread's time (its Python work holds the GIL the training thread
    needs). Only the statistics are new each step. `MergePlan.of(meta)`
    builds one; `plan.meta == meta` says whether it serves."""

    __slots__ = ("meta", "keep", "input_dst", "input_src", "has_sources", "first", "inverse",
                 "single", "numel_rows", "static", "perm", "group_count")

    @classmethod
    def of(cls, meta: list[tuple]) -> "MergePlan":
        plan = cls()
        plan.meta = meta
        dst, src, has = [], [], []
        for i, m in enumerate(meta):
            sources = m[7] if len(m) > 7 else None
            if sources is not None:
                has.append(i)
                dst += [i] * len(sources)
                src += sources
        plan.has_sources = np.array(has, dtype=np.int64)
        plan.input_dst = np.array(dst, dtype=np.int64)
        plan.input_src = np.array(src, dtype=np.int64)
        # Count-only rows go with `input_nonfinite` (rows of 8 fields).
        keep = [i for i, m in enumerate(meta) if not (len(m) > 7 and m[1] == COUNT_KIND)]
        plan.keep = None if len(keep) == len(meta) else np.array(keep, dtype=np.int64)
        kept = meta if plan.keep is None else [meta[i] for i in keep]
        keys: dict[tuple, int] = {}
        first: list[int] = []
        inverse = np.empty(len(kept), dtype=np.int64)
        ops = False
        for i, m in enumerate(kept):
            k = (m[0], m[1], m[2], m[4])
            if len(m) > 8:  # an `intermediate` row: (op, op_index, source) is part of its key
                k = k + (m[8],)
                ops = True
            j = keys.get(k)
            if j is None:
                j = keys[k] = len(first)
                first.append(i)
            inverse[i] = j
        g = len(first)
        plan.first, plan.inverse, plan.group_count = first, inverse, g
        # Every key once (one micro-batch, one output tensor per module: the
        # usual step): keys are in first-seen order, so row i is key i, and
        # each merge would return its one part (a NaN part stays null).
        plan.single = g == len(kept)
        numel_rows = np.array([m[6] for m in kept], dtype=np.float64)
        order_rows = np.array([m[3] for m in kept], dtype=np.int64)
        if plan.single:
            numel, order = numel_rows, order_rows
        else:
            numel = np.zeros(g)
            np.add.at(numel, inverse, numel_rows)
            order = np.full(g, np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(order, inverse, order_rows)
        plan.numel_rows = numel_rows
        phases = [kept[i][2] for i in first]
        # Keep the table in execution order: phase, then order.
        phase_rank = np.array([0 if p == "forward" else 1 for p in phases])
        perm = np.lexsort((order, phase_rank))
        plan.perm = perm
        # The columns that do not change while the plan serves, permuted;
        # the same objects every step (the writer's Arrow arrays are reused
        # for them, see writer.ShardWriter).
        plan.static = {
            "name": [kept[first[i]][0] for i in perm],
            "kind": [kept[first[i]][1] for i in perm],
            "phase": [phases[i] for i in perm],
            "order": order.astype(np.int32)[perm],
            "call": np.array([kept[i][4] for i in first], dtype=np.int32)[perm],
            "dtype": [kept[first[i]][5] for i in perm],
            "numel": numel.astype(np.int64)[perm],
        }
        plan.static.update(_op_columns([kept[first[i]] for i in perm] if ops else None, g))
        return plan


def _op_columns(rows: list | None, g: int) -> dict:
    """The `op`, `op_index` and `source` columns of a step's merged rows
    (`rows`: each key's first raw row; None: no `intermediate` row, all null)."""
    if rows is None:
        return {"op": [None] * g, "op_index": np.full(g, _NAN), "source": [None] * g}
    ops = [m[8] if len(m) > 8 else None for m in rows]
    return {"op": [o[0] if o else None for o in ops],
            "op_index": np.array([o[1] if o else _NAN for o in ops], dtype=np.float64),
            "source": [o[2] if o else None for o in ops]}


def event_rows(cols: dict) -> np.ndarray:
    """The merged rows that count as non-finite (NaN/Inf) for the events,
    the bundle triggers and the shard's `nonfinite_rows`: every kind but
    `intermediate` (inside a module an Inf is often meant: a mask's -Inf)."""
    bad = (np.asarray(cols["nan_count"]) > 0) | (np.asarray(cols["inf_count"]) > 0)
    op_index = cols.get("op_index")
    if op_index is not None and len(op_index) and not np.isnan(op_index).all():
        bad &= np.isnan(op_index)
    return bad


def without_intermediates(cols: dict) -> dict:
    """`cols` without its `intermediate` rows (the same dict when it has none)."""
    op_index = cols.get("op_index")
    if op_index is None or not len(op_index) or np.isnan(op_index).all():
        return cols
    keep = np.isnan(op_index)
    idx = np.flatnonzero(keep)
    return {k: ([v[i] for i in idx] if isinstance(v, list) else np.asarray(v)[keep]) for k, v in cols.items()}


def fill_input_nonfinite(meta: list[tuple], stats: np.ndarray, plan: MergePlan | None = None):
    """Fill each raw row's `input_nonfinite` from the rows that hold its
    inputs (`meta[i][7]`: row indices, or None for null) and drop the
    count-only rows. The hooks record where a module's inputs came from
    instead of adding counts on the device: no tensor op per module."""
    if not meta or len(meta[0]) < 8:
        return meta, stats
    if plan is None:
        plan = MergePlan.of(meta)
    if len(plan.has_sources):
        # The counts are whole numbers: the order of the additions changes nothing.
        bad = stats[:, _NONFINITE[0]] + stats[:, _NONFINITE[1]]
        inputs = stats[:, _INPUT]
        inputs[plan.has_sources] = 0.0
        np.add.at(inputs, plan.input_dst, bad[plan.input_src])
    if plan.keep is None:
        return meta, stats
    return [meta[i] for i in plan.keep], stats[plan.keep]


def merge_rows(meta: list[tuple], stats: np.ndarray, plan: MergePlan | None = None) -> dict[str, np.ndarray | list]:
    """`meta[i]` = (name, kind, phase, order, call, dtype, numel[, inputs]);
    `stats[i]` the statistics vector of that row. Returns the non-constant
    columns of the tensors table (everything but step and rank), one row
    per key. `plan`: `MergePlan.of(meta)` made for an earlier step with the
    same rows (None: made here)."""
    if plan is None or (plan.meta is not meta and plan.meta != meta):
        plan = MergePlan.of(meta)
    if len(meta) and len(meta[0]) >= 8:
        _, stats = fill_input_nonfinite(meta, stats, plan)
    n, width = stats.shape if len(meta) else (0, len(schema.FULL_STATS))
    g, inverse, single, numel_rows = plan.group_count, plan.inverse, plan.single, plan.numel_rows
    out: dict[str, np.ndarray | list] = dict(plan.static)
    col = {name: idx for idx, name in enumerate(schema.FULL_STATS[:width])}
    perm = plan.perm

    def reduce(name, how):
        v = stats[:, col[name]]
        if single:
            return v[perm]
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
        return r[perm]

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
    return out
