"""One row per step across ranks: what `scale`, `summary`, `ranges` and
`instability` need of the steps table, without reading it into pandas.

At 1,000 ranks the steps table is millions of rows, but those analyses ask
only, per step: the lowest rank's values (the loss-scale series, the loss)
and whether any rank skipped the step, saw a NaN/Inf loss, applied
non-finite gradients or recorded tensor rows (on a clean step). That is a
reduction that merges exactly, in any grouping: `shard_partial` (one steps
shard's rows in, one row per step out, plus each rank's last step) runs
wherever the engine reads the shard, and `merge` combines partials. The
same reduction over the whole, de-duplicated table (`from_table`) gives the
same series: the loader uses it when the shards cannot stand in for the
table (a step recorded twice by one rank: the table keeps the last copy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recorders.format import schema

# What a steps shard is read for (projected: never `lr` or `wall_time`).
READ_COLUMNS = ["step", "rank", "loss", "loss_scale_before", "loss_scale", "skipped", "tensor_rows",
                "nonfinite_param_grads", "sharded_grad_sqsum"]
# The lowest rank's row of each step (as `steps.drop_duplicates("step")`).
LOWEST_COLUMNS = ["rank", "loss", "loss_scale_before", "loss_scale", "skipped"]
# True when any rank's row of the step is (as `steps.groupby("step").any()`).
ANY_COLUMNS = ["skipped_any", "loss_nonfinite_any", "applied_nonfinite_any", "nonfinite_grads_any",
               "clean_recorded_any", "recorded_any", "sharded_grad_any"]
# The first non-null `loss_scale_before` in rank order (`groupby("step").first()`).
FIRST_SCALE = "loss_scale_before_first"
_FIRST_SCALE_RANK = "_first_scale_rank"
_PARTIAL_SCHEMA = pa.schema([("step", pa.int64()), ("rank", pa.int32()), ("loss", pa.float64()),
                             ("loss_scale_before", pa.float64()), ("loss_scale", pa.float64()),
                             ("skipped", pa.bool_())]
                            + [(c, pa.bool_()) for c in ANY_COLUMNS]
                            + [(FIRST_SCALE, pa.float64()), (_FIRST_SCALE_RANK, pa.int32())])
# Partials are merged once this many rows wait: the client holds a few
# partials, never the table.
_MERGE_ROWS = 1 << 18


@dataclass
class SeriesPartial:
    """What one shard (or several merged) gives: one row per step, each
    rank's last step, and whether a (step, rank) row came twice."""
    table: pa.Table
    rank_last_steps: dict = field(default_factory=dict)
    duplicated: bool = False


@dataclass
class StepSeries:
    """`steps`: one row per step, ascending: `step`, the lowest rank's
    `rank`, `loss`, `loss_scale_before`, `loss_scale`, `skipped`; the any-rank
    flags `skipped_any`, `loss_nonfinite_any` (NaN/Inf loss),
    `applied_nonfinite_any` (non-finite parameter gradients on a step not
    skipped), `nonfinite_grads_any` (non-finite parameter gradients, skipped
    or not), `clean_recorded_any` (not skipped, with tensor rows),
    `recorded_any` (with tensor rows), `sharded_grad_any`; `loss_scale_before_first` (the first non-null in
    rank order). `rank_last_steps`: {rank: its last recorded step}."""
    steps: pd.DataFrame
    rank_last_steps: dict

    @property
    def sharded_grads(self) -> bool:
        return bool(self.steps["sharded_grad_any"].any())


def recorded_steps(steps: pd.DataFrame) -> pd.Series:
    """The steps of a series (`StepSeries.steps`) with module rows on any
    rank (`recorded_any`), ascending: a sentinel run's sampled and
    re-executed steps, an every-step run's every step."""
    return steps["step"][steps["recorded_any"]]


def shard_partial(rows: pa.Table) -> SeriesPartial:
    """The map: a steps shard's rows (`READ_COLUMNS`) to its partial."""
    loss = rows.column("loss")
    # As the loader's steps table: a NaN loss is a finding, a null one is no loss.
    nonfinite = pc.fill_null(pc.invert(pc.is_finite(loss)), False)
    return _partial(rows.append_column("loss_nonfinite", nonfinite))


def from_table(steps: pd.DataFrame) -> StepSeries:
    """The same series from the loader's steps table (already de-duplicated)."""
    table = pa.Table.from_pandas(steps[[c for c in READ_COLUMNS + ["loss_nonfinite"] if c in steps]],
                                 preserve_index=False)
    # A table built by hand (a test, an older reader) may lack columns: null, as on disk.
    for c in READ_COLUMNS:
        if c not in table.column_names:
            table = table.append_column(c, pa.nulls(table.num_rows, schema.STEP_SCHEMA.field(c).type))
    if "loss_nonfinite" not in table.column_names:
        table = table.append_column("loss_nonfinite", pa.array(np.zeros(table.num_rows, bool)))
    return finish(_partial(table))


