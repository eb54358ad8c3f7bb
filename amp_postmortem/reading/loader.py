"""The one place that reads a run directory.

`load_run(path)` validates the manifests (format, schema version, run id),
discovers the ranks and reads every shard's index, or its footer (never its
data). The steps table is read on first use; the analyses that need one row
per step take `Run.step_series`, reduced shard by shard, instead. The large
tensors table stays on disk as a `pyarrow.dataset`; analyses read it
through `Run.scan_tensors`, which prunes shards by the step range and
non-finite row count stamped in their footers and row groups by their
Parquet statistics, and projects columns.

Damage becomes warnings (`Run.warnings`) or named errors, never a silently
wrong answer: an unreadable shard is skipped and named, missing ranks and a
recorder that was never closed are reported, files of different recordings
in one directory are refused.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs  # noqa: F401  (pa.fs)

from recorders.format import schema

from .engines import Engine
from .engines.local import LocalEngine
from .engines.scan import NONFINITE_FILTER, ShardScan, scan_shard
from ..errors import CorruptRunError, EmptyRunError, MixedRunsError, RankNotFoundError, RunNotFoundError
from .files.limits import MAX_STATUS_BYTES
from .files.models import RunManifest, validate
from .files.safe import Damaged, parse_json, read_bytes, read_json, shown
from .index import read_indexes, shard_from_index
from .journal import is_journal, location, read_journal_table, with_journals
from .step_facts import StepFacts, from_indexes, from_series, from_table
from . import step_series
from .step_series import StepSeries
from .store import StorePath, filesystem_of, fs_path, run_location
from .shard_rows import SHARD_KEY, SHARDED_KINDS, frames_as_batches, merge_shards, merged_frames
from .shards import (RANK_DIR, Shard, check_pairs, check_version, error_text, rank_dirs, read_footer,
                     shard_files)
from .step_table import read_steps


NO_STEPS = "no steps on disk: the recorder wrote no completed shard yet"

# A progress callback: (label, rows done, rows total). Set by the CLI.
Progress = Callable[[str, int, int], None]


@dataclass
class Run:
    """A recorded run, validated. `steps` is a DataFrame (one row per step and
    rank, sorted by step then rank; the columns of `schema.STEP_COLUMNS` plus
    `loss_nonfinite`: the loss was NaN/Inf, not merely missing), read from
    disk on first use; tensor rows are read on demand with `scan_tensors`."""
    path: Path
    manifest: dict
    rank_manifests: dict[int, dict]
    ranks: list[int]
    # The steps table once read (None: not yet; `steps` reads it with `steps_reader`).
    loaded_steps: pd.DataFrame | None
    tensor_shards: list[Shard]
    warnings: list[str] = field(default_factory=list)
    progress: Progress | None = None
    scanned_files: list[Path] = field(default_factory=list)  # every tensor shard read, in order
    engine: Engine = field(default_factory=LocalEngine)  # runs the per-shard map (engines/)
    step_shards: list[Shard] = field(default_factory=list)
    shard_indexes: dict = field(default_factory=dict)  # (rank, shard file name) -> its index
    # `steps_reader(warnings)`: the steps table, its warnings appended (see `steps`).
    steps_reader: Callable[[list], pd.DataFrame] | None = field(default=None, repr=False)
    cached_step_series: StepSeries | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------ the steps
    @property
    def steps(self) -> pd.DataFrame:
        """The steps table, read with `steps_reader` when first used: at 1,000
        ranks it is millions of rows, which `nans` on an indexed run never
        needs."""
        if self.loaded_steps is None:
            warnings: list[str] = []
            self.loaded_steps = self.steps_reader(warnings)
            for w in warnings:
                self.warn(w)
            if self.loaded_steps.empty:
                self.warn(NO_STEPS)
        return self.loaded_steps

    @property
    def steps_read(self) -> bool:
        """Whether the steps table is in memory (`steps` reads it)."""
        return self.loaded_steps is not None

    def step_facts(self, first_step: int | None = None, last_step: int | None = None) -> StepFacts:
        """Non-finite loss steps, skipped step count and single step rows in
        [first_step, last_step], from the indexes when the steps table is not
        read yet and they stand in for it exactly, else from the step series
        (a run without indexes), else from the table."""
        if not self.steps_read and self.step_shards:
            docs: dict[int, list] = {}
            for s in self.step_shards:
                doc = self.shard_indexes.get((s.rank, s.path.name))
                if doc is None:
                    break
                docs.setdefault(s.rank, []).append(doc)
            else:
                facts = from_indexes(docs, first_step, last_step)
                if facts is not None:
                    return facts
            series = self.step_series()  # from the shards, unless only the table can say
            if not self.steps_read:
                return from_series(series.steps, self._step_row, first_step, last_step)
        return from_table(self.steps, first_step, last_step)

    def _step_row(self, step: int, rank: int) -> tuple[bool, bool] | None:
        """(skipped, loss_nonfinite) of one step row, read from the one
        steps shard that holds it (no rank's shards overlap here)."""
        for s in self.step_shards:
            if s.rank == rank and s.num_rows and s.first_step <= step <= s.last_step:
                task = self._scan_task(s, ["step", "skipped", "loss"], False, [step], None, None, None,
                                       table=schema.STEPS_DIR)
                part = scan_shard(task)
                if part.error is None and part.table is not None and part.table.num_rows:
                    loss = part.table.column("loss")[0].as_py()
                    nonfinite = loss is not None and not math.isfinite(loss)  # null: no loss passed
                    return bool(part.table.column("skipped")[0].as_py()), nonfinite
        return None

    def step_series(self) -> StepSeries:
        """One row per step across the ranks (`step_series.StepSeries`): the
        lowest rank's scale and loss, what any rank saw. Reduced shard by
        shard through the run's engine, so the steps table never reaches
        pandas; from the table when it is already read, or when the shards
        cannot stand in for it (a rank's shards overlap, a shard without a
        step range, an unreadable shard: the table names and skips it)."""
        if self.cached_step_series is None:
            series = None if self.steps_read else self._reduce_step_shards()
            self.cached_step_series = series if series is not None else step_series.from_table(self.steps)
        return self.cached_step_series

    def _reduce_step_shards(self) -> StepSeries | None:
        spans: dict[int, list[tuple[int, int]]] = {}
        for s in self.step_shards:
            if s.num_rows and (s.first_step is None or s.last_step is None):
                return None
            if s.num_rows:
                spans.setdefault(s.rank, []).append((s.first_step, s.last_step))
        for rank_spans in spans.values():
            rank_spans.sort()
            if any(a[1] >= b[0] for a, b in zip(rank_spans, rank_spans[1:])):
                return None  # a step recorded twice: the table keeps the last copy
        shards = [s for s in self.step_shards if s.num_rows]
        failed = []

        def partials():
            total, done = sum(s.num_rows for s in shards), 0
            self._report("reading steps", 0, total)
            tasks = [self._scan_task(s, step_series.READ_COLUMNS, False, None, None, None, None,
                                     step_series.shard_partial, table=schema.STEPS_DIR) for s in shards]
            for shard, part in zip(shards, self.engine.map(scan_shard, tasks)):
                if part.error is not None:
                    failed.append(shard)
                    return
                done += shard.num_rows
                self._report("reading steps", done, total)
                if part.result is not None:
                    yield part.result

        merged = step_series.merge(partials())
        if failed or merged.duplicated:
            return None
        series = step_series.finish(merged)
        if series.sharded_grads and len(self.ranks) < self.world_size:
            self.warn(sharded_norm_warning(self.ranks, self.world_size))  # as when the table is read
        return series

    # ------------------------------------------------------------ run facts
    @property
    def run_id(self) -> str:
        return self.manifest.get("run_id", "")

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size") or 1)

    @property
    def autocast(self) -> dict:
        return self.manifest.get("autocast") or {"enabled": False, "device_type": None, "dtype": None}

    @property
    def scaler(self) -> dict | None:
        """Scaler configuration, or None when the job ran without an enabled scaler."""
        s = self.manifest.get("scaler")
        return s if s and s.get("enabled", True) else None

    @property
    def first_step(self) -> int | None:
        steps = self._step_numbers()
        return int(steps.min()) if len(steps) else None

    @property
    def last_step(self) -> int | None:
        steps = self._step_numbers()
        return int(steps.max()) if len(steps) else None

    def _step_numbers(self) -> pd.Series:
        """The recorded steps: from the table when it is read, else from the
        step series (never reading the table for two numbers)."""
        return self.steps["step"] if self.steps_read else self.step_series().steps["step"]

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    # ---------------------------------------------------------- tensor rows
    @property
    def tensors(self) -> ds.Dataset:
        """All readable tensor shards as one dataset (for DuckDB-style use)."""
        fs = filesystem_of(self.path)
        shards = ds.dataset([fs_path(s.path) for s in self.tensor_shards if not is_journal(s.path)],
                            format="parquet", schema=schema.TENSOR_SCHEMA, filesystem=fs)
        journals = [read_journal_table(location(s.path), schema.TENSORS_DIR, fs)
                    for s in self.tensor_shards if is_journal(s.path)]
        return ds.dataset([shards, ds.dataset(journals, schema=schema.TENSOR_SCHEMA)]) if journals else shards

    def select_shards(self, *, steps: Iterable[int] | None = None,
                      nonfinite_only: bool = False) -> list[Shard]:
        wanted = None if steps is None else {int(s) for s in steps}
        out = []
        for s in self.tensor_shards:
            if nonfinite_only and s.nonfinite_rows == 0:
                continue  # the footer says no row here holds a NaN/Inf
            if not s.may_hold(wanted):
                continue
            out.append(s)
        return out

    def iter_tensor_batches(self, columns: list[str] | None = None, *,
                            steps: Iterable[int] | None = None, kinds: Iterable[str] | None = None,
                            nonfinite_only: bool = False, step_range: tuple | None = None,
                            label: str = "reading tensors", merged: bool = False) -> Iterator[pa.RecordBatch]:
        """Record batches of the tensors table, shard by shard in step order
        per rank. Shards whose footer rules them out are never opened; within
        a shard, Parquet row-group statistics prune with the same filter.
        `step_range` = (first, last), both inclusive, either may be None.
        `merged`: sharded parameters' rows merged across ranks, as
        `iter_tensor_frames` has them."""
        if merged and self._sharded_to_merge(kinds):
            yield from frames_as_batches(self.iter_tensor_frames(
                columns or [c.name for c in schema.TENSOR_COLUMNS], steps=steps, kinds=kinds,
                nonfinite_only=nonfinite_only, step_range=step_range, label=label))
            return
        for table in self.map_tensor_shards(None, columns, steps=steps, kinds=kinds,
                                            nonfinite_only=nonfinite_only, step_range=step_range, label=label):
            yield from table.to_batches()

    def iter_tensor_frames(self, columns: list[str], **options) -> Iterator[pd.DataFrame]:
        """`iter_tensor_batches` (the same options) as DataFrames, with the
        ranks' shards of a sharded parameter (FSDP) merged into one row per
        step, as `scan_tensors` has them (`shard_rows.merged_frames`): what
        every reader that streams the tensors table reads."""
        sharded = self._sharded_to_merge(options.get("kinds"))
        if not sharded:
            for batch in self.iter_tensor_batches(columns, **options):
                yield batch.to_pandas()
            return
        yield from merged_frames(self, list(columns), sharded, **options)

    def map_tensor_shards(self, reduce: Callable | None, columns: list[str] | None = None, *,
                          steps: Iterable[int] | None = None, kinds: Iterable[str] | None = None,
                          nonfinite_only: bool = False, step_range: tuple | None = None,
                          label: str = "reading tensors") -> Iterator:
        """`reduce(rows)` of each shard's matching rows (an Arrow table; the
        rows themselves when `reduce` is None), in shard order, skipping the
        shards ruled out as `iter_tensor_batches` does. The run's engine runs
        the reads and `reduce` next to the data (a top-level function, so it
        pickles); the caller merges the results in order."""
        steps = None if steps is None else sorted({int(s) for s in steps})
        lo, hi = step_range or (None, None)
        shards = [s for s in self.select_shards(steps=steps, nonfinite_only=nonfinite_only)
                  if not ((lo is not None and s.last_step is not None and s.last_step < lo)
                          or (hi is not None and s.first_step is not None and s.first_step > hi))]
        total = sum(s.num_rows for s in shards)
        done = 0
        self._report(label, 0, total)
        tasks = [self._scan_task(s, columns, nonfinite_only, steps, kinds, lo, hi, reduce) for s in shards]
        # The engine runs the per-shard map (here or on a cluster); partials
        # come back in shard order, so every engine gives the same answer.
        for shard, part in zip(shards, self.engine.map(scan_shard, tasks)):
            done += shard.num_rows
            if part.error is not None:
                self.warn(f"skipped unreadable shard {self._rel(shard.path)} ({part.error})")
                continue
            if part.table is None and part.result is None:  # statistics ruled every row group out
                continue
            self.scanned_files.append(shard.path)
            self._report(label, done, total)
            yield part.table if reduce is None else part.result

    def _scan_task(self, shard: Shard, columns, nonfinite_only, steps, kinds, lo, hi, reduce=None,
                   table: str = schema.TENSORS_DIR) -> ShardScan:
        remote = isinstance(shard.path, StorePath)
        return ShardScan(
            path=fs_path(shard.path) if remote else os.path.abspath(shard.path),
            root_uri=str(self.path) if remote else None,
            columns=None if columns is None else tuple(columns), nonfinite_only=nonfinite_only,
            steps=None if steps is None else tuple(steps), kinds=None if kinds is None else tuple(kinds),
            first_step=lo, last_step=hi, reduce=reduce, table=table)

    def scan_tensors(self, columns: list[str] | None = None, **options) -> pd.DataFrame:
        """`iter_tensor_batches` gathered into one DataFrame (the same
        options). The ranks' shards of a sharded parameter (FSDP) come back
        merged into one row per step, as an unsharded run has them."""
        cols = columns or [c.name for c in schema.TENSOR_COLUMNS]
        sharded = self._sharded_to_merge(options.get("kinds"))
        read = cols + [c for c in SHARD_KEY if c not in cols] if sharded else cols
        batches = list(self.iter_tensor_batches(read, **options))
        if not batches:
            return schema.TENSOR_SCHEMA.empty_table().select(cols).to_pandas()
        df = pa.Table.from_batches(batches).to_pandas()
        if sharded:
            df = merge_shards(df, sharded)[cols]
        return df

    def _sharded_to_merge(self, kinds) -> set[str]:
        """The sharded parameters whose rows a read of `kinds` must merge
        (none with one rank read, or no parameter kind asked for)."""
        if len(self.ranks) < 2 or (kinds is not None and not set(kinds) & set(SHARDED_KINDS)):
            return set()
        return self.sharded_params

    @property
    def sharded_params(self) -> set[str]:
        """Names of the parameters whose rows hold one rank's shard."""
        out = set()
        for m in [self.manifest, *self.rank_manifests.values()]:
            out.update(p["name"] for p in m.get("params") or () if isinstance(p, dict) and p.get("sharded"))
        return out

    def _report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)

    def _rel(self, p: Path) -> str:
        try:
            return str(Path(p).relative_to(self.path))
        except ValueError:
            return str(p)


