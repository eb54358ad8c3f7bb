"""How a job wraps and shards the user's model: canonical names, the user's
class, local shards.

Wrappers (`torch.compile`'s OptimizedModule, DDP/DataParallel, FSDP1,
activation-checkpoint wrappers) are recognised by type and descended into
without adding a name component, so the names the recorder writes are the
ones the user's own model gives (`blocks.0.attn`), whatever wraps it. Names
are never stripped as strings: a user's child may well be called `module`.

Sharded tensors are recorded as this rank's local shard: a DTensor (FSDP2,
tensor parallel) is read through `to_local()`, an FSDP1 `use_orig_params`
parameter already is a view of the local shard, and an FSDP1 parameter
without `use_orig_params` is read as its slice of the local FlatParameter
(`FlatView`). Nothing here issues a collective.
"""
from __future__ import annotations

import sys

import torch

# (module holding the class, class name, attribute holding the wrapped module)
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
     "_checkpoint_wrapped_module"),
)


def _wrapper_attr(module: torch.nn.Module) -> str | None:
    """The attribute holding the wrapped module when `module` is a pure
    wrapper, else None. Only modules already imported are looked at: an
    instance of a wrapper implies its module was imported."""
    for mod_name, cls_name, attr in _WRAPPERS:
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is not None and isinstance(module, cls):
            return attr
    return None


def wrapper_chain(module: torch.nn.Module):
    """The module, then the module each pure wrapper wraps, outermost first
    (a cycle of wrappers ends the chain)."""
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        yield module
        attr = _wrapper_attr(module)
        inner = getattr(module, attr, None) if attr else None
        if not isinstance(inner, torch.nn.Module):
            return
        module = inner


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under a chain of pure wrappers."""
    for module in wrapper_chain(module):
        pass
    return module


def canonical_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module, as the unwrapped model names them,
    in `named_modules()` order; each module once (its first name), and
    never a wrapper (its output is the wrapped module's: it would only
    duplicate rows)."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    todo = [("", model)]
    while todo:
        prefix, m = todo.pop()
        m = unwrap(m)
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append((prefix, m))
        children = [(f"{prefix}.{n}" if prefix else n, c) for n, c in m._modules.items() if c is not None]
        todo.extend(reversed(children))
    return out


def all_module_names(model) -> list[tuple[str, torch.nn.Module]]:
    """Every (name, module) of the unwrapped model, a module shared by two
    parents under each name (as `named_modules(remove_duplicate=False)`):
    tied parameters get their aliases."""
    out = []
    unique = canonical_modules(model)
    canon = {id(m): n for n, m in unique}
    for name, m in unique:
        out.append((name, m))
        for child_name, child in m._modules.items():
            if child is None:
                continue
            inner = unwrap(child)
            full = f"{name}.{child_name}" if name else child_name
            if canon.get(id(inner)) != full:
                # a module reached under a second name: its subtree again
                out.extend((f"{full}{'.' + n if n else ''}", sub) for n, sub in canonical_modules(inner))
    return out


def canonical_parameters(modules: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the modules' own parameters, each once; FSDP1's
    FlatParameter (a container of the real parameters' shards, which stay
    registered under their own names with `use_orig_params=True`, and are
    read from it as `FlatView`s without) is left out."""
    out = []
    seen: set[int] = set()
    for mname, m in modules:
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen or is_flat_param(p):
                continue
            seen.add(id(p))
            out.append((f"{mname}.{pname}" if mname else pname, p))
    return out


def is_flat_param(p) -> bool:
    """FSDP1's FlatParameter: its class makes plain `Parameter`s marked
    `_is_flat_param` (its metaclass answers isinstance), so the type's
    name does not tell it."""
    return bool(getattr(p, "_is_flat_param", False)) or type(p).__name__ == "FlatParameter"


def user_class(model: torch.nn.Module) -> type:
    """The class the user wrote: wrappers unwrapped, and FSDP2's
    `FSDP<cls>` (a subclass of FSDPModule and cls) taken back to cls."""
    cls = type(unwrap(model))
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    fsdp_module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if fsdp_module is not None and issubclass(cls, fsdp_module):
        for base in cls.__mro__:
            if not issubclass(base, fsdp_module):
                return base
    return cls


def is_compiled(model: torch.nn.Module) -> bool:
    """The model (or a wrapper around it) is an OptimizedModule, or the
    user called `module.compile()` on it."""
    mod = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(mod, "OptimizedModule", None) if mod is not None else None
    return any(getattr(m, "_compiled_call_impl", None) is not None
               or (optimized is not None and isinstance(m, optimized)) for m in wrapper_chain(model))


