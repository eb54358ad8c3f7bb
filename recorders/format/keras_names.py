"""How the Keras recorder names what it records (needs Keras): a layer's
and a variable's run name (`keras_name`, `layer_name`) and the layers it
walks (`layers_of`), which the Keras replay walks alike to match its calls
with the recorded rows (`recorders/keras_recorder.py`)."""
from ..keras_recorder import keras_name, layer_name, layers_of

__all__ = ["keras_name", "layer_name", "layers_of"]
