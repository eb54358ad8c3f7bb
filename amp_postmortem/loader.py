"""The one place that reads a run directory.

`load_run(path)` validates the manifests (format, schema version, run id),
discovers the ranks, reads every shard's footer (never its data) and loads
the small steps table. The large tensors table stays on disk as a
`pyarrow.dataset`; analyses read it through `Run.scan_tensors`, which prunes
shards by the step range and non-finite row count stamped in their footers
and row groups by their Parquet statistics, and projects columns.

Damage becomes warnings (`Run.warnings`) or named errors, never a silently
wrong answer: an unreadable shard is skipped and named, missing ranks and a
recorder that was never closed are reported, files of different recordings
in one directory are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs  # noqa: F401  (pa.fs)

from recorders import schema

from .errors import CorruptRunError, EmptyRunError, MixedRunsError, RankNotFoundError, RunNotFoundError
from .shards import (RANK_DIR, Shard, check_pairs, check_version, error_text, rank_dirs, read_footer, read_steps,
                     shard_files)

_FORMAT = ds.ParquetFileFormat()
_LOCAL_FS = pa.fs.LocalFileSystem()
NONFINITE_FILTER = (pc.field("nan_count") > 0) | (pc.field("inf_count") > 0)

# A progress callback: (label, rows done, rows total). Set by the CLI.
Progress = Callable[[str, int, int], None]


@dataclass
class Run:
    """A recorded run, validated. `steps` is in memory (one row per step and
    rank, sorted by step then rank; the columns of `schema.STEP_COLUMNS` plus
    `loss_nonfinite`: the loss was NaN/Inf, not merely missing); tensor rows
    are read on demand with `scan_tensors`."""
    path: Path
    manifest: dict
    rank_manifests: dict[int, dict]
    ranks: list[int]
    steps: pd.DataFrame
    tensor_shards: list[Shard]
    warnings: list[str] = field(default_factory=list)
    progress: Progress | None = None
    scanned_files: list[Path] = field(default_factory=list)  # every tensor shard read, in order

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
        return int(self.steps["step"].min()) if len(self.steps) else None

    @property
    def last_step(self) -> int | None:
        return int(self.steps["step"].max()) if len(self.steps) else None

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    # ---------------------------------------------------------- tensor rows
    @property
    def tensors(self) -> ds.Dataset:
        """All readable tensor shards as one dataset (for DuckDB-style use)."""
        return ds.dataset([str(s.path) for s in self.tensor_shards], format="parquet",
                          schema=schema.TENSOR_SCHEMA)

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
                            label: str = "reading tensors") -> Iterator[pa.RecordBatch]:
        """Record batches of the tensors table, shard by shard in step order
        per rank. Shards whose footer rules them out are never opened; within
        a shard, Parquet row-group statistics prune with the same filter.
        `step_range` = (first, last), both inclusive, either may be None."""
        steps = None if steps is None else sorted({int(s) for s in steps})
        lo, hi = step_range or (None, None)
        shards = [s for s in self.select_shards(steps=steps, nonfinite_only=nonfinite_only)
                  if not ((lo is not None and s.last_step is not None and s.last_step < lo)
                          or (hi is not None and s.first_step is not None and s.first_step > hi))]
        expr = None
        if nonfinite_only:
            expr = NONFINITE_FILTER
        if steps is not None:
            e = pc.field("step").isin(pa.array(steps, pa.int64()))
            expr = e if expr is None else expr & e
        if lo is not None:
            expr = (pc.field("step") >= lo) if expr is None else expr & (pc.field("step") >= lo)
        if hi is not None:
            expr = (pc.field("step") <= hi) if expr is None else expr & (pc.field("step") <= hi)
        if kinds is not None:
            e = pc.field("kind").isin(pa.array(list(kinds), pa.string()))
            expr = e if expr is None else expr & e
        total = sum(s.num_rows for s in shards)
        done = 0
        self._report(label, 0, total)
        for shard in shards:
            try:
                frag = _FORMAT.make_fragment(str(shard.path), filesystem=_LOCAL_FS)
                if expr is not None:
                    frag = frag.subset(filter=expr, schema=schema.TENSOR_SCHEMA)
                    if frag.num_row_groups == 0:  # statistics rule every row group out
                        done += shard.num_rows
                        continue
                self.scanned_files.append(shard.path)
                scanner = frag.scanner(schema=schema.TENSOR_SCHEMA, columns=columns, filter=expr)
                batches = list(scanner.to_batches())
            except (OSError, pa.ArrowException) as exc:
                self.warn(f"skipped unreadable shard {self._rel(shard.path)} ({error_text(exc)})")
                continue
            done += shard.num_rows
            self._report(label, done, total)
            yield from batches

    def scan_tensors(self, columns: list[str] | None = None, **options) -> pd.DataFrame:
        """`iter_tensor_batches` gathered into one DataFrame (the same options)."""
        cols = columns or [c.name for c in schema.TENSOR_COLUMNS]
        batches = list(self.iter_tensor_batches(cols, **options))
        if not batches:
            return schema.TENSOR_SCHEMA.empty_table().select(cols).to_pandas()
        return pa.Table.from_batches(batches).to_pandas()

    def _report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)

    def _rel(self, p: Path) -> str:
        try:
            return str(Path(p).relative_to(self.path))
        except ValueError:
            return str(p)


# ---------------------------------------------------------------- loading
def load_run(path, rank: int | None = None) -> Run:
    """Validate and open the run directory `path` (all ranks, or only `rank`)."""
    root = Path(path)
    if not root.exists():
        raise RunNotFoundError(f"run directory not found: {root}")
    if not root.is_dir():
        raise RunNotFoundError(f"{root} is not a directory; pass the run directory (the one holding manifest.json)")
    m = RANK_DIR.match(root.name)
    if m and (root.parent / schema.MANIFEST_FILE).is_file():
        raise RunNotFoundError(f"{root} is one rank of a run: pass the run directory {root.parent} "
                               f"(with --rank {m.group(1)} for this rank only)")
    warnings: list[str] = []

    try:
        found = rank_dirs(root)
    except OSError as exc:  # e.g. no permission to list it: the user's to fix
        raise RunNotFoundError(f"cannot read the run directory {root} ({error_text(exc)})") from None
    top = root / schema.MANIFEST_FILE
    if top.is_file():
        manifest = _read_manifest(top)
    elif found and (found[min(found)] / schema.MANIFEST_FILE).is_file():
        r0 = min(found)
        manifest = _read_manifest(found[r0] / schema.MANIFEST_FILE)
        warnings.append(f"{top} is missing; using the manifest of rank {r0}")
    else:
        raise RunNotFoundError(f"{root} is not an amp-postmortem run: no {schema.MANIFEST_FILE}")
    run_id = manifest.get("run_id")

    rank_manifests: dict[int, dict] = {}
    for r, d in sorted(found.items()):
        mpath = d / schema.MANIFEST_FILE
        if not mpath.is_file():
            warnings.append(f"{mpath.relative_to(root)} is missing; reading rank {r} from its shards only")
            continue
        m = _read_manifest(mpath)
        if m.get("run_id") != run_id:
            raise MixedRunsError(
                f"mixed runs in {root}: rank {r} has run_id {m.get('run_id')!r}, the run manifest "
                f"has {run_id!r}; keep one recording per directory")
        rank_manifests[r] = m
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
        missing = [r for r in range(world_size) if r not in found]
        if missing:
            warnings.append(f"rank(s) {_join(missing)} of world_size {world_size} are missing; "
                            f"the analysis covers rank(s) {_join(present)} only")

    open_ranks = [r for r in selected if rank_manifests.get(r, {}).get("status", "closed") == "open"]
    if open_ranks:
        warnings.append(f"the recorder of rank(s) {_join(open_ranks)} was not closed (status 'open'): "
                        f"the job may have been killed; the analysis covers the steps on disk")
    for r in selected:
        m = rank_manifests.get(r, {})
        if m.get("dropped_steps"):
            warnings.append(f"rank {r}: the recorder dropped {m['dropped_steps']} step(s) "
                            f"because its queue was full; those steps are absent")
        if m.get("disabled_reason"):
            warnings.append(f"rank {r}: recording was switched off during the job "
                            f"({m['disabled_reason']}); later steps are absent")

    step_shards: list[Shard] = []
    tensor_shards: list[Shard] = []
    found_files = 0
    for r in selected:
        for table, out in ((schema.STEPS_DIR, step_shards), (schema.TENSORS_DIR, tensor_shards)):
            for f in shard_files(found[r] / table):
                found_files += 1
                shard = read_footer(root, f, r, table, run_id, warnings)
                if shard is not None:
                    out.append(shard)
    check_pairs(root, step_shards, tensor_shards, warnings)

    steps = read_steps(root, step_shards, warnings)
    run = Run(path=root, manifest=manifest, rank_manifests=rank_manifests, ranks=selected,
              steps=steps, tensor_shards=tensor_shards)
    for w in warnings:
        run.warn(w)
    if steps.empty:
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
    return f"{where} holds no readable step: {why}" + _disabled(manifests)


def _disabled(manifests) -> str:
    reasons = sorted({m["disabled_reason"] for m in manifests if m.get("disabled_reason")})
    return f"; recording was switched off ({'; '.join(reasons)})" if reasons else ""


def _read_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRunError(f"{path} is not a readable manifest ({error_text(exc)})") from None
    if not isinstance(m, dict):
        raise CorruptRunError(f"{path} is not a run manifest (a JSON object was expected)")
    fmt = m.get("format")
    if fmt != schema.FORMAT_NAME:
        raise CorruptRunError(f"{path} has format {fmt!r}, expected {schema.FORMAT_NAME!r}: not an amp-postmortem run")
    check_version(m.get("schema_version"), str(path))
    return m


def _join(values) -> str:
    return ", ".join(str(v) for v in values)