def global_grad_norm(steps: pd.DataFrame, ranks: list[int], world_size: int, warnings: list[str]) -> pd.DataFrame:
    """Each step's `grad_norm` as the global norm when gradients are sharded:
    the ranks' local shard square sums added, the replicated part counted
    once (from the lowest rank); steps missing a rank keep their own."""
    if "sharded_grad_sqsum" not in steps or steps["sharded_grad_sqsum"].isna().all():
        return steps
    if len(ranks) < world_size:
        warnings.append(sharded_norm_warning(ranks, world_size))
        return steps
    sq = steps["grad_norm"].astype("float64") ** 2
    sharded = steps["sharded_grad_sqsum"].astype("float64").fillna(0.0)
    replicated = (sq - sharded).clip(lower=0.0)
    first = steps["rank"] == steps.groupby("step")["rank"].transform("min")
    total = sharded.groupby(steps["step"]).sum() + replicated[first].groupby(steps["step"][first]).sum()
    # pandas sums skip NaN: a non-finite norm on any rank makes the global one non-finite.
    total[sq.isin([float("inf")]).groupby(steps["step"]).any()] = float("inf")
    total[sq.isna().groupby(steps["step"]).any() & sq.notna().groupby(steps["step"]).any()] = float("nan")
    complete = steps.groupby("step")["rank"].transform("nunique") >= world_size
    steps = steps.copy()
    steps.loc[complete, "grad_norm"] = steps.loc[complete, "step"].map(total ** 0.5)
    return steps


