"""`BundlePolicy`: which replay bundles a recorder holds and saves, and what
holding them may cost (`AmpRecorder(bundles=BundlePolicy(...))`).

A frozen value, validated when it is made: a bad option raises an
`OptionError` in the user's own line, before any recorder exists.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..errors import OptionError, option_float, option_int
from .loss_call import loss_target
from .triggers import TRIGGERS, trigger_names

SNAPSHOT_PARAMS = ("auto", True, False)
DEFAULT_LOSS_WINDOW_STEPS = 16  # the window `loss_fn=` alone turns on


@dataclass(frozen=True)
class BundlePolicy:
    """The bundle options (keywords; their one definition):

    triggers: the automatic triggers in force, a subset of `nonfinite_loss`,
        `nonfinite_tensor`, `skipped`, `scale_low` (default: all four).
    steps: steps to save a bundle of in any case (recorded at the full tier).
    max_bundles: at most this many bundles per rank and run (3).
    max_bundle_bytes: at most this many raw tensor bytes of bundles per rank
        and run, counted before compression (64 GiB).
    min_loss_scale: the `scale_low` trigger fires below this scale (1.0;
        None: never).
    settle_steps: consecutive optimizer steps that end the calibration of a
        fresh GradScaler; skips before that never trigger (10).
    snapshot_params: copy the weights in the optimizer pre-step hook every
        step: True, False, or "auto" (when no GradScaler is enabled; on the
        CPU only for a step whose gradients are not all finite, where True
        copies them every step: a finite event such as a loss spike is then
        re-executable too); at most two copies of the parameters exist, on
        their device, while the writer decides (a clean step's goes back at
        once).
    snapshot_buffers_bytes: copy the buffers at each step's first forward
        when they total at most this many bytes (64 MiB).
    hold_steps: finished steps whose inputs and output gradients stay
        referenced while the writer thread decides (2; at least 1).
    clone_inputs: copy the inputs at the forward instead of holding
        references (False; True for loops that change a batch in place
        after the step).
    window_steps: K > 0 keeps a counterfactual window: a device-side copy
        of the weights, buffers, optimizer state and scaler state at the
        window's first step, and every step's inputs (references, as held
        for bundles) and RNG states since. The window restarts every K
        steps until an event that matters opens it (`WINDOW_EVENTS`: the
        first non-finite loss, the first forward NaN/Inf, a loss-scale
        collapse's onset, the first recorded step whose updates of the
        bfloat16/float16 parameters were at least half left unchanged, a
        `save_bundle()` request; never one isolated scaler skip); it then runs on for K more steps (or until `close()`)
        and is written under `windows/` (`amp-postmortem rerun` replays it),
        and a new window rolls on for the next event, while
        `max_window_bytes` allows. A window holds up to K steps from its
        event on, and before it the steps since the last restart (fewer
        than K; more when the writer thread lags: a window restarts only
        once every held step is decided). Default: 16 when `loss_fn` is
        given, else 0: off; nothing is copied or held on the training path.
    max_window_bytes: the byte budget of the windows, per rank and run (the
        copies and the inputs, 1 GiB): what one window holds and the raw
        bytes of those written, together. A rolling window restarts early
        when it would exceed what is left; a triggered one is written early
        (its last steps missing); no new window opens when its state copy
        alone exceeds what is left (the first one: turned off with a
        warning).
    loss_fn: the loss the loop computes outside the model
        (`loss = loss_fn(model(x), y)`): an `nn.Module` criterion (its calls
        are seen by a forward pre-hook) or a module-level function (the
        name it is defined under is wrapped while the recorder is open).
        Each micro-batch's call is kept in the window: its tensors but the
        prediction (the targets, saved as the inputs are), the prediction's
        shape and dtype, and the loss's name (never the object itself), so
        that `amp-postmortem rerun --loss FILE.py:fn` can call the loss as
        the loop did. Turns the window on (16 steps) unless `window_steps`
        says otherwise.

    `AmpRecorder(bundles=False)` holds and saves nothing; `bundles=True` is
    `BundlePolicy()`."""

    triggers: tuple = TRIGGERS
    steps: tuple = ()
    max_bundles: int = 3
    max_bundle_bytes: int = 64 << 30
    min_loss_scale: float | None = 1.0
    settle_steps: int = 10
    snapshot_params: bool | str = "auto"
    snapshot_buffers_bytes: int = 64 << 20
    hold_steps: int = 2
    clone_inputs: bool = False
    window_steps: int | None = None
    max_window_bytes: int = 1 << 30
    loss_fn: object = None

    def __post_init__(self):
        triggers = trigger_names(self.triggers)
        steps = (() if self.steps is None else (self.steps,) if isinstance(self.steps, numbers.Real)
                 else tuple(self.steps))
        if self.snapshot_params not in SNAPSHOT_PARAMS:
            raise OptionError(f"snapshot_params={self.snapshot_params!r} (valid: 'auto', True, False)")
        min_scale = self.min_loss_scale
        if min_scale is not None:
            option_float("min_loss_scale", min_scale)
        normal = {
            "triggers": triggers,
            "steps": tuple(sorted({option_int("steps", s) for s in steps})),
            "max_bundles": option_int("max_bundles", self.max_bundles),
            "max_bundle_bytes": option_int("max_bundle_bytes", self.max_bundle_bytes),
            # kept as given (1 or 1.0): the manifest records the value passed
            "min_loss_scale": min_scale,
            "settle_steps": option_int("settle_steps", self.settle_steps),
            "snapshot_buffers_bytes": option_int("snapshot_buffers_bytes", self.snapshot_buffers_bytes),
            "hold_steps": max(1, option_int("hold_steps", self.hold_steps)),
            "clone_inputs": bool(self.clone_inputs),
            "window_steps": (DEFAULT_LOSS_WINDOW_STEPS if self.loss_fn is not None else 0)
            if self.window_steps is None else max(0, option_int("window_steps", self.window_steps)),
            "max_window_bytes": option_int("max_window_bytes", self.max_window_bytes),
        }
        if self.loss_fn is not None:
            loss_target(self.loss_fn)  # refused here, in the user's line, when it cannot be seen called
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def window_refusal(self, *, sharded: bool, enabled: bool) -> str | None:
        """Why no window is kept (None: kept when asked for). With sharded
        parameters each rank would start its window when its own writer has
        decided the steps before: the ranks' windows would start at
        different steps, whose shards no reader could put together."""
        if sharded and enabled and self.window_steps > 0:
            return "sharded parameters (the ranks' windows would not start at one step)"
        return None

    def config(self, *, enabled: bool, snapshot_params: bool) -> dict:
        """The options as the manifest (`recorder.bundles`) and bundle.json
        record them: `enabled` is the master switch as it stands (False for
        `bundles=False` or a sharded model), `snapshot_params` as resolved
        for this job ("auto" decided)."""
        return {
            "bundles": enabled, "bundle_triggers": list(self.triggers),
            "bundle_steps": list(self.steps), "max_bundles": self.max_bundles,
            "max_bundle_bytes": self.max_bundle_bytes, "min_loss_scale": self.min_loss_scale,
            "settle_steps": self.settle_steps, "snapshot_params": bool(snapshot_params),
            "snapshot_buffers_bytes": self.snapshot_buffers_bytes, "hold_steps": self.hold_steps,
            "clone_inputs": self.clone_inputs, "window_steps": self.window_steps,
            "max_window_bytes": self.max_window_bytes,
            # only when given: the options a run without it records are as before
            **({} if self.loss_fn is None else {"loss_fn": loss_target(self.loss_fn)[0]}),
        }
