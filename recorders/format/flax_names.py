"""How the Flax recorder names what it records (needs JAX and Flax): a
module call's run name (`module_name`) and the parameters by name
(`named_params`), which the Flax replay uses alike to load a bundle's
variables and match its calls with the recorded rows
(`recorders/flax_recorder.py`)."""
from ..flax_recorder import module_name, named_params

__all__ = ["module_name", "named_params"]
