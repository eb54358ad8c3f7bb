"""The run format as the analyzer reads it: what the recorder writes and
`amp_postmortem` needs to read it, in one place. The analyzer imports
`recorders` only through this package (beside the package's public API):
never the recorder's internals (`tests/test_api.py`).

The definitions stay where the recorder imports them, and this package
names them. Torch-free, here:

- `schema`: the tables' columns and Arrow types, the file and directory
  names, the format version, the reserved row names (`LOSS_NAME`), the
  recorded limits (`recorders/schema.py`; docs/FORMAT.md in prose);
- `plain`: a value made JSON-plain as the recorder writes it, and
  `json_checksum`, the checksum that bundles and windows carry
  (`recorders/plain.py`).

In its own module, so that reading a value's JSON form loads no filesystem
layer, `recorders.format.locations`: where a run is (`is_uri`, `local_path`,
`open_filesystem`, and `is_spool`: a recorder's local spool is no run).

Needing torch, `recorders.format.tensors`: the tensor codec, which tensors
of a module's values the record holds and in what order, and which output is
the loss. Needing a framework, `recorders.format.keras_names` and
`recorders.format.flax_names`: how those recorders name layers and variables.
"""
from .. import schema
from ..plain import json_checksum, plain

__all__ = ["schema", "plain", "json_checksum"]
