"""The rows of sharded parameters (FSDP1 both ways, FSDP2): each rank
records its local shard of a parameter as its own `param`/`param_grad` row,
and the manifest marks the parameter `sharded`. Readers see one row per
parameter and step, as an unsharded run has them: `merge_shards` is the one
merge (extremes by max/min, counts and numel by sum, means and shares
weighted by numel), used by `Run.scan_tensors` on a whole frame and by
`merged_frames` on a stream of record batches (`Run.iter_tensor_frames`:
`nans`, the report, the exports)."""
from __future__ import annotations

from typing import Iterator

import pandas as pd
import pyarrow as pa

SHARDED_KINDS = ("param", "param_grad")
SHARD_KEY = ["step", "rank", "name", "kind", "phase", "call", "numel"]


def merge_shards(df: pd.DataFrame, sharded: set[str]) -> pd.DataFrame:
    """One row per step for each sharded parameter's `param`/`param_grad`
    rows, from the ranks' shards: extremes by max/min, counts and numel by
    sum, means and shares weighted by numel (null parts left out), rms from
    the summed squares; the lowest rank's row keeps the place."""
    mask = df["kind"].isin(SHARDED_KINDS) & df["name"].isin(sharded)
    if not mask.any():
        return df
    part = df[mask]
    key = ["step", "name", "kind", "phase", "call"]
    groups = part.groupby(key, sort=False, dropna=False)
    merged = groups.head(1).set_index(key)  # dtype and anything unlisted below
    n = part["numel"].astype("float64")
    out = {"rank": groups["rank"].min(), "numel": groups["numel"].sum()}
    for col in ("nan_count", "inf_count"):
        if col in part:
            out[col] = groups[col].sum()
    if "input_nonfinite" in part:
        out["input_nonfinite"] = groups["input_nonfinite"].sum(min_count=1)
    for col in ("absmax", "max"):
        if col in part:
            out[col] = groups[col].max()
    if "min" in part:
        out["min"] = groups["min"].min()
    if "order" in part:
        out["order"] = groups["order"].min()
    for col in ("mean", "zero_share", "below_normal_share", "below_subnormal_share", "near_overflow_share", "rms"):
        if col not in part:
            continue
        v = part[col].astype("float64")
        v = v * v if col == "rms" else v
        w = n.where(v.notna(), 0.0)
        num = (v.fillna(0.0) * w).groupby([part[k] for k in key], sort=False, dropna=False).sum()
        den = w.groupby([part[k] for k in key], sort=False, dropna=False).sum()
        r = (num / den).where(den > 0)
        out[col] = r ** 0.5 if col == "rms" else r
    for col, values in out.items():
        merged[col] = values.reindex(merged.index).to_numpy()
    merged = merged.reset_index()[df.columns]
    for col in df.columns:
        try:
            merged[col] = merged[col].astype(df[col].dtype)
        except (TypeError, ValueError):
            pass
    both = pd.concat([df[~mask], merged], ignore_index=True)
    return both.sort_values("step", kind="stable").reset_index(drop=True)


def merged_frames(run, columns: list[str], sharded: set[str], **options) -> Iterator[pd.DataFrame]:
    """`run.iter_tensor_batches(columns, **options)` as DataFrames, in the
    same order (shard by shard, each rank's steps in order), with the rows
    of the `sharded` parameters merged across ranks.

    The sharded rows are read first, in their own pass over their kinds
    only, and merged (one row per parameter and step, a few per step);
    the second pass streams every other row and places each merged row in
    the first frame of its rank (the lowest holding a shard) whose last
    step reaches its step, so each rank's frames stay in step order for a
    reader that streams by step (the TensorBoard export)."""
    read = columns + [c for c in SHARD_KEY if c not in columns]
    kinds = options.get("kinds")
    shard_kinds = [k for k in SHARDED_KINDS if kinds is None or k in set(kinds)]
    merged = None
    if shard_kinds:
        parts = [b.to_pandas() for b in run.iter_tensor_batches(read, **{**options, "kinds": shard_kinds})]
        parts = [p for p in parts if len(p)]
        if parts:
            df = pd.concat(parts, ignore_index=True)
            df = df[df["name"].isin(sharded)]
            if len(df):
                merged = merge_shards(df, sharded)
    # rank -> its merged rows not placed yet, in step order
    waiting = {} if merged is None else {
        int(r): g.sort_values("step", kind="stable") for r, g in merged.groupby("rank", sort=True)}
    last_rank = None
    for batch in run.iter_tensor_batches(read, **options):
        df = batch.to_pandas()
        if not len(df):
            continue
        rank, top = int(df["rank"].iloc[0]), df["step"].max()  # a batch holds one shard: one rank
        df = df[~(df["kind"].isin(SHARDED_KINDS) & df["name"].isin(sharded))]
        if last_rank is not None and rank != last_rank and last_rank in waiting:
            yield waiting.pop(last_rank)[columns]  # the rest of the previous rank's rows
        last_rank = rank
        mine = waiting.get(rank)
        if mine is not None:
            now = mine[mine["step"] <= top]
            if len(now):
                df = pd.concat([df, now], ignore_index=True).sort_values("step", kind="stable")
                rest = mine[mine["step"] > top]
                if len(rest):
                    waiting[rank] = rest
                else:
                    del waiting[rank]
        if len(df):
            yield df[columns].reset_index(drop=True)
    for rank in sorted(waiting):
        yield waiting[rank][columns].reset_index(drop=True)


def frames_as_batches(frames) -> Iterator[pa.RecordBatch]:
    """Arrow record batches of `frames` (readers written over batches)."""
    for df in frames:
        if len(df):
            yield from pa.Table.from_pandas(df, preserve_index=False).to_batches()
