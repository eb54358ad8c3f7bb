"""Opening the files of a run or bundle without trusting them.

Only regular files are read: a FIFO named like a shard would block `open()`
forever, so files are opened with O_NONBLOCK (a FIFO then opens at once) and
O_NOFOLLOW, and the open descriptor must be a regular file. No symbolic link
inside a run or bundle is followed (nothing outside the run is ever read);
the run's own directory may be one, as the user named it. Names are
canonical ASCII (`rank=0`, never `rank=00`, `rank=+1` or `rank=٠`, which
`int()` would read as rank 0 and so alias its data); a name that is not
UTF-8 is ignored with a warning (it could not be printed or opened by
pyarrow). JSON is bounded in size and in nesting depth before `json.loads`
recurses into it.

A violation raises the caller's error class (a `PostmortemError`) with one
line: `<file>: <what is wrong, what is valid>`.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..store import StorePath
from .limits import MAX_JSON_BYTES, MAX_JSON_DEPTH

# [0-9], re.ASCII and \Z: `\d` matches any Unicode digit and `$` matches
# before a trailing newline (anchored, so `.match` is as safe as `.fullmatch`).
RANK_DIR = re.compile(r"rank=(0|[1-9][0-9]*)\Z", re.ASCII)
STEP_DIR = re.compile(r"step=(0|-?[1-9][0-9]*)\Z", re.ASCII)
CANONICAL_RANK = "valid: rank=<r> with r in ASCII digits and no leading zero or sign, e.g. rank=0, rank=12"
CANONICAL_STEP = "valid: step=<n> with n in ASCII digits and no leading zero or plus sign, e.g. step=0, step=120"

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def shown(path) -> str:
    """`path` as text that can always be printed on one line: bytes that are
    not UTF-8 (kept by Python as surrogates) become \\x.. escapes, and so do
    control characters (a newline in a name would split the message)."""
    text = os.fsencode(str(path)).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # surrogateescape'd bytes of a non-UTF-8 name
        return False
    return True


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _is_local(path) -> bool:
    return not isinstance(path, StorePath)


def check_inside(path, root, error) -> None:
    """Refuse `path` when any part of it below `root` is a symbolic link:
    whatever it points at is outside what the run vouches for."""
    if not _is_local(path) or root is None:
        return
    path, root = Path(path), Path(root)
    try:
        rel = path.relative_to(root)
    except ValueError:
        return  # not inside the run: the caller named it itself
    at = root
    for part in rel.parts:
        at = at / part
        try:
            mode = os.lstat(at).st_mode
        except FileNotFoundError:
            return  # the caller's own "missing" message says it better
        except OSError as exc:
            raise error(f"{shown(at)}: cannot be read ({exc.strerror or exc})") from None
        if stat.S_ISLNK(mode):
            raise error(f"{shown(at)}: is a symbolic link; nothing a link inside a run or bundle points "
                        f"at is read (valid: regular files and directories)")


def check_entry(path, root, error, *, directory: bool = False) -> None:
    """`path` (inside `root`) is a regular file (or a directory), not a link."""
    if not _is_local(path):
        return
    check_inside(path, root, error)
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise error(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    if (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        return
    raise error(f"{shown(path)}: is {_kind(mode)}; only {'directories' if directory else 'regular files'} "
                f"are read here")


def open_regular(path, root, error):
    """A binary file object of the regular file `path`: never a FIFO (no
    hang), never through a symbolic link."""
    check_inside(path, root, error)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise error(f"{shown(path)}: is a symbolic link; nothing a link inside a run or bundle "
                        f"points at is read (valid: regular files)") from None
        raise error(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{shown(path)}: is {_kind(mode)}; only regular files are read")
    return os.fdopen(fd, "rb")


def read_bytes(path, root, error, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes."""
    if not _is_local(path):
        size = path.size()
        if size is not None and size > limit:
            raise error(f"{shown(path)}: {size} bytes, more than the {limit} bytes such a file may have")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise error(f"{shown(path)}: cannot be read ({exc})") from None
    else:
        with open_regular(path, root, error) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{shown(path)}: {size} bytes, more than the {limit} bytes such a file may have")
            try:
                data = f.read(limit + 1)
            except OSError as exc:
                raise error(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{shown(path)}: more than the {limit} bytes such a file may have")
    return data


# A JSON string, escapes included: its brackets are not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(data: bytes) -> int:
    """How deeply the arrays and objects of the JSON text `data` nest,
    counted without recursion (a `json.loads` of 200,000 levels would
    exhaust the stack first)."""
    text = _STRING.sub(b'""', data)
    deepest = depth = 0
    for start in range(0, len(text), _CHUNK):  # bounded temporaries for a 64 MiB file
        a = np.frombuffer(text, dtype=np.uint8, count=min(_CHUNK, len(text) - start), offset=start)
        opens = (a == ord("[")) | (a == ord("{"))
        at = np.flatnonzero(opens | (a == ord("]")) | (a == ord("}")))
        if at.size:
            levels = depth + np.cumsum(np.where(opens[at], 1, -1), dtype=np.int64)
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


_CHUNK = 1 << 22


class Damaged(Exception):
    """Bytes that are not UTF-8 JSON: damage, which some readers skip."""


def parse_json(data: bytes, where, error):
    """The JSON value of `data`, its depth checked first (`error` when too
    deep); `Damaged` when it is not UTF-8 JSON. NaN and Infinity are read
    (the recorder's files keep them)."""
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{shown(where)}: JSON nested {depth} levels deep, more than the {MAX_JSON_DEPTH} "
                    f"levels this format uses")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Damaged(f"not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Damaged(f"not JSON: {str(exc).splitlines()[0][:120]}") from None


def read_json(path, root, error, what: str = "JSON file"):
    """The JSON value of a regular file inside `root`, size and depth
    bounded; `error` (one line naming the file) when it is unusable."""
    data = read_bytes(path, root, error, MAX_JSON_BYTES)
    try:
        return parse_json(data, path, error)
    except Damaged as exc:
        raise error(f"{shown(path)}: is not a readable {what} ({exc})") from None


def listed(directory, warnings: list | None) -> list:
    """Entries of `directory` whose names are UTF-8; each other one is
    named in a warning and ignored."""
    out = []
    for p in directory.iterdir():
        if is_utf8(p.name):
            out.append(p)
        elif warnings is not None:
            msg = f"ignored {shown(p)}: its name is not UTF-8"
            if msg not in warnings:
                warnings.append(msg)
    return out


def parse_dir_name(name: str, pattern: re.Pattern, prefix: str, valid: str, where, error) -> int | None:
    """The number in a `rank=R` / `step=N` directory name; None for a name
    of another kind; `error` for a non-canonical one (it would alias)."""
    if not name.startswith(prefix):
        return None
    m = pattern.fullmatch(name)
    if m is None:
        raise error(f"{shown(where)}: directory name {name!r} is not canonical ({valid})")
    return int(m.group(1))


def rank_of(name: str, where, error) -> int | None:
    return parse_dir_name(name, RANK_DIR, "rank=", CANONICAL_RANK, where, error)


def step_of(name: str, where, error) -> int | None:
    return parse_dir_name(name, STEP_DIR, "step=", CANONICAL_STEP, where, error)


def numbered_dirs(parent, number_of, root, error, warnings: list | None = None) -> list[tuple[int, Path]]:
    """(number, directory) of the `rank=R` / `step=N` directories in
    `parent` (`number_of`: `rank_of` or `step_of`); a non-canonical name
    (it would alias another) or a linked directory raises `error`."""
    out = []
    for d in listed(parent, warnings):
        number = number_of(d.name, d, error)
        if number is None:
            continue  # another kind of entry, hidden temporary directories included
        check_inside(d, root, error)
        if d.is_dir():
            out.append((number, d))
    return out
