"""Did the replay reproduce the recorded step?

The replay of the recorded precision is compared with what the recorder saw
at that step (the run's tensors table: per module, the largest finite
absolute value and the NaN/Inf counts of its outputs and of the gradients
that reached them). Without a run, the loss saved in the bundle and the
bundle's trigger are the only evidence; without any, the answer is None.

`reproduced` is True when the replay agrees on where values are non-finite
(any at all, and the first module in execution order that has them) and the
absmax of at least `ABSMAX_AGREE_SHARE` of the modules finite in both agrees
within `ABSMAX_REL_TOL`; when the model returns the loss, the replayed loss
must also match the saved one (both non-finite, or within `LOSS_REL_TOL`).
When the backward started from a substitute (`engine.ReplaySession.start_backward`:
the saved output gradient was non-finite), the replayed gradients are not
those of the step: only the forward statistics are compared.
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import torch

from recorders.format import schema

from ..reading.shards import shard_files

ABSMAX_REL_TOL = 0.05    # CPU emulation of a CUDA step moves absmax by ~1e-3
ABSMAX_AGREE_SHARE = 0.9
LOSS_REL_TOL = 0.01
_NONFINITE_TRIGGERS = ("nonfinite_loss", "nonfinite_tensor", "skipped")
_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "call", "absmax", "nan_count", "inf_count"]


def recorded_rows(run_dir, step: int, rank: int) -> list[dict] | None:
    """The activation and grad_output rows of `step` on `rank`, in execution
    order, or None when the run holds none."""
    folder = Path(run_dir) / schema.RANK_DIR.format(rank=rank) / schema.TENSORS_DIR
    if not folder.is_dir():
        return None
    rows = []
    # Regular files only (a FIFO would hang the read), none through a link.
    for shard in shard_files(folder, Path(run_dir)):
        try:
            meta = pq.ParquetFile(shard).schema_arrow.metadata or {}
            first = int(meta.get(schema.META_FIRST_STEP, b"-1"))
            last = int(meta.get(schema.META_LAST_STEP, b"-1"))
            if first >= 0 and last >= 0 and not first <= step <= last:
                continue
            table = pq.read_table(shard, columns=_COLUMNS,
                                  filters=[("step", "=", step), ("rank", "=", rank)])
        except Exception:  # noqa: BLE001 - a damaged shard is the loader's to report
            continue
        rows.extend(r for r in table.to_pylist() if r["kind"] in ("activation", "grad_output"))
    if not rows:
        return None
    rows.sort(key=lambda r: (r["phase"] != "forward", r["order"]))
    return rows


def replayed_rows(capture) -> dict:
    """(name, kind, call) -> {"absmax", "nonfinite"} of a capture, merged over
    micro-batches and tuple outputs as the recorder merges them."""
    out: dict = {}
    for call in capture.calls.values():
        for kind, tensors in (("activation", call.outputs),
                              ("grad_output", [g for g in call.grad_outputs if g is not None])):
            for t in tensors:
                slot = out.setdefault((call.name, kind, call.call), {"absmax": math.nan, "nonfinite": 0})
                finite = torch.isfinite(t)
                slot["nonfinite"] += int((~finite).sum())
                if bool(finite.any()):
                    m = float(t.detach().abs().masked_fill(~finite, 0).max().double())
                    slot["absmax"] = m if math.isnan(slot["absmax"]) else max(slot["absmax"], m)
    return out


def check(capture, bundle, run_dir=None, *, backward: bool = True) -> dict:
    """Fidelity report of the recorded precision's replay (see module doc).
    `backward` False: the backward started from a substitute; compare the
    forward statistics only."""
    report = {"reproduced": None, "basis": None, "precision": capture.config.precision,
              "recorded_nonfinite_modules": [], "replayed_nonfinite_modules": [],
              "absmax_compared": 0, "absmax_agreed": 0, "absmax_mismatches": [],
              "loss_recorded": bundle.loss, "loss_replayed": capture.loss}
    loss_ok = _loss_agrees(bundle.loss, capture.loss)
    rows = recorded_rows(run_dir, bundle.step, bundle.rank) if run_dir is not None else None
    if rows and not backward:
        rows = [r for r in rows if r["kind"] == "activation"]
    if rows:
        stats_ok = _compare_rows(rows, replayed_rows(capture), report)
        report["basis"] = ("recorded statistics" + ("" if backward else " (forward only)")
                           + (" and loss" if loss_ok is not None else ""))
        report["reproduced"] = stats_ok and loss_ok is not False
    elif loss_ok is not None:
        report["basis"] = "loss saved in the bundle"
        report["reproduced"] = loss_ok
    elif bundle.reason in _NONFINITE_TRIGGERS:
        report["basis"] = f"bundle trigger {bundle.reason!r}"
        report["reproduced"] = _trigger_reproduced(bundle.reason, capture)
    else:
        report["basis"] = "no recorded statistics, loss or non-finite trigger to compare with"
    return report


def _trigger_reproduced(reason: str, capture) -> bool:
    """Whatever made the recorder save the step shows in the replay: a
    non-finite output (or loss), a non-finite activation or gradient, or a
    non-finite parameter gradient (a skipped step). A saved output gradient
    that is already NaN makes the backward non-finite whatever the model
    does, so the forward decides when the trigger allows it."""
    outputs = any(not bool(torch.isfinite(t).all()) for mb in capture.outputs for t in mb)
    loss = capture.loss is not None and not math.isfinite(capture.loss)
    activations = any(not bool(torch.isfinite(t).all()) for c in capture.calls.values() for t in c.outputs)
    if reason == "nonfinite_loss":
        return outputs or loss
    if reason == "nonfinite_tensor":
        return activations or outputs or bool(capture.nonfinite_param_grads)
    return bool(capture.nonfinite_param_grads) or outputs  # skipped


def _loss_agrees(recorded, replayed):
    if recorded is None or replayed is None:
        return None
    if not math.isfinite(recorded) or not math.isfinite(replayed):
        return math.isfinite(recorded) == math.isfinite(replayed)
    return abs(replayed - recorded) <= LOSS_REL_TOL * max(abs(recorded), 1e-12)


def _compare_rows(rows, replayed, report) -> bool:
    recorded_nf, replayed_nf = [], []
    compared = agreed = 0
    for r in rows:
        key = (r["name"], r["kind"], r["call"])
        rep = replayed.get(key)
        if rep is None:
            continue
        label = f"{r['name'] or '<model>'} ({r['kind']})"
        rec_nf = int(r["nan_count"] or 0) + int(r["inf_count"] or 0)
        if rec_nf:
            recorded_nf.append(label)
        if rep["nonfinite"]:
            replayed_nf.append(label)
        a_rec, a_rep = r["absmax"], rep["absmax"]
        if rec_nf or rep["nonfinite"] or a_rec is None or math.isnan(a_rec) or math.isnan(a_rep):
            continue
        compared += 1
        rel = abs(a_rep - a_rec) / max(abs(a_rec), 1e-30)
        if rel <= ABSMAX_REL_TOL or max(abs(a_rec), abs(a_rep)) < 1e-30:
            agreed += 1
        else:
            report["absmax_mismatches"].append({"module": label, "recorded": a_rec, "replayed": a_rep})
    report.update(recorded_nonfinite_modules=recorded_nf, replayed_nonfinite_modules=replayed_nf,
                  absmax_compared=compared, absmax_agreed=agreed)
    same_nonfinite = bool(recorded_nf) == bool(replayed_nf) and (
        not recorded_nf or recorded_nf[0] == replayed_nf[0])
    share_ok = compared == 0 or agreed / compared >= ABSMAX_AGREE_SHARE
    return same_nonfinite and share_ok