def sharded_norm_warning(ranks: list[int], world_size: int) -> str:
    return (f"gradients are sharded across {world_size} ranks: grad_norm of rank(s) "
            f"{_join(ranks)} covers only their shards (load every rank for the global norm)")


# ---------------------------------------------------------------- loading
def load_run(path, rank: int | None = None) -> Run:
    """Validate and open the run directory `path` (all ranks, or only `rank`)."""
    root = run_location(path)  # a Path, or a StorePath for a URI (s3://, gs://, ...)
    if not root.exists():
        raise RunNotFoundError(f"run directory not found: {root}")
    if not root.is_dir():
        raise RunNotFoundError(f"{root} is not a directory; pass the run directory (the one holding manifest.json)")
    m = RANK_DIR.fullmatch(root.name)
    if m and (root.parent / schema.MANIFEST_FILE).is_file():
        raise RunNotFoundError(f"{root} is one rank of a run: pass the run directory {root.parent} "
                               f"(with --rank {m.group(1)} for this rank only)")
    warnings: list[str] = []

    try:
        found = rank_dirs(root, warnings)
    except OSError as exc:  # e.g. no permission to list it: the user's to fix
        raise RunNotFoundError(f"cannot read the run directory {root} ({error_text(exc)})") from None
    top = root / schema.MANIFEST_FILE
    if _present(top):
        manifest = _read_manifest(top, root)
    elif found and _present(found[min(found)] / schema.MANIFEST_FILE):
        r0 = min(found)
        manifest = _read_manifest(found[r0] / schema.MANIFEST_FILE, root)
        warnings.append(f"{top} is missing; using the manifest of rank {r0}")
    else:
        raise RunNotFoundError(f"{root} is not an amp-postmortem run: no {schema.MANIFEST_FILE}")
    run_id = manifest.get("run_id")

    rank_manifests: dict[int, dict] = {}
    for r, d in sorted(found.items()):
        mpath = d / schema.MANIFEST_FILE
        if not _present(mpath):
            warnings.append(f"{mpath.relative_to(root)} is missing; reading rank {r} from its shards only")
            continue
        m = _read_manifest(mpath, root)
        if m.get("run_id") != run_id and (rank is None or int(rank) == r):
            # With --rank, only that rank must belong to the run: the ranks
            # of an older recorder (each its own id) stay readable one by one.
            raise MixedRunsError(
                f"mixed runs in {root}: rank {r} has run_id {m.get('run_id')!r}, the run manifest "
                f"has {run_id!r}; keep one recording per directory")
        if m.get("run_id") == run_id:
            rank_manifests[r] = with_status_slot(m, d / schema.STATUS_FILE, warnings, root)
            if r == min(found):  # the run manifest is this rank's copy
                manifest = with_status_slot(manifest, d / schema.STATUS_FILE, [], root)
    if not found:
        raise EmptyRunError(f"{root} has a manifest but no rank=<r> directories: nothing was recorded"
                            + _disabled([manifest]))

    present = sorted(found)
    world_size = int(manifest.get("world_size") or 1)
    if rank is not None:
        if int(rank) not in found:
            raise RankNotFoundError(f"rank {rank} is not in {root} (ranks on disk: {_join(present)})")
        selected = [int(rank)]
    else:
        selected = present
        missing = missing_ranks(present, world_size)
        if missing:
            warnings.append(f"rank(s) {_spans(missing)} of world_size {world_size} are missing; "
                            f"the analysis covers rank(s) {_spans(present)} only")

    open_ranks = [r for r in selected if rank_manifests.get(r, {}).get("status", "closed") == "open"]
    if open_ranks:
        warnings.append(f"the recorder of rank(s) {_join(open_ranks)} was not closed (status 'open'): "
                        f"the job may have been killed; the analysis covers the steps on disk")
    for r in selected:
        m = rank_manifests.get(r, {})
        if m.get("dropped_steps"):
            warnings.append(f"rank {r}: the recorder dropped {m['dropped_steps']} step(s) "
                            f"because its queue was full; those steps are absent")
        lost = (m.get("storage") or {}).get("spool_dropped_steps")
        if lost:
            warnings.append(f"rank {r}: {lost} step(s) were not recorded because the object store was "
                            f"unreachable and the recorder's local spool was full; those steps are absent")
        if m.get("disabled_reason"):
            warnings.append(f"rank {r}: recording was switched off during the job "
                            f"({m['disabled_reason']}); later steps are absent")

    step_shards: list[Shard] = []
    tensor_shards: list[Shard] = []
    found_files = 0
    indexes = read_indexes(root, {r: found[r] for r in selected}, run_id, warnings)
    for r in selected:
        for table, out in ((schema.STEPS_DIR, step_shards), (schema.TENSORS_DIR, tensor_shards)):
            for f in shard_files(found[r] / table, root, warnings):
                found_files += 1
                shard = (shard_from_index(f, r, table, indexes.get((r, f.name)))
                         or read_footer(root, f, r, table, run_id, warnings))
                if shard is not None:
                    out.append(shard)
    # The steps not in a shard yet (a killed job, a recorder that failed).
    step_shards, tensor_shards = with_journals(root, {r: found[r] for r in selected}, run_id,
                                               step_shards, tensor_shards, warnings)
    check_pairs(root, step_shards, tensor_shards, warnings)

    run = Run(path=root, manifest=manifest, rank_manifests=rank_manifests, ranks=selected,
              loaded_steps=None, tensor_shards=tensor_shards, step_shards=step_shards,
              shard_indexes={k: v for k, v in indexes.items() if k[0] in selected},
              steps_reader=lambda w: global_grad_norm(read_steps(root, step_shards, w), selected, world_size, w))
    for w in warnings:
        run.warn(w)
    if not any(s.num_rows for s in step_shards):
        # Judged from the indexes or footers: the table itself is read later.
        raise EmptyRunError(_why_empty(root, rank, [manifest, *(rank_manifests.get(r, {}) for r in selected)],
                                       step_shards, found_files, warnings))
    return run


