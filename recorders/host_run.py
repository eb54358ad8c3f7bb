"""A run written from host-side numbers: the part the Keras and Flax
recorders share (and any other framework's).

The PyTorch recorder reduces its statistics on the device and hands the
writer packed tensors; a recorder of another framework reduces them inside
its own compiled step and gets back a few numbers per step. `HostRun` takes
those numbers (one `StepRecord` per step, its rows as `TensorRow`s), writes
them with the same `ShardWriter` (shards, journal, index) and a manifest
of the same format, so the analyzer reads the run as it reads a PyTorch one.
It imports neither torch nor any other framework.

Lifecycle: construct, `write_step()`, `flush()`, `close()` (idempotent),
context manager. Steps are written on the calling thread (a step of these
recorders is a handful of rows).
"""
from __future__ import annotations

import math
import platform
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .format import schema
from .writer import ShardWriter, atomic_write_json

try:
    from importlib.metadata import version as _dist_version
    PACKAGE_VERSION = _dist_version("amp-postmortem")
except Exception:  # noqa: BLE001 - not installed (running from a source tree)
    PACKAGE_VERSION = "0+unknown"


# The full tier's columns after the cheap tier's (schema.FULL_STATS).
FULL_COLUMNS = schema.FULL_STATS[len(schema.CHEAP_STATS):]


@dataclass(slots=True)
class TensorRow:
    """One row of the tensors table (docs/FORMAT.md, "Table: tensors"); the
    full tier's columns None on a cheap-tier row. Not frozen: a frozen
    dataclass sets each of its 20 fields through object.__setattr__, ~3 us
    a row and ~25 rows every step of a Keras or Flax job."""
    name: str
    kind: str
    phase: str
    order: int
    call: int
    dtype: str
    numel: int
    absmax: float
    nan_count: int
    inf_count: int
    input_nonfinite: int | None = None
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    rms: float | None = None
    zero_share: float | None = None
    below_normal_share: float | None = None
    below_subnormal_share: float | None = None
    near_overflow_share: float | None = None
    share_sample_size: int | None = None


def stats_row(name: str, kind: str, phase: str, order: int, call: int, dtype: str, stats,
              input_nonfinite: bool = False) -> TensorRow:
    """A row from the five in-graph numbers [absmax, NaN count, Inf count,
    NaN/Inf among the inputs, numel] (`input_nonfinite` kept when true),
    and on a full-tier step the nine of `FULL_COLUMNS` after them, the four
    shares as counts over the sample (`xp_stats`)."""
    # Python floats at once: indexing a numpy row and converting each
    # value cost more than the row's other work (~25 rows a step).
    v = np.asarray(stats, dtype=np.float64).tolist()
    full = {}
    if len(v) > 5:
        full = dict(zip(FULL_COLUMNS, v[5:]))
        # The shares come as counts over the sample: divided here, in float64.
        m = int(v[13])
        for c in FULL_COLUMNS[4:8]:
            full[c] = full[c] / m if m else math.nan
        full["share_sample_size"] = m
    return TensorRow(name=name, kind=kind, phase=phase, order=order, call=int(call), dtype=dtype,
                     numel=int(v[4]), absmax=float(v[0]), nan_count=int(v[1]), inf_count=int(v[2]),
                     input_nonfinite=int(v[3]) if input_nonfinite else None, **full)


def backward_rows(module_rows, grads) -> list[TensorRow]:
    """A step's backward rows in backward order. `module_rows`: (name,
    kind, call, dtype, stats) of the `grad_output` / `grad_input` rows as
    the backward made them; `grads`: (name, dtype, stats) of each
    parameter's unscaled gradient in parameter order (the backward visits
    them last first). A parameter's `param_grad` row goes where its module's
    backward made it: after the module's last `grad_output` row, before its
    last `grad_input` row; without a row of its module, after the parameter
    before it."""
    module_rows, grads = list(module_rows), list(grads)
    keyed = [((i, 0, 0), (name, kind, call, dtype, v)) for i, (name, kind, call, dtype, v) in enumerate(module_rows)]
    place = {name: (i - 0.5) if kind == "grad_input" else (i + 0.5)
             for i, (name, kind, *_) in enumerate(module_rows)}
    at = -1.0
    for j, (name, dtype, v) in enumerate(reversed(grads)):
        at = place.get(name.rpartition(".")[0], at)
        keyed.append(((at, 1, j), (name, "param_grad", 0, dtype, v)))
    keyed.sort(key=lambda kr: kr[0])
    # Rows made once their order is known (a frozen row copied by
    # dataclasses.replace cost ~5 us a row, every step).
    return [stats_row(name, kind, "backward", order, call, dtype, v, input_nonfinite=kind == "grad_input")
            for order, (_, (name, kind, call, dtype, v)) in enumerate(keyed)]


