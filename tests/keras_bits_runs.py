"""Whether the Keras recorder changes a job's numbers: the same classifier
trained plain and recorded, in a process of its own (`KERAS_BACKEND=...
python tests/keras_bits_runs.py OUT.json`). Prints nothing; writes, per
model, each step's own loss and the final weights' bytes (hex digests) of
the plain and the recorded run.

The models end in what Keras' crossentropy losses look through: a softmax
(or sigmoid) output's logits, which the losses differentiate instead of
the probabilities on TensorFlow (`_keras_logits`, or the op's type for a
`tf.nn.softmax` in a layer's own code). A tap that hid them trained the
recorded job by another formula. The first batch holds a row whose true
class the model rates below float32's smallest probability (a logit 200
below the others): from the logits its loss is ~200, from the clipped
probabilities 16.1 (-log 1e-7), whatever the kernels.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np
from keras import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recorders.keras_recorder import KerasRecorder  # noqa: E402

BATCH, WIDTH, CLASSES, STEPS = 8, 16, 4, 6


class RawSoftmax(keras.layers.Layer):
    """A softmax written in the layer's own code with the backend's op
    (`tf.nn.softmax` on TensorFlow: no `_keras_logits`, found by op type)."""

    def call(self, x):
        x = ops.cast(x, "float32")
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf
            return tf.nn.softmax(x)
        return ops.softmax(x)


def build(head: str) -> keras.Model:
    inp = keras.Input((WIDTH,))
    h = keras.layers.Dense(WIDTH, activation="relu", name="d1")(inp)
    logits = keras.layers.Dense(CLASSES, name="logits")(h)
    if head == "softmax_layer":
        out = keras.layers.Activation("softmax", dtype="float32", name="probs")(logits)
    elif head == "raw_softmax":
        out = RawSoftmax(dtype="float32", name="probs")(logits)
    else:  # "sigmoid": a binary crossentropy over independent classes
        out = keras.layers.Dense(CLASSES, activation="sigmoid", dtype="float32", name="probs")(h)
    return keras.Model(inp, out, name="net")


def data(head: str):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, WIDTH)).astype("float32")
    if head == "sigmoid":
        y = rng.integers(0, 2, (STEPS * BATCH, CLASSES)).astype("float32")
    else:
        y = rng.integers(0, CLASSES, STEPS * BATCH).astype("int32")
    return x, y


def plant(net, head: str, x, y) -> None:
    """Row 0 of the first batch: its true class's logit 200 below the
    others (0 for the sigmoid's), so its probability is 0 in float32."""
    d1 = net.get_layer("d1")
    out = net.get_layer("probs" if head == "sigmoid" else "logits")
    x[0] = 0.0
    x[0, 0] = 1.0
    k1, b1 = d1.get_weights()
    k1[0] = 0.0
    k1[0, 0] = 1.0   # h[0] = relu(1) = 1 at row 0, the other units 0
    k2, b2 = out.get_weights()
    k2[0] = 0.0
    b2[:] = 0.0
    if head == "sigmoid":
        k2[0] = -200.0   # every class's logit -200; its label 1
        y[0] = 1.0
    else:
        k2[0, int(y[0])] = -200.0
    d1.set_weights([k1, b1])
    out.set_weights([k2, b2])


class Losses(keras.callbacks.Callback):
    """Keras' running mean of the epoch's losses after each step (the
    first: the first step's own loss)."""

    def __init__(self):
        super().__init__()
        self.means = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(ops.convert_to_numpy(logs["loss"])))


def train(head: str, recorded: bool, template, run_dir) -> dict:
    net = build(head)
    net.set_weights(template)
    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
                loss="binary_crossentropy" if head == "sigmoid" else "sparse_categorical_crossentropy")
    x, y = data(head)
    plant(net, head, x, y)
    losses = Losses()
    callbacks = [losses]
    rec = None
    if recorded:
        rec = KerasRecorder(run_dir, net, full_every=2)
        callbacks = [rec, losses]
    net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    if rec is not None:
        rec.close()
    means = losses.means
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in net.get_weights())).hexdigest()
    return {"running_mean": means, "first_loss": means[0], "weights": digest}


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    result = {"backend": keras.backend.backend()}
    with tempfile.TemporaryDirectory() as tmp:
        for head in ("softmax_layer", "raw_softmax", "sigmoid"):
            keras.utils.set_random_seed(0)
            template = build(head).get_weights()
            result[head] = {"plain": train(head, False, template, None),
                            "recorded": train(head, True, template, Path(tmp) / head)}
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
