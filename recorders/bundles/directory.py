"""Writing one replay bundle directory (the recorder's writer thread).

A bundle is `bundle.json` (metadata, with the sha256 and size of every other
file and a checksum of its own content) and `tensors.parquet` (one row per
tensor chunk). The directory is written under a hidden temporary name next
to its final place and renamed when complete, so a reader never sees a
partial bundle. Nothing here pickles anything.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..format import schema
from ..format.plain import file_sha256, json_checksum, plain
from ..format.tensor_codec import dtype_name, host_array
from ..writer import fsync_dir

ROW_GROUP_BYTES = 64 << 20



def precision_flags() -> dict:
    """The global switches that change numerics (read on the training thread,
    at the step's first forward)."""
    flags = {}
    probes = {
        "allow_tf32_matmul": lambda: torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": lambda: torch.backends.cudnn.allow_tf32,
        "fp16_reduced_precision_reduction": lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced_precision_reduction": lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled,
        "cudnn_enabled": lambda: torch.backends.cudnn.enabled,
        "cudnn_benchmark": lambda: torch.backends.cudnn.benchmark,
        "cudnn_deterministic": lambda: torch.backends.cudnn.deterministic,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some of these getters are deprecated aliases
        for key, get in probes.items():
            try:
                flags[key] = get()
            except Exception:  # noqa: BLE001 - a flag this torch does not have
                flags[key] = None
    return flags


def environment(package_version: str, device_type: str | None, device_name: str | None) -> dict:
    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    return {
        "package_version": package_version,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": cudnn,
        "device_type": device_type,
        "device_name": device_name,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "numpy_version": np.__version__,
        "pyarrow_version": pa.__version__,
    }


def _batch_table(rows: list[tuple]) -> pa.Table:
    cols = list(zip(*rows))
    arrays = [
        pa.array(cols[0], pa.string()),
        pa.array(cols[1], pa.string()),
        pa.array(cols[2], pa.int32()),
        pa.array(cols[3], pa.string()),
        pa.array(cols[4], pa.list_(pa.int64())),
        pa.array(cols[5], pa.bool_()),
        pa.array(cols[6], pa.int64()),
        pa.array(cols[7], pa.large_binary()),
    ]
    return pa.Table.from_arrays(arrays, schema=schema.BUNDLE_TENSOR_SCHEMA)


def write_tensors(path: Path, records, metadata: dict) -> int:
    """Write `records` ((name, role, micro_batch, tensor, requires_grad)
    tuples; tensors on any device) as bundle tensor rows. Returns the row count."""
    meta = {k.encode(): str(v).encode() for k, v in metadata.items()}
    writer = pq.ParquetWriter(path, schema.BUNDLE_TENSOR_SCHEMA.with_metadata(meta), compression="zstd")
    n_rows = 0
    try:
        batch, batch_bytes = [], 0
        for name, role, micro_batch, tensor, requires_grad in records:
            flat = host_array(tensor)
            shape = list(tensor.shape)
            dt = dtype_name(tensor.dtype)
            offsets = range(0, max(flat.size, 1), schema.BUNDLE_CHUNK_BYTES)
            for off in offsets:
                data = flat[off:off + schema.BUNDLE_CHUNK_BYTES].tobytes()
                batch.append((name, role, int(micro_batch), dt, shape, bool(requires_grad), off, data))
                batch_bytes += len(data)
                if batch_bytes >= ROW_GROUP_BYTES:
                    writer.write_table(_batch_table(batch), row_group_size=len(batch))
                    n_rows += len(batch)
                    batch, batch_bytes = [], 0
        if batch or n_rows == 0:
            table = _batch_table(batch) if batch else schema.BUNDLE_TENSOR_SCHEMA.empty_table()
            writer.write_table(table, row_group_size=max(1, len(batch)))
            n_rows += len(batch)
    finally:
        writer.close()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return n_rows


def write_bundle(final_dir: Path, records, meta: dict, *, manifest_file: str = schema.BUNDLE_MANIFEST_FILE,
                 format_name: str = schema.BUNDLE_FORMAT_NAME, version: str = schema.BUNDLE_SCHEMA_VERSION) -> dict:
    """Write a complete bundle at `final_dir` atomically. `meta` is the body
    of bundle.json without `files`/`checksum` (added here). Returns the
    `files` entry. A counterfactual window is written the same way, under
    its own `manifest_file`, `format_name` and `version`."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f".{final_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        tensors = tmp / schema.BUNDLE_TENSORS_FILE
        rows = write_tensors(tensors, records, {
            "amp_postmortem.format": format_name,
            "amp_postmortem.bundle_version": version,
            "amp_postmortem.step": meta.get("step"),
            "amp_postmortem.rank": meta.get("rank"),
        })
        files = {schema.BUNDLE_TENSORS_FILE: {
            "bytes": tensors.stat().st_size, "sha256": file_sha256(tensors), "rows": rows}}
        meta = dict(meta, files=files)
        meta["checksum"] = json_checksum(meta)
        with open(tmp / manifest_file, "wb") as f:
            f.write(json.dumps(meta, indent=2, allow_nan=True).encode())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final_dir.exists():
            # A resumed job saving the same step again: the newer bundle wins.
            old = final_dir.parent / f".{final_dir.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(final_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final_dir)
        fsync_dir(final_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def bundle_records(inventory, p):
    """(name, role, micro_batch, tensor, requires_grad) rows of a pending bundle."""
    for name, t, src in zip(inventory.param_names, p.params, inventory.params):
        yield name, "param", -1, t, src.requires_grad
    for name, t in zip(inventory.buffer_names, p.buffers):
        yield name, "buffer", -1, t, False
    for i, t in enumerate(p.optimizer_state or ()):
        yield f"state.{i}", "optimizer_state", -1, t, False
    for k, (mb, tensors) in enumerate(zip(p.capture.micro_batches, p.inputs)):
        for name, t in tensors:
            yield name, "input", k, t, t.requires_grad
        for i, g in sorted(mb.grads.items()):
            yield f"output.{i}", "grad_output", k, g, False
        yield "cpu", "rng", k, mb.rng["cpu"], False
        for i, state in enumerate(mb.rng.get("cuda", ())):
            yield f"cuda:{i}", "rng", k, state, False


def bundle_meta(inventory, p, run: dict) -> dict:
    """The body of bundle.json (see docs/FORMAT.md, "Replay bundles").
    `run`: run_id, rank, world_size, package_version, device_type,
    device_name, scaler (manifest entry or None), has_scaler, recorder."""
    cap, order = p.capture, p.order
    s = order["summary"]
    micro_batches = []
    for mb, spec in zip(cap.micro_batches, p.specs):
        n = mb.outputs if mb.outputs is not None else (max(mb.grads) + 1 if mb.grads else 0)
        micro_batches.append(dict(
            spec, outputs=n,
            grad_outputs=[f"output.{i}" if i in mb.grads else None for i in range(n)],
            rng={"cpu": "cpu", "cuda": [f"cuda:{i}" for i in range(len(mb.rng.get("cuda", ())))]}))
    scaler = None
    if run["scaler"] is not None:
        scaler = dict(run["scaler"], scale=s["loss_scale_before"], scale_after=s["loss_scale"],
                      growth_tracker=order["growth_tracker"], growth_tracker_after=order["growth_tracker_after"])
    return {
        "format": schema.BUNDLE_FORMAT_NAME, "version": schema.BUNDLE_SCHEMA_VERSION,
        "run_id": run["run_id"], "step": p.step, "rank": run["rank"], "world_size": run["world_size"],
        "created_at": time.time(), "reason": order["reasons"][0], "reasons": order["reasons"],
        "loss": s["loss"], "loss_scale": s["loss_scale_before"] if run["has_scaler"] else None,
        "grad_outputs_scaled": bool(run["has_scaler"]), "skipped": s["skipped"], "stepped": cap.stepped,
        "training": cap.training, "micro_batches": micro_batches,
        "params": {"names": inventory.param_names, "aliases": inventory.aliases,
                   "source": cap.params_source, "exact": cap.params_exact,
                   **({"placements": inventory.placements} if inventory.placements else {})},
        "buffers": {"names": inventory.buffer_names, "non_persistent": inventory.non_persistent,
                    "source": p.info["buffers_source"], "exact": p.info["buffers_exact"]},
        "inputs_exact": p.info["inputs_exact"],
        **({"grad_outputs_released": True} if cap.grads_released else {}),
        "autocast": plain(cap.autocast, keep_nonfinite=True), "precision_flags": plain(cap.precision, keep_nonfinite=True),
        "scaler": plain(scaler, keep_nonfinite=True), "model_class": inventory.model_class,
        "name_prefix_removed": inventory.prefix or None,
        "optimizer": p.info["optimizer"],
        "env": environment(run["package_version"], run["device_type"], run["device_name"]),
        "recorder": run["recorder"],
    }
