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

# Which automatic triggers a recorder of another framework has: the
# PyTorch recorder's `nonfinite_loss` and `nonfinite_tensor` (a forward
# row), and `nonfinite_gradient`, the first step with NaN/Inf in a backward
# row (`grad_output`, `grad_input`, `param_grad`) while the forward rows and
# the loss are finite: a backward-only overflow, whose step the loss scale
# skips, is otherwise saved by none of them (PyTorch's `skipped` covers it;
# as there, not the skips of a scale calibrating or probing).
TRIGGERS = ("nonfinite_loss", "nonfinite_tensor", "nonfinite_gradient")


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
    loss, the first with NaN/Inf in a forward row, the first with NaN/Inf
    in a backward row only (forward and loss finite; each once), and every
    step of `steps`; at most `max_bundles`. A pure decision on host values;
    the recorder gathers and writes.

    A step the loss scale skipped counts for `nonfinite_gradient` only once
    the scale has settled (`settle_steps` consecutive steps applied, as for
    PyTorch's `skipped` trigger): a fresh scale calibrating down from its
    initial value skips on overflowing gradients, and so does a scale that
    has just grown (a probe: `loss_scale_before` above the step before's);
    neither fires."""

    def __init__(self, *, max_bundles: int = 3, steps=(), triggers=TRIGGERS, settle_steps: int = 10):
        bad = [t for t in triggers if t not in TRIGGERS]
        if bad:
            raise ValueError(f"bundle trigger {bad[0]!r} is not one of {', '.join(TRIGGERS)}")
        self.max_bundles = int(max_bundles)
        self.steps = {int(s) for s in steps}
        self.triggers = tuple(triggers)
        self.settle_steps = int(settle_steps)
        self.fired: set = set()
        self.saved = 0
        self._clean_steps = 0
        self._settled = self.settle_steps <= 0
        self._prev_scale = None

    def fresh(self) -> BundleTriggers:
        """These options with nothing fired or saved yet: what one run
        counts on (a recorder takes its own, so that a default or shared
        `BundleTriggers` does not carry one run's count into the next)."""
        return BundleTriggers(max_bundles=self.max_bundles, steps=self.steps, triggers=self.triggers,
                              settle_steps=self.settle_steps)

    @property
    def enabled(self) -> bool:
        return self.max_bundles > 0 and (bool(self.triggers) or bool(self.steps))

    def options(self) -> dict:
        return {"max_bundles": self.max_bundles, "bundle_steps": sorted(self.steps),
                "bundle_triggers": list(self.triggers), "settle_steps": self.settle_steps}

    def _skip_counts(self, skipped: bool, loss_scale_before) -> bool:
        """Whether this step's skip says the gradients broke (the scale had
        settled, and had not just grown); True for a step not skipped.
        Counts the step towards settling."""
        probe = (loss_scale_before is not None and self._prev_scale is not None
                 and loss_scale_before > self._prev_scale)
        self._prev_scale = loss_scale_before
        if skipped:
            self._clean_steps = 0
            return self._settled and not probe
        self._clean_steps += 1
        self._settled = self._settled or self._clean_steps >= self.settle_steps
        return True

    def reasons(self, step: int, loss, forward_nonfinite: bool, backward_nonfinite: bool = False, *,
                skipped: bool = False, loss_scale_before=None) -> list[str]:
        """The reasons `step` is saved for (empty: not saved); counts it.
        Called once per step, in order (the scale's settling is counted)."""
        counts = self._skip_counts(bool(skipped), loss_scale_before)
        if not self.enabled or self.saved >= self.max_bundles:
            return []
        fire = []
        loss_bad = loss is None or not np.isfinite(loss)
        # Backward-only: a step whose forward broke is saved for that.
        backward_only = backward_nonfinite and not forward_nonfinite and not loss_bad and counts
        for reason, holds in (("nonfinite_loss", loss_bad), ("nonfinite_tensor", forward_nonfinite),
                              ("nonfinite_gradient", backward_only)):
            if reason in self.triggers and holds and reason not in self.fired:
                fire.append(reason)
        if step in self.steps:
            fire.append("step_list")
        if fire:
            self.fired.update(fire)
            self.saved += 1
        return fire
