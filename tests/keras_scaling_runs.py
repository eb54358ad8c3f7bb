"""Custom Keras train steps with a LossScaleOptimizer, right and wrong, made
in a process of their own (`KERAS_BACKEND=tensorflow|jax python
tests/keras_scaling_runs.py OUT_DIR`). Each run is a tiny `mixed_float16`
model with its own `train_step`, as Keras' guides to customizing `fit`
write them, trained 4 steps with `fit` and recorded by `KerasRecorder`:

- `correct`: `scale_loss` inside the step, gradients of the scaled loss to
  `optimizer.apply` (which unscales);
- `noscale`: the guide's step as written, the loss never scaled: the
  gradients of the unscaled loss go to `optimizer.apply`;
- TensorFlow only: `inner`: the scaled loss's gradients applied by
  `optimizer.inner_optimizer.apply` (never unscaled); `twice`: the
  gradients divided by the scale by hand before `optimizer.apply`
  (unscaled twice).
"""
from __future__ import annotations

import sys

import keras
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from recorders.keras_recorder import KerasRecorder  # noqa: E402

BATCH = 8


class TFStep(keras.Model):
    """A custom `train_step` on the TensorFlow backend (tf.GradientTape)."""

    def __init__(self, mistake: str):
        super().__init__(name="net")
        self.mistake = mistake
        self.d1 = keras.layers.Dense(8, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(1, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))

    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        opt = self.optimizer
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            if self.mistake != "noscale":
                scaled = opt.scale_loss(loss)
        grads = tape.gradient(loss if self.mistake == "noscale" else scaled, self.trainable_variables)
        if self.mistake == "inner":
            opt.inner_optimizer.apply(grads, self.trainable_variables)
        elif self.mistake == "twice":
            scale = tf.cast(scaled, tf.float32) / tf.cast(loss, tf.float32)  # the scale the step used
            opt.apply([g / scale for g in grads], self.trainable_variables)
        else:
            opt.apply(grads, self.trainable_variables)
        return {"loss": loss}


class JaxStep(keras.Model):
    """A custom `train_step` on the JAX backend (stateless, jax.value_and_grad)."""

    def __init__(self, mistake: str):
        super().__init__(name="net")
        self.mistake = mistake
        self.d1 = keras.layers.Dense(8, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(1, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, optimizer_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        if self.mistake == "noscale":
            return loss, (loss, non_trainable_variables)
        # As Keras' own JAX step: the scale read from the step's optimizer state.
        mapping = list(zip(self.optimizer.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping):
            scaled = self.optimizer.scale_loss(loss)
        return scaled, (loss, non_trainable_variables)

    def train_step(self, state, data):
        import jax
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, (loss, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, optimizer_variables, x, y)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        return {"loss": loss}, (trainable_variables, non_trainable_variables, optimizer_variables,
                                metrics_variables)


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * BATCH, 4)).astype("float32")
    y = rng.standard_normal((4 * BATCH, 1)).astype("float32")
    tf_backend = keras.backend.backend() == "tensorflow"
    for mistake in ("correct", "noscale", "inner", "twice") if tf_backend else ("correct", "noscale"):
        keras.utils.set_random_seed(0)
        net = (TFStep if tf_backend else JaxStep)(mistake)
        net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-2)), loss="mse")
        with KerasRecorder(f"{out}/{mistake}", net) as rec:
            net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])


if __name__ == "__main__":
    main(sys.argv[1])
