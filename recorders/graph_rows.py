"""The in-graph statistics' buffer (`collectors.graph_stats.GraphStats`)
turned into a step's rows, on the writer thread; and its layout.

One step's values are the forward rows (a row per `GraphStats.slots`
entry, then the step's own row: the micro-batches traced in the graph, the
autocast codes), then a row per `GraphStats.grad_slots` entry, each row
`WIDTH` float64 values:

    absmax, nan_count, inf_count, input_nonfinite, tensors, numel, seq, dtype, enter

A slot no graph wrote (`tensors` 0) gives no row.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .aggregate import COUNT_KIND

WIDTH = 9
ABSMAX, NAN, INF, INPUT_BAD, TENSORS, NUMEL, SEQ, DTYPE, ENTER = range(WIDTH)
# Codes of the dtypes a row may have (0: none seen); also autocast's.
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)
AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")
# Columns of the forward rows' last row (the step's own; column 0 unused:
# the counter is a tensor of its own).
MICRO_BATCHES, AUTOCAST_DTYPE, AUTOCAST_DEVICE = range(1, 4)


def autocast_info(stats, values) -> dict | None:
    """The autocast state a traced graph saw (None: not traced in a graph,
    or autocast off there: the eager reading stands)."""
    last = values[len(stats.slots) * WIDTH:(len(stats.slots) + 1) * WIDTH]
    code, dev = int(last[AUTOCAST_DTYPE]), int(last[AUTOCAST_DEVICE])
    if not code or not dev:
        return None
    return {"enabled": True, "device_type": AUTOCAST_DEVICES[dev - 1], "dtype": DTYPE_NAMES[code - 1],
            "cache_enabled": None}


def graph_rows(stats, values, width: int) -> tuple[list, list, int]:
    """(meta, stats rows of `width`, micro-batches traced in the graph) of
    the used slots of one step's values (`GraphStats.take`, as a float64
    array). A sort key stands in the `order` field (the caller ranks it
    among the step's eager rows): forward rows by when their call ended;
    backward rows by the reverse of their module's forward (the gradient
    reaching a module's output comes when its forward's end is undone, the
    one it hands its inputs when its beginning is). A `grad_input` row's
    `input_nonfinite` is the NaN/Inf count of the gradients its module's
    outputs received (its `grad_output` slot), as in eager rows."""
    n = len(stats.slots) + 1
    fwd = values[: n * WIDTH].reshape(n, WIDTH)
    bwd = values[n * WIDTH:].reshape(-1, WIDTH)
    used = {}
    for (name, kind), v in list(zip(stats.slots, fwd)) + list(zip(stats.grad_slots, bwd)):
        if v[TENSORS] > 0:
            used[(name, kind)] = v
    pad = (math.nan,) * (width - 4)
    meta, rows = [], []
    for (name, kind), v in used.items():
        act = fwd[stats.index[(name, "activation")]] if kind in ("grad_output", "grad_input") else None
        if kind == "activation":
            phase, key, bad = "forward", float(v[SEQ]), float(v[INPUT_BAD])
        elif kind == "input":
            phase, key, bad = "forward", float(v[SEQ]), math.nan
        elif kind == "grad_output":
            phase, key, bad = "backward", -float(act[SEQ]), math.nan
        else:
            out = used.get((name, "grad_output"))
            phase, key = "backward", -float(act[ENTER])
            bad = float(out[NAN] + out[INF]) if out is not None else math.nan
        code = int(v[DTYPE])
        meta.append((name, kind, phase, key, 0, DTYPE_NAMES[code - 1] if code else None, int(v[NUMEL]), None))
        rows.append((float(v[ABSMAX]), float(v[NAN]), float(v[INF]), bad) + pad)
    return meta, rows, int(fwd[-1][MICRO_BATCHES])


def with_graph_rows(meta: list, rows, gmeta: list, grows: list, fwd_anchor) -> tuple[list, object]:
    """The step's eager rows (`meta`, `rows`: an array) and its graph rows
    together, every row's `order` its rank in the step's execution order,
    per phase. The graph's forward rows come before the eager forward row
    of order `fwd_anchor` (the order the eager root's inputs left off at;
    None: before every eager one: the root ran in the graph); its backward
    rows before the eager parameter gradients (their hooks run after the
    compiled backward) and after any other eager backward row (the
    gradient reaching an eager root's output, which reaches the graph
    next)."""
    param_orders = [m[3] for m in meta if m[1] == "param_grad"]
    other_bwd = [m[3] for m in meta if m[2] == "backward" and m[1] != "param_grad"]
    bwd_anchor = min(param_orders) if param_orders else (max(other_bwd) + 1 if other_bwd else 0)
    anchors = {"forward": 0 if fwd_anchor is None else fwd_anchor, "backward": bwd_anchor}
    # (eager order, 1, 0) and (anchor, 0, seq): dense ranks of the keys
    keys = [None if m[1] == COUNT_KIND else (m[3], 1, 0.0) for m in meta]
    keys += [(anchors[m[2]], 0, m[3]) for m in gmeta]
    all_meta = list(meta) + list(gmeta)
    out = []
    for phase in ("forward", "backward"):
        ranks = {k: r for r, k in enumerate(sorted({k for k, m in zip(keys, all_meta)
                                                    if k is not None and m[2] == phase}))}
        for i, (k, m) in enumerate(zip(keys, all_meta)):
            if m[2] == phase and k is not None:
                keys[i] = ranks[k]
    for k, m in zip(keys, all_meta):
        out.append(m if k is None else (m[0], m[1], m[2], int(k)) + tuple(m[4:]))
    extra = np.asarray(grows, dtype=np.float64).reshape(len(grows), -1)
    return out, np.concatenate([np.asarray(rows).reshape(-1, extra.shape[1]), extra])