@dataclass
class StepRecord:
    """What one optimizer step of a non-torch framework says, on the host.
    `loss_scale_before`/`loss_scale`: the scale the step's backward used and
    the one the next step uses (None without a dynamic loss scale);
    `skipped`: the scale's own finiteness check refused the update;
    `full`: the rows carry the full tier (the steps table's `tier`)."""
    step: int
    loss: float | None
    loss_scale_before: float | None = None
    loss_scale: float | None = None
    growth_tracker: int | None = None
    skipped: bool = False
    lr: list | None = None
    grad_norm: float | None = None
    loss_dtype: str | None = None
    micro_batches: int = 1
    rows: list = field(default_factory=list)  # TensorRow, forward rows first
    wall_time: float | None = None
    full: bool = False


def step_events(record: StepRecord) -> list[str]:
    """What a step says to the record schedule (`schedule.EVENT_KINDS`), as
    the PyTorch recorder's writer tells it: a skip; NaN/Inf in a forward
    row; in a backward row of a step that was not skipped (a skipped
    step's non-finite gradients are that skip); a non-finite loss."""
    events = ["skipped"] if record.skipped else []
    bad = [r for r in record.rows if r.nan_count or r.inf_count]
    if any(r.phase == "forward" for r in bad):
        events.append("nonfinite_forward")
    if not record.skipped and any(r.phase != "forward" for r in bad):
        events.append("nonfinite_gradient")
    if record.loss is not None and not math.isfinite(record.loss):
        events.append("nonfinite_loss")
    return events


def framework_entry(name: str, version: str | None, backend: str | None = None) -> dict:
    """The manifest's `framework` object (schema 1.5)."""
    if name not in schema.FRAMEWORKS:
        raise ValueError(f"framework {name!r} is not one of {', '.join(schema.FRAMEWORKS)}")
    return {"name": name, "version": version, "backend": backend}


def tensor_columns(step: int, rank: int, rows: list[TensorRow]) -> dict | None:
    """The rows as the column dict `ShardWriter.add_step` takes (null full-tier
    statistics as NaN, string columns as lists)."""
    if not rows:
        return None
    n = len(rows)
    nan = np.full(n, math.nan)

    def floats(attr):
        return np.array([math.nan if getattr(r, attr) is None else float(getattr(r, attr)) for r in rows])

    cols = {
        "step": np.full(n, step, dtype=np.int64),
        "rank": np.full(n, rank, dtype=np.int32),
        "name": [r.name for r in rows],
        "kind": [r.kind for r in rows],
        "phase": [r.phase for r in rows],
        "order": np.array([r.order for r in rows], dtype=np.int32),
        "call": np.array([r.call for r in rows], dtype=np.int32),
        "dtype": [r.dtype for r in rows],
        "numel": np.array([r.numel for r in rows], dtype=np.int64),
        "absmax": floats("absmax"),
        "nan_count": np.array([r.nan_count for r in rows], dtype=np.int64),
        "inf_count": np.array([r.inf_count for r in rows], dtype=np.int64),
        "input_nonfinite": floats("input_nonfinite"),
        "op": [None] * n, "op_index": nan.copy(), "source": [None] * n,
    }
    # A cheap-tier step's full columns are null: no per-row reads.
    full = any(r.share_sample_size is not None for r in rows)
    for c in FULL_COLUMNS:
        cols[c] = floats(c) if full else nan.copy()
    return cols


