"""The run format's tensors (needs torch): how a bundle holds a tensor and
a call's arguments (`recorders/format/tensor_codec.py`), and the recorder's
rules that a replay applies alike to match its rows with the recorded ones:
which tensors a module's inputs or outputs hold, in the order their rows are
numbered (`iter_tensors`), and which of a model's outputs is the loss, the
row named `schema.LOSS_NAME` (`find_loss`). Defined here, the one place both
sides import them (`recorders.stats` and `recorders.loss_tap` re-export them
for the recorder's callers)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .tensor_codec import decode_tree, itemsize, parse_dtype, tensor_from_bytes

__all__ = ["decode_tree", "itemsize", "parse_dtype", "tensor_from_bytes", "iter_tensors", "find_loss"]


def iter_tensors(obj, _depth: int = 0):
    """Yield the tensors inside a module's inputs or outputs: tensors, lists,
    tuples, dicts (HF ModelOutput is an OrderedDict) and dataclasses."""
    if _depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, name, None), _depth + 1)


def find_loss(output):
    """The loss among a model's outputs, or None; the one rule of the
    recorder's tap and of the replay (`amp_postmortem.replay.outputs`).

    A loss is a 0-d floating tensor (a reduced value, never the prediction
    of a batch of one; integers are counts). It is the output itself; a
    mapping's `"loss"` (Hugging Face's `ModelOutput` holds one only when
    labels were given); an object's `.loss` (a dataclass, a namedtuple);
    in a tuple or list, the first element (HF's `return_dict=False` gives
    `(loss, logits, ...)`, MoE models `(loss, aux_loss, logits, ...)`, and
    the Trainer trains on `outputs[0]`), else the only loss among the
    elements (nanoGPT's `(logits, loss)`). None when there is none, or
    several and none first: which one is trained on is not the outputs' to
    say (a replay takes a loss_fn)."""
    if type(output) is torch.Tensor:  # the usual forward hook's case: no attribute or container to look at
        return output if output.dim() == 0 and output.is_floating_point() else None
    if _is_loss(output):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if _is_loss(loss) else None
    loss = getattr(output, "loss", None)
    if _is_loss(loss):
        return loss
    if not isinstance(output, (tuple, list)) or not output:
        return None
    if _is_loss(output[0]):
        return output[0]
    scalars = [t for t in output if _is_loss(t)]
    return scalars[0] if len(scalars) == 1 else None


def _is_loss(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
