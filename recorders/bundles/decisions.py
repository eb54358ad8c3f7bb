"""The writer-thread part of bundle capture: deciding and writing bundles.

`BundleCapture` (capture.py) runs on the training thread; `BundleDecisions`
runs on the recorder's writer thread, one step late: it evaluates the
triggers on a step's summary and records the decision for the training
thread to apply (`on_step_summary`, `take`), records a bundle that could
not be saved (`miss`), and copies a decided bundle to the host and writes
it (`write`). The two threads share only what passes through the lock
(explicit requests, decisions) and the `PendingBundle`s handed over.
"""
from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

from ..format import schema
from .directory import bundle_meta, bundle_records, write_bundle
from .held import PendingBundle


class BundleDecisions:
    """`triggers`: a `BundleTriggers`; `run_info`: the run's identity and
    the recorder's bundle options, for bundle.json; `growth_tracker`: the
    scaler's tracker before the first step (None: unknown);
    `on_change(saved, missed)`: called after a bundle is saved or missed."""

    def __init__(self, triggers, *, inventory, run_dir: Path, run_info: dict,
                 max_bundle_bytes: int, growth_tracker, on_change):
        self.triggers = triggers
        self.inventory = inventory
        self.run_dir = Path(run_dir)
        self.run_info = run_info
        self.max_bundle_bytes = int(max_bundle_bytes)
        self.saved: list[dict] = []
        self.missed: list[dict] = []
        self._on_change = on_change
        # shared with the training thread, under the lock
        self._lock = threading.Lock()
        # step -> order (None: no), made here, taken by `take`; the training
        # thread tests it without the lock at every step (one reference,
        # atomic under the GIL: a decision landing meanwhile waits a step).
        self.decided: dict[int, dict | None] = {}
        self._explicit: dict[int, list[str]] = {}
        self._no_loss: set[int] = set()
        # writer thread only
        self._tracker = growth_tracker
        self._bytes_saved = 0
        self._warned = False

    # ------------------------------------------------------ training thread
    def note_step(self, step: int, explicit: list[str], *, no_loss: bool) -> None:
        """A step closed: the reasons it was asked for explicitly, and
        whether it had no loss (its summary's NaN then means nothing)."""
        if not explicit and not no_loss:
            return  # the usual step: nothing to note (no lock on every step)
        with self._lock:
            if explicit:
                self._explicit[step] = list(explicit)
            if no_loss:
                self._no_loss.add(step)

    def take(self) -> dict[int, dict | None]:
        """The decisions made since the last call: step -> order (None: no)."""
        if not self.decided:
            # Read without the lock (one reference, atomic under the GIL): a
            # decision that lands meanwhile is taken at the next call.
            return _NONE
        with self._lock:
            decisions, self.decided = self.decided, {}
        return decisions

    # -------------------------------------------------------- writer thread
    def on_step_summary(self, summary: dict) -> None:
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
            self.miss(step, reasons, f"max_bundles={self.triggers.max_bundles} reached")
        elif reasons:
            order = {"reasons": reasons, "growth_tracker": tracker_before,
                     "growth_tracker_after": summary.get("growth_tracker"),
                     "summary": {k: summary.get(k) for k in ("loss", "loss_scale", "loss_scale_before", "skipped")}}
        with self._lock:
            self.decided[step] = order

    def miss(self, step, reasons, why, refund=False) -> None:
        if refund:
            self.triggers.refund()
        self.missed.append({"step": step, "rank": self.run_info["rank"], "reasons": list(reasons), "why": why})
        self._on_change(self.saved, self.missed)
        if not self._warned:
            self._warned = True
            warnings.warn(f"amp-postmortem: replay bundle of step {step} not saved: {why}", RuntimeWarning)

    def write(self, p: PendingBundle) -> None:
        rank = self.run_info["rank"]
        try:
            if p.event is not None:
                p.event.synchronize()
            records = list(bundle_records(self.inventory, p))
            size = sum(t.numel() * t.element_size() for _, _, _, t, _ in records)
            state = sum(t.numel() * t.element_size() for t in p.optimizer_state or ())
            if state and self._bytes_saved + size > self.max_bundle_bytes >= self._bytes_saved + size - state:
                # The replay needs the weights, not the optimizer state: a
                # bundle that fits without it is saved without it.
                p.optimizer_state = []
                p.info["optimizer"] = dict(p.info["optimizer"], state=[], state_omitted=(
                    f"max_bundle_bytes={self.max_bundle_bytes} would be exceeded by its {state} bytes"))
                records = list(bundle_records(self.inventory, p))
                size -= state
            if self._bytes_saved + size > self.max_bundle_bytes:
                self.miss(p.step, p.order["reasons"], f"max_bundle_bytes={self.max_bundle_bytes} would be "
                          f"exceeded ({self._bytes_saved} saved, {size} more)", refund=True)
                return
            rel = f"{schema.BUNDLES_DIR}/{schema.BUNDLE_DIR.format(step=p.step, rank=rank)}"
            files = write_bundle(self.run_dir / rel, records, bundle_meta(self.inventory, p, self.run_info))
            written = sum(f["bytes"] for f in files.values())
            self._bytes_saved += size  # raw bytes, as the cap is stated
            self.saved.append({"step": p.step, "rank": rank, "path": rel, "reason": p.order["reasons"][0],
                               "reasons": p.order["reasons"], "bytes": written, "created_at": time.time(),
                               "params_exact": p.capture.params_exact})
            self._on_change(self.saved, self.missed)
        except Exception as exc:  # noqa: BLE001 - a failed bundle never stops the recording
            self.miss(p.step, p.order["reasons"], f"{type(exc).__name__}: {exc}", refund=True)
        finally:
            p.params = p.buffers = p.inputs = p.capture = p.optimizer_state = None


# What `take` returns when nothing was decided: one shared empty mapping,
# never changed (its callers only iterate it).
_NONE: dict = {}
