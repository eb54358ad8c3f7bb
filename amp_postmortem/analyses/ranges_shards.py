"""The shard reduction of `ranges`: the tensor rows of the window reduced to
one row per layer and step, shard by shard (`reduce_shard`, the per-shard
map, batch by batch), then merged across shards (`reduce_window`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..reading.engines.scan import reduces_batches
from ..reading.loader import Run

KINDS = ("input", "activation", "grad_output", "grad_input")
_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "dtype", "absmax", "nan_count",
            "inf_count", "zero_share", "below_normal_share", "below_subnormal_share", "rms", "share_sample_size"]

# One value per layer and step: ranks and repeated calls merged. Max, any,
# min and first merge shard by shard exactly; the means (full-tier columns,
# null in cheap-tier rows) are taken at the end over the full-tier rows
# only, in the order read, which is the same sum as over every row. A shard
# is reduced batch by batch as it is read (`scan.reduces_batches`), a layer
# travels as an integer id (its name and kind once per shard) and the
# merged table as a few numpy columns merged by sorting (an Arrow group-by
# holds several times its input): so the memory is bounded by a batch of
# rows plus window x layers of a few numbers (and the full-tier rows), not
# by the shard's rows nor by ranks x window x layers of strings.
_KEYS = ["lid", "step"]
# The merged columns: absmax (max; NaN: none recorded), bad (any), dtype (a
# code into the dtypes seen, the first recorded; -1: none), fwd (1 for a
# forward row: first), order (min).
_MERGED = ["absmax", "bad", "dtype", "fwd", "order"]
_MEANS = ["zero_share", "below_normal_share", "below_subnormal_share"]
# share_sample_size: the values the shares were counted on, summed over
# ranks and calls (a sum over nothing but nulls is null: unknown).
_FULL = _KEYS + _MEANS + ["rms", "share_sample_size"]
_CONSOLIDATE_ROWS = 1 << 20


@dataclass
class ShardRanges:
    """One shard's part of the per-step table (see `reduce_shard`)."""
    layers: list       # (name, kind) of each layer id of this shard
    dtypes: list       # the dtype of each dtype code of this shard
    merged: dict       # _KEYS + _MERGED + pos numpy columns, one row per layer and step (see `_merge`)
    full: pa.Table     # _FULL, the full-tier rows as read
    full_steps: set
    rows: int


@reduces_batches
def reduce_shard(batches) -> ShardRanges:
    """The per-shard map of `ranges` (runs where the shard is read): the
    shard's record batches (or one table) in, one partial bounded by its
    layers x steps out. In Arrow and numpy: at 1,000 ranks it runs once per
    shard of the window."""
    if isinstance(batches, pa.Table):
        batches = batches.to_batches()
    layers: dict = {}
    dtypes: dict = {}
    merged: list[dict] = []
    full: list[pa.Table] = []
    full_steps: set = set()
    rows = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        rows += batch.num_rows
        t = pa.Table.from_batches([batch])
        lid = _codes(t["name"], t["kind"], layers)
        has_full = pc.or_kleene(pc.or_kleene(pc.is_valid(t["zero_share"]), pc.is_valid(t["below_normal_share"])),
                                pc.is_valid(t["below_subnormal_share"]))
        # With the rows that carry only an RMS or a sample size: their
        # maximum and sum are over every row of the layer and step.
        keep = pc.or_kleene(has_full, pc.or_kleene(pc.is_valid(t["rms"]), pc.is_valid(t["share_sample_size"])))
        full.append(t.append_column("lid", pa.array(lid, pa.int32())).filter(keep).select(_FULL))
        full_steps.update(pc.unique(t.filter(pc.is_valid(t["below_normal_share"]))["step"]).to_pylist())
        merged.append(_merge([{
            "lid": lid, "step": t["step"].to_numpy(), "pos": np.arange(rows - batch.num_rows, rows),
            "absmax": t["absmax"].to_numpy().astype(float),  # null: NaN
            "bad": pc.greater(pc.add(t["nan_count"], t["inf_count"]), 0).to_numpy(),
            "dtype": _dtype_codes(t["dtype"], dtypes),
            "fwd": pc.equal(t["phase"], "forward").to_numpy().astype(np.int8),
            "order": t["order"].to_numpy()}]))
    return ShardRanges(list(layers), list(dtypes), _merge(merged),
                       pa.concat_tables(full) if full else _EMPTY_FULL, full_steps, rows)


