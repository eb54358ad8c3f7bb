"""The autocast policy of the device that recorded a run, and a way to follow it
on any machine.

A replay often runs on a CPU, but CPU autocast is not CUDA autocast: under CUDA
autocast softmax, layer_norm, exp, sum and the losses run in float32, under CPU
autocast they stay in the low precision type. So a CUDA-recorded step is
replayed under the emulation of the CUDA policy, which casts inputs the way
CUDA autocast would, above autograd, so the backward pass runs in the same
dtypes as on the recording device.

    policy = get_policy("cuda", "fp16")
    with autocast_context(policy, run_device_type="cpu"):
        loss = model(batch)          # linear in float16, softmax in float32
    loss.backward()

Limits of the emulation, all because it sees Python-level calls only:
- A C++ composite op that is not in the tables runs uncast, although on the
  device its inner ops would be autocast. The common ones are mapped
  (`_CUDA_COMPOSITES`, `OP_ALIASES`); not mapped: RNN layers and F.pad under a
  CPU policy, and RNN layers under a CUDA bfloat16 policy.
- Tables hold op names, not overloads. The one difference that matters: CPU
  autocast lists only the 12-argument (deprecated) torch._convolution.
- A nested `torch.autocast(...)` on the policy's or the replay's device type
  switches the emulation on or off, keeping the policy's dtype. On a machine
  without CUDA, torch turns any `torch.autocast("cuda", ...)` into a disabled
  region, so a model that re-enables CUDA autocast inside a disabled region
  stays disabled there.
- Ops that bypass torch functions (the backward pass's own) see native
  autocast of the replay device while the block runs: see emulate_autocast.
- Every tensor counts as living on the policy's device; a CPU tensor inside a
  CUDA run (which CUDA autocast would leave alone) is cast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from typing import Any, Iterable, Iterator, Literal

import torch
from torch.overrides import TorchFunctionMode

from ..errors import PostmortemError
from .policy_tables import OP_ALIASES, OP_TABLES
# The tables' public names, re-exported: callers read them from here.
from .policy_tables import REGISTERED_OPS, TABLES_TORCH_VERSION

__all__ = ["AutocastPolicy", "REGISTERED_OPS", "TABLES_TORCH_VERSION", "UnknownPolicyError",
           "autocast_context", "emulate_autocast", "expected_output_dtype", "get_policy",
           "is_eligible", "native_autocast"]

Rule = Literal["lower", "fp32", "promote"]

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_RULE_OF_KIND = {"lower": "lower", "fp32": "fp32", "fp32_by_dtype": "fp32", "promote": "promote"}
# Opens like torch's own error, so a replay fails the way the device did.
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
    "autocast; use binary_cross_entropy_with_logits or BCEWithLogitsLoss.")


class UnknownPolicyError(PostmortemError, ValueError):
    """No autocast policy is known for this device type and dtype."""


def _unknown_policy(device_type: Any, dtype: Any) -> UnknownPolicyError:
    return UnknownPolicyError(
        f"no autocast policy for device {device_type!r} with dtype {dtype!r}; known: 'cuda' or "
        "'cpu' with float16 or bfloat16 (a run without autocast needs none: pass None)")


def _op_name(name: str) -> str:
    """'aten::softmax.int', 'Tensor.softmax' and 'softmax' all name softmax."""
    return name.rpartition("::")[2].removeprefix("Tensor.").split(".")[0]


def is_eligible(value: Any) -> bool:
    """Would autocast cast this argument? Floating tensors other than float64
    (autocast_mode.h `is_eligible`); ints, bools and float64 stay as they are."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype != torch.float64)


