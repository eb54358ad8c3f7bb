"""The files of a run directory, read one by one: rank directories, shard
files, their Parquet footers.

It owns what the format says about files on disk: which names are shards
(temporary files are invisible), what a footer stamps into a `Shard` (step
range, non-finite row count, format, schema version, run id) and which
shard pairs are incomplete; `step_table.py` reads the steps table from the
shards and the journals. It is separate from `loader.py`, which decides
what a run is (manifests, ranks, warnings) and scans tensor rows through
`Run`, so that each reads in one sitting. Its names serve `loader.py`;
users open runs with `amp_postmortem.load_run`.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recorders.format import schema

from ..errors import CorruptRunError, MixedRunsError, UnsupportedVersionError
from .files.safe import RANK_DIR, check_entry, check_inside, listed, numbered_dirs, rank_of
from .store import filesystem_of, fs_path


@dataclass(frozen=True)
class Shard:
    """One Parquet file of a rank, as its footer describes it."""
    path: Path
    rank: int
    table: str                 # "steps" or "tensors"
    num_rows: int
    first_step: int | None
    last_step: int | None
    nonfinite_rows: int | None  # None when the footer does not say

    def may_hold(self, steps: set[int] | None) -> bool:
        if steps is None or self.first_step is None or self.last_step is None:
            return True
        return any(self.first_step <= s <= self.last_step for s in steps)


def rank_dirs(root: Path, warnings: list | None = None) -> dict[int, Path]:
    """{rank: directory}; a name like `rank=00` or `rank=٠` (it would read
    as rank 0) or a linked rank directory is refused (CorruptRunError)."""
    return dict(numbered_dirs(root, rank_of, root, CorruptRunError, warnings))


def shard_files(d: Path, root: Path | None = None, warnings: list | None = None,
                pattern: str = "part-*.parquet") -> list[Path]:
    """The shard files (or, with another `pattern`, journal files) of a
    `steps/` or `tensors/` directory; one that is not a regular file (a
    FIFO would hang its reader, a link leads out of the run) is refused
    (CorruptRunError)."""
    check_inside(d, root, CorruptRunError)
    if not d.is_dir():
        return []
    # Temporary files start with "." and never end in ".parquet": invisible.
    found = sorted(p for p in listed(d, warnings)
                   if fnmatch.fnmatchcase(p.name, pattern) and not p.name.startswith("."))
    for p in found:
        check_entry(p, root, CorruptRunError)
    return found


def check_version(version, where: str) -> None:
    try:
        major, _minor = schema.parse_version(version)
    except (TypeError, ValueError):
        raise CorruptRunError(f"{where} has an unreadable schema_version {version!r}") from None
    if major > schema.SCHEMA_MAJOR:
        raise UnsupportedVersionError(
            f"{where} uses run format version {version}, this amp-postmortem {_package_version()} reads "
            f"{schema.SCHEMA_MAJOR}.x; upgrade amp-postmortem (pip install -U amp-postmortem)")
    # A newer minor version only adds columns and keys: readable as is.


def read_footer(root: Path, path: Path, rank: int, table: str, run_id, warnings) -> Shard | None:
    rel = path.relative_to(root)
    try:
        md = pq.read_metadata(fs_path(path), filesystem=filesystem_of(path))
    except (OSError, pa.ArrowException) as exc:
        warnings.append(f"skipped unreadable shard {rel} ({error_text(exc)}); "
                        f"a job killed while writing it leaves such a file")
        return None
    kv = md.metadata or {}

    def get(key):
        v = kv.get(key)
        return v.decode() if v is not None else None

    fmt = get(schema.META_FORMAT)
    if fmt is not None and fmt != schema.FORMAT_NAME:
        warnings.append(f"skipped {rel}: format {fmt!r} is not {schema.FORMAT_NAME!r}")
        return None
    # A file without the format's key columns is another program's Parquet:
    # read with the run's schema it would turn into rows of nulls.
    absent = [c for c in ("step", "rank") if c not in md.schema.names]
    if absent:
        warnings.append(f"skipped {rel}: not a {table} shard of this format (no column {absent[0]!r})")
        return None
    nulls = _key_nulls(md)
    if nulls:
        warnings.append(f"skipped {rel}: column {nulls!r} holds nulls or does not say it holds none "
                        f"(valid: step and rank in every row); not a shard this format writes")
        return None
    version = get(schema.META_SCHEMA_VERSION)
    if version is not None:
        check_version(version, str(rel))
    shard_run = get(schema.META_RUN_ID)
    if shard_run is not None and run_id is not None and shard_run != run_id:
        raise MixedRunsError(
            f"mixed runs in {root}: {rel} belongs to run {shard_run!r}, the manifest to {run_id!r}; "
            f"a resumed job must reuse the run id (AMP_POSTMORTEM_RUN_ID) or write to a new directory")
    return Shard(path=path, rank=rank, table=table, num_rows=md.num_rows,
                 first_step=_int(get(schema.META_FIRST_STEP)), last_step=_int(get(schema.META_LAST_STEP)),
                 nonfinite_rows=_int(get(schema.META_NONFINITE_ROWS)))


def _key_nulls(md) -> str | None:
    """The first key column (`step`, `rank`) that may hold a null: the
    recorder writes them as required columns; a nullable one must say, in
    every row group's statistics, that it holds none (a file of nulls would
    otherwise reach the analyses as rows without a step)."""
    for i in range(md.num_columns):
        col = md.schema.column(i)
        if col.path not in ("step", "rank") or col.max_definition_level == 0:
            continue
        for g in range(md.num_row_groups):
            stats = md.row_group(g).column(i).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return col.path
    return None


def check_pairs(root, step_shards, tensor_shards, warnings) -> None:
    """A shard pair covers one step range; say when one half is missing."""
    steps_names = {(s.rank, s.path.name) for s in step_shards}
    tensor_names = {(s.rank, s.path.name) for s in tensor_shards}
    for s in step_shards:
        if (s.rank, s.path.name) not in tensor_names and s.num_rows:
            warnings.append(f"rank {s.rank}: steps {s.first_step}-{s.last_step} have no tensor rows "
                            f"(tensors/{s.path.name} is missing or unreadable)")
    for s in tensor_shards:
        if (s.rank, s.path.name) not in steps_names and s.num_rows:
            warnings.append(f"rank {s.rank}: tensor rows of steps {s.first_step}-{s.last_step} have no step "
                            f"rows (steps/{s.path.name} is missing or unreadable)")


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("amp-postmortem")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "(unknown version)"


def _int(v):
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
