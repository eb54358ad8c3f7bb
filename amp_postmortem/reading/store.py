"""Run locations for readers: a local directory (a `Path`), or a URI on any
filesystem pyarrow or fsspec opens (a `StorePath`).

A `StorePath` answers the few `pathlib` questions the loader asks
(`exists`, `is_dir`, `iterdir`, `glob`, `read_text`, ...) from ONE
recursive listing of the run, taken on first use: an object store lists
thousands of keys per request, while asking per directory or per file
would cost a round trip each. `filesystem_of(p)` and `fs_path(p)` give
pyarrow what it needs to open a file of either kind.

`shallow_view(p)` is the other way to look, for `watch`'s polls of a run
being written: a directory is listed (one level, one request) only when
asked about, so a look at the manifests, status slots and indexes never
lists the shards; `ShallowListing.seen` holds the size and modification
time of every file it listed (what changed since the last look).
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

from recorders.format.locations import is_uri, local_path, open_filesystem

LOCAL_FS = pafs.LocalFileSystem()


class _Listing:
    """Every file and directory under one root, listed once."""

    def __init__(self, fs: pafs.FileSystem, root: str, uri: str):
        self.fs, self.root, self.uri = fs, root, uri
        self._kinds: dict[str, str] | None = None  # path -> "file" / "dir"
        self.sizes: dict[str, int] = {}
        self._children: dict[str, list[str]] = {}

    def kinds(self) -> dict[str, str]:
        if self._kinds is None:
            kinds = {}
            info = self.fs.get_file_info(self.root)
            if info.type == pafs.FileType.Directory or info.type == pafs.FileType.NotFound:
                entries = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True,
                                                                  allow_not_found=True))
                if entries or info.type == pafs.FileType.Directory:
                    kinds[self.root] = "dir"
                for e in entries:
                    kinds[e.path.rstrip("/")] = "dir" if e.type == pafs.FileType.Directory else "file"
                    if e.type == pafs.FileType.File:
                        self.sizes[e.path] = e.size
                    # Object stores may list no directory entries: infer them.
                    parent = e.path.rstrip("/").rpartition("/")[0]
                    while parent and parent.startswith(self.root) and parent not in kinds:
                        kinds[parent] = "dir"
                        parent = parent.rpartition("/")[0]
            elif info.type == pafs.FileType.File:
                kinds[self.root] = "file"
            children: dict[str, list[str]] = {}
            for p in kinds:
                if p != self.root:
                    children.setdefault(p.rpartition("/")[0], []).append(p)
            self._kinds, self._children = kinds, children
        return self._kinds

    def children(self, path: str) -> list[str]:
        self.kinds()
        return sorted(self._children.get(path, []))

    def kind(self, path: str) -> str | None:
        return self.kinds().get(path)

    def size(self, path: str) -> int | None:
        self.kinds()
        return self.sizes.get(path)

    def versions(self) -> dict[str, tuple[int | None, int | None]]:
        self.kinds()
        return {p: (size, None) for p, size in self.sizes.items()}


class ShallowListing:
    """The directories of one root, each listed one level deep, once, when
    first asked about (an object store answers a listing with a delimiter
    in one request; a directory whose parent's listing lacks it is known
    absent without one)."""

    def __init__(self, fs: pafs.FileSystem, root: str, uri: str):
        self.fs, self.root, self.uri = fs, root, uri
        self._kinds: dict[str, str] = {}
        self._listed: dict[str, list[str]] = {}
        self.seen: dict[str, tuple[int | None, int | None]] = {}  # file -> (size, mtime_ns)

    def _list(self, d: str) -> None:
        if d in self._listed:
            return
        children = []
        if d == self.root or self.kind(d) == "dir":
            for e in self.fs.get_file_info(pafs.FileSelector(d, recursive=False, allow_not_found=True)):
                p = e.path.rstrip("/")
                if p == d or not p.startswith(d + "/"):
                    continue
                children.append(p)
                if e.type == pafs.FileType.Directory:
                    self._kinds[p] = "dir"
                else:
                    self._kinds[p] = "file"
                    self.seen[p] = (e.size, e.mtime_ns)
            if d == self.root:
                if children:
                    self._kinds[d] = "dir"
                else:  # an empty directory of a filesystem that has them, or nothing
                    info = self.fs.get_file_info(d)
                    if info.type == pafs.FileType.Directory:
                        self._kinds[d] = "dir"
                    elif info.type == pafs.FileType.File:
                        self._kinds[d] = "file"
        self._listed[d] = sorted(children)

    def kind(self, path: str) -> str | None:
        if path == self.root:
            self._list(path)
        elif path.startswith(self.root + "/"):
            self._list(path.rpartition("/")[0])
        return self._kinds.get(path)

    def children(self, path: str) -> list[str]:
        self._list(path)
        return self._listed[path]

    def size(self, path: str) -> int | None:
        self.kind(path)
        return self.seen.get(path, (None, None))[0]

    def versions(self) -> dict[str, tuple[int | None, int | None]]:
        return dict(self.seen)


class StorePath:
    """A path inside a run on a (remote) pyarrow filesystem."""

    def __init__(self, listing: _Listing, path: str):
        self._listing = listing
        self.path = path.rstrip("/")

    @property
    def fs(self) -> pafs.FileSystem:
        return self._listing.fs

    def _at(self, path: str) -> "StorePath":
        return StorePath(self._listing, path)

    def __truediv__(self, other) -> "StorePath":
        return self._at(f"{self.path}/{str(other).strip('/')}")

    def __str__(self) -> str:
        root = self._listing.root
        rel = self.path[len(root):] if self.path.startswith(root) else "/" + self.path
        return self._listing.uri + rel

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __fspath__(self) -> str:  # so str-based messages and os.fspath callers work
        return str(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, StorePath) and other.path == self.path and other.fs is self.fs

    def __hash__(self) -> int:
        return hash(self.path)

    def __lt__(self, other) -> bool:
        return self.path < other.path

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def parent(self) -> "StorePath":
        return self._at(self.path.rpartition("/")[0])

    def exists(self) -> bool:
        return self._listing.kind(self.path) is not None

    def is_dir(self) -> bool:
        return self._listing.kind(self.path) == "dir"

    def is_file(self) -> bool:
        return self._listing.kind(self.path) == "file"

    def iterdir(self):
        return iter([self._at(p) for p in self._listing.children(self.path)])

    def glob(self, pattern: str):
        return iter([self._at(p) for p in self._listing.children(self.path)
                     if fnmatch.fnmatchcase(p.rpartition("/")[2], pattern)])

    def relative_to(self, other) -> PurePosixPath:
        base = other.path if isinstance(other, StorePath) else str(other)
        if not (self.path == base or self.path.startswith(base.rstrip("/") + "/")):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.path[len(base):].lstrip("/"))

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def size(self) -> int | None:
        """Size in bytes, from the listing."""
        return self._listing.size(self.path)

    def version(self) -> tuple[int | None, int | None] | None:
        """(size, mtime_ns) of this file as listed (mtime None where the
        listing gives none); None when it was not listed."""
        self._listing.kind(self.path)
        return self.listed_versions().get(self.path)

    def listed_versions(self) -> dict[str, tuple[int | None, int | None]]:
        """(size, mtime_ns) of every file listed so far, by path."""
        return self._listing.versions()


def run_location(location) -> Path | StorePath:
    """A run location as the loader reads it: a Path, or a StorePath for a URI."""
    if isinstance(location, (Path, StorePath)):
        return location
    if not is_uri(location):
        return local_path(location)
    uri = str(location).rstrip("/")
    try:
        fs, root = open_filesystem(uri)
    except ValueError as exc:
        from ..errors import RunNotFoundError
        raise RunNotFoundError(str(exc)) from None
    except OSError as exc:  # pyarrow asks an S3 store for the bucket's region here
        from ..errors import RunNotFoundError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RunNotFoundError(f"cannot open {uri} ({detail})") from None
    return StorePath(_Listing(fs, root, uri), root)


def fresh_view(p: StorePath) -> StorePath:
    """The run at `p` listed anew (one recursive listing, on first use),
    on the same filesystem object."""
    return StorePath(_Listing(p.fs, p.path, str(p)), p.path)


def shallow_view(p: StorePath) -> StorePath:
    """The run at `p` seen through a new `ShallowListing` (see the module
    docstring), on the same filesystem object."""
    return StorePath(ShallowListing(p.fs, p.path, str(p)), p.path)


def filesystem_of(p) -> pafs.FileSystem:
    return p.fs if isinstance(p, StorePath) else LOCAL_FS


def fs_path(p) -> str:
    """The path pyarrow opens on `filesystem_of(p)`."""
    return p.path if isinstance(p, StorePath) else os.fspath(p)


CACHE_ENV = "AMP_POSTMORTEM_CACHE"


def local_copy(location) -> Path:
    """A local copy of a remote run (the commands that replay bundles read
    a run directory on disk): every file, under `$AMP_POSTMORTEM_CACHE` or
    the temp directory, one folder per URI; files already there with the
    same size are not fetched again. A local path is returned as is."""
    root = run_location(location)
    if not isinstance(root, StorePath):
        return root
    import hashlib
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    base = os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "amp-postmortem-cache")
    target = Path(base) / hashlib.sha256(str(root).encode()).hexdigest()[:16]
    listing = root._listing
    kinds = listing.kinds()
    if not kinds:
        from ..errors import RunNotFoundError
        raise RunNotFoundError(f"run directory not found: {root}")
    files = [p for p, k in kinds.items() if k == "file"]
    for path in files:
        # An object key is any string: one that climbs out ("..") would be
        # written outside the cache folder.
        rel = path[len(root.path):]
        if not rel.startswith("/") or any(p in ("", ".", "..") for p in rel[1:].split("/")):
            from ..errors import CorruptRunError
            raise CorruptRunError(f"{root}: object {path!r} is not a plain path inside the run")

    def fetch(path: str) -> None:
        dest = target / path[len(root.path):].lstrip("/")
        if dest.is_file() and dest.stat().st_size == listing.sizes.get(path):
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.write_bytes(root._at(path).read_bytes())
        os.replace(tmp, dest)

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(fetch, files))
    return target
