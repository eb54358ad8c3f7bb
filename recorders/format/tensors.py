"""The run format's tensors (needs torch): how a bundle holds a tensor and
a call's arguments (`recorders/tensor_codec.py`), and the recorder's rules
that a replay applies alike to match its rows with the recorded ones: which
tensors a module's inputs or outputs hold, in the order their rows are
numbered (`iter_tensors`, `recorders/stats.py`), and which of a model's
outputs is the loss, the row named `schema.LOSS_NAME` (`find_loss`,
`recorders/loss_tap.py`)."""
from ..loss_tap import find_loss
from ..stats import iter_tensors
from ..tensor_codec import decode_tree, itemsize, parse_dtype, tensor_from_bytes

__all__ = ["decode_tree", "itemsize", "parse_dtype", "tensor_from_bytes", "iter_tensors", "find_loss"]
