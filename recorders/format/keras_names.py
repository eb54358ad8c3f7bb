"""How the Keras recorder names what it records (needs Keras): a layer's
and a variable's run name (`keras_name`, `layer_name`) and the layers it
walks (`layers_of`), which the Keras replay walks alike to match its calls
with the recorded rows. Defined here, the one place the recorder
(`recorders/keras_recorder.py`) and the replay import them."""
from __future__ import annotations

import keras

__all__ = ["keras_name", "layer_name", "layers_of"]


def keras_name(path: str, root: str) -> str:
    """A Keras path as a PyTorch-style qualified name: `block/dense/kernel`
    -> `block.dense.kernel`, without the model's own name in front."""
    if path.startswith(root + "/"):
        path = path[len(root) + 1:]
    return path.replace("/", ".")


def layers_of(model) -> list:
    """The model's sublayers, nested ones included, without input layers
    (they compute nothing)."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if not isinstance(layer, keras.layers.InputLayer)]


def layer_name(layer, root: str) -> str:
    return keras_name(getattr(layer, "path", None) or layer.name, root)
