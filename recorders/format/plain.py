"""Plain JSON values and checksums: the one converter and the one checksum
rule shared by the recorder (manifests, bundle metadata) and the analyzer
(every report's `to_dict()`, i.e. every `--json`).

Imports neither torch nor pandas: the analyzer's table commands run where
torch is not installed, and the recorder core must stay light.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import PurePath


def plain(obj, *, keep_nonfinite: bool = False):
    """A JSON-ready copy of `obj`: dicts, lists and tuples recursed; numpy
    scalars and arrays and CPU tensors read as Python values; pandas' NA as
    None; anything else as its `str`.

    NaN and Inf floats become None (strict JSON, what `--json` prints) unless
    `keep_nonfinite`: the recorder keeps them in its own files, where a NaN
    loss or scale is the news (Python's `json` writes them as NaN/Infinity).
    A tensor on an accelerator is never read here (that would wait for the
    device): it becomes its `str` description instead.
    """
    if isinstance(obj, dict):
        return {str(k): plain(v, keep_nonfinite=keep_nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, keep_nonfinite=keep_nonfinite) for v in obj]
    if isinstance(obj, float):
        return obj if keep_nonfinite or math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    if isinstance(obj, PurePath):
        return str(obj)
    if type(obj).__name__ == "NAType":  # pandas.NA, without importing pandas
        return None
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return str(obj)
    for read in ("tolist", "item"):  # numpy arrays and scalars, CPU tensors
        if hasattr(obj, read):
            try:
                return plain(getattr(obj, read)(), keep_nonfinite=keep_nonfinite)
            except (ValueError, TypeError, RuntimeError):
                return str(obj)
    return str(obj)


def json_checksum(meta: dict) -> str:
    """sha256 of the canonical JSON of `meta` without its `checksum` key."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