def _why_empty(root, rank, manifests, step_shards, found_files, warnings) -> str:
    """Why a run holds no readable step, in one line."""
    where = f"{root}" + (f" (rank {rank})" if rank is not None else "")
    if not found_files:
        why = "no shard written yet (the recorder writes one every steps_per_shard steps and on close)"
    else:
        skipped = [w for w in warnings if w.startswith("skipped")]
        if skipped:
            why = f"no steps shard among its {found_files} shard file(s) could be used; first: {skipped[0]}"
        elif not step_shards:
            why = f"none of its {found_files} shard file(s) is a steps shard"
        else:
            why = f"its {len(step_shards)} steps shard(s) hold no step row"
    lost = sum(int((m.get("storage") or {}).get("spool_dropped_steps") or 0) for m in manifests[1:])
    spool = (f"; {lost} step(s) were not recorded because the object store was unreachable and the "
             f"recorder's local spool was full") if lost else ""
    return f"{where} holds no readable step: {why}" + _disabled(manifests) + spool


def _disabled(manifests) -> str:
    reasons = sorted({m["disabled_reason"] for m in manifests if m.get("disabled_reason")})
    return f"; recording was switched off ({'; '.join(reasons)})" if reasons else ""


def _present(path) -> bool:
    """A name on disk, whatever it is (a FIFO or a dangling link is refused
    by the reader, with a message, rather than taken for a missing file)."""
    return path.exists() or (not isinstance(path, StorePath) and os.path.lexists(path))