def merge(partials: Iterable[SeriesPartial]) -> SeriesPartial:
    """Partials combined: the lowest rank's row per step, flags or-ed, the
    first non-null scale in rank order, each rank's last step."""
    pending: list[pa.Table] = []
    rows = 0
    last: dict[int, int] = {}
    duplicated = False
    for p in partials:
        duplicated |= p.duplicated
        for r, s in p.rank_last_steps.items():
            last[r] = max(s, last.get(r, s))
        pending.append(p.table)
        rows += p.table.num_rows
        if rows >= _MERGE_ROWS and len(pending) > 1:
            pending = [_reduce(pa.concat_tables(pending))]
            rows = pending[0].num_rows
    table = _reduce(pa.concat_tables(pending)) if pending else _PARTIAL_SCHEMA.empty_table()
    return SeriesPartial(table, last, duplicated)


def finish(partial: SeriesPartial) -> StepSeries:
    table = partial.table.drop_columns([_FIRST_SCALE_RANK])
    return StepSeries(table.to_pandas(), dict(sorted(partial.rank_last_steps.items())))


def _partial(t: pa.Table) -> SeriesPartial:
    skipped = pc.fill_null(t.column("skipped"), False)
    clean = pc.invert(skipped)
    recorded = pc.greater(pc.fill_null(t.column("tensor_rows"), 0), 0)
    sq = t.column("sharded_grad_sqsum")
    bad_grads = pc.greater(pc.fill_null(t.column("nonfinite_param_grads"), 0), 0)
    flags = {
        "skipped_any": skipped,
        "loss_nonfinite_any": t.column("loss_nonfinite"),
        "applied_nonfinite_any": pc.and_(bad_grads, clean),
        "nonfinite_grads_any": bad_grads,
        "clean_recorded_any": pc.and_(recorded, clean),
        "recorded_any": recorded,
        "sharded_grad_any": pc.fill_null(pc.invert(pc.is_nan(sq)), False),
    }
    scale = t.column("loss_scale_before")
    rows = pa.table({
        "step": t.column("step").cast(pa.int64()), "rank": t.column("rank").cast(pa.int32()),
        "loss": t.column("loss"), "loss_scale_before": scale, "loss_scale": t.column("loss_scale"),
        "skipped": skipped, **flags, FIRST_SCALE: scale,
        # pandas' `first` skips NaN and null alike.
        _FIRST_SCALE_RANK: pc.if_else(pc.fill_null(pc.invert(pc.is_nan(scale)), False),
                                      t.column("rank").cast(pa.int32()), pa.scalar(None, pa.int32())),
    }, schema=_PARTIAL_SCHEMA)
    rows = _sorted(rows)
    step, rank = rows.column("step").to_numpy(), rows.column("rank").to_numpy()
    duplicated = bool(len(step) > 1 and ((step[1:] == step[:-1]) & (rank[1:] == rank[:-1])).any())
    last = {}
    if rows.num_rows:
        by_rank = rows.group_by("rank").aggregate([("step", "max")])
        last = dict(zip(by_rank.column("rank").to_pylist(), by_rank.column("step_max").to_pylist()))
    return SeriesPartial(_reduce(rows, presorted=True), last, duplicated)


def _sorted(t: pa.Table) -> pa.Table:
    return t.take(pc.sort_indices(t, [("step", "ascending"), ("rank", "ascending")]))


def _reduce(t: pa.Table, presorted: bool = False) -> pa.Table:
    """One row per step of partial rows (any number per step)."""
    if t.num_rows == 0:
        return t
    t = t if presorted else _sorted(t)
    step = t.column("step").to_numpy()
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    if len(starts) == len(step):
        return t  # one row per step already: nothing to merge
    out = t.take(pa.array(starts))
    cols = {c: out.column(c) for c in out.column_names}
    for c in ANY_COLUMNS:
        cols[c] = pa.array(np.logical_or.reduceat(t.column(c).to_numpy(zero_copy_only=False), starts))
    # The first non-null scale in rank order: rows are sorted by rank within
    # a step, but a partial's scale may come from a higher rank than its row's
    # own rank, so the smallest scale rank wins.
    none = np.iinfo(np.int32).max  # no non-null scale: after every rank
    srank = pc.fill_null(t.column(_FIRST_SCALE_RANK), none).to_numpy()
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(step)]))
    order = np.lexsort((srank, group))
    firsts = order[np.r_[True, group[order][1:] != group[order][:-1]]]
    cols[FIRST_SCALE] = t.column(FIRST_SCALE).take(pa.array(firsts))
    cols[_FIRST_SCALE_RANK] = t.column(_FIRST_SCALE_RANK).take(pa.array(firsts))
    return pa.table(cols, schema=_PARTIAL_SCHEMA)
