"""How a Keras train step used its `LossScaleOptimizer`: the evidence for
a custom step that never scales its loss, or applies gradients the scale
never left.

Keras 3's `LossScaleOptimizer` (keras/src/optimizers/loss_scale_optimizer.py)
splits the work: `scale_loss(loss)` multiplies the loss by `dynamic_scale`
and the step differentiates that; `apply(grads)` divides every gradient by
the scale, skips the update when one is non-finite and adjusts the scale.
`fit`'s own train step does both. A custom `train_step` must call both, and
the two mistakes are silent: gradients of the unscaled loss handed to
`apply` are divided by the scale anyway (every update `scale` times too
small, float16 gradients unprotected from underflow); gradients of the
scaled loss handed to `optimizer.inner_optimizer.apply` are never divided
(every update `scale` times too large, non-finite steps not skipped).

Two kinds of evidence, gathered by the recorder:
- from the traced step's code (both backends): how many times `scale_loss`
  ran, and which optimizer's `apply` received the gradients;
- measured (TensorFlow backend, compiled step): the factor between the
  gradient of one variable as handed to the optimizer and that variable's
  gradient of the step's own loss, recomputed in the graph
  (`tf.gradients`, pruned to the ops between the loss and the variable: the
  last trainable variable, usually the output layer's bias, so a short
  path). About the loss scale when the loss was scaled, about 1 when not.

`LossScalingLog` keeps both on the host and gives the manifest's
`loss_scaling` (docs/FORMAT.md); the analyzer decides
(`amp_postmortem/analyses/loss_scaling.py`).
"""
from __future__ import annotations

import math

# Measured steps the manifest keeps (the first ones: a step's code does not
# change within a run, and the first steps are where a mistake shows).
MAX_MEASURED = 16

LOSS_SCALE_OPTIMIZER = "loss_scale_optimizer"
INNER_OPTIMIZER = "inner_optimizer"


def grad_loss_ratio(loss, grads, variables):
    """In the TensorFlow graph: the least-squares factor between the
    gradient handed to the optimizer for the last variable that has one and
    that variable's gradient of `loss`; NaN when it cannot be measured
    (another backend, an eager step, a loss not connected to it)."""
    import keras
    from keras import ops
    nan = ops.convert_to_tensor(math.nan, "float32")
    if loss is None or keras.backend.backend() != "tensorflow":
        return nan
    import tensorflow as tf
    if tf.executing_eagerly():
        return nan  # tf.gradients needs a graph (run_eagerly=True)
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if not pairs:
        return nan
    g, v = pairs[-1]
    ref = tf.gradients(loss, [getattr(v, "value", v)])[0]
    if ref is None:
        return nan
    ref = tf.cast(tf.convert_to_tensor(ref), tf.float32)
    g = tf.cast(tf.convert_to_tensor(g), tf.float32)
    den = tf.reduce_sum(ref * ref)
    return tf.where(den > 0, tf.reduce_sum(g * ref) / tf.where(den > 0, den, 1.0), nan)


class LossScalingLog:
    """The host side: the traced step's facts (set at each trace) and the
    first `MAX_MEASURED` steps' measured factors."""

    def __init__(self, *, custom_train_step: bool):
        self.custom_train_step = bool(custom_train_step)
        self.scale_loss_calls: int | None = None
        self.applied_by: str | None = None
        self.measured: list = []

    def traced(self, scale_loss_calls: int, applied_by: str | None) -> None:
        self.scale_loss_calls, self.applied_by = int(scale_loss_calls), applied_by

    def observe(self, step: int, ratio, loss_scale_before) -> None:
        if len(self.measured) >= MAX_MEASURED or ratio is None or not math.isfinite(ratio):
            return
        scale = loss_scale_before if loss_scale_before is not None and math.isfinite(loss_scale_before) else None
        self.measured.append([int(step), float(ratio), scale])

    def entry(self) -> dict:
        return {"custom_train_step": self.custom_train_step, "scale_loss_calls": self.scale_loss_calls,
                "applied_by": self.applied_by, "measured": [list(m) for m in self.measured]}
