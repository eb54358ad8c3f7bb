"""The per-shard index: what one shard pair holds, in a few hundred bytes.

Built by the writer thread from the rows it is about to write (no re-read)
and written after both shards of the pair, so an index never names a shard
that is not complete. Readers use it to learn a shard's step range and
non-finite row count without opening the shard's footer, and to skip every
shard with nothing to report. The keys are `schema.INDEX_COLUMNS`.
"""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from .format import schema


def shard_index(*, run_id: str, rank: int, shard: str, step_rows: list[dict],
                tensors: pa.Table, nonfinite_rows: int) -> dict:
    """The index of one shard pair: `step_rows` as written to the steps
    shard, `tensors` the tensors shard's table."""
    steps = [int(r["step"]) for r in step_rows]
    skipped = sorted({int(r["step"]) for r in step_rows if r.get("skipped")})
    bad_loss = sorted({int(r["step"]) for r in step_rows
                       if r.get("loss") is not None and not math.isfinite(r["loss"])})
    applied = sorted({int(r["step"]) for r in step_rows
                      if (r.get("nonfinite_param_grads") or 0) > 0 and not r.get("skipped")})
    scales = [r.get("loss_scale") for r in step_rows]
    scales = [float(s) for s in scales if s is not None and not math.isnan(s)]
    befores = [r.get("loss_scale_before") for r in step_rows]
    backoffs = sum(1 for r in step_rows
                   if _num(r.get("loss_scale")) is not None and _num(r.get("loss_scale_before")) is not None
                   and r["loss_scale"] < r["loss_scale_before"])
    return {
        "format": schema.INDEX_FORMAT_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "run_id": run_id,
        "rank": int(rank),
        "shard": shard,
        "first_step": min(steps),
        "last_step": max(steps),
        "step_rows": len(step_rows),
        "tensor_rows": int(tensors.num_rows),
        "nonfinite_rows": int(nonfinite_rows),
        "step_bytes": None,    # set by the writer once the files exist
        "tensor_bytes": None,
        "skipped_steps": skipped,
        "nonfinite_loss_steps": bad_loss,
        "applied_nonfinite_steps": applied,
        "loss_scale_first": _num(befores[0]) if befores else None,
        "loss_scale_last": _num(scales[-1]) if scales else None,
        "loss_scale_min": min(scales) if scales else None,
        "loss_scale_max": max(scales) if scales else None,
        "scale_backoffs": int(backoffs),
        "first_nonfinite": first_nonfinite(tensors) if nonfinite_rows else [],
    }


def first_nonfinite(tensors: pa.Table) -> list[dict]:
    """Per (name, kind) with a NaN/Inf row: first/last step and step count,
    in the order of the first such row (rows are in step, then execution order);
    `intermediate` rows (an op probe's) are no tensor's first NaN/Inf."""
    bad = pc.and_(pc.or_(pc.greater(tensors["nan_count"], 0), pc.greater(tensors["inf_count"], 0)),
                  pc.not_equal(tensors["kind"], schema.INTERMEDIATE_KIND))
    rows = tensors.filter(bad).select(["step", "name", "kind", "phase"]).to_pylist()
    out: dict[tuple[str, str], dict] = {}
    seen: dict[tuple[str, str], set] = {}
    for r in rows:
        key = (r["name"], r["kind"])
        e = out.get(key)
        if e is None:
            e = out[key] = {"name": key[0], "kind": key[1], "phase": r["phase"],
                            "first_step": r["step"], "last_step": r["step"], "steps": 0}
            seen[key] = set()
        e["first_step"] = min(e["first_step"], r["step"])
        e["last_step"] = max(e["last_step"], r["step"])
        seen[key].add(r["step"])
    for key, e in out.items():
        e["steps"] = len(seen[key])
    return list(out.values())


def _num(v):
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v
