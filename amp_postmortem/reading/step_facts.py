"""The few facts about steps that `nans` needs (which steps had a
non-finite loss, how many were skipped, one step's row), from the steps
table or, without reading it, from the per-shard indexes or (a run
recorded before the indexes) from the per-step reduction across ranks.

At 1,000 ranks the steps table is millions of rows; its indexes say the same
in a few kilobytes. Both sources give the same answer: the index path is
taken only when every steps shard of the selected ranks has an index with a
dense step range (one row per step, no overlap: the table's rows are then
exactly the index's steps), else the table is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass
class StepFacts:
    nonfinite_loss_steps: list[int]  # steps with a NaN/Inf loss on any rank, ascending
    skipped_steps: int               # steps whose lowest-rank row was skipped
    _rows: dict                      # (step, rank) -> (skipped, loss_nonfinite), for `row`
    _lookup: object = None

    def row(self, step: int, rank: int) -> tuple[bool, bool] | None:
        """(skipped, loss_nonfinite) of one step row, None when absent."""
        if self._lookup is not None:
            return self._lookup(int(step), int(rank))
        return self._rows.get((int(step), int(rank)))


def from_table(steps: pd.DataFrame, lo=None, hi=None) -> StepFacts:
    if lo is not None:
        steps = steps[steps["step"] >= lo]
    if hi is not None:
        steps = steps[steps["step"] <= hi]
    bad_loss = steps.loc[steps["loss_nonfinite"], "step"]
    skipped = int(steps.drop_duplicates("step")["skipped"].sum()) if len(steps) else 0

    def lookup(step, rank):
        row = steps[(steps["step"] == step) & (steps["rank"] == rank)]
        if not len(row):
            return None
        return bool(row["skipped"].iloc[0]), bool(row["loss_nonfinite"].iloc[0])

    return StepFacts(sorted({int(s) for s in bad_loss}), skipped, {}, lookup)


def from_series(per_step: pd.DataFrame, lookup, lo=None, hi=None) -> StepFacts:
    """The same facts from the per-step reduction across ranks
    (`step_series.StepSeries.steps`); `lookup(step, rank)` reads one row."""
    s = per_step
    if lo is not None:
        s = s[s["step"] >= lo]
    if hi is not None:
        s = s[s["step"] <= hi]
    bad = [int(v) for v in s.loc[s["loss_nonfinite_any"], "step"]]

    def inside(step, rank):
        return lookup(step, rank) if (lo is None or step >= lo) and (hi is None or step <= hi) else None

    # `skipped` is the lowest rank's, as the table's first row of each step.
    return StepFacts(bad, int(s["skipped"].sum()), {}, inside)


def from_indexes(docs_by_rank: dict[int, list[dict]], lo=None, hi=None) -> StepFacts | None:
    """The same facts from the indexes of every steps shard ({rank: [index,
    ...]}), or None when they cannot stand in for the table."""
    lo = -(1 << 62) if lo is None else int(lo)
    hi = (1 << 62) if hi is None else int(hi)
    ranges: dict[int, list[tuple[int, int, dict]]] = {}
    for rank, docs in docs_by_rank.items():
        spans = []
        for d in docs:
            try:
                first, last, rows = int(d["first_step"]), int(d["last_step"]), int(d["step_rows"])
                skipped, bad_loss = d["skipped_steps"], d["nonfinite_loss_steps"]
            except (KeyError, TypeError, ValueError):
                return None
            if rows != last - first + 1 or not isinstance(skipped, list) or not isinstance(bad_loss, list):
                return None  # not one row per step: only the table says which
            spans.append((first, last, d))
        spans.sort(key=lambda s: s[0])
        if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
            return None  # overlapping shards (a resumed job): the table drops duplicates
        ranges[rank] = spans

    bad = sorted({int(s) for spans in ranges.values() for _, _, d in spans
                  for s in d["nonfinite_loss_steps"] if lo <= s <= hi})
    # The table keeps, per step, its lowest rank's row: walk the ranks up,
    # each owning the steps of its shards no lower rank covered.
    covered: list[tuple[int, int]] = []
    skipped = 0
    for rank in sorted(ranges):
        for first, last, d in ranges[rank]:
            a, b = max(first, lo), min(last, hi)
            if a > b:
                continue
            owned = _subtract((a, b), covered)
            if owned:
                skipped += sum(1 for s in d["skipped_steps"] if any(x <= s <= y for x, y in owned))
                covered = _merge(covered + owned)

    def lookup(step, rank):
        for first, last, d in ranges.get(rank, ()):
            if first <= step <= last and lo <= step <= hi:
                return step in set(d["skipped_steps"]), step in set(d["nonfinite_loss_steps"])
        return None

    return StepFacts(bad, skipped, {}, lookup)


def _subtract(span: tuple[int, int], covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = [span]
    for x, y in covered:
        nxt = []
        for a, b in out:
            if y < a or x > b:
                nxt.append((a, b))
                continue
            if a < x:
                nxt.append((a, x - 1))
            if y < b:
                nxt.append((y + 1, b))
        out = nxt
    return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
