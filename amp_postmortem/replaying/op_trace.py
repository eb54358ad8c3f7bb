"""The operations inside one module call, one by one: the op trace of a replay.

    trace = trace_module(session, reference, run, "blocks.1.attn")
    trace.origin            # the first OpRecord whose output turned NaN/Inf from finite inputs
    trace.to_dict()         # plain data: `replay --json`'s `op_trace` entries

The module runs alone, as the local replay runs it (`ReplaySession.rerun_call`):
fed the float64 reference run's inputs rounded to the dtypes the precision's
run gave it, under that run's configuration (autocast policy, native or
emulated). An `OpTracer`, a `TorchDispatchMode` that exists only here (never on
the training path), sees every aten op below autograd and autocast, so each op
is seen in the dtype the policy made it run in (the casts autocast inserts are
ops of their own, `aten::_to_copy`). Per op with a floating output it records
the op, its dtype, its output's largest finite magnitude and NaN/Inf counts,
its own error against float64 (the op run again on its inputs upcast to
float64: a local error, independent of what came before it), and the model's
source line that called it: the innermost Python frame that is neither
torch's, the standard library's, the recorder's nor amp_postmortem's.

Bounds: at most `MAX_OPS_PER_CALL` ops are recorded per module call (after
that only finiteness is checked, so the origin is still found and recorded),
and at most `MAX_CALLS` calls of a module are traced (the first one that makes
a non-finite value, else the first). Random ops (dropout) get no local error:
run again in float64 they would draw other numbers.

Tracing imports and calls nothing a run's data names: the module is the
user's, resolved by `--model`; its source lines are read from the files its
code objects name (`linecache`, without a loader).
"""
from __future__ import annotations

import contextlib
import enum
import linecache
import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import recorders

__all__ = ["MAX_CALLS", "MAX_OPS_PER_CALL", "ModuleOpTrace", "OpRecord", "OpTracer", "SourceLine", "TraceStatus",
           "trace_module"]

MAX_OPS_PER_CALL = 1000  # a transformer block is a few hundred aten ops; the JSON stays small
MAX_CALLS = 8            # a module called in a loop: enough calls to meet the one that breaks

# Frames that are not the model's own code: torch (module call plumbing,
# functional wrappers, the copies of torch functions the autocast emulation
# runs), the standard library (contextlib), the recorder (keep_fp32's wrapper)
# and this package (the replay machinery, the emulation's mode).
_NOT_MODEL_DIRS = tuple(os.path.abspath(d) + os.sep for d in (
    os.path.dirname(torch.__file__), os.path.dirname(recorders.__file__),
    os.path.dirname(os.path.dirname(__file__)), sysconfig.get_paths()["stdlib"]))


class TraceStatus(enum.Enum):
    ORIGIN = "origin"                      # an op made NaN/Inf from finite inputs
    INPUTS_NONFINITE = "inputs_nonfinite"  # NaN/Inf only carried in from the inputs
    FINITE = "finite"                      # every op's output finite
    NOT_TRACED = "not_traced"              # the call could not be run alone (see `error`)


@dataclass(frozen=True)
class SourceLine:
    file: str          # relative to the current directory when under it
    line: int
    code: str          # the source text of the line, stripped ("" when unreadable)
    function: str      # the code object's name ("forward")
    module: str | None  # the module whose method it is (its `self`), when one of the model's


@dataclass
class OpRecord:
    index: int                 # order among the call's ops with a floating output
    op: str                    # "aten::bmm"
    dtype: str | None          # the dtype it ran in: its floating output's
    absmax: float | None       # largest finite |value| of its floating outputs (None: none finite)
    nan: int
    inf: int
    inputs_finite: bool        # every floating input finite
    local_rel_err: float | None  # relative L2 error vs float64 on the same inputs; inf: non-finite only here
    module: str                # the innermost module of the model running it
    source: SourceLine | None  # the model's line that called it (None: called by torch code alone)

    @property
    def made_nonfinite(self) -> bool:
        return self.inputs_finite and (self.nan + self.inf) > 0

    def to_dict(self) -> dict:
        s = self.source
        return {"index": self.index, "op": self.op, "dtype": self.dtype, "absmax": self.absmax,
                "nan": self.nan, "inf": self.inf, "inputs_finite": self.inputs_finite,
                "local_rel_err": self.local_rel_err, "module": self.module,
                "file": s.file if s else None, "line": s.line if s else None, "code": s.code if s else None,
                "function": s.function if s else None, "frame_module": s.module if s else None}


