"""Writer thread: one finished step's copied statistics -> table rows."""
from __future__ import annotations

import math

import numpy as np

from .aggregate import merge_rows


class StepRowsMixin:
    """(mixed into AmpRecorder; runs on the writer thread only)"""

    def _write_step(self, p) -> None:
        if p.event is not None:
            p.event.synchronize()
        values = p.packed.numpy() if p.packed is not None else np.empty(0)
        n = len(p.meta)
        rows = values[: n * p.width].reshape(n, p.width) if n else np.empty((0, p.width))
        scalars = dict(p.host_scalars)
        for i, k in enumerate(p.dev_scalar_keys):
            scalars[k] = float(values[n * p.width + i])
        cols = merge_rows(p.meta, rows) if n else None

        skipped = False
        before, after = scalars.get("loss_scale_before"), scalars.get("loss_scale")
        if p.has_scaler:
            backoff = (self._manifest.get("scaler") or {}).get("backoff_factor") or 0.5
            if before is not None and after is not None and backoff < 1 and not math.isnan(before):
                # GradScaler backs off exactly when it found Inf/NaN, i.e.
                # when it skipped optimizer.step(); it never shrinks otherwise.
                skipped = after < before
            elif p.stepped is not None:
                skipped = not p.stepped
        elif p.stepped is not None:
            skipped = not p.stepped and p.micro_batches > 0

        nonfinite_params = 0
        nonfinite_rows = 0
        if cols is not None:
            g = len(cols["name"])
            cols["step"] = np.full(g, p.step, dtype=np.int64)
            cols["rank"] = np.full(g, self.rank, dtype=np.int32)
            bad = (cols["nan_count"] > 0) | (cols["inf_count"] > 0)
            nonfinite_rows = int(bad.sum())
            kinds = np.array(cols["kind"], dtype=object)
            nonfinite_params = int((bad & (kinds == "param_grad")).sum())
        sq = scalars.get("grad_sqsum")
        step_row = {
            "step": p.step,
            "rank": self.rank,
            "wall_time": p.wall_time,
            "loss": scalars.get("loss"),
            "loss_scale": after if p.has_scaler else None,
            "loss_scale_before": before if p.has_scaler else None,
            "growth_tracker": int(scalars["growth_tracker"]) if p.has_scaler and not math.isnan(scalars.get("growth_tracker", math.nan)) else None,
            "skipped": bool(skipped),
            "lr": p.lr,
            "grad_norm": _grad_norm(sq, nonfinite_params),
            "nonfinite_param_grads": nonfinite_params if cols is not None else None,
            "micro_batches": p.micro_batches,
            "tier": p.tier,
            "tensor_rows": len(cols["name"]) if cols is not None else 0,
        }
        self._writer.add_step(step_row, cols)
        m = self._manifest
        m["steps_recorded"] += 1
        m["first_step"] = p.step if m["first_step"] is None else min(m["first_step"], p.step)
        m["last_step"] = p.step if m["last_step"] is None else max(m["last_step"], p.step)
        loss = scalars.get("loss")
        event = skipped or nonfinite_rows > 0 or (loss is not None and not math.isfinite(loss))
        if event and self.full_after_event > 0:
            # Read by the training thread as a plain int: detail for the
            # next steps without any synchronisation.
            self._full_until = max(self._full_until, p.step + self.full_after_event)
        self.bundles.on_step_summary({
            "step": p.step, "skipped": bool(skipped), "loss": loss,
            "loss_scale": after, "loss_scale_before": before,
            "growth_tracker": step_row["growth_tracker"],
            "nonfinite_rows": nonfinite_rows, "columns": cols,
        })


def _grad_norm(sq, nonfinite_params: int):
    """sqrt of the recorded square sum; a skipped step, whose optimizer never
    ran (no norm taken), has an Inf norm when a gradient was non-finite."""
    if sq is not None and not (sq < 0):
        return math.sqrt(sq)
    return math.inf if nonfinite_params else None
