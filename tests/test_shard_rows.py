"""`shard_rows`: the one merge of sharded parameters' rows, on a stream.
The real FSDP runs are in test_distributed.py; here a stream of record
batches as the loader yields them (rank by rank, a shard a step), to pin
where each merged row is placed."""
from __future__ import annotations

import pandas as pd
import pyarrow as pa

from amp_postmortem.reading.shard_rows import merge_shards, merged_frames

COLS = ["step", "rank", "name", "kind", "phase", "call", "numel", "absmax", "nan_count"]


def _row(step, rank, name, kind, numel, absmax, nan=0):
    return {"step": step, "rank": rank, "name": name, "kind": kind, "phase": "backward", "call": 0,
            "numel": numel, "absmax": absmax, "nan_count": nan}


class _Stream:
    """The loader's `iter_tensor_batches`: one batch per (rank, step)."""

    def __init__(self, rows):
        self.rows = pd.DataFrame(rows, columns=COLS)

    def iter_tensor_batches(self, columns, kinds=None, **_):
        df = self.rows if kinds is None else self.rows[self.rows["kind"].isin(kinds)]
        for (_, _), g in df.groupby(["rank", "step"], sort=True):
            yield pa.RecordBatch.from_pandas(g[columns], preserve_index=False)


ROWS = [_row(s, r, "w", "param_grad", n, a, nan) for s, r, n, a, nan in
        [(0, 0, 3, 1.0, 0), (0, 1, 2, 4.0, 1), (1, 0, 3, 2.0, 0), (1, 1, 2, 0.5, 0)]] + \
       [_row(s, r, "layer", "grad_output", 10, 1.0) for s in (0, 1) for r in (0, 1)]


def test_merged_rows_are_placed_in_their_ranks_frame_of_their_step():
    frames = list(merged_frames(_Stream(ROWS), COLS, {"w"}))
    assert [(sorted(set(f["rank"])), sorted(set(f["step"]))) for f in frames] == [
        ([0], [0]), ([0], [1]), ([1], [0]), ([1], [1])]
    w = pd.concat(frames)
    w = w[w["name"] == "w"]
    assert w[["step", "rank", "numel", "absmax", "nan_count"]].values.tolist() == [[0, 0, 5, 4.0, 1],
                                                                                 [1, 0, 5, 2.0, 0]]


def test_the_stream_merges_as_the_whole_frame_does():
    streamed = pd.concat(merged_frames(_Stream(ROWS), COLS, {"w"}), ignore_index=True)
    whole = merge_shards(pd.DataFrame(ROWS, columns=COLS), {"w"})
    key = ["step", "rank", "name", "kind"]
    assert streamed.sort_values(key).reset_index(drop=True).equals(whole.sort_values(key).reset_index(drop=True))


def test_rows_of_names_not_sharded_pass_as_read():
    frames = list(merged_frames(_Stream(ROWS), COLS, set()))
    assert len(pd.concat(frames)) == len(ROWS)