class HostRun:
    """Writes one rank's run from `StepRecord`s.

    `framework`: `framework_entry(...)`; `model_class`: the user's model
    class as `module.QualName`; `modules`: `{"name", "type", "watched"}` per
    layer; `params`: `{"name", "shape", "dtype", "requires_grad"}` per
    variable; `scaler`, `optimizer`, `autocast`: the manifest's objects
    (docs/FORMAT.md, "Manifest"); `recorder_options`: the recorder's own
    configuration, as the manifest's `recorder`; `dtype_policies`: the
    manifest's `dtype_policies` (Keras), absent when None."""

    def __init__(self, run_dir, *, framework: dict, model_class: str, modules: list, params: list,
                 scaler: dict | None = None, optimizer: dict | None = None, autocast: dict | None = None,
                 recorder_options: dict | None = None, dtype_policies: dict | None = None,
                 device_type: str = "cpu", steps_per_shard: int = 1000, run_id: str | None = None, rank: int = 0, world_size: int = 1):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.rank_dir = self.run_dir / schema.RANK_DIR.format(rank=rank)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.manifest = {
            "format": schema.FORMAT_NAME, "schema_version": schema.SCHEMA_VERSION,
            "run_id": run_id or uuid.uuid4().hex, "created_at": time.time(),
            "package_version": PACKAGE_VERSION, "torch_version": None, "framework": framework,
            "rank": rank, "world_size": world_size, "device_type": device_type,
            "device_name": platform.processor() or platform.machine() or device_type,
            "model_class": model_class, "model_config": None, "autocast": autocast,
            "scaler": scaler, "optimizer": optimizer, "recorder": recorder_options or {},
            "modules": list(modules), "params": [{"sharded": False, **p} for p in params],
            "bundles": [], "status": "open", "steps_recorded": 0, "first_step": None,
            "last_step": None, "dropped_steps": 0, "disabled_reason": None, "disabled_at_step": None,
        }
        if dtype_policies is not None:
            self.manifest[schema.DTYPE_POLICIES_KEY] = dtype_policies
        self.shards = ShardWriter(self.rank_dir, run_id=self.manifest["run_id"], rank=rank,
                                  world_size=world_size, steps_per_shard=steps_per_shard,
                                  # Every step has rows, written on the training thread.
                                  gather_rows=True)
        self._closed = False
        self._write_manifest()

    def set_autocast(self, autocast: dict | None) -> None:
        self.manifest["autocast"] = autocast

    def set_scaler(self, scaler: dict | None) -> None:
        self.manifest["scaler"] = scaler

    def set_loss_scaling(self, loss_scaling: dict) -> None:
        """The manifest's `loss_scaling` (Keras, with a LossScaleOptimizer:
        `keras_loss_scaling.LossScalingLog.entry()`), written with the
        manifest's next write."""
        self.manifest[schema.LOSS_SCALING_KEY] = loss_scaling

    def set_jax_reductions(self, entry: dict) -> None:
        """The manifest's `jax_reductions` (a JAX step's float16/bfloat16
        reductions: `jax_program.trace_reductions`), written with the
        manifest's next write."""
        self.manifest[schema.JAX_REDUCTIONS_KEY] = entry

    def write_step(self, record: StepRecord) -> None:
        if self._closed:
            return
        rows = record.rows
        param_bad = sum(1 for r in rows if r.kind == "param_grad" and (r.nan_count or r.inf_count))
        has_grads = any(r.kind == "param_grad" for r in rows)
        step_row = {
            "step": int(record.step), "rank": self.rank,
            "wall_time": record.wall_time if record.wall_time is not None else time.time(),
            "loss": record.loss,
            "loss_scale": record.loss_scale, "loss_scale_before": record.loss_scale_before,
            "growth_tracker": record.growth_tracker, "skipped": bool(record.skipped),
            "lr": record.lr, "grad_norm": record.grad_norm,
            "nonfinite_param_grads": param_bad if has_grads else None,
            "micro_batches": int(record.micro_batches),
            # Schema 1.5: a step without tensor rows (not sampled) has no tier.
            "tier": ("full" if record.full else "cheap") if rows else None,
            "tensor_rows": len(rows), "sharded_grad_sqsum": None, "loss_dtype": record.loss_dtype,
        }
        self.shards.add_step(step_row, tensor_columns(record.step, self.rank, rows))
        m = self.manifest
        m["steps_recorded"] += 1
        m["first_step"] = record.step if m["first_step"] is None else min(m["first_step"], record.step)
        m["last_step"] = record.step if m["last_step"] is None else max(m["last_step"], record.step)
        if m["steps_recorded"] == 1:
            self._write_manifest()

    def add_bundle(self, entry: dict) -> None:
        """List a written replay bundle (`host_bundle.write_bundle`'s entry)
        in the manifest, rewritten at once."""
        self.manifest["bundles"].append(entry)
        self._write_manifest()

    def flush(self) -> None:
        """Write the buffered steps as a shard pair and the manifest."""
        self.shards.roll()
        self.shards.wait_published()
        self._write_manifest()

    def close(self) -> None:
        if self._closed:
            return
        self.shards.roll()
        self.shards.wait_published()
        self.shards.journal.close()
        self.manifest["status"] = "closed"
        self._write_manifest()
        self._closed = True

    def _write_manifest(self) -> None:
        atomic_write_json(self.rank_dir / schema.MANIFEST_FILE, self.manifest)
        if self.rank == 0:
            atomic_write_json(self.run_dir / schema.MANIFEST_FILE, self.manifest)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