# ------------------------------------------------------------------ shards
def is_dtensor(t) -> bool:
    # Duck-typed so that plain jobs never import torch.distributed.tensor.
    return isinstance(t, torch.Tensor) and hasattr(t, "to_local") and hasattr(t, "placements")


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def local(t):
    """This rank's local part of `t` (a DTensor's local shard), else `t`."""
    if type(t) in PLAIN_TENSORS:  # the usual case, several hundred times a step
        return t
    return t.to_local() if is_dtensor(t) else t


def fsdp1_sharded_params(model: torch.nn.Module, sharded_only: bool = True) -> set[int]:
    """ids of the parameters that FSDP1 (`use_orig_params=True`) shards
    across ranks: views of each rank's part of a FlatParameter (with
    `sharded_only=False`, every parameter FSDP1 manages)."""
    mod = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp = getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None
    if fsdp is None:
        return set()
    out: set[int] = set()
    for m in model.modules():
        if not isinstance(m, fsdp):
            continue
        handle = getattr(m, "_handle", None)
        if handle is None or (sharded_only and not getattr(handle, "uses_sharded_strategy", False)):
            continue
        for p in getattr(handle.flat_param, "_params", None) or ():
            out.add(id(p))
    return out


def fsdp1_shapes(model: torch.nn.Module) -> dict[int, list[int]]:
    """The unsharded shape of each FSDP1 `use_orig_params` parameter (its
    own `.shape` is that of its local, flattened part)."""
    mod = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp = getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None
    out: dict[int, list[int]] = {}
    if fsdp is None:
        return out
    for m in model.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, fsdp) else None
        flat = getattr(handle, "flat_param", None)
        params = getattr(flat, "_params", None)
        if not params:
            continue
        for p, shape in zip(params, flat._shapes):
            out[id(p)] = list(shape)
    return out


def sharded_param_ids(model: torch.nn.Module, params) -> set[int]:
    """ids of the parameters whose gradients are sharded across ranks."""
    out = fsdp1_sharded_params(model)
    for _, p in params:
        if is_dtensor(p) and any(pl.is_shard() for pl in p.placements):
            out.add(id(p))
    return out


class FlatView:
    """One original parameter of an FSDP1 FlatParameter built without
    `use_orig_params`: the parameter itself is no longer registered (its
    module holds a plain tensor attribute, only while unsharded), so its
    rows are read from this rank's part of the flat parameter and of its
    gradient, `flat[offset : offset + numel]` (FSDP's `_ShardParamInfo`),
    a 1-D view that copies nothing. `shape` is the unsharded shape;
    `sharded`: the flat parameter is sharded across ranks."""

    __slots__ = ("flat", "offset", "numel", "shape", "sharded", "aliases", "intra_start", "__weakref__")

    def __init__(self, flat, offset: int, numel: int, shape: list[int], sharded: bool, aliases=(),
                 intra_start: int = 0):
        self.flat, self.offset, self.numel, self.shape, self.sharded = flat, offset, numel, shape, sharded
        self.aliases = list(aliases)  # a tied parameter's other names
        # where this part starts in the flattened parameter (`_ShardParamInfo.intra_param_start_idx`)
        self.intra_start = int(intra_start)

    @property
    def dtype(self):
        return self.flat.dtype

    @property
    def device(self):
        return self.flat.device

    @property
    def requires_grad(self) -> bool:
        return bool(self.flat.requires_grad)

    def _slice(self, t):
        # The offsets index the local shard (`_sharded_size`, padding
        # included): a flat tensor of another size is an unsharded one (the
        # gradient accumulated under `no_sync()`), whose offsets differ.
        size = getattr(self.flat, "_sharded_size", None)
        if t is None or t.dim() != 1 or (t.shape != size if size is not None
                                         else t.numel() < self.offset + self.numel):
            return None
        return t.detach().narrow(0, self.offset, self.numel)

    def grad(self):
        """This rank's part of the parameter's gradient, or None (no
        gradient, or one not reduce-scattered: under `no_sync()`)."""
        return self._slice(self.flat.grad)

    def value(self):
        """This rank's part of the parameter's values (`_local_shard`, also
        while the flat parameter is unsharded; before FSDP's lazy
        initialisation the flat parameter itself holds the shard)."""
        data = getattr(self.flat, "_local_shard", None) if self.sharded else None
        return self._slice(self.flat if data is None else data)


