"""What a replay bundle is made of, while the recorder holds it.

`ModelInventory` names the model's parameters and buffers once (as
`state_dict()` names them); `StepCapture` holds references to one step's
inputs and output gradients and, when taken, device-side copies of its
weights; `PendingBundle` is a decided capture on its way to the writer
thread; `SnapshotPool` reuses preallocated device buffers for the per-step
copies so that steady state allocates nothing.
"""
from __future__ import annotations

import torch


class ModelInventory:
    """Parameters (tied ones stored once, with aliases) and buffers, named
    without a DataParallel/DDP wrapper's `module.` prefix."""

    def __init__(self, model: torch.nn.Module):
        self.prefix = ""
        inner = model
        if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            inner, self.prefix = model.module, "module."
        self.model_class = f"{type(inner).__module__}.{type(inner).__qualname__}"
        self.params: list[torch.Tensor] = []
        self.param_names: list[str] = []
        self.aliases: dict[str, str] = {}
        self.name_by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            name = self.strip(name)
            if id(p) in self.name_by_id:
                self.aliases[name] = self.name_by_id[id(p)]
                continue
            self.name_by_id[id(p)] = name
            self.params.append(p)
            self.param_names.append(name)
        self.buffers: list[torch.Tensor] = []
        self.buffer_names: list[str] = []
        self.non_persistent: list[str] = []
        seen = set()
        for mname, module in model.named_modules(remove_duplicate=False):
            skip = getattr(module, "_non_persistent_buffers_set", set())
            for bname, b in module._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                full = self.strip(f"{mname}.{bname}" if mname else bname)
                self.buffers.append(b)
                self.buffer_names.append(full)
                if bname in skip:
                    self.non_persistent.append(full)

    def strip(self, name: str) -> str:
        return name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def param_versions(self) -> list[int]:
        return [p._version for p in self.params]

    def buffer_versions(self) -> list[int]:
        return [b._version for b in self.buffers]


class MicroBatch:
    __slots__ = ("args", "kwargs", "input_versions", "rng", "outputs", "grads")

    def __init__(self, args, kwargs, input_versions, rng):
        self.args, self.kwargs = args, kwargs
        self.input_versions = input_versions  # [(tensor, _version at the forward)]
        self.rng = rng                        # {"cpu": ByteTensor, "cuda": [ByteTensor, ...]}
        self.outputs = None                   # floating outputs requiring grad, when known
        self.grads: dict[int, torch.Tensor] = {}  # output index -> scaled gradient


class StepCapture:
    __slots__ = ("step", "micro_batches", "param_versions", "buffer_versions", "opt_steps",
                 "buffers", "params", "params_source", "params_exact", "params_pooled",
                 "autocast", "precision", "optimizer_groups", "explicit", "stepped", "training")

    def __init__(self, step: int):
        self.step = step
        self.micro_batches: list[MicroBatch] = []
        self.params = None
        self.params_source = None
        self.params_exact = False
        self.params_pooled = False
        self.buffers = None
        self.optimizer_groups = None
        self.explicit: list[str] = []
        self.stepped = None
        self.training = True


class PendingBundle:
    __slots__ = ("step", "order", "capture", "params", "buffers", "inputs", "specs", "event", "info")


class SnapshotPool:
    """Preallocated copies of a fixed tensor list, filled with one
    `torch._foreach_copy_` (device work only). At most `max_sets` exist."""

    def __init__(self, tensors, max_sets: int):
        self.src = [t.detach() for t in tensors]
        self.max_sets = max_sets
        self.free: list[list] = []
        self.allocated = 0

    def take(self):
        if self.free:
            snap = self.free.pop()
        elif self.allocated < self.max_sets:
            snap = [torch.empty_like(t) for t in self.src]
            self.allocated += 1
        else:
            return None
        with torch.no_grad():
            torch._foreach_copy_(snap, self.src)
        return snap

    def give(self, snap) -> None:
        self.free.append(snap)

    def forget(self, snap) -> None:
        self.allocated -= 1  # handed to a bundle; a new set is allocated when needed


def clone_now(tensors) -> list[torch.Tensor]:
    """Copies queued on the current stream (no sync)."""
    out = []
    with torch.no_grad():
        for t in tensors:
            t = t.detach()
            try:
                out.append(t.clone())
            except RuntimeError:
                if t.device.type != "cuda":
                    raise
                # Out of device memory: copy to the host asynchronously; the
                # writer waits on the event recorded after the copies.
                out.append(t.to("cpu", non_blocking=True))
    return out