def read_manifest(path, root=None) -> dict:
    """A manifest.json (of the run or a rank), read safely (files.safe)
    and validated (files.models.RunManifest): CorruptRunError otherwise."""
    m = read_json(path, root, CorruptRunError, "manifest")
    if not isinstance(m, dict):
        raise CorruptRunError(f"{path} is not a run manifest (a JSON object was expected)")
    return validate(RunManifest, m, path, CorruptRunError)


def _read_manifest(path: Path, root=None) -> dict:
    m = read_manifest(path, root)
    fmt = m.get("format")
    if fmt != schema.FORMAT_NAME:
        raise CorruptRunError(f"{path} has format {fmt!r}, expected {schema.FORMAT_NAME!r}: not an amp-postmortem run")
    check_version(m.get("schema_version"), str(path))
    return m



def with_status_slot(manifest: dict, path, warnings: list[str], root=None) -> dict:
    """The manifest with the recorder's status slot (`rank=R/status.json`)
    laid over it: the slot took the stop record where the manifest's rewrite
    failed (a full disk), so its `status`, `disabled_reason` and
    `disabled_at_step` win. A missing slot (a run recorded before slots
    existed) changes nothing; a damaged one is named in a warning; one that
    is no regular file inside the run, too large or too deep is refused
    (files.safe), as every other file of a run."""
    if not _present(path):
        return manifest
    data = read_bytes(path, root, CorruptRunError, MAX_STATUS_BYTES)
    try:
        slot = parse_json(data, path, CorruptRunError)
        if not isinstance(slot, dict) or slot.get("format") != schema.STATUS_FORMAT:
            raise ValueError(f"not a status slot (format {schema.STATUS_FORMAT!r} expected)")
        if slot.get("run_id") != manifest.get("run_id"):
            raise ValueError(f"run_id {slot.get('run_id')!r} is not the manifest's")
        status, reason, at = slot.get("status"), slot.get("disabled_reason"), slot.get("disabled_at_step")
        if status not in ("open", "closed") or not isinstance(reason, (str, type(None))) \
                or not (at is None or (isinstance(at, int) and not isinstance(at, bool))):
            raise ValueError("its status, disabled_reason or disabled_at_step has the wrong type")
    except (Damaged, ValueError) as exc:
        warnings.append(f"ignored {shown(path)}: {exc}")
        return manifest
    out = dict(manifest)
    if status == "closed" or out.get("status") is None:
        out["status"] = status
    if reason is not None:
        out["disabled_reason"] = reason
        if at is not None:
            out["disabled_at_step"] = at
    return out


def _join(values) -> str:
    return ", ".join(str(v) for v in values)


def missing_ranks(present: list[int], world_size: int) -> list[tuple[int, int]]:
    """The ranks in range(world_size) not in `present`, as (first, last)
    spans: counted from the gaps, never by listing a million ranks."""
    spans, start = [], 0
    for r in sorted(r for r in set(present) if r < world_size) + [world_size]:
        if r > start:
            spans.append((start, r - 1))
        start = r + 1
    return spans


# A warning names at most this many spans of ranks, then counts the rest.
_SPANS_SHOWN = 8


def _spans(values) -> str:
    """Ranks as `0, 2-5, 9`: spans (first, last) or single ranks."""
    spans = []
    for v in values:
        a, b = v if isinstance(v, tuple) else (v, v)
        if spans and isinstance(spans[-1], list) and spans[-1][1] + 1 == a:
            spans[-1][1] = b
        else:
            spans.append([a, b])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in spans[:_SPANS_SHOWN]]
    if len(spans) > _SPANS_SHOWN:
        text.append(f"and {len(spans) - _SPANS_SHOWN} more span(s)")
    return ", ".join(text)
