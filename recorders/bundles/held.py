"""What a replay bundle is made of, while the recorder holds it.

`ModelInventory` names the model's parameters and buffers once (as
`state_dict()` names them); `StepCapture` holds references to one step's
inputs and output gradients and, when taken, device-side copies of its
weights; `PendingBundle` is a decided capture on its way to the writer
thread; `SnapshotPool` reuses preallocated device buffers for the per-step
copies so that steady state allocates nothing.
"""
from __future__ import annotations

import operator

import torch

from ..layout import (PLAIN_TENSORS, all_module_names, canonical_modules, fsdp1_flat_views, is_flat_param,
                      local_value, shard_placements, unwrap, user_class, version_of)
from ..format.plain import plain

VERSION = operator.attrgetter("_version")  # a tensor's version counter, read in C over many


class ModelInventory:
    """Parameters (tied ones stored once, with aliases) and buffers, named
    as the unwrapped model's `state_dict()` names them (no prefix of a
    compile, DDP, FSDP or checkpoint wrapper)."""

    def __init__(self, model: torch.nn.Module):
        cls = user_class(model)
        # The raw names' prefix of the outermost wrappers (DDP's "module."),
        # for the bundle's record; names below never carry one.
        self.prefix = _raw_prefix(model)
        self.model_class = f"{cls.__module__}.{cls.__qualname__}"
        self.params: list = []  # tensors (a DTensor's local part is read when copied), or FlatViews
        self._plain_params = None  # every one a tensor (param_version_sum's fast path), once known
        self.param_names: list[str] = []
        self.aliases: dict[str, str] = {}
        self.name_by_id: dict[int, str] = {}
        modules = all_module_names(model)
        for name, p in ((f"{m}.{n}" if m else n, p) for m, mod in modules for n, p in mod._parameters.items()):
            if p is None or is_flat_param(p):
                continue
            if id(p) in self.name_by_id:
                self.aliases[name] = self.name_by_id[id(p)]
                continue
            self.name_by_id[id(p)] = name
            self.params.append(p)
            self.param_names.append(name)
        # FSDP1 without use_orig_params: the parameters exist only as slices
        # of the flat parameters (this rank's part of them), and the
        # optimizer holds the flat ones: each one's views (`_views_of`) name
        # its state and its groups' parameters.
        self._views_of: dict[int, list] = {}
        canonical = {m: n for n, m in canonical_modules(model)}
        for name, view in fsdp1_flat_views(model, canonical):
            self.name_by_id[id(view)] = name
            self.params.append(view)
            self.param_names.append(name)
            self._views_of.setdefault(id(view.flat), []).append((name, view))
            for alias in view.aliases:
                self.aliases[alias] = name
        # name -> where this rank's part sits in the whole (sharded only)
        by_id = shard_placements(model, self.params)
        self.placements: dict[str, dict] = {n: by_id[id(p)] for n, p in zip(self.param_names, self.params)
                                            if id(p) in by_id}
        self.buffers: list[torch.Tensor] = []
        self.buffer_names: list[str] = []
        self.non_persistent: list[str] = []
        seen = set()
        for mname, module in modules:
            skip = getattr(module, "_non_persistent_buffers_set", set())
            for bname, b in module._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                full = f"{mname}.{bname}" if mname else bname
                self.buffers.append(b)
                self.buffer_names.append(full)
                if bname in skip:
                    self.non_persistent.append(full)

    def param_names_of(self, params) -> list[str]:
        """The names of an optimizer group's parameters (a flat parameter's:
        those of the parameters it holds here)."""
        out = []
        for p in params:
            views = self._views_of.get(id(p))
            out += [n for n, _ in views] if views is not None else [self.name_by_id.get(id(p), "?")]
        return out

    def optimizer_state(self, opt) -> tuple[list, list, list]:
        """The optimizer's state as ([(param name, key, tensor index or
        {"value": plain value})], [tensors], [placement or None per tensor]):
        a state tensor of its parameter's local shape has the parameter's
        placement (Adam's moments, momentum), another (a scalar `step`) none;
        a flat parameter's state is cut into its parameters' slices. The
        tensors are references (a DTensor's local part, detached)."""
        entries, tensors, placements = [], [], []
        state = getattr(opt, "state", None) if opt is not None else None
        if not state:
            return entries, tensors, placements
        for group in opt.param_groups:
            for p in group["params"]:
                views = self._views_of.get(id(p))
                for key, value in (state.get(p) or {}).items():
                    if not isinstance(value, torch.Tensor):
                        for name in ([n for n, _ in views] if views is not None else [self.name_by_id.get(id(p), "?")]):
                            entries.append((name, str(key), {"value": plain(value, keep_nonfinite=True)}))
                        continue
                    value = local_value(value)
                    like_param = value.shape == local_value(p).shape
                    if views is not None and like_param and value.dim() == 1:
                        for name, view in views:
                            entries.append((name, str(key), len(tensors)))
                            tensors.append(value.narrow(0, view.offset, view.numel))
                            placements.append(self.placements.get(name))
                        continue
                    names = [n for n, _ in views] if views is not None else [self.name_by_id.get(id(p), "?")]
                    entries += [(name, str(key), len(tensors)) for name in names]
                    tensors.append(value)
                    placements.append(self.placements.get(names[0]) if views is None and like_param else None)
        return entries, tensors, placements

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def param_version_sum(self) -> int:
        """The sum of the parameters' version counters: a counter never
        goes down and every in-place write raises one, so the sum is equal
        exactly when no parameter was written. One number, not a list of
        them: a list of 288 is a large allocation, and the first one after
        a forward's or backward's small frees sets off glibc's
        consolidation of its bins (~60 us of the launch-bound proxy's step,
        a point of its ratio in `sentinel_cost.py`; the sum allocates
        nothing)."""
        if self._plain_params is None:
            self._plain_params = all(isinstance(p, torch.Tensor) for p in self.params)
        if self._plain_params:
            return sum(map(VERSION, self.params))  # in C: read every step
        return sum(version_of(p) for p in self.params)

    def buffer_versions(self) -> list[int]:
        return list(map(VERSION, self.buffers))


