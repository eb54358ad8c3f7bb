"""What a running job wrote since the last look, read cheaply, for `watch`:
the step rows of each rank's journal past the last step seen (a journal
holds at most one shard's steps: `steps_per_shard` small rows) and the
indexes of shard pairs published since (a few hundred bytes each, each
read once). Never a shard's data.

It answers one question: did a new step go wrong? A step the loss scaler
skipped, a NaN/Inf loss, non-finite gradients the optimizer applied, or
(from a published pair's index) non-finite tensor rows. Every non-finite
value on the training path shows as one of these, so `watch` re-runs the
whole analysis at once when one appears, and otherwise only now and then.

A run on a store has no journal there (the recorder uploads published
pairs only): its tail is the indexes, read from the view `watch` lists
at each look (`read(view)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyarrow as pa

from recorders.format import schema

from ..errors import CorruptRunError, PostmortemError
from .files.limits import MAX_JSON_BYTES
from .files.safe import parse_json, read_bytes
from .journal import location, read_journal_table
from .shards import rank_dirs
from .store import filesystem_of, run_location

_STEP_COLUMNS = ["step", "skipped", "loss", "nonfinite_param_grads"]


@dataclass
class TailNews:
    """What the last `RunTail.read()` found new."""
    last_step: int | None                              # the newest step on disk, any rank
    alarming_steps: list = field(default_factory=list)  # new steps that went wrong, ascending


class RunTail:
    """The tail of one run (all ranks, or `rank`): a local directory, or a
    run on a store given as a `StorePath`."""

    def __init__(self, root, *, rank: int | None = None):
        self.root = run_location(root)
        self.rank = rank
        self.checked: dict[int, int] = {}   # rank -> the last step looked at
        self._indexes: set = set()          # index files read

    def read(self, view=None) -> TailNews:
        """What is new; `view`: the run as listed at this look (a store's
        listing is taken once per view), default the root given."""
        alarming: set[int] = set()
        try:
            ranks = rank_dirs(self.root if view is None else view)
        except (PostmortemError, OSError, pa.ArrowException):
            return TailNews(self._last())
        for r, d in sorted(ranks.items()):
            if self.rank is not None and r != self.rank:
                continue
            seen = self.checked.get(r, -1)
            newest = seen
            for step, bad in self._index_steps(d) + self._journal_steps(d):
                newest = max(newest, step)
                if bad and step > seen:
                    alarming.add(step)
            self.checked[r] = newest
        return TailNews(self._last(), sorted(alarming))

    def _last(self) -> int | None:
        return max(self.checked.values(), default=None) if self.checked else None

    def _index_steps(self, rank_dir) -> list[tuple[int, bool]]:
        """(step, went wrong) from the indexes not read before."""
        out = []
        d = rank_dir / schema.INDEX_DIR
        for f in sorted(d.glob("part-*.json")) if d.is_dir() else []:
            if f in self._indexes:
                continue
            try:
                doc = parse_json(read_bytes(f, self.root, CorruptRunError, MAX_JSON_BYTES), f, CorruptRunError)
                last = int(doc["last_step"])
                bad = ({int(s) for k in ("skipped_steps", "nonfinite_loss_steps", "applied_nonfinite_steps")
                        for s in doc.get(k) or []}
                       | {int(e["first_step"]) for e in doc.get("first_nonfinite") or []})
            except (PostmortemError, OSError, pa.ArrowException, KeyError, TypeError, ValueError):
                continue  # torn or foreign: the analysis names it; the next look retries
            self._indexes.add(f)
            out += [(s, True) for s in sorted(bad)] + [(last, False)]
        return out

    def _journal_steps(self, rank_dir) -> list[tuple[int, bool]]:
        """(step, went wrong) of every step row in the rank's journal (its
        intact prefix: the writer may be appending to it)."""
        out = []
        d = rank_dir / schema.JOURNAL_DIR / schema.STEPS_DIR
        for f in sorted(d.glob("part-*" + schema.JOURNAL_SUFFIX)) if d.is_dir() else []:
            try:
                rows = read_journal_table(location(f), schema.STEPS_DIR, filesystem_of(f))
            except (PostmortemError, OSError, pa.ArrowException):
                continue  # published and removed since it was listed: its index tells
            for row in rows.select(_STEP_COLUMNS).to_pylist():
                loss = row["loss"]
                bad = bool(row["skipped"]) or (loss is not None and not math.isfinite(loss)) \
                    or (row["nonfinite_param_grads"] or 0) > 0
                out.append((int(row["step"]), bad))
        return out