@dataclass
class ModuleOpTrace:
    module: str
    precision: str
    status: TraceStatus
    micro_batch: int | None = None
    call: int | None = None
    ops: list = field(default_factory=list)   # OpRecord, at most MAX_OPS_PER_CALL (+ the origin)
    ops_seen: int = 0                         # ops with a floating output, recorded or not
    origin: OpRecord | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {"module": self.module, "precision": self.precision, "status": self.status.value,
                "micro_batch": self.micro_batch, "call": self.call, "ops_seen": self.ops_seen,
                "ops_recorded": len(self.ops), "max_ops": MAX_OPS_PER_CALL,
                "origin": self.origin.to_dict() if self.origin else None,
                "ops": [o.to_dict() for o in self.ops], "error": self.error}


class _Quiet:
    """The tracer's own arithmetic (statistics, the float64 re-run) outside
    every torch function mode (the autocast emulation's) and with native
    autocast off, so nothing of it is cast or seen."""

    def __enter__(self):
        self._no_modes = torch._C.DisableTorchFunction()
        self._no_modes.__enter__()
        self._devices = [d for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d)]
        self._were = [torch.is_autocast_enabled(d) for d in self._devices]
        for d in self._devices:
            torch.set_autocast_enabled(d, False)

    def __exit__(self, *exc):
        for d, was in zip(self._devices, self._were):
            torch.set_autocast_enabled(d, was)
        self._no_modes.__exit__(*exc)
        return False


def _floats(obj) -> list:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.layout == torch.strided]


