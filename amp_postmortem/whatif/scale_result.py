"""The loss-scale window as a result: `ScaleWindow`, and what both ways of
finding it share.

It owns the constants of the window (the scale range, the underflow limit,
the table columns), the `ScaleWindow` dataclass both methods return, and the
derivations from a list of usable scales: the window itself (longest run),
where the recorded scale sits, the GradScaler settings and the notes on the
recorded scaler's calibration. It is separate so that the replayed window
(`scale_window.py`) and the statistics-only estimate (`scale_estimate.py`)
can share it without importing each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import pandas as pd

from recorders.format import plain

from ..names import BackwardFrom, Word

SCALES = (-16, 40)            # k range of the replayed scales 2^k
MAX_UNDERFLOW = 0.05          # usable: at most 5% of the gradient values flushed/subnormal
WIDE_WINDOW_BITS = 4
SCALE_COLUMNS = ["k", "scale", "forward_finite", "overflow", "underflow_share", "param_grad_lost_share",
                 "usable", "recorded", "loss_overflow", "overflow_cause"]
LAYER_COLUMNS = ["name", "numel", "absmax_unscaled", "below_normal_share", "zero_share", "overflow_k",
                 "underflow_k", "log2_mu", "log2_sigma", "structural_zero_share", "flushed_zero_share",
                 "edge_cause"]
# Largest finite value per loss dtype: the scale itself, d(scaled loss)/d(loss)
# rounded to the loss's dtype, is the backward's first gradient.
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
             "float64": 1.7976931348623157e308}
LOSS_ROW = "<loss>"


class EdgeCause(str, Enum):
    """What sets the overflow edge (the window's top)."""
    LOSS_DTYPE = "loss_dtype"            # the scale itself overflows the loss's dtype (a float16 loss: > 65504)
    ACTIVATION_GRAD = "activation_grad"  # a module's output gradient
    WEIGHT_GRAD = "weight_grad"          # a weight-gradient matmul run in float16


class WindowMethod(Word):
    """How the window was found; `value` is the `--json` "method"."""
    REPLAY = "replay"                    # every scale replayed on a saved step (`scale_window.py`)
    ESTIMATE = "estimate"                # estimated from the recorded statistics (`scale_estimate.py`)


class ScalePosition(Word):
    """Where the recorded scale sits against the window; `value` is the
    `--json` "recorded_position"."""
    INSIDE = "inside"
    ABOVE = "above"                      # above the overflow edge: its steps overflow
    BELOW = "below"                      # below the underflow edge


EDGE_WORDS = {EdgeCause.LOSS_DTYPE: "the loss's own dtype",
              EdgeCause.ACTIVATION_GRAD: "a module's output gradient",
              EdgeCause.WEIGHT_GRAD: "a float16 weight-gradient matmul"}


@dataclass(frozen=True)
class SavedStepScale:
    """Another saved step replayed at the window's top (`verify_window`):
    finite there, else the highest scale of the window where it is
    (`max_finite_k`, None: none is) and why in one sentence."""
    step: int
    finite_at_max: bool
    max_finite_k: int | None
    why: str | None = None

    def to_dict(self) -> dict:
        return {"step": self.step, "finite_at_max": self.finite_at_max, "max_finite_k": self.max_finite_k,
                "why": self.why}

    def line(self) -> str:
        return f"saved step {self.step}: " + (f"finite at 2^{self.max_finite_k}" if self.finite_at_max else self.why)


@dataclass
class ScaleWindow:
    method: WindowMethod
    step: int | None
    rank: int | None
    recorded_scale: float | None
    window: dict | None             # {"min_k", "max_k", "min_scale", "max_scale", "width_bits"}
    recorded_position: ScalePosition | None  # None: no window or no recorded scale
    settings: dict | None           # GradScaler keyword arguments
    code: str | None
    rows: list                      # replay: per scale; estimate: per layer
    max_underflow: float = MAX_UNDERFLOW
    notes: list = field(default_factory=list)
    recorded_scaler: dict | None = None
    # Replayed: every scale was run, forward and backward, so the edges are
    # facts of the saved step. Estimated: `why` it could not be checked.
    verified: bool = False
    why: str | None = None
    # Replayed with `verify_window`: the other saved steps at the window's
    # top ([{"step", "finite_at_max", "max_finite_k", "why"}]).
    checked_steps: list = field(default_factory=list)   # [SavedStepScale], verify_window's
    # The overflow edge's cause (EdgeCause) and the tensor that sets it
    # (a layer, a parameter or "<loss>"); the loss's dtype (None: unknown)
    # and the highest k it allows; replays: where the backward started
    # (engine's StepCapture).
    overflow_cause: EdgeCause | None = None
    overflow_edge_by: str | None = None
    loss_dtype: str | None = None
    loss_max_k: int | None = None
    backward_from: BackwardFrom | None = None
    # Replayed with a model: the proposed init_scale re-run over the saved
    # window of steps (`window_check.WindowCheck`), or None (none proposed).
    window_check: object = None

    def to_dict(self) -> dict:
        return plain({"method": self.method.value, "step": self.step, "rank": self.rank,
                      "verified": self.verified, "why": self.why,
                      "checked_steps": [c.to_dict() for c in self.checked_steps],
                      "overflow_cause": self.overflow_cause.value if self.overflow_cause else None,
                      "overflow_edge_by": self.overflow_edge_by, "loss_dtype": self.loss_dtype,
                      "loss_max_k": self.loss_max_k,
                      "backward_from": self.backward_from.value if self.backward_from else None,
                      "recorded_scale": self.recorded_scale, "window": self.window,
                      "recorded_position": self.position_words, "settings": self.settings, "code": self.code,
                      "max_underflow": self.max_underflow, "recorded_scaler": self.recorded_scaler,
                      "notes": self.notes, ("scales" if self.method is WindowMethod.REPLAY else "layers"): self.rows,
                      "window_check": self.window_check.to_dict() if self.window_check is not None else None})

    @property
    def position_words(self) -> str | None:
        """`recorded_position` as its `--json` string (None when unknown)."""
        return self.recorded_position.value if self.recorded_position is not None else None

    def edge_line(self) -> str | None:
        """What sets the overflow edge, in words (None when unknown)."""
        if self.overflow_cause is None:
            return None
        if self.overflow_cause is EdgeCause.LOSS_DTYPE:
            return (f"overflow edge set by the loss's own dtype ({self.loss_dtype}): the scale itself is the "
                    f"backward's first gradient and must stay at most {DTYPE_MAX[self.loss_dtype]:g} "
                    f"(2^{self.loss_max_k}); above it every step overflows")
        return (f"overflow edge set by {EDGE_WORDS[self.overflow_cause]}"
                + (f": {self.overflow_edge_by}" if self.overflow_edge_by else ""))

    def loss_caveat(self) -> str | None:
        """When the loss's dtype is unknown and the window reaches above
        what a float16 loss allows: the limit it would set."""
        top = loss_max_k("float16")
        if self.loss_dtype is not None or self.window is None or self.window["max_k"] <= top:
            return None
        return (f"the loss's dtype is not recorded: if the loss is float16, no scale above 2^{top} works "
                "(the scale itself is the backward's first gradient, Inf above 65504)")

    def table(self) -> pd.DataFrame:
        cols = SCALE_COLUMNS if self.method is WindowMethod.REPLAY else LAYER_COLUMNS
        return pd.DataFrame(self.rows, columns=cols)

    def lines(self) -> list[str]:
        what = ("replayed" if self.method is WindowMethod.REPLAY else
                f"estimated from recorded statistics (estimate, not verified: {self.why})" if self.why else
                "estimated from recorded statistics (estimate, not verified)")
        out = [f"loss-scale window, {what}: step {self.step}"
               + (f", rank {self.rank}" if self.rank is not None else "")
               + (f", recorded scale {self.recorded_scale:g}" if self.recorded_scale else "")]
        w = self.window
        if w is None and self.recorded_scale is None and self.method is WindowMethod.ESTIMATE and self.notes:
            out.append("no scale judged: " + self.notes[0])  # a run without a scale says why
        elif w is None:
            out.append("no usable scale: " + (self.notes[0] if self.notes else "every scale overflows or underflows"))
        else:
            out.append(f"window: 2^{w['min_k']} .. 2^{w['max_k']} ({w['min_scale']:g} .. {w['max_scale']:g}, "
                       f"{w['width_bits']} bits); the recorded scale is {self.position_words or 'unknown'}")
        if self.backward_from:
            out.append("backward started from " + BACKWARD_WORDS[self.backward_from]
                       + (f" (the loss is {self.loss_dtype})" if self.loss_dtype else ""))
        if self.edge_line():
            out.append(self.edge_line())
        if self.code:
            out.append(f"GradScaler settings that stay inside it: {self.code}")
        out += [c.line() for c in self.checked_steps]
        if self.window_check is not None:
            out.append(self.window_check.line())
        out += [f"note: {n}" for n in self.notes[(1 if w is None and self.notes else 0):]]
        return out




BACKWARD_WORDS = {BackwardFrom.LOSS: "the model's loss output, the scale in the loss's own dtype as in training",
                  BackwardFrom.LOSS_FN: "loss_fn's loss computed under autocast, scaled as GradScaler does",
                  BackwardFrom.OUTPUT_GRADIENT: "the saved output gradient times the scale (the loss is outside "
                                                "the model call)"}


def loss_max_k(dtype: str | None) -> int | None:
    """The highest k at which the scale 2^k is finite in `dtype` (15 for
    float16: 2^16 = 65536 rounds to Inf), or None for an unknown dtype."""
    top = DTYPE_MAX.get(dtype or "")
    return int(math.floor(math.log2(top))) if top else None


def recorded_loss_dtype(run, step: int) -> tuple[str | None, str | None]:
    """(the dtype of the loss step `step` backpropagated, why it is unknown)
    from the steps table's `loss_dtype` (schema 1.3)."""
    steps = run.steps
    if "loss_dtype" not in steps.columns:
        return None, ("the run does not record the loss's dtype (recorded before schema 1.3): whether the "
                      "loss itself bounds the scale (a float16 loss: at most 65504) is unknown")
    at = steps.loc[steps["step"] == int(step), "loss_dtype"].dropna()
    if not len(at):
        return None, (f"step {step} recorded no loss tensor (the loss's dtype is unknown): whether the loss "
                      "itself bounds the scale (a float16 loss: at most 65504) is unknown")
    dtype = str(at.iloc[0])
    if dtype not in DTYPE_MAX:
        return None, (f"step {step} recorded the loss's dtype as {dtype!r}, not a floating dtype (one of "
                      f"{', '.join(DTYPE_MAX)}): whether the loss itself bounds the scale is unknown")
    return dtype, None


def usable_window(usable_ks) -> dict | None:
    """The longest run of consecutive usable k (the highest on a tie)."""
    best, start, prev = None, None, None
    for k in sorted(usable_ks):
        if prev is None or k != prev + 1:
            start = k
        prev = k
        if best is None or (k - start) >= (best[1] - best[0]):
            best = (start, k)
    if best is None:
        return None
    lo, hi = best
    return {"min_k": lo, "max_k": hi, "min_scale": 2.0 ** lo, "max_scale": 2.0 ** hi, "width_bits": hi - lo}


def position_in_window(window, recorded_k) -> ScalePosition | None:
    if window is None or recorded_k is None:
        return None
    if recorded_k > window["max_k"]:
        return ScalePosition.ABOVE
    if recorded_k < window["min_k"]:
        return ScalePosition.BELOW
    return ScalePosition.INSIDE


def scaler_settings(window, device_type: str = "cuda") -> tuple[dict | None, str | None]:
    """GradScaler keyword arguments that keep a run inside `window`."""
    if window is None:
        return None, None
    lo, hi = window["min_k"], window["max_k"]
    settings = {"init_scale": 2.0 ** max(lo, hi - 1), "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 2000 if hi - lo >= WIDE_WINDOW_BITS else 500}
    args = ", ".join(f"{k}={_literal(v)}" for k, v in settings.items())
    return settings, f'torch.amp.GradScaler("{device_type or "cuda"}", {args})'


def _literal(v) -> str:
    if isinstance(v, float) and v >= 8 and math.log2(v).is_integer():
        return f"2.0**{int(math.log2(v))}"
    return repr(v)


def calibration_notes(scaler, window) -> list:
    """What the recorded GradScaler configuration costs against the window."""
    if not scaler or window is None:
        return []
    notes = []
    init = scaler.get("init_scale")
    if init and init > window["max_scale"]:
        skips = math.ceil(math.log2(init / window["max_scale"]))
        notes.append(f"the recorded init_scale {init:g} is above the window: about {skips} skipped steps "
                     "of calibration at every (re)start")
    elif init and init < window["min_scale"]:
        notes.append(f"the recorded init_scale {init:g} is below the window: gradients underflow until it "
                     f"has grown {math.ceil(math.log2(window['min_scale'] / init))} times")
    return notes
