"""The run format, defined once in code: what the recorder writes and
`amp_postmortem` reads, in one place both sides import. The recorder's
modules import the format from here, and the analyzer imports `recorders`
only through this package (beside the package's public API): never the
recorder's internals (`tests/test_api.py`). It imports nothing of the
recorder: it is the bottom layer of `recorders`.

Torch-free, here:

- `schema` (`recorders/format/schema.py`): the tables' columns and Arrow
  types, the file and directory names, the format version, the reserved row
  names (`LOSS_NAME`), the recorded limits (docs/FORMAT.md in prose);
- `plain` and `json_checksum` (`recorders/format/plain.py`): a value made
  JSON-plain as the recorder writes it, and the checksum that bundles and
  windows carry.

In its own module, so that reading a value's JSON form loads no filesystem
layer, `recorders.format.locations`: where a run is (`is_uri`, `local_path`,
`open_filesystem`, `spool_dir_for`, and `is_spool`: a recorder's local
spool is no run).

Needing torch, `recorders.format.tensors`: the tensor codec
(`recorders/format/tensor_codec.py`), which tensors of a module's values the
record holds and in what order (`iter_tensors`), and which output is the
loss (`find_loss`). Needing a framework, `recorders.format.keras_names` and
`recorders.format.flax_names`: how those recorders name layers and
variables.

The old paths `recorders.schema`, `recorders.plain` and
`recorders.tensor_codec` stay importable, as the same module objects, for
code outside the package.
"""
from . import schema
from .plain import json_checksum, plain

__all__ = ["schema", "plain", "json_checksum"]
