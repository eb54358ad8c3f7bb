"""A Keras train step that misuses its `LossScaleOptimizer`: the loss never
scaled, gradients unscaled twice, or scaled gradients applied as they are.

Keras 3 splits loss scaling in two (`recorders/keras_loss_scaling.py`):
the step multiplies its loss by the scale (`optimizer.scale_loss`) and
differentiates that; `optimizer.apply` divides every gradient by the scale
(and skips a step whose gradients hold Inf/NaN). The recorder writes the
manifest's `loss_scaling`: how many times the traced step called
`scale_loss`, which optimizer's `apply` took the gradients, and, measured on
the TensorFlow backend, the factor between a gradient handed to the
optimizer and the same gradient of the step's own loss (`measured`:
`[step, factor, loss scale]`).

Decided on the measured factor when there is one (its median over the
measured steps against the scale: within a factor of 2 of the scale means
scaled, within a factor of 2 of 1 means not; a scale below 4 tells nothing),
else on the step's code. Typed outcomes (`ScalingMistake`):

- `LOSS_NOT_SCALED`: `scale_loss` never ran, and the gradients went to the
  LossScaleOptimizer's `apply`, which divided the gradients of an unscaled
  loss by the scale;
- `UNSCALED_TWICE`: `scale_loss` ran, yet the gradients reached `apply` at
  1x the loss's own: taken of the unscaled loss, or divided by the scale in
  the step before `apply` divided them again;
- `SCALED_GRADIENTS_APPLIED`: the inner optimizer applied the gradients
  itself (`optimizer.inner_optimizer.apply`): the scaled loss's gradients
  never divided, no step skipped;
- `SCALE_UNUSED`: the inner optimizer applied the gradients of an unscaled
  loss: no loss scaling at all, the LossScaleOptimizer idle.

`loss_scaling_mistake(run)`: None for a run without the key (PyTorch, Flax,
Keras without a LossScaleOptimizer) or a step that uses it right.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from recorders.format import schema

from ..names import Word

# log2 distance within which a measured factor counts as the scale (or 1).
TOLERANCE_BITS = 1.0
# Below this scale, 1x and 1x-the-scale are too close to tell apart.
MIN_SCALE = 4.0


class ScalingMistake(Word):
    LOSS_NOT_SCALED = "loss_not_scaled"
    UNSCALED_TWICE = "unscaled_twice"
    SCALED_GRADIENTS_APPLIED = "scaled_gradients_applied"
    SCALE_UNUSED = "scale_unused"


class Basis(Word):
    MEASURED = "measured"   # the gradients' factor against the loss's own
    STEP_CODE = "step_code"  # what the traced step called


class AppliedBy(Word):
    LOSS_SCALE_OPTIMIZER = "loss_scale_optimizer"
    INNER_OPTIMIZER = "inner_optimizer"


class GradScaling(Word):
    SCALED = "scaled"       # gradients at about the scale times the loss's
    UNSCALED = "unscaled"   # at about 1x
    OTHER = "other"


@dataclass
class LossScalingCheck:
    mistake: ScalingMistake
    basis: Basis
    applied_by: AppliedBy | None
    scale_loss_calls: int | None
    custom_train_step: bool
    backend: str | None = None        # Keras' backend (the fix differs)
    first_step: int | None = None
    factor: float | None = None       # median measured factor
    loss_scale: float | None = None   # the scale at the first measured step
    measured: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"mistake": self.mistake.value, "basis": self.basis.value, "applied_by": None if self.applied_by is None else self.applied_by.value,
                "scale_loss_calls": self.scale_loss_calls, "custom_train_step": self.custom_train_step,
                "backend": self.backend,
                "first_step": self.first_step, "factor": self.factor, "loss_scale": self.loss_scale,
                "measured": self.measured}


def classify(factor: float, scale: float | None) -> GradScaling:
    """One measured step: the gradients' factor against the loss's own."""
    if scale is None or not scale >= MIN_SCALE or not factor > 0:
        return GradScaling.OTHER
    bits = math.log2(factor)
    if abs(bits - math.log2(scale)) <= TOLERANCE_BITS:
        return GradScaling.SCALED
    if abs(bits) <= TOLERANCE_BITS:
        return GradScaling.UNSCALED
    return GradScaling.OTHER


def loss_scaling_mistake(run) -> LossScalingCheck | None:
    """What the run's `loss_scaling` says (see the module's doc)."""
    entry = run.manifest.get(schema.LOSS_SCALING_KEY)
    if not isinstance(entry, dict):
        return None
    applied_by = next((a for a in AppliedBy if a.value == entry.get("applied_by")), None)
    calls = entry.get("scale_loss_calls")
    measured = [m for m in entry.get("measured") or [] if isinstance(m, list) and len(m) == 3]
    votes = [(m, classify(float(m[1]), m[2])) for m in measured]
    votes = [(m, v) for m, v in votes if v is not GradScaling.OTHER]
    inner = applied_by is AppliedBy.INNER_OPTIMIZER
    if votes:
        scaled = sum(v is GradScaling.SCALED for _, v in votes) * 2 > len(votes)
        basis = Basis.MEASURED
    elif calls is not None:
        # From the code alone: through the LossScaleOptimizer, only a loss
        # never scaled is certain; through the inner optimizer, scale_loss
        # says whether what it applied was scaled.
        if not inner and calls > 0:
            return None
        scaled, basis = calls > 0, Basis.STEP_CODE
    else:
        return None
    if inner:
        mistake = ScalingMistake.SCALED_GRADIENTS_APPLIED if scaled else ScalingMistake.SCALE_UNUSED
    elif scaled:
        return None
    else:
        mistake = ScalingMistake.UNSCALED_TWICE if calls else ScalingMistake.LOSS_NOT_SCALED
    first = votes[0][0] if votes else None
    scaler = run.manifest.get("scaler") or {}
    return LossScalingCheck(
        mistake=mistake, basis=basis, applied_by=applied_by, scale_loss_calls=calls,
        custom_train_step=bool(entry.get("custom_train_step")),
        backend=(run.manifest.get("framework") or {}).get("backend"),
        first_step=int(first[0]) if first else run.manifest.get("first_step"),
        factor=statistics.median(float(m[1]) for m, _ in votes) if votes else None,
        loss_scale=float(first[2]) if first else scaler.get("init_scale"), measured=[list(m) for m, _ in votes])
