"""When to save a replay bundle: a pure function of each step's host-side
summary (the recorder's writer thread calls it once per step, in order).

Each automatic trigger fires once, at the first step where its condition
holds, whether or not the cap then lets the bundle be saved:

- `nonfinite_loss`: the loss passed to `rec.step()` is NaN or Inf;
- `nonfinite_tensor`: a recorded tensor holds a NaN or Inf. With an enabled
  GradScaler only forward values count (inputs, activations, parameters,
  loss): scaled gradients that overflow are the scaler's business and show
  up as `skipped`;
- `skipped`: the step was skipped after the loss scale settled, i.e. after
  `settle_steps` consecutive steps that ran the optimizer. The skips of a
  fresh GradScaler calibrating down from its initial scale come before that
  and neither fire nor use up the cap. Nor does a *probe* skip: the first
  step at a scale the scaler has just grown to overflowing is how a healthy
  GradScaler oscillates (grow every `growth_interval` clean steps, back off
  when that was too much); only a skip at a scale that had already worked
  says the gradients themselves changed;
- `scale_low`: the scale after `update()` fell below `min_loss_scale`.

Explicit reasons (`request`, `step_list`) are passed in and always count.

A counterfactual window opens on fewer events than a bundle
(`WINDOW_EVENTS`, whatever the bundle cap and `triggers` say): the first
failure (a non-finite loss, or a non-finite forward value: with a GradScaler
only forward values count, without one any recorded value), before it a
loss-scale collapse's onset (`COLLAPSE_SKIPS` consecutive skips after
settling, not counting probes, or the scale below `min_loss_scale`), and
every explicit request. One isolated skip is how a healthy scaler behaves: it opens none.
A silent failure opens one too: the first step measured (`collectors.updates`)
where at least `LOST_UPDATE_SHARE` of the updates the optimizer asked of the
low-precision parameters left them unchanged (`lost_updates`, the summary's
`(moved, unchanged)` over all of them), whether or not a failure came before.
They are noted only when `watch_window` is set, and taken by the training
thread (`take_window_events`).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ..errors import OptionError

TRIGGERS = ("nonfinite_loss", "nonfinite_tensor", "skipped", "scale_low")
# The first reason in this order names a bundle saved for several reasons.
REASON_ORDER = TRIGGERS + ("request", "step_list")
# What opens a counterfactual window, in this order of naming.
WINDOW_EVENTS = ("nonfinite_loss", "nonfinite_tensor", "scale_collapse", "lost_updates", "request")
COLLAPSE_SKIPS = 3  # consecutive settled, non-probe skips: the scale is collapsing
# Half the asked-for updates rounded away: the weights mostly stand still,
# which no NaN or skip shows. A small language model held in bfloat16
# (tests/silent_runs.TinyLM, AdamW, its first 12 steps) loses 6-15% of them
# at lr 1e-3, 29-45% at 3e-4, 78-81% at 1e-4 and 96% at 1e-5; issue 42's
# GPT-2 at 1e-5, 89%.
LOST_UPDATE_SHARE = 0.5


def updates_lost(summary: dict) -> bool:
    """Whether the step's measured updates were mostly lost to rounding
    (the summary's `lost_updates`: (moved, unchanged), or None: not measured)."""
    counts = summary.get("lost_updates")
    if not counts:
        return False
    moved, unchanged = counts
    return moved > 0 and unchanged >= LOST_UPDATE_SHARE * moved


def trigger_names(triggers) -> tuple[str, ...]:
    """The triggers named (one name or several), checked against TRIGGERS."""
    triggers = (triggers,) if isinstance(triggers, str) else tuple(triggers or ())
    unknown = [t for t in triggers if t not in TRIGGERS]
    if unknown:
        raise OptionError(f"unknown bundle trigger {unknown[0]!r} (valid: {', '.join(TRIGGERS)})")
    return triggers


class BundleTriggers:
    def __init__(self, triggers=TRIGGERS, *, has_scaler: bool, max_bundles: int = 3,
                 min_loss_scale: float | None = 1.0, settle_steps: int = 10):
        self.triggers = trigger_names(triggers)
        self.has_scaler = has_scaler
        self.max_bundles = int(max_bundles)
        self.min_loss_scale = min_loss_scale
        self.settle_steps = int(settle_steps)
        self.settled = not has_scaler or self.settle_steps <= 0
        self.latched: set[str] = set()
        self.orders = 0
        self._clean_steps = 0
        self._prev_scale_before = None
        self._skip_run = 0
        self.watch_window = False
        self._window_latched: set[str] = set()
        self._window_lock = threading.Lock()
        self._window_events: dict[int, list[str]] = {}

    def conditions(self, summary: dict) -> list[str]:
        """Which trigger conditions hold at this step (state: settling)."""
        reasons = []
        loss = summary.get("loss")
        if loss is not None and not math.isfinite(loss):
            reasons.append("nonfinite_loss")
        cols = summary.get("columns")
        if cols is not None and len(cols["name"]):
            bad = (np.asarray(cols["nan_count"]) > 0) | (np.asarray(cols["inf_count"]) > 0)
            if self.has_scaler:
                bad &= np.asarray(cols["phase"], dtype=object) == "forward"
            if bad.any():
                reasons.append("nonfinite_tensor")
        before = summary.get("loss_scale_before")
        probe = (before is not None and self._prev_scale_before is not None
                 and not math.isnan(before) and before > self._prev_scale_before)
        self._prev_scale_before = before
        if summary.get("skipped"):
            if self.settled and not probe:
                reasons.append("skipped")
                self._skip_run += 1
            self._clean_steps = 0
        else:
            self._skip_run = 0
            self._clean_steps += 1
            if self._clean_steps >= self.settle_steps:
                self.settled = True
        scale = summary.get("loss_scale")
        if (self.min_loss_scale is not None and scale is not None and not math.isnan(scale)
                and scale < self.min_loss_scale):
            reasons.append("scale_low")
        return reasons

    def decide(self, summary: dict, explicit=()) -> tuple[list[str], bool]:
        """(reasons to save this step for, in REASON_ORDER; whether the cap
        allows it). A positive answer counts against `max_bundles`."""
        conditions = self.conditions(summary)
        if self.watch_window:
            self._note_window_events(summary, conditions, explicit)
        fired = [r for r in conditions if r in self.triggers and r not in self.latched]
        self.latched.update(conditions)
        fired += [r for r in explicit if r not in fired]
        fired.sort(key=REASON_ORDER.index)
        if not fired:
            return [], False
        if self.orders >= self.max_bundles:
            return fired, False
        self.orders += 1
        return fired, True

    def _note_window_events(self, summary, conditions, explicit) -> None:
        # The first failure (a non-finite loss or forward value: one event,
        # named by what was seen), and before it a collapse's onset; what
        # follows a failure (more NaNs, the scale collapsing after it) is
        # its consequence, not a new story.
        events = []
        if "failure" not in self._window_latched:
            events = [c for c in conditions if c in ("nonfinite_loss", "nonfinite_tensor")]
            if events:
                self._window_latched.add("failure")
            elif ((self._skip_run >= COLLAPSE_SKIPS or "scale_low" in conditions)
                  and "scale_collapse" not in self._window_latched):
                events = ["scale_collapse"]
                self._window_latched.add("scale_collapse")
        if "lost_updates" not in self._window_latched and updates_lost(summary):
            # Its own story, before or after a failure: the weights stood still.
            events.append("lost_updates")
            self._window_latched.add("lost_updates")
        if "request" in explicit:
            events.append("request")  # every request counts
        step = summary.get("step")
        if events and step is not None:
            with self._window_lock:
                self._window_events[int(step)] = sorted(events, key=WINDOW_EVENTS.index)

    def take_window_events(self) -> dict[int, list[str]]:
        """Training thread: the window events noted since the last call,
        by step."""
        with self._window_lock:
            events, self._window_events = self._window_events, {}
        return events

    def refund(self) -> None:
        """A decided bundle was not written (size cap, error): free its slot."""
        self.orders = max(0, self.orders - 1)
