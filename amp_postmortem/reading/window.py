"""Counterfactual windows, as the analyzer sees them: `load_window(path)`
validates and reads one window written by `recorders.bundles.window`
(`windows/step=S/rank=R/`: window.json and tensors.parquet), as
`bundle.py` reads a bundle: the same checks (format, version, checksum,
place, sha256 of every file, sizes before decompression) and nothing
unpickled or imported: tensors from raw bytes, the rest from JSON.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from recorders.format import schema

from ..errors import BundleError
from .files.models import WindowMeta, validate
from .files.safe import check_inside, numbered_dirs, rank_of, shown, step_of


PREDICTION_KEY = schema.WINDOW_PREDICTION_KEY  # a kept loss call's prediction (window 1.1)


@dataclass
class WindowStep:
    step: int
    inputs: list            # per micro-batch: (args: tuple, kwargs: dict)
    rng: list               # per micro-batch: {"cpu": uint8 Tensor, "cuda": [...]}
    optimizer_groups: list | None  # the hyperparameters the step used, per group
    stepped: bool | None
    # per micro-batch: the loop's loss call (`BundlePolicy(loss_fn=)`, since
    # 1.1) as {"args": tuple, "kwargs": dict, "calls": int}, each prediction
    # a {PREDICTION_KEY: i, "shape", "dtype"} dict; None: not kept
    losses: list = field(default_factory=list)


@dataclass
class Window:
    path: str
    rank: int
    first_step: int
    last_step: int
    trigger_step: int | None
    params: dict            # name -> Tensor at the first step's forward
    buffers: dict
    extra_buffers: dict     # non-persistent buffers
    optimizer: dict | None  # {"class", "defaults", "param_groups" (params by name), "state": [...]}
    optimizer_state: list   # [(param name, key, Tensor or plain value)]
    scaler: dict | None     # the manifest's scaler entry (init_scale, growth_factor, ...)
    scaler_state: dict      # "scale", "growth_tracker" -> Tensor, when the scaler had them
    autocast: dict
    precision_flags: dict
    env: dict
    model_class: str
    steps: list             # WindowStep, in order
    meta: dict = field(default_factory=dict)

    @property
    def step_numbers(self) -> list[int]:
        return [s.step for s in self.steps]

    def state_dict(self) -> dict:
        return {**self.params, **self.buffers}


def list_windows(run_dir) -> list[tuple[int, int, Path]]:
    """(first step, rank, path) of every window under `run_dir/windows`."""
    root = Path(run_dir) / schema.WINDOWS_DIR
    check_inside(root, run_dir, BundleError)
    found = []
    if root.is_dir():
        for step, sdir in numbered_dirs(root, step_of, run_dir, BundleError):
            found += [(step, rank, rdir) for rank, rdir in numbered_dirs(sdir, rank_of, run_dir, BundleError)]
    return sorted(found)


def find_window(run_dir, step: int | None = None, rank: int | None = None) -> Window | None:
    """The window of `rank` (default: the lowest with one) whose steps hold
    `step` (None: the first window); None when there is none."""
    if run_dir is None or not Path(run_dir).is_dir():
        return None
    for _, r, path in list_windows(run_dir):
        if rank is not None and r != int(rank):
            continue
        w = load_window(path)
        if step is None or w.first_step <= int(step) <= w.last_step:
            return w
    return None


def window_spans(run_dir, rank: int | None = None) -> list[dict]:
    """{"first_step", "last_step", "trigger_step", "rank", "path"} of every
    window of the run (of `rank`), from window.json alone (no torch: what
    `summary` reads); a damaged window is left out here (loading it says why)."""
    out = []
    if run_dir is None or not Path(run_dir).is_dir():
        return out
    for _, r, path in list_windows(run_dir):
        if rank is not None and r != int(rank):
            continue
        try:
            meta = _read_meta(path / schema.WINDOW_MANIFEST_FILE, path)
        except BundleError:
            continue
        loss = meta.get("loss")
        out.append({"first_step": meta["first_step"], "last_step": meta["last_step"],
                    "trigger_step": meta.get("trigger_step"), "rank": r, "path": str(path),
                    "reasons": list(meta.get("reasons") or []),
                    "loss": loss.get("name") if isinstance(loss, dict) and loss.get("kept") else None})
    return out


def windows_off(run_dir) -> str | None:
    """Why the recorder kept no window although one was asked for (a
    sharded job's: `recorder.bundles.window_disabled` of a rank manifest),
    else None; unreadable manifests say nothing here."""
    from ..errors import PostmortemError
    from .loader import read_manifest
    from .shards import rank_dirs
    if run_dir is None or not Path(run_dir).is_dir():
        return None
    try:
        for d in rank_dirs(Path(run_dir)).values():
            manifest = d / schema.MANIFEST_FILE
            if manifest.is_file():
                why = ((read_manifest(manifest, run_dir).get("recorder") or {}).get("bundles") or {}).get(
                    "window_disabled")
                if isinstance(why, str):
                    return why
    except PostmortemError:
        return None
    return None


def load_window(path) -> Window:
    """Validate and read the window at `path` (its directory or window.json);
    BundleError for a missing, truncated, tampered or newer one."""
    from .bundle import check_files, read_tensor_file
    path = Path(path)
    if path.name == schema.WINDOW_MANIFEST_FILE:
        path = path.parent
    meta_path = path / schema.WINDOW_MANIFEST_FILE
    if not (meta_path.is_file() or os.path.lexists(meta_path)):
        raise BundleError(f"not a counterfactual window: {meta_path} is missing")
    meta = _read_meta(meta_path, path)
    _check_place(path, meta_path, meta)
    check_files(path, meta, schema.WINDOW_TENSORS_FILE)
    tensors = read_tensor_file(path / schema.WINDOW_TENSORS_FILE, path, schema.WINDOW_ROLES)
    try:
        return _assemble(path, meta, tensors)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BundleError(f"malformed window {path}: {type(exc).__name__}: {exc}") from None


def _read_meta(meta_path: Path, root: Path) -> dict:
    from .bundle import read_versioned_meta  # bundle.py imports torch: only when a window is read
    return read_versioned_meta(meta_path, root, format_name=schema.WINDOW_FORMAT_NAME,
                               version=schema.WINDOW_SCHEMA_VERSION, word="window", model=WindowMeta)


def _check_place(path: Path, meta_path: Path, meta: dict) -> None:
    if path.parent.parent.name != schema.WINDOWS_DIR:
        return
    for key, place in (("first_step", step_of(path.parent.name, path.parent, BundleError)),
                       ("rank", rank_of(path.name, path, BundleError))):
        if place is not None and meta[key] != place:
            raise BundleError(f"{shown(meta_path)}: {key}: {meta[key]!r} is not the one of its place "
                              f"({path.parent.name}/{path.name})")
    from .bundle import check_run_id
    check_run_id(path.parent.parent.parent, meta_path, meta, "window")
    steps = [s["step"] for s in meta["steps"]]
    if steps[0] != meta["first_step"] or steps[-1] != meta["last_step"] or steps != sorted(set(steps)):
        raise BundleError(f"{shown(meta_path)}: steps: {steps[:4]}... do not run from first_step "
                          f"{meta['first_step']} to last_step {meta['last_step']} in order")


def _loss_call(spec, k: int, get):
    """A micro-batch's kept loss call (window 1.1), its tensors read as the
    inputs are; None when none was kept."""
    if not isinstance(spec, dict):
        return None
    from .bundle import decode_tree  # the tensor codec, as the bundle reader imports it
    lookup = (lambda name: get("input", name, k))
    return {"args": tuple(decode_tree(spec["args"], lookup)), "kwargs": dict(decode_tree(spec["kwargs"], lookup)),
            "calls": int(spec.get("calls", 1))}


def _assemble(path: Path, meta: dict, tensors: dict) -> Window:
    from .bundle import micro_batch_of, optimizer_state_of, tensor_lookup, weights_of
    get = tensor_lookup(tensors, path, schema.WINDOW_MANIFEST_FILE)
    params, buffers, extra = weights_of(meta, get)
    opt = meta.get("optimizer")
    state = optimizer_state_of(meta, get)
    scaler = meta.get("scaler")
    scaler_state = {n: get("scaler_state", n) for n in (scaler or {}).get("tensors", [])}
    steps = []
    for s in meta["steps"]:
        inputs, rngs, losses = [], [], []
        for mb in s["micro_batches"]:
            call, rng = micro_batch_of(mb, mb["index"], get)
            inputs.append(call)
            rngs.append(rng)
            losses.append(_loss_call(mb.get("loss"), mb["index"], get))
        steps.append(WindowStep(int(s["step"]), inputs, rngs, s.get("optimizer_groups"), s.get("stepped"),
                                losses))
    return Window(
        path=str(path), rank=int(meta["rank"]), first_step=int(meta["first_step"]),
        last_step=int(meta["last_step"]), trigger_step=meta.get("trigger_step"), params=params,
        buffers=buffers, extra_buffers=extra, optimizer=opt, optimizer_state=state, scaler=scaler,
        scaler_state=scaler_state,
        autocast=meta.get("autocast") or {"enabled": False, "device_type": None, "dtype": None},
        precision_flags=meta.get("precision_flags") or {}, env=meta.get("env") or {},
        model_class=meta["model_class"], steps=steps, meta=meta)