def _upcast(obj):
    """Floating tensors as float64 copies (an in-place op must not touch the
    real ones) and floating dtype arguments as float64 (`_to_copy(dtype=
    float16)` is the identity in the reference: its error is the rounding)."""
    def up(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.layout == torch.strided:
            return v.detach().to(torch.float64, copy=True)
        if isinstance(v, torch.dtype) and v.is_floating_point:
            return torch.float64
        return v
    return pytree.tree_map(up, obj)


def _rel_err(outs: list, refs: list) -> float | None:
    worst = None
    for x, r in zip(outs, refs):
        if x.shape != r.shape:
            continue
        x, r = x.detach().to(torch.float64), r.detach().to(device=x.device, dtype=torch.float64)
        ref_finite = torch.isfinite(r)
        if bool((ref_finite & ~torch.isfinite(x)).any()):
            return math.inf  # NaN/Inf here that float64 does not make
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        num = float(torch.linalg.vector_norm(torch.where(ref_finite, x - r, zero)))
        den = float(torch.linalg.vector_norm(torch.where(ref_finite, r, zero)))
        err = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        worst = err if worst is None else max(worst, err)
    return worst


class OpTracer(TorchDispatchMode):
    """Records the aten ops run while it is active (see the module's doc).
    `names`: id(module) -> name of every module of the model; `stop`: the
    frame the traced call was made from (frames outside it are not the
    module's)."""

    def __init__(self, names: dict, stop, *, max_ops: int = MAX_OPS_PER_CALL):
        super().__init__()
        self.names = names
        self.stop = stop
        self.max_ops = max_ops
        self.ops: list = []
        self.seen = 0
        self.origin: OpRecord | None = None
        self.inputs_nonfinite = False
        self.cwd = os.getcwd() + os.sep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # torch pops this mode while we are in here: our own ops are not traced.
        kwargs = kwargs or {}
        with _Quiet():
            float_in = _floats((args, kwargs))
            inputs_finite = all(bool(torch.isfinite(t).all()) for t in float_in)
            recording = len(self.ops) < self.max_ops
            random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
            reference = _upcast((args, kwargs)) if (recording or inputs_finite) and not random else None
        out = func(*args, **kwargs)
        with _Quiet():
            float_out = _floats(out)
            if not float_out:
                return out
            index = self.seen
            self.seen += 1
            nan = sum(int(torch.isnan(t).sum()) for t in float_out)
            inf = sum(int(torch.isinf(t).sum()) for t in float_out)
            self.inputs_nonfinite |= not inputs_finite
            first_bad = self.origin is None and inputs_finite and (nan + inf) > 0
            if not (recording or first_bad):
                return out
            record = OpRecord(index=index, op=func.name().split(".")[0], dtype=str(float_out[0].dtype)
                              .replace("torch.", ""), absmax=_absmax(float_out), nan=nan, inf=inf,
                              inputs_finite=inputs_finite,
                              local_rel_err=self._reference_error(func, reference, float_out),
                              **self._where())
            self.ops.append(record)
            if first_bad:
                self.origin = record
        return out

    @staticmethod
    def _reference_error(func, reference, float_out) -> float | None:
        if reference is None:
            return None
        ref_args, ref_kwargs = reference
        try:
            ref = func(*ref_args, **ref_kwargs)
        except Exception:  # noqa: BLE001 - an op without a float64 kernel (or argument) has no reference
            return None
        return _rel_err(float_out, _floats(ref))

    def _where(self) -> dict:
        """The innermost model module running, and the model's own line."""
        module = None
        source = None
        frame = sys._getframe(2)
        while frame is not None and frame is not self.stop:
            code = frame.f_code
            owner = frame.f_locals.get("self") if code.co_argcount and code.co_varnames[0] == "self" else None
            name = self.names.get(id(owner)) if owner is not None else None
            if module is None and name is not None:
                module = name
            if source is None and not code.co_filename.startswith(("<",)) and \
                    not os.path.abspath(code.co_filename).startswith(_NOT_MODEL_DIRS):
                path = code.co_filename
                shown = path[len(self.cwd):] if path.startswith(self.cwd) else path
                source = SourceLine(file=shown, line=frame.f_lineno,
                                    code=linecache.getline(path, frame.f_lineno).strip(),
                                    function=code.co_name, module=name)
            if module is not None and source is not None:
                break
            frame = frame.f_back
        return {"module": module if module is not None else "", "source": source}


def _absmax(tensors: list) -> float | None:
    best = None
    for t in tensors:
        finite = t[torch.isfinite(t)]
        if finite.numel():
            m = float(finite.abs().max())
            best = m if best is None else max(best, m)
    return best


@contextlib.contextmanager
def _active_inside(module: torch.nn.Module, tracer: OpTracer):
    """The tracer on during the module's own forward only: the replay's
    rounding of its inputs and detaching of its outputs are not its ops."""
    depth = [0]

    def enter(*_):
        depth[0] += 1
        if depth[0] == 1:
            tracer.__enter__()

    def leave(*_):
        depth[0] -= 1
        if depth[0] == 0:
            tracer.__exit__(None, None, None)
    # always_call: the forward hook runs even when the forward raises, so the mode never stays pushed.
    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def trace_module(session, reference, run, name: str, *, max_ops: int = MAX_OPS_PER_CALL) -> ModuleOpTrace:
    """The op trace of module `name` under `run`'s configuration, fed the
    `reference` (float64) run's kept inputs rounded to the dtypes `run` gave
    it: the first of its calls (at most MAX_CALLS) in which an op makes a
    non-finite value, else its first call."""
    precision = run.config.precision
    calls = sorted((c for c in reference.calls.values() if c.name == name),
                   key=lambda c: c.forward_order)[:MAX_CALLS]
    if not calls:
        return ModuleOpTrace(name, precision, TraceStatus.NOT_TRACED, error="the module did not run in the step")
    model = session.model(run.config.weight_dtype)
    names = {id(m): n for n, m in model.named_modules()}
    first = None
    for ref_call in calls:
        trace = ModuleOpTrace(name, precision, TraceStatus.NOT_TRACED, micro_batch=ref_call.micro_batch,
                              call=ref_call.call)
        if ref_call.inputs is None:
            trace.error = "the float64 run kept no inputs of it (a replay without local runs)"
            return first or trace
        run_call = run.calls.get(ref_call.key)
        tracer = OpTracer(names, sys._getframe(), max_ops=max_ops)
        try:
            with _active_inside(model.get_submodule(name), tracer):
                session.rerun_call(run.config, ref_call, run_call.input_dtypes if run_call else [])
        except Exception as exc:  # noqa: BLE001 - some modules cannot run outside their parent
            trace.error = f"could not be run alone: {type(exc).__name__}: {exc}"
        else:
            trace.status = (TraceStatus.ORIGIN if tracer.origin else
                            TraceStatus.INPUTS_NONFINITE if tracer.inputs_nonfinite else TraceStatus.FINITE)
        trace.ops, trace.ops_seen, trace.origin = tracer.ops, tracer.seen, tracer.origin
        first = first or trace
        if trace.origin is not None:
            return trace
    return first
