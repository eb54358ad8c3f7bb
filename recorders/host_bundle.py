"""Replay bundles of the Keras and Flax recorders, written from host arrays
(docs/FORMAT.md, "Array bundles").

A bundle is a directory `bundles/step=N/rank=R/` holding `bundle.json` and
`arrays.npz`: every array (the variables, the model call's inputs, Keras'
targets and sample weights) is a `.npy` member, none of them an object
array, so a reader loads them with `numpy.load(..., allow_pickle=False)`
and runs no code. bfloat16 arrays are stored as their uint16 bit patterns
(`.npy` has no bfloat16). The argument trees are JSON. Written under a
hidden name and renamed when complete, as PyTorch bundles are.

Imports numpy only: the recorders hand it arrays already on the host.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from .format import schema
from .format.plain import file_sha256, json_checksum, plain
from .writer import atomic_write_json, fsync_dir

# Which automatic triggers a recorder of another framework has (the
# PyTorch recorder's `nonfinite_loss` and `nonfinite_tensor`; with a loss
# scale, gradients overflowing are the scale's business, as there).
TRIGGERS = ("nonfinite_loss", "nonfinite_tensor")


def _is_array(obj) -> bool:
    return hasattr(obj, "shape") and hasattr(obj, "dtype") and not isinstance(obj, (str, bytes))


def encode_tree(obj, prefix: str, arrays: dict):
    """`obj` (arrays in tuples, lists, dicts) as an argument-tree node;
    its arrays go to `arrays` under `prefix.0`, `prefix.1`, ..."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"kind": "value", "value": obj}
    if _is_array(obj):
        name = f"{prefix}.{len([k for k in arrays if k.startswith(prefix + '.')])}"
        arrays[name] = obj
        return {"kind": "array", "name": name}
    if isinstance(obj, (tuple, list)):
        return {"kind": type(obj).__name__, "items": [encode_tree(v, prefix, arrays) for v in obj]}
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"kind": "dict", "items": [[k, encode_tree(v, prefix, arrays)] for k, v in obj.items()]}
    return {"kind": "unsupported", "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def stored(array) -> tuple[np.ndarray, str]:
    """(the array as `.npy` can hold it, its dtype's name)."""
    a = np.asarray(array)
    dtype = str(a.dtype)
    if dtype == "bfloat16":
        return np.ascontiguousarray(a).view(np.uint16), dtype
    if a.dtype.kind not in "biuf":
        raise TypeError(f"an array of dtype {dtype} is not stored in a bundle")
    return np.ascontiguousarray(a), dtype


def write_bundle(run_dir, *, rank: int, step: int, meta: dict, arrays: dict) -> dict:
    """Write one bundle and return its entry for the manifest's `bundles`.

    `meta`: the bundle.json keys the recorder knows (framework, reason(s),
    loss, loss scale, params, inputs trees, ...); `arrays`: `{role/name:
    array}` with role one of `schema.ARRAY_BUNDLE_ROLES`."""
    final = Path(run_dir) / schema.BUNDLES_DIR / schema.BUNDLE_DIR.format(step=step, rank=rank)
    tmp = final.parent / f".rank={rank}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        listing, members = {}, {}
        for key, value in arrays.items():
            role = key.split("/", 1)[0]
            if role not in schema.ARRAY_BUNDLE_ROLES:
                raise ValueError(f"bundle array {key!r}: role {role!r} is not one of {schema.ARRAY_BUNDLE_ROLES}")
            a, dtype = stored(value)
            member = f"a{len(members)}"
            members[member] = a
            listing[key] = {"member": member, "dtype": dtype, "shape": list(a.shape)}
        file = tmp / schema.ARRAY_BUNDLE_ARRAYS_FILE
        with open(file, "wb") as f:
            np.savez(f, **members)
            f.flush()
            os.fsync(f.fileno())
        doc = plain({
            "format": schema.ARRAY_BUNDLE_FORMAT_NAME, "version": schema.ARRAY_BUNDLE_SCHEMA_VERSION,
            "step": int(step), "rank": int(rank), "created_at": time.time(), **meta,
            "arrays": listing,
            "files": {schema.ARRAY_BUNDLE_ARRAYS_FILE: {"bytes": file.stat().st_size,
                                                        "sha256": file_sha256(file)}},
        }, keep_nonfinite=True)
        doc["checksum"] = json_checksum(doc)
        atomic_write_json(tmp / schema.BUNDLE_MANIFEST_FILE, doc)
        if final.exists():  # a resumed job saving the step again
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": int(step), "rank": int(rank), "path": str(final.relative_to(Path(run_dir))),
            "reason": meta.get("reason"), "reasons": list(meta.get("reasons") or []),
            "bytes": sum(int(np.asarray(a).nbytes) for a in members.values()),
            "created_at": doc["created_at"], "params_exact": bool((meta.get("params") or {}).get("exact"))}


class BundleTriggers:
    """Which finished steps save a bundle: the first step with a non-finite
    loss, the first with NaN/Inf in a forward row (each once), and every
    step of `steps`; at most `max_bundles`. A pure decision on host values;
    the recorder gathers and writes."""

    def __init__(self, *, max_bundles: int = 3, steps=(), triggers=TRIGGERS):
        bad = [t for t in triggers if t not in TRIGGERS]
        if bad:
            raise ValueError(f"bundle trigger {bad[0]!r} is not one of {', '.join(TRIGGERS)}")
        self.max_bundles = int(max_bundles)
        self.steps = {int(s) for s in steps}
        self.triggers = tuple(triggers)
        self.fired: set = set()
        self.saved = 0

    def fresh(self) -> BundleTriggers:
        """These options with nothing fired or saved yet: what one run
        counts on (a recorder takes its own, so that a default or shared
        `BundleTriggers` does not carry one run's count into the next)."""
        return BundleTriggers(max_bundles=self.max_bundles, steps=self.steps, triggers=self.triggers)

    @property
    def enabled(self) -> bool:
        return self.max_bundles > 0 and (bool(self.triggers) or bool(self.steps))

    def options(self) -> dict:
        return {"max_bundles": self.max_bundles, "bundle_steps": sorted(self.steps),
                "bundle_triggers": list(self.triggers)}

    def reasons(self, step: int, loss, forward_nonfinite: bool) -> list[str]:
        """The reasons `step` is saved for (empty: not saved); counts it."""
        if not self.enabled or self.saved >= self.max_bundles:
            return []
        fire = []
        loss_bad = loss is None or not np.isfinite(loss)
        for reason, holds in (("nonfinite_loss", loss_bad), ("nonfinite_tensor", forward_nonfinite)):
            if reason in self.triggers and holds and reason not in self.fired:
                fire.append(reason)
        if step in self.steps:
            fire.append("step_list")
        if fire:
            self.fired.update(fire)
            self.saved += 1
        return fire
