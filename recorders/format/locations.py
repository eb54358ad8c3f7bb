"""Where a run is, as the recorder writes it and a reader asks: whether a
location is a URI (`is_uri`), a local one as a path (`local_path`), the
filesystem of a URI (`open_filesystem`: pyarrow's, else fsspec's), a rank's
spool directory (`spool_dir_for`) and whether a directory is a recorder's
local spool (`is_spool`), which holds no complete run. `recorders.storage`
writes runs there and imports these from here."""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["SPOOL_ENV", "StorageError", "is_uri", "local_path", "open_filesystem", "spool_dir_for", "is_spool"]

# A scheme of two letters or more: "C:\runs" (a Windows drive) stays a path.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")

SPOOL_ENV = "AMP_POSTMORTEM_SPOOL_DIR"


class StorageError(ValueError):
    """A run location that cannot be opened (bad URI, missing extra)."""


def is_uri(location) -> bool:
    """Whether `location` names a filesystem by URI (`s3://...`), not a local path."""
    if isinstance(location, os.PathLike):
        return False
    m = _URI.match(str(location))
    return bool(m) and m.group(1).lower() != "file"


def local_path(location) -> Path:
    """A local run location as a Path (`file://` URIs included)."""
    s = os.fspath(location)
    if isinstance(s, str) and s.lower().startswith("file://"):
        return Path(s[len("file://"):])
    return Path(s)


def open_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI: pyarrow's own filesystem for
    the schemes it knows (s3, gs, abfs, hdfs, file), else fsspec's (the `s3`
    extra installs it) wrapped for pyarrow."""
    uri = str(uri).rstrip("/")
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, ValueError) as first:
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise StorageError(f"cannot open {uri}: {first}; install fsspec "
                               f"(pip install 'amp-postmortem[s3]') for more filesystems") from None
        try:
            fs, path = url_to_fs(uri)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {uri}: {exc}") from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path.rstrip("/")


def spool_dir_for(uri: str, rank: int, base=None) -> Path:
    """The spool of one rank of a run: under `base` (default
    `$AMP_POSTMORTEM_SPOOL_DIR`, else the system temp directory), one folder
    per run URI and rank, so that ranks sharing a node never share a spool
    and a restarted job finds its leftovers."""
    base = base or os.environ.get(SPOOL_ENV) or os.path.join(tempfile.gettempdir(), "amp-postmortem-spool")
    key = hashlib.sha256(str(uri).rstrip("/").encode()).hexdigest()[:16]
    return Path(base) / f"{key}-rank{int(rank)}"


def is_spool(directory, uri, rank: int) -> bool:
    """Whether `directory` is the spool of rank `rank` of the run at `uri`
    (its name is derived from both, wherever its base is): a reader's
    question, since a spool is no complete run (published pairs leave it
    once uploaded)."""
    d = Path(directory)
    try:
        return d == spool_dir_for(uri, int(rank), d.parent)
    except (TypeError, ValueError):
        return False
