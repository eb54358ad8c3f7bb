"""Replay bundles of the Keras and Flax recorders, as the analyzer reads
them (docs/FORMAT.md, "Array bundles"; written by `recorders.host_bundle`).

`load_array_bundle(path)` checks `bundle.json` (format, major version,
checksum), the size and sha256 of `arrays.npz` before parsing it, and every
listed array's dtype and shape; the arrays are read with
`numpy.load(..., allow_pickle=False)`: nothing is unpickled, nothing a
bundle names is imported. Imports numpy only (no torch, TensorFlow or JAX).
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recorders.format import json_checksum, schema

from ..errors import BundleError
from .files import limits
from .files.safe import Damaged, parse_json, read_bytes, shown


@dataclass
class ArrayBundle:
    path: str
    meta: dict            # the whole bundle.json
    arrays: dict          # role/name -> numpy array (bfloat16 as float32: exact)

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def framework(self) -> str:
        return str((self.meta.get("framework") or {}).get("name"))

    @property
    def backend(self) -> str | None:
        return (self.meta.get("framework") or {}).get("backend")

    @property
    def params(self) -> dict:
        """Variables by run name (`d1.kernel`), in the order recorded."""
        return {n: self.arrays[f"param/{n}"] for n in self.meta["params"]["names"]}

    @property
    def loss(self) -> float | None:
        v = self.meta.get("loss")
        return float(v) if isinstance(v, (int, float)) else None

    @property
    def loss_scale(self) -> float | None:
        v = self.meta.get("loss_scale")
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    def inputs(self) -> tuple[tuple, dict]:
        """(args, kwargs) of the model call, rebuilt from the argument trees."""
        spec = self.meta["inputs"]
        return (tuple(self.tree(n) for n in spec["args"]),
                {k: self.tree(n) for k, n in spec.get("kwargs") or []})

    def tree(self, node):
        kind = node["kind"]
        if kind == "array":
            return self.arrays[node["name"]]
        if kind == "value":
            return node["value"]
        if kind in ("tuple", "list"):
            items = [self.tree(n) for n in node["items"]]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict":
            return {k: self.tree(n) for k, n in node["items"]}
        return None  # unsupported: the recorder could not store it


def is_array_bundle(path) -> bool:
    """Whether `path` is a bundle directory of this format (its bundle.json
    says so); False for a PyTorch bundle or anything unreadable."""
    meta = Path(path) / schema.BUNDLE_MANIFEST_FILE
    try:
        data = read_bytes(meta, Path(path), BundleError, limits.MAX_JSON_BYTES)
        return parse_json(data, meta, BundleError).get("format") == schema.ARRAY_BUNDLE_FORMAT_NAME
    except (BundleError, Damaged, AttributeError):
        return False


def load_array_bundle(path) -> ArrayBundle:
    """Validate and read one array bundle directory (BundleError, one line,
    for anything missing, truncated, tampered with or newer)."""
    path = Path(path)
    meta_path = path / schema.BUNDLE_MANIFEST_FILE
    if not meta_path.is_file():
        raise BundleError(f"not a replay bundle: {shown(meta_path)} is missing")
    meta = _read_meta(meta_path, path)
    try:
        arrays = _read_arrays(path, meta)
        ArrayBundle(str(path), meta, arrays).inputs()  # every name the trees use exists
        return ArrayBundle(str(path), meta, arrays)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BundleError(f"malformed bundle {shown(path)}: {type(exc).__name__}: {exc}") from None


def _read_meta(meta_path: Path, root: Path) -> dict:
    data = read_bytes(meta_path, root, BundleError, limits.MAX_JSON_BYTES)
    try:
        meta = parse_json(data, meta_path, BundleError)
    except Damaged as exc:
        raise BundleError(f"{shown(meta_path)} is truncated or not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != schema.ARRAY_BUNDLE_FORMAT_NAME:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise BundleError(f"{shown(meta_path)}: format {fmt!r} is not {schema.ARRAY_BUNDLE_FORMAT_NAME!r}")
    found = str(meta.get("version"))
    try:
        major, _ = schema.parse_version(found)
    except ValueError:
        raise BundleError(f"{shown(meta_path)}: bad bundle version {found!r}") from None
    if major > schema.parse_version(schema.ARRAY_BUNDLE_SCHEMA_VERSION)[0]:
        raise BundleError(f"{shown(meta_path)}: bundle format {found} is newer than this amp-postmortem reads "
                          f"({schema.ARRAY_BUNDLE_SCHEMA_VERSION}); upgrade amp-postmortem")
    if meta.get("checksum") != json_checksum(meta):
        raise BundleError(f"{shown(meta_path)} fails its checksum (edited or damaged)")
    for key, kind in (("step", int), ("rank", int), ("arrays", dict), ("files", dict), ("params", dict),
                      ("inputs", dict)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise BundleError(f"{shown(meta_path)}: {key!r} is missing or not a {kind.__name__}")
    return meta


def _read_arrays(path: Path, meta: dict) -> dict:
    name = schema.ARRAY_BUNDLE_ARRAYS_FILE
    listed = meta["files"].get(name)
    if not isinstance(listed, dict):
        raise BundleError(f"{shown(path / schema.BUNDLE_MANIFEST_FILE)} lists no {name}")
    file = path / name
    size = listed.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= limits.MAX_BUNDLE_BYTES:
        raise BundleError(f"{shown(path / schema.BUNDLE_MANIFEST_FILE)}: {name} bytes {size!r} is not a size "
                          f"of 0..{limits.MAX_BUNDLE_BYTES}")
    data = read_bytes(file, path, BundleError, size)
    if len(data) != listed.get("bytes"):
        raise BundleError(f"{shown(file)}: {len(data)} bytes, bundle.json says {listed.get('bytes')} "
                          f"(truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != listed.get("sha256"):
        raise BundleError(f"{shown(file)} fails its sha256 (tampered with or damaged)")
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        members = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, EOFError) as exc:  # an object array asks for pickle: refused here
        raise BundleError(f"{shown(file)} cannot be read without pickle: {exc}") from None
    arrays = {}
    for key, spec in meta["arrays"].items():
        a = members.get(spec["member"])
        if a is None:
            raise BundleError(f"{shown(file)} has no member {spec['member']!r} for {key!r}")
        if list(a.shape) != list(spec["shape"]):
            raise BundleError(f"{shown(file)}: {key!r} has shape {list(a.shape)}, bundle.json says {spec['shape']}")
        if spec["dtype"] == "bfloat16":
            if a.dtype != np.uint16:
                raise BundleError(f"{shown(file)}: bfloat16 {key!r} is not stored as uint16 bit patterns")
            a = (a.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is float32's upper half: exact
        elif str(a.dtype) != spec["dtype"]:
            raise BundleError(f"{shown(file)}: {key!r} has dtype {a.dtype}, bundle.json says {spec['dtype']}")
        arrays[key] = a
    return arrays