def _codes(names: pa.ChunkedArray, kinds: pa.ChunkedArray, seen: dict) -> np.ndarray:
    """Per row, the id of its (name, kind) in `seen` (new pairs added, ids in
    order of first row): one dictionary lookup per distinct pair."""
    n = pc.dictionary_encode(names.combine_chunks())
    k = pc.dictionary_encode(kinds.combine_chunks())
    nk = len(k.dictionary)
    key = n.indices.to_numpy().astype(np.int64) * nk + k.indices.to_numpy()
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    ids = np.empty(len(uniq), dtype=np.int32)
    names_d, kinds_d = n.dictionary.to_pylist(), k.dictionary.to_pylist()
    for i in np.argsort(first, kind="stable"):  # new ids in order of first row
        ids[i] = seen.setdefault((names_d[uniq[i] // nk], kinds_d[uniq[i] % nk]), len(seen))
    return ids[inverse.ravel()]


def _dtype_codes(dtype: pa.ChunkedArray, seen: dict) -> np.ndarray:
    """Per row, the code of its dtype in `seen` (new ones added; -1 where none recorded)."""
    d = pc.dictionary_encode(dtype.combine_chunks())
    table = np.array([seen.setdefault(v, len(seen)) for v in d.dictionary.to_pylist()] + [-1], dtype=np.int32)
    return table[pc.fill_null(d.indices, len(table) - 1).to_numpy()]


def _merge(parts: list[dict]) -> dict:
    """The rows of `parts` (in the order read) with equal (layer, step)
    merged, sorted by (layer, step); `pos` is each group's first row (its
    position in the order read). A stable sort keeps each group's rows in
    the order read, so `first` is the first recorded. It consumes `parts`
    (their columns are moved out one by one) and works column by column, so
    that beside the rows only the sort and one sorted column are held."""
    if not parts:
        return {c: np.zeros(0, dtype=t) for c, t in _DTYPES.items()}
    cols = {c: np.concatenate([p.pop(c) for p in parts]) for c in _DTYPES}
    n = len(cols["lid"])
    if not n:
        return cols
    srt = np.lexsort((cols["step"], cols["lid"]))
    lid, step = cols.pop("lid")[srt], cols.pop("step")[srt]
    new = np.ones(n, dtype=bool)
    new[1:] = (lid[1:] != lid[:-1]) | (step[1:] != step[:-1])
    starts = np.flatnonzero(new)
    del new
    out = {"lid": lid[starts], "step": step[starts]}
    del lid, step
    for c, how in (("absmax", np.fmax), ("bad", np.logical_or), ("order", np.minimum), ("pos", np.minimum)):
        out[c] = how.reduceat(cols.pop(c)[srt], starts)  # fmax: NaN only when all are
    out["fwd"] = cols.pop("fwd")[srt[starts]]
    dtype = cols.pop("dtype")[srt]
    first_known = np.minimum.reduceat(np.where(dtype >= 0, np.arange(n), n), starts)
    out["dtype"] = np.where(first_known < n, dtype[np.minimum(first_known, n - 1)], -1).astype(np.int32)
    return out


_DTYPES = {"lid": np.int32, "step": np.int64, "absmax": np.float64, "bad": np.bool_, "dtype": np.int32,
           "fwd": np.int8, "order": np.int32, "pos": np.int64}
_EMPTY_FULL = pa.table({"lid": pa.array([], pa.int32()), "step": pa.array([], pa.int64()),
                        **{c: pa.array([], pa.float64()) for c in _MEANS + ["rms"]},
                        "share_sample_size": pa.array([], pa.int64())})


@dataclass
class PerStep:
    """The merged per-step table of the window, as numpy columns sorted by
    (layer, step), plus its full-tier rows (means taken)."""
    layers: list       # (name, kind) per layer id
    dtypes: list       # dtype string (or None) per code
    cols: dict         # _KEYS + _MERGED columns, sorted by (lid, step)
    bounds: np.ndarray  # layer i's rows: cols[...][bounds[i]:bounds[i + 1]]
    order: list        # layer ids in the order their group first appears in the step-sorted table
    full: pd.DataFrame  # one row per (lid, step) with full-tier rows: means, rms max, sample sizes summed, bad
    full_steps: int


def reduce_window(run: Run, lo) -> PerStep | None:
    layers: dict = {}
    dtypes: dict = {}
    merged: list[dict] = []
    full: list[pa.Table] = []
    full_steps: set = set()
    rows = 0
    for part in run.map_tensor_shards(reduce_shard, _COLUMNS, kinds=KINDS, step_range=(lo, None),
                                      label="reading ranges"):
        rows += part.rows
        # The shard's ids and codes as the run's.
        lids = np.array([layers.setdefault(key, len(layers)) for key in part.layers] + [0], dtype=np.int32)
        codes = np.array([dtypes.setdefault(d, len(dtypes)) for d in part.dtypes] + [-1], dtype=np.int32)
        m = dict(part.merged)
        # A shard whose ids are already the run's (the first one read) keeps
        # its columns as they are, still sorted: no copy of the window.
        same_ids = np.array_equal(lids[:-1], np.arange(len(lids) - 1))
        if not same_ids:
            m["lid"] = lids[m["lid"]]
        if not np.array_equal(codes[:-1], np.arange(len(codes) - 1)):
            m["dtype"] = codes[m["dtype"]]  # code -1 stays -1
        if rows > part.rows:
            m["pos"] = m["pos"] + (rows - part.rows)  # the position in the whole read
        merged.append(m)
        if len(part.full):
            full.append(part.full.set_column(0, "lid", pa.array(lids[part.full["lid"].to_numpy()], pa.int32())))
        full_steps |= part.full_steps
        del part
        if sum(len(p["lid"]) for p in merged[1:]) >= _CONSOLIDATE_ROWS:
            merged = [_merge(merged)]
            same_ids = True
    if not rows:
        return None
    # One part merged and sorted already (one shard, or all consolidated) is the table.
    cols = merged[0] if len(merged) == 1 and same_ids else _merge(merged)
    del merged
    bounds = np.searchsorted(cols["lid"], np.arange(len(layers) + 1))
    # The layers in the order their groups first appear in the table sorted
    # by step: by earliest step, then by the first row read of that step.
    heads = bounds[:-1]
    order = [int(i) for i in np.lexsort((cols["pos"][heads], cols["step"][heads]))]
    # The means in pandas, as one pass over the full-tier rows in the order
    # read (pandas' compensated sum: the same value as over every row).
    full_rows = (pa.concat_tables(full) if full else _EMPTY_FULL).to_pandas()
    g = full_rows.groupby(_KEYS, sort=False)
    means = g[_MEANS].mean()
    means["rms"] = g["rms"].max()
    means["share_sample_size"] = g["share_sample_size"].sum(min_count=1)
    means = means.reset_index()
    # Each full-tier (layer, step) finds its merged row: keys (layer, rank
    # of the step) are sorted as the columns are.
    steps = np.unique(cols["step"])
    key = cols["lid"].astype(np.int64) * len(steps) + np.searchsorted(steps, cols["step"])
    at = np.searchsorted(key, means["lid"].to_numpy().astype(np.int64) * len(steps)
                         + np.searchsorted(steps, means["step"].to_numpy()))
    means["bad"] = cols["bad"][at]
    means["absmax"] = cols["absmax"][at]  # zero_split reads the tail's top off it
    return PerStep([*layers], [*dtypes], cols, bounds, order, means, len(full_steps))