def fsdp1_flat_views(model: torch.nn.Module, module_names: dict) -> list[tuple[str, FlatView]]:
    """(name, view) of every original parameter that this rank's part of
    an FSDP1 FlatParameter without `use_orig_params` holds (a parameter
    wholly on other ranks has none here, as FSDP1 gives such a parameter
    no gradient with `use_orig_params=True`). Names as the unwrapped
    model gives them: the owning module's canonical name (`module_names`:
    module -> name) and the parameter's own; shared (tied) parameters are
    stored once, under their first name."""
    mod = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp = getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None
    out: list[tuple[str, FlatView]] = []
    if fsdp is None:
        return out
    for m in model.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, fsdp) else None
        flat = getattr(handle, "flat_param", None)
        if flat is None or getattr(flat, "_params", None) is not None:
            continue  # use_orig_params: the parameters themselves are recorded
        sharded = bool(getattr(handle, "uses_sharded_strategy", False))

        def full_name(module, module_name, param_name):
            owner = module_names.get(module, module_name)
            return f"{owner}.{param_name}" if owner else param_name
        aliases: dict = {}
        for info in getattr(flat, "_shared_param_infos", None) or ():
            aliases.setdefault((id(info.prim_module), info.prim_param_name), []).append(
                full_name(info.module, info.module_name, info.param_name))
        for info, shape, shard in zip(flat._param_infos, flat._shapes, flat._shard_param_infos):
            if not shard.in_shard or shard.numel_in_shard is None:
                continue
            name = full_name(info.module, info.module_name, info.param_name)
            out.append((name, FlatView(flat, shard.offset_in_shard, shard.numel_in_shard, list(shape), sharded,
                                       aliases.get((id(info.module), info.param_name), ()),
                                       shard.intra_param_start_idx or 0)))
    return out


# ------------------------------------------------------------ placements
def local_value(t):
    """The values this rank holds of a parameter, a plain tensor: a
    DTensor's local shard (`_foreach_copy_` and `clone` of a DTensor would
    need a sharding strategy), a `FlatView`'s slice of the local
    FlatParameter, else the tensor itself; detached. Read again at every
    snapshot: FSDP2's lazy initialisation may give a DTensor a new local
    tensor after the recorder was built."""
    if isinstance(t, FlatView):
        v = t.value()
        return v if v is not None else t.flat.detach().new_empty((0,))
    return local(t.detach())


def version_of(t) -> int:
    """The version counter of what `local_value` reads (a FlatView's: its
    flat parameter's, which every in-place update of it bumps)."""
    return t.flat._version if isinstance(t, FlatView) else t._version


def _placement_name(p) -> str:
    if p.is_shard():
        return f"Shard({p.dim})"
    return "Replicate()" if p.is_replicate() else type(p).__name__


def shard_placements(model: torch.nn.Module, params) -> dict[int, dict]:
    """How this rank's part of each sharded parameter sits in the whole,
    by `id(param)` (of a `FlatView` for FSDP1 without `use_orig_params`),
    for the bundle's `params.placements` (docs/FORMAT.md): a DTensor's
    `{"kind": "dtensor", "global_shape", "global_offset", "placements",
    "mesh_shape"}` (its local tensor's shape is its row's), an FSDP1
    parameter's `{"kind": "flat", "global_shape", "flat_offset", "numel"}`
    (its values are the flattened parameter's `[flat_offset : flat_offset
    + numel]`). Computed from local metadata: no collective."""
    out: dict[int, dict] = {}
    for p in params:
        if isinstance(p, FlatView):  # stored 1-D, sharded or not: placed like a shard
            out[id(p)] = {"kind": "flat", "global_shape": list(p.shape), "flat_offset": p.intra_start,
                          "numel": int(p.numel)}
            continue
        if is_dtensor(p) and any(pl.is_shard() for pl in p.placements):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[id(p)] = {"kind": "dtensor", "global_shape": list(p.shape), "global_offset": [int(o) for o in offset],
                          "placements": [_placement_name(pl) for pl in p.placements],
                          "mesh_shape": list(p.device_mesh.shape)}
    mod = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp = getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None
    if fsdp is None:
        return out
    wanted = {id(p) for p in params}
    for m in model.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, fsdp) else None
        flat = getattr(handle, "flat_param", None)
        if not getattr(flat, "_params", None) or not getattr(handle, "uses_sharded_strategy", False):
            continue
        for p, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            if id(p) in wanted:
                # use_orig_params: the parameter is a 1-D view of its part
                # of the local shard (empty when it lies on other ranks).
                start = info.intra_param_start_idx if info.in_shard else 0
                out[id(p)] = {"kind": "flat", "global_shape": list(shape), "flat_offset": int(start or 0),
                              "numel": int(info.numel_in_shard or 0) if info.in_shard else 0}
    return out


def is_distributed_wrapper(model: torch.nn.Module) -> bool:
    """A DDP, DataParallel or FSDP wrapper anywhere in the model's chain, or
    an FSDP2 module (`fully_shard`): its forward or backward takes part in
    collectives (or scatters over devices)."""
    for m in wrapper_chain(model):
        attr = _wrapper_attr(m)
        if attr is not None and attr != "_orig_mod" and attr != "_checkpoint_wrapped_module":
            return True
    fsdp2 = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    cls = getattr(fsdp2, "FSDPModule", None) if fsdp2 is not None else None
    return cls is not None and any(isinstance(m, cls) for m in unwrap(model).modules())
