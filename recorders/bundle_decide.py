"""The writer-thread half of `BundleCapture`: deciding and writing bundles.

`BundleCapture` (bundle.py) runs its hooks on the training thread; these
methods run on the recorder's writer thread, one step late: evaluate the
triggers on a step's summary and record the decision for the training
thread to apply (`on_step_summary`), record a bundle that could not be
saved (`_miss`), and copy a decided bundle to the host and write it
(`_write`). They are separate because they run on another thread and touch
only what `BundleCapture` shares through its lock or hands over in a
`PendingBundle`; `BundleCapture` inherits them, so it stays one object.
"""
from __future__ import annotations

import time
import warnings

from . import schema
from .bundle_state import PendingBundle
from .bundle_writer import bundle_meta, bundle_records, write_bundle


class BundleDecisions:
    """Writer-thread methods of `BundleCapture` (a mixin: the state they use
    is set up by `BundleCapture.__init__`)."""

    def on_step_summary(self, summary: dict) -> None:
        if not self.enabled:
            return
        step = summary["step"]
        with self._lock:
            explicit = self._explicit.pop(step, [])
            if step in self._no_loss:
                self._no_loss.discard(step)
                summary = dict(summary, loss=None)
        reasons, allowed = self.triggers.decide(summary, explicit)
        tracker_before, self._tracker = self._tracker, summary.get("growth_tracker", self._tracker)
        order = None
        if reasons and not allowed:
            self._miss(step, reasons, f"max_bundles={self.triggers.max_bundles} reached")
        elif reasons:
            order = {"reasons": reasons, "growth_tracker": tracker_before,
                     "growth_tracker_after": summary.get("growth_tracker"),
                     "summary": {k: summary.get(k) for k in ("loss", "loss_scale", "loss_scale_before", "skipped")}}
        with self._lock:
            self._decisions[step] = order

    def _miss(self, step, reasons, why, refund=False) -> None:
        if refund:
            self.triggers.refund()
        self.missed.append({"step": step, "rank": self.recorder.rank, "reasons": list(reasons), "why": why})
        self.recorder._manifest["bundles_missed"] = list(self.missed)
        self.recorder._write_manifest()
        if not self._warned:
            self._warned = True
            warnings.warn(f"amp-postmortem: replay bundle of step {step} not saved: {why}", RuntimeWarning)

    def _write(self, p: PendingBundle) -> None:
        rec = self.recorder
        try:
            if p.event is not None:
                p.event.synchronize()
            records = list(bundle_records(self.inventory, p))
            size = sum(t.numel() * t.element_size() for _, _, _, t, _ in records)
            if self._bytes_saved + size > self.max_bundle_bytes:
                self._miss(p.step, p.order["reasons"], f"max_bundle_bytes={self.max_bundle_bytes} would be "
                           f"exceeded ({self._bytes_saved} saved, {size} more)", refund=True)
                return
            m = rec._manifest
            run = {"run_id": rec.run_id, "rank": rec.rank, "world_size": rec.world_size,
                   "package_version": m.get("package_version"), "device_type": m.get("device_type"),
                   "device_name": m.get("device_name"), "scaler": m.get("scaler"),
                   "has_scaler": rec._scaler_enabled(), "recorder": self.config}
            rel = f"{schema.BUNDLES_DIR}/{schema.BUNDLE_DIR.format(step=p.step, rank=rec.rank)}"
            files = write_bundle(rec.run_dir / rel, records, bundle_meta(self.inventory, p, run))
            written = sum(f["bytes"] for f in files.values())
            self._bytes_saved += size  # raw bytes, as the cap is stated
            self.saved.append({"step": p.step, "rank": rec.rank, "path": rel, "reason": p.order["reasons"][0],
                               "reasons": p.order["reasons"], "bytes": written, "created_at": time.time(),
                               "params_exact": p.capture.params_exact})
            rec._write_manifest()
        except Exception as exc:  # noqa: BLE001 - a failed bundle never stops the recording
            self._miss(p.step, p.order["reasons"], f"{type(exc).__name__}: {exc}", refund=True)
        finally:
            p.params = p.buffers = p.inputs = p.capture = None
