"""Readers' side of the per-shard index (`rank=<r>/index/part-N.json`, see
`recorders/index.py` and docs/FORMAT.md).

`load_run` asks here first: a shard pair whose index is readable is known
without opening either footer (on an object store, two round trips per
shard saved, and many thousand shards per run). A shard without a usable
index (older runs, a job killed between the shards and their index) is
read from its footer, as before; an index that is there but cannot be used
(damaged, of the wrong shape) is said in a warning first.
"""
from __future__ import annotations

import fnmatch
import os
from concurrent.futures import ThreadPoolExecutor

from recorders.format import schema

from ..errors import CorruptRunError, MixedRunsError, UnsupportedVersionError
from .files.limits import MAX_JSON_BYTES
from .files.models import ShardIndex, validate
from .files.safe import Damaged, check_entry, listed, parse_json, read_bytes, shown
from .shards import Shard, check_version
from .store import StorePath

# Index files are tiny: reading them is all latency (an object store's
# round trip), so several are read at once.
_READERS = 16


def read_indexes(root, rank_dirs: dict, run_id, warnings: list | None = None) -> dict[tuple[int, str], dict]:
    """{(rank, shard file name): index} for every usable index of the given
    ranks. An index is an optimisation, never needed (docs/FORMAT.md): one
    that cannot be used (not JSON, too large or too deeply nested, not a
    regular file, a field of the wrong type, an unreadable or newer
    schema_version) is named in a warning and its pair is read from the
    footers, which decide. Only an index of another recording (its run id)
    is an error: it says the directory mixes two runs."""
    warnings = warnings if warnings is not None else []
    files = []
    for rank, d in sorted(rank_dirs.items()):
        idir = d / schema.INDEX_DIR
        check_entry(d, root, CorruptRunError, directory=True)
        if not idir.is_dir():
            continue
        try:
            check_entry(idir, root, CorruptRunError, directory=True)
        except CorruptRunError as exc:
            warnings.append(f"{exc}; {_FALLBACK} of rank {rank}")
            continue
        names = sorted(f for f in listed(idir, warnings)
                       if fnmatch.fnmatchcase(f.name, "part-*.json") and not f.name.startswith("."))
        files += [(rank, f) for f in names]
    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=min(_READERS, len(files))) as pool:
        docs = list(pool.map(lambda rf: _read(rf[1], root), files))
    out = {}
    for (rank, f), (doc, problem) in zip(files, docs):
        if problem is None:
            problem = _problem(doc, rank, f, root)
        if problem is not None:
            warnings.append(f"{problem}; {_FALLBACK}")
            continue
        if doc is None:
            continue
        if run_id is not None and doc.get("run_id") != run_id:
            raise MixedRunsError(
                f"mixed runs in {root}: {f.relative_to(root)} belongs to run {doc.get('run_id')!r}, the "
                f"manifest to {run_id!r}; a resumed job must reuse the run id (AMP_POSTMORTEM_RUN_ID) "
                f"or write to a new directory")
        out[(rank, str(doc.get("shard")))] = doc
    return out


# What a warning about an unusable index says happens instead.
_FALLBACK = "the index is ignored and its shard pair read from the footers"


def _problem(doc: dict | None, rank: int, f, root) -> str | None:
    """Why a parsed index cannot be used (None: it can, or it is another
    file kind's JSON, which is no index and says nothing)."""
    if doc is None or doc.get("format") != schema.INDEX_FORMAT_NAME or doc.get("rank") != rank:
        return None
    try:
        validate(ShardIndex, doc, f, CorruptRunError)
        check_version(doc.get("schema_version"), str(f.relative_to(root)))
    except (CorruptRunError, UnsupportedVersionError) as exc:
        return str(exc)
    return None


def shard_from_index(path, rank: int, table: str, doc: dict | None) -> Shard | None:
    """The `Shard` the footer of `path` would give, from its pair's index."""
    if doc is None:
        return None
    try:
        expected = int(doc["tensor_bytes"] if table == schema.TENSORS_DIR else doc["step_bytes"])
        if file_size(path) != expected:
            return None  # damaged or replaced since: its footer tells
        rows = int(doc["tensor_rows"] if table == schema.TENSORS_DIR else doc["step_rows"])
        nonfinite = int(doc["nonfinite_rows"]) if table == schema.TENSORS_DIR else 0
        return Shard(path=path, rank=rank, table=table, num_rows=rows, first_step=int(doc["first_step"]),
                     last_step=int(doc["last_step"]), nonfinite_rows=nonfinite)
    except (KeyError, TypeError, ValueError):
        return None


def file_size(path) -> int | None:
    try:
        return path.size() if isinstance(path, StorePath) else os.stat(path).st_size
    except OSError:
        return None


def _read(path, root) -> tuple[dict | None, str | None]:
    """(the index, None), or (None, why it cannot be read)."""
    try:
        check_entry(path, root, CorruptRunError)
        doc = parse_json(read_bytes(path, root, CorruptRunError, MAX_JSON_BYTES), path, CorruptRunError)
    except CorruptRunError as exc:
        return None, str(exc)
    except Damaged as exc:
        return None, f"{shown(path)}: {exc}"
    return (doc if isinstance(doc, dict) else None), None
