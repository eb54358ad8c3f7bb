"""The steps table of a run: one row per step and rank, read from its
steps shards (Parquet, consecutive ones as one dataset) and its journals
(`journal.py`), in file order, with damaged files skipped and named.

Above both `shards.py` and `journal.py`, which it combines; `loader.py`
reads the table through it on first use (`Run.steps`).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from recorders.format import schema

from .journal import location, read_journal_table
from .shards import Shard, error_text
from .store import filesystem_of, fs_path

_STEP_COLUMNS = [c.name for c in schema.STEP_COLUMNS]


def read_steps(root: Path, shards: list[Shard], warnings) -> pd.DataFrame:
    """The steps table of `shards` (a run's steps shards and journals, in
    load order), sorted by step then rank, a step recorded twice kept once
    (its last copy), with `loss_nonfinite`; each damaged file skipped and
    named in `warnings`."""
    def read(paths):
        d = ds.dataset([fs_path(p) for p in paths], format="parquet", schema=schema.STEP_SCHEMA,
                       filesystem=filesystem_of(paths[0]))
        return d.to_table(columns=_STEP_COLUMNS)

    def read_run(group):
        # Journals (recorders/journal.py) one by one, consecutive Parquet
        # shards as one dataset: the file order is kept.
        if group[0].path.name.endswith(schema.JOURNAL_SUFFIX):
            return [read_journal_table(location(s.path), schema.STEPS_DIR, filesystem_of(s.path)).select(_STEP_COLUMNS)
                    for s in group]
        return [read([s.path for s in group])]

    tables = []
    try:
        for _, group in itertools.groupby(shards, key=lambda s: s.path.name.endswith(schema.JOURNAL_SUFFIX)):
            tables += read_run(list(group))
    except (OSError, pa.ArrowException):
        # Find the damaged file(s) one by one; keep the rest.
        tables = []
        for s in shards:
            try:
                tables += read_run([s])
            except (OSError, pa.ArrowException) as exc:
                warnings.append(f"skipped unreadable shard {s.path.relative_to(root)} ({error_text(exc)})")
    if not tables:
        return schema.STEP_SCHEMA.empty_table().append_column(
            "loss_nonfinite", pa.array([], pa.bool_())).to_pandas()
    table = pa.concat_tables(tables)
    if table.column("step").null_count or table.column("rank").null_count:
        # Only a shard that hides its nulls from its footer gets here.
        keep = pc.and_(pc.is_valid(table.column("step")), pc.is_valid(table.column("rank")))
        warnings.append(f"skipped {table.num_rows - pc.sum(keep.cast('int64')).as_py()} step row(s) without "
                        f"a step or rank (valid: both in every row)")
        table = table.filter(keep)
    # Sorted and de-duplicated in Arrow, before pandas: at 1,000 ranks the
    # table has millions of rows (the stable sort keeps file order, so the
    # last-written copy of a twice-recorded row is the one kept).
    table = table.take(pc.sort_indices(table, [("step", "ascending"), ("rank", "ascending")]))
    step = table.column("step").to_numpy()
    rank = table.column("rank").to_numpy()
    last = np.ones(len(step), dtype=bool)
    last[:-1] = (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
    if not last.all():
        warnings.append(f"{int((~last).sum())} step row(s) recorded twice (a resumed job?); keeping the last")
        table = table.filter(pa.array(last))
    loss = table.column("loss")
    # pandas turns NaN and null into the same NaN: tell them apart here (a
    # NaN loss is a finding, a null one means no loss was passed).
    nonfinite = pc.fill_null(pc.invert(pc.is_finite(loss)), False)
    # `lr` (a list per row) stays Arrow-backed: millions of small Python
    # lists would cost more memory than the rest of the table.
    return table.append_column("loss_nonfinite", nonfinite).to_pandas(
        types_mapper=lambda t: pd.ArrowDtype(t) if pa.types.is_list(t) else None,
        split_blocks=True, self_destruct=True)
