"""Keras runs whose dtype policies disagree, and one whose do not, made in
a process of their own (`KERAS_BACKEND=jax python tests/keras_policy_runs.py
OUT_DIR`), each a tiny model trained for two steps with `model.fit` under
the global `mixed_float16` policy and recorded by `KerasRecorder`:

- `disagree`: `d1` built with `dtype="float16"` (its variables held in
  float16), `bf` with `dtype="mixed_bfloat16"` (computes in bfloat16 inside
  a float16 model), `d2` under the global policy;
- `agree`: every layer under the global policy but the last, kept in
  float32 on purpose (Keras' advice for a final softmax).
"""
from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recorders.keras_recorder import KerasRecorder  # noqa: E402


def model(first: dict, middle: dict, last: dict) -> keras.Model:
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1", **first)(inp)
    h = keras.layers.Dense(8, name="bf", **middle)(h)
    out = keras.layers.Dense(1, name="d2", **last)(h)
    return keras.Model(inp, out, name="net")


def train(run_dir, net) -> None:
    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    x = np.random.default_rng(0).standard_normal((16, 4)).astype("float32") * 0.1
    with KerasRecorder(run_dir, net) as rec:
        net.fit(x, np.zeros((16, 1), "float32"), batch_size=8, verbose=0, callbacks=[rec])


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    train(f"{out}/disagree", model({"dtype": "float16"}, {"dtype": "mixed_bfloat16"}, {}))
    train(f"{out}/agree", model({}, {}, {"dtype": "float32"}))


if __name__ == "__main__":
    main(sys.argv[1])