def _dtype_is_eligible(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype != torch.float64


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """Which dtype each op runs in under autocast on `device_type` with the
    low precision type `dtype`."""

    device_type: str
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if (self.device_type, self.dtype) not in OP_TABLES:
            raise _unknown_policy(self.device_type, self.dtype)

    @property
    def _table(self) -> dict[str, str]:
        return OP_TABLES[(self.device_type, self.dtype)]

    def kind(self, op_name: str) -> str | None:
        """The detailed cast kind: "lower", "fp32", "fp32_by_dtype", "promote",
        "banned", or None for an op autocast leaves alone."""
        name = _op_name(op_name)
        table = self._table
        return table.get(name) or table.get(OP_ALIASES.get(name, ""))

    def rule(self, op_name: str) -> Rule | None:
        """"lower", "fp32", "promote", or None (also for a banned op)."""
        return _RULE_OF_KIND.get(self.kind(op_name))

    def op_names(self, rule: Rule | None = None) -> frozenset[str]:
        """Op names of the tables with this rule (all of them for None)."""
        return frozenset(name for name, kind in self._table.items()
                         if rule is None or _RULE_OF_KIND.get(kind) == rule)

    def target_dtype(self, op_name: str, input_dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
        """The dtype eligible inputs are cast to, or None when none are cast."""
        kind = self.kind(op_name)
        if kind == "lower":
            return self.dtype
        if kind == "fp32":
            return torch.float32
        if kind == "promote":
            return _widest(self.dtype, input_dtypes)
        return None

    def cast_inputs(self, op_name: str, args: tuple, kwargs: dict,
                    cache: dict | None = None) -> tuple[tuple, dict]:
        """`args` and `kwargs` as autocast would hand them to the op. With a
        `cache` dict, float32 leaf weights are cast once per cache."""
        kind = self.kind(op_name)
        if kind == "banned":
            raise RuntimeError(_BANNED_MESSAGE)
        if kind == "fp32_by_dtype":
            return args, _with_float32_dtype(args, kwargs)
        eligible = [t.dtype for t in _tensors((args, tuple(kwargs.values()))) if is_eligible(t)]
        to = self.target_dtype(op_name, eligible)
        if to is None:
            return args, kwargs
        cast = functools.partial(_cast, to=to, lower=self.dtype, cache=cache)
        return cast(args), {key: cast(value) for key, value in kwargs.items()}


def get_policy(device_type: str | torch.device, dtype: torch.dtype | str) -> AutocastPolicy:
    """The autocast policy of `device_type` ("cuda", "cpu", "cuda:0", ...) with
    low precision `dtype` (torch.float16/bfloat16 or "float16", "fp16",
    "half", "bfloat16", "bf16")."""
    try:
        device = torch.device(device_type).type
    except (RuntimeError, TypeError):
        device = None
    resolved = _DTYPE_NAMES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or (device, resolved) not in OP_TABLES:
        raise _unknown_policy(device_type, dtype)
    return AutocastPolicy(device, resolved)


def expected_output_dtype(policy: AutocastPolicy | None, op_name: str,
                          input_dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The output dtype of an op that returns its (cast) floating inputs'
    promoted type, given those inputs' dtypes in argument order."""
    dtypes = list(input_dtypes)
    if not dtypes:
        raise ValueError(f"expected_output_dtype of {op_name!r} needs at least one input dtype")
    kind = policy.kind(op_name) if policy is not None else None
    if kind == "banned":
        raise RuntimeError(_BANNED_MESSAGE)
    if kind == "fp32_by_dtype":
        if _dtype_is_eligible(dtypes[0]):
            return torch.float32
    elif kind is not None:
        to = policy.target_dtype(op_name, [d for d in dtypes if _dtype_is_eligible(d)])
        dtypes = [to if _dtype_is_eligible(d) else d for d in dtypes]
    return functools.reduce(torch.promote_types, dtypes)


def _widest(lower: torch.dtype, dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """autocast_mode.h `prioritize`: float32 wins over the low precision type."""
    widest = lower
    for dtype in dtypes:
        if dtype == torch.float32:
            widest = torch.float32
        elif dtype != lower:
            # The device raises the same way, so a replay cannot silently pass.
            raise RuntimeError(f"Unexpected floating ScalarType {dtype} in at::autocast::prioritize")
    return widest


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _cast(value: Any, to: torch.dtype, lower: torch.dtype, cache: dict | None) -> Any:
    if isinstance(value, (list, tuple)):
        items = [_cast(item, to, lower, cache) for item in value]
        if type(value) in (list, tuple):
            return type(value)(items)
        # A namedtuple is rebuilt field by field; torch.Size holds no tensors.
        return type(value)(*items) if hasattr(value, "_fields") else value
    if not is_eligible(value) or value.dtype == to:
        return value
    # Like autocast_mode.cpp `cached_cast`: a float32 leaf weight cast to the
    # low precision type once per region, so every use shares one cast node
    # and its gradients are summed in that type before the cast back, as on
    # the device.
    cacheable = (cache is not None and to == lower and value.dtype == torch.float32
                 and value.requires_grad and value.is_leaf and not value._is_view())
    if not cacheable:
        return value.to(to)
    hit = cache.get(id(value))
    if hit is not None and hit[0]() is value:
        return hit[1]
    cast = value.to(to)
    cache[id(value)] = (weakref.ref(value), cast)
    return cast


def _with_float32_dtype(args: tuple, kwargs: dict) -> dict:
    """fp32_set_opt_dtype: respect a dtype the caller gave, else ask for
    float32 when the first argument is eligible."""
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    if explicit or not is_eligible(first):
        return kwargs
    return {**kwargs, "dtype": torch.float32}


# ---------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------

_PROLOGUE_NAMES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _no_torch_function(*args: Any) -> bool:
    return False


def _body_of(func: Any) -> Any:
    """A copy of a Python-level torch function (F.normalize, Tensor.__rdiv__,
    F.multi_head_attention_forward, ...) whose `if has_torch_function(...)`
    prologue is off, so its body runs with the mode active and its inner
    calls (norm, reciprocal, softmax, ...) are seen one by one, like autocast
    sees the inner ops of a composite. None for a C function."""
    if not isinstance(func, types.FunctionType):
        return None
    globals_ = dict(func.__globals__)
    globals_.update({name: _no_torch_function for name in _PROLOGUE_NAMES if name in globals_})
    body = types.FunctionType(func.__code__, globals_, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


class _NativeAutocastOff:
    """Native autocast off while an op runs, as autocast's own
    ExcludeDispatchKeyGuard does, so nothing is cast twice."""

    def __init__(self, device_types: tuple[str, ...]):
        self.device_types = device_types

    def __enter__(self) -> None:
        self.were_enabled = [torch.is_autocast_enabled(d) for d in self.device_types]
        for device in self.device_types:
            torch.set_autocast_enabled(device, False)

    def __exit__(self, *exc: Any) -> None:
        for device, enabled in zip(self.device_types, self.were_enabled):
            torch.set_autocast_enabled(device, enabled)


class _EmulatedAutocast(TorchFunctionMode):
    """Casts the inputs of every intercepted torch function, Tensor method,
    torch.nn.functional function and torch.ops call as `policy` says. A
    TorchFunctionMode sits above autograd like real autocast, so the casts
    are recorded in the graph and the backward runs in the device's dtypes (a
    TorchDispatchMode sits below autograd and would not record them)."""

    def __init__(self, policy: AutocastPolicy, switches: tuple[str, ...], cache_enabled: bool):
        super().__init__()
        self.policy = policy
        self.switches = switches
        self.cache: dict | None = {} if cache_enabled else None
        self.running_bodies: set = set()

    def __torch_function__(self, func, arg_types, args=(), kwargs=None):
        # torch pops this mode while we are in here, so the calls below are
        # not intercepted again unless a body is run under `with self`.
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        enabled = all(torch.is_autocast_enabled(d) for d in self.switches)
        kind = self.policy.kind(name) if enabled and name else None
        # Calls with out= are never autocast.
        if kind is not None and kwargs.get("out") is None:
            args, kwargs = self.policy.cast_inputs(name, tuple(args), kwargs, self.cache)
        elif enabled and func not in self.running_bodies:
            body = _body_of(func)
            if body is not None:
                # A prologue that escapes the patch dispatches `func` again;
                # `running_bodies` makes that second call a plain one.
                self.running_bodies.add(func)
                try:
                    with self:
                        return body(*args, **kwargs)
                finally:
                    self.running_bodies.discard(func)
        with _NativeAutocastOff(self.switches):
            return func(*args, **kwargs)


def _autocast_devices() -> list[str]:
    candidates = ["cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu",
                  torch._C._get_privateuse1_backend_name()]
    return [d for d in dict.fromkeys(candidates) if torch.amp.is_autocast_available(d)]


@contextlib.contextmanager
def emulate_autocast(policy: AutocastPolicy, *, run_device_type: str | torch.device = "cpu",
                     cache_enabled: bool = True) -> Iterator[None]:
    """Run the block, on `run_device_type` tensors, under `policy`.

    The native autocast flags of the policy's and the replay's device types
    are set, with the policy's dtype, as the emulation's switch; every other
    device type's flag is off. During each op all of them are off, so native
    autocast casts nothing. The switch is what the model sees on the device:
    `torch.is_autocast_enabled(x.device.type)` is True, its own
    `torch.autocast(x.device.type, enabled=False)` (Hugging Face rotary
    embeddings compute frequencies in float32 that way) turns the emulation
    off there, and activation checkpointing captures an enabled autocast and
    re-enters it for the recompute.

    Ops that bypass torch functions are left to native autocast of the
    replay's device type while the block runs: mainly the backward pass's own
    ops, so call backward outside the block, unless the model uses activation
    checkpointing, whose recompute must run inside it."""
    run_device = torch.device(run_device_type).type
    switches = tuple(dict.fromkeys((policy.device_type, run_device)))
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
             for d in dict.fromkeys([*_autocast_devices(), *switches])]
    try:
        for device, _, _ in saved:
            torch.set_autocast_enabled(device, device in switches)
        for device in switches:
            torch.set_autocast_dtype(device, policy.dtype)
        with _EmulatedAutocast(policy, switches, cache_enabled):
            yield
    finally:
        for device, enabled, dtype in saved:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def native_autocast(policy: AutocastPolicy) -> torch.autocast:
    """torch's own autocast for `policy`, for a replay on the recording device type."""
    return torch.autocast(policy.device_type, dtype=policy.dtype)


def autocast_context(policy: AutocastPolicy | None,
                     run_device_type: str | torch.device) -> contextlib.AbstractContextManager:
    """Native autocast when the replay runs on the policy's device type, the
    emulation otherwise, and nothing for a run without autocast (None)."""
    if policy is None:
        return contextlib.nullcontext()
    if torch.device(run_device_type).type == policy.device_type:
        return native_autocast(policy)
    return emulate_autocast(policy, run_device_type=run_device_type)