def _raw_prefix(model) -> str:
    inner = unwrap(model)
    for name, m in model.named_modules():
        if m is inner:
            return f"{name}." if name else ""
    return ""


def rng_state() -> dict:
    """The RNG states a step's forward starts from: the CPU's and, once CUDA
    is initialised, every device's (host-side generator state: no sync)."""
    rng = {"cpu": torch.default_generator.get_state()}  # `torch.get_rng_state()` without its frame
    if torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def set_rng_state(rng: dict) -> None:
    """Put back what `rng_state` took."""
    if rng.get("cpu") is not None:
        torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(rng["cuda"])


class MicroBatch:
    __slots__ = ("args", "kwargs", "input_versions", "rng", "outputs", "grads")

    def __init__(self, args, kwargs, input_versions, rng):
        # args, kwargs; [(tensor, _version at the forward)]; {"cpu": ByteTensor, "cuda": [ByteTensor, ...]}
        self.args, self.kwargs, self.input_versions, self.rng = args, kwargs, input_versions, rng
        # floating outputs requiring grad, when known; output index -> scaled gradient
        self.outputs, self.grads = None, {}


class StepCapture:
    """What is held of one step. What most steps leave as it is comes from
    the class (one is made every step: each line counts on the training path)."""

    params = None
    params_source = None
    params_exact = False
    clean = False  # host facts showed no event: the first to give up when too many are held
    grads_released = False  # its output gradients let go at its close (clean, not asked for)
    params_pooled = False
    buffers = None
    optimizer_groups = None
    stepped = None
    training = True
    precision = None
    autocast = None
    param_version_sum = None
    versions_skipped = False  # not read at a clean backward's end (`BundleCapture._take_versions`): never judged exact
    buffer_versions = None
    opt_steps = 0

    def __init__(self, step: int):
        self.step = step
        self.micro_batches: list[MicroBatch] = []
        self.explicit: list[str] = []


class PendingBundle:
    __slots__ = ("step", "order", "capture", "params", "buffers", "inputs", "specs", "event", "info",
                 "optimizer_state")


class SnapshotPool:
    """Preallocated copies of a fixed tensor list, filled with one
    `torch._foreach_copy_` (device work only). At most `max_sets` exist."""

    def __init__(self, tensors, max_sets: int):
        self.tensors = list(tensors)
        self.max_sets = max_sets
        self.free: list[list] = []
        self.allocated = 0
        # Plain tensors are copied from as they are (the copy runs under
        # no_grad): no detach per tensor and step (a BatchNorm CNN's
        # buffers are copied at every step's forward).
        self._plain = all(type(t) in PLAIN_TENSORS for t in self.tensors)

    def take(self):
        # Else local parts read at each copy (a DTensor's local tensor can be
        # replaced by FSDP2's lazy initialisation); an empty shard copies nothing.
        src = self.tensors if self._plain else [local_value(t) for t in self.tensors]
        if self.free:
            snap = self.free.pop()
        elif self.allocated < self.max_sets:
            snap = [torch.empty_like(t) for t in src]
            self.allocated += 1
        else:
            return None
        with torch.no_grad():
            torch._foreach_copy_(snap, src)
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
            t = local_value(t)
            try:
                out.append(t.clone())
            except RuntimeError:
                if t.device.type != "cuda":
                    raise
                # Out of device memory: copy to the host asynchronously; the
                # writer waits on the event recorded after the copies.
                out.append(t.to("cpu", non_blocking=True))
    return out
