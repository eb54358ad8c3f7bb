"""Compare replays with the float64 reference and name the culprit.

Two comparisons per module call, forward and backward:
- propagated: the module's output (forward) or output-gradient (backward) in
  an end-to-end run of the precision, against the float64 run;
- local: the module alone, fed the float64 run's inputs rounded to the dtypes
  the precision run gave it (backward: the float64 output-gradient, scaled and
  rounded), against float64 on those same rounded inputs. Only the module's
  own arithmetic differs, as in PyTorch's Numeric Suite for quantization.

Statuses, with u the unit roundoff of the replayed precision's dtype
(float16 2**-11, bfloat16 2**-8, float32 2**-24):
- `broken`: a NaN/Inf where float64 is finite, or a relative L2 error above
  `BROKEN_REL[precision]` (local) / `PROPAGATED_BROKEN_REL[precision]`
  (propagated);
- `degraded`: local error above `DEGRADED_RATIO` times the error of merely
  rounding the float64 result to the precision's dtype (propagated: relative
  error above `PROPAGATED_DEGRADED_U` * u);
- `ok` otherwise.

Calibration: 40 replays of 7 healthy models (MLP with LayerNorm and dropout,
conv + BatchNorm (6 seeds), two transformers, GRU, an 8-layer residual MLP,
a 4096-wide reduction; fp16 bundles recorded on "cpu" and "cuda", replayed on
a CPU under each policy), 562 module-phases per precision, plus the healthy
models of tests/test_replay.py:
- local error / rounding error: median 1.1-1.3 (fp16, bf16), 3.3 (fp32);
  forward max 12; backward p99 44-99, max 152 (the weight gradient of a
  convolution followed by BatchNorm: the BatchNorm backward removes the
  gradient's mean, the sum over the batch then cancels, and every bit of
  rounding shows; real, and in every precision);
- local relative error: forward max 0.0019 (fp16), 0.0082 (bf16); backward
  max 0.031 (fp16), 0.124 (bf16, the conv + BatchNorm container);
- propagated relative error: max 0.037 (fp16), 0.097 (bf16), 3.5e-7 (fp32).
So `degraded` (16x rounding) marks the precision-hungry spots of a healthy
model (at most a few percent of its module-phases), and `broken` sits at
least 4x above anything a healthy module showed. tests/test_replay.py keeps
healthy models inside these bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from recorders.format import schema

# Thresholds (see the module docstring for how they were calibrated).
DEGRADED_RATIO = 16.0
BROKEN_REL = {"fp32": 0.25, "fp16": 0.25, "bf16": 0.5}
PROPAGATED_DEGRADED_U = 64.0
PROPAGATED_BROKEN_REL = {"fp32": 0.25, "fp16": 0.25, "bf16": 0.5}
PARAM_GRAD_FLAG_REL = 0.10  # the playbook's fp16-vs-fp32 gradient check
# A parameter whose float64 gradient is this small next to the largest one
# has (almost) no gradient: a conv bias before BatchNorm is ~1e-17 in
# float64 and any rounding makes its relative error huge. Never flagged.
PARAM_GRAD_NEGLIGIBLE = 1e-6

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
                 torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# A result that rounds exactly (zeros, small integers) has no rounding error
# to compare with: the denominator never drops below this share of u*|ref|.
_ROUNDING_FLOOR = 0.25
PRECISION_OF = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_PRECISION_RANK = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


@dataclass
class ErrorStats:
    """Error of a set of tensors against their float64 reference, summed so
    that calls, micro-batches and tuple outputs of a module can be merged."""
    numel: int = 0
    sq_err: float = 0.0
    sq_ref: float = 0.0
    sq_round: float = 0.0
    max_abs_err: float = 0.0
    nonfinite_new: int = 0       # NaN/Inf in the run where the reference is finite
    ref_nonfinite: int = 0       # NaN/Inf already in the reference
    unrepresentable: int = 0     # finite reference values that overflow the dtype
    dtype: torch.dtype | None = None  # lowest-precision dtype seen in the run

    def add(self, run: torch.Tensor, ref: torch.Tensor, scale: float = 1.0,
            dtype: torch.dtype | None = None) -> "ErrorStats":
        """Add one tensor of a run (as it travelled: times `scale` for a
        scaled gradient) and its unscaled float64 reference. `dtype`: the
        precision whose rounding error is the yardstick (default: the run
        tensor's dtype)."""
        if run.shape != ref.shape:
            return self
        dtype = dtype or run.dtype
        x = run.detach().to(torch.float64) / scale
        r = ref.detach().to(device=x.device, dtype=torch.float64)
        rf = torch.isfinite(r)
        xf = torch.isfinite(x)
        both = rf & xf
        err = torch.where(both, x - r, torch.zeros((), dtype=torch.float64, device=x.device))
        ref_f = torch.where(rf, r, torch.zeros((), dtype=torch.float64, device=x.device))
        rounded = (ref_f * scale).to(dtype).to(torch.float64) / scale
        rounded_f = torch.isfinite(rounded)
        round_err = torch.where(rounded_f, rounded - ref_f, torch.zeros((), dtype=torch.float64, device=x.device))
        self.numel += r.numel()
        self.sq_err += float((err * err).sum())
        self.sq_ref += float((ref_f * ref_f).sum())
        self.sq_round += float((round_err * round_err).sum())
        if r.numel():
            self.max_abs_err = max(self.max_abs_err, float(err.abs().max()))
        self.nonfinite_new += int((rf & ~xf).sum())
        self.ref_nonfinite += int((~rf).sum())
        self.unrepresentable += int((rf & ~rounded_f).sum())
        if self.dtype is None or _PRECISION_RANK[dtype] > _PRECISION_RANK.get(self.dtype, 0):
            self.dtype = dtype
        return self

    def merge(self, other: "ErrorStats") -> "ErrorStats":
        if other.numel == 0:
            return self
        self.numel += other.numel
        self.sq_err += other.sq_err
        self.sq_ref += other.sq_ref
        self.sq_round += other.sq_round
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)
        self.nonfinite_new += other.nonfinite_new
        self.ref_nonfinite += other.ref_nonfinite
        self.unrepresentable += other.unrepresentable
        if other.dtype is not None and (self.dtype is None or
                                        _PRECISION_RANK[other.dtype] > _PRECISION_RANK[self.dtype]):
            self.dtype = other.dtype
        return self

    @property
    def empty(self) -> bool:
        return self.numel == 0

    @property
    def rel_l2(self) -> float:
        """||run - ref|| / ||ref|| over the values finite in both; inf when
        the run has a NaN/Inf where the reference is finite."""
        if self.nonfinite_new:
            return math.inf
        if self.sq_err == 0.0:
            return 0.0
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else math.inf

    @property
    def sqnr_db(self) -> float:
        if self.nonfinite_new:
            return -math.inf
        if self.sq_err == 0.0:
            return math.inf
        return 10.0 * math.log10(self.sq_ref / self.sq_err) if self.sq_ref > 0 else -math.inf

    @property
    def rounding_rel(self) -> float:
        return math.sqrt(self.sq_round / self.sq_ref) if self.sq_ref > 0 else 0.0

    @property
    def ratio_to_rounding(self) -> float:
        """Error over the error of rounding the float64 result to the run's
        dtype: about 1 for an op that only rounds its exact result."""
        if self.nonfinite_new:
            return math.inf
        if self.sq_err == 0.0:
            return 0.0
        u = UNIT_ROUNDOFF.get(self.dtype, 2.0 ** -24)
        floor = _ROUNDING_FLOOR * u * math.sqrt(self.sq_ref)
        denom = max(math.sqrt(self.sq_round), floor)
        return math.sqrt(self.sq_err) / denom if denom > 0 else math.inf

    def to_dict(self) -> dict:
        return {"rel_l2": self.rel_l2, "sqnr_db": self.sqnr_db, "max_abs_err": self.max_abs_err,
                "nonfinite_new": self.nonfinite_new, "ratio_to_rounding": self.ratio_to_rounding,
                "ref_nonfinite": self.ref_nonfinite, "unrepresentable": self.unrepresentable,
                "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
                "numel": self.numel}


def local_status(stats: ErrorStats, precision: str | None = None) -> tuple[str, str]:
    """(status, reason) of a module's own arithmetic."""
    if stats.empty:
        return "ok", ""
    dtype = _dtype_name(stats.dtype)
    if stats.nonfinite_new:
        extra = (f"; {stats.unrepresentable} float64 values exceed {dtype}'s range"
                 if stats.unrepresentable else "")
        return "broken", (f"{stats.nonfinite_new} NaN/Inf in {dtype} where float64 is finite, "
                          f"on the same inputs{extra}")
    rel = stats.rel_l2
    limit = BROKEN_REL.get(precision or PRECISION_OF.get(stats.dtype), 0.25)
    if rel > limit:
        return "broken", f"relative error {rel:.3g} > {limit} on the same inputs"
    ratio = stats.ratio_to_rounding
    if ratio > DEGRADED_RATIO:
        return "degraded", f"error {ratio:.3g}x the rounding error of {dtype} (> {DEGRADED_RATIO:g}x)"
    return "ok", ""


def propagated_status(stats: ErrorStats, precision: str) -> tuple[str, str]:
    if stats.empty:
        return "ok", ""
    dtype = _dtype_name(stats.dtype)
    if stats.nonfinite_new:
        return "broken", f"{stats.nonfinite_new} NaN/Inf in {dtype} where float64 is finite"
    rel = stats.rel_l2
    limit = PROPAGATED_BROKEN_REL.get(precision, 0.25)
    if rel > limit:
        return "broken", f"relative error {rel:.3g} > {limit}"
    u = UNIT_ROUNDOFF.get(stats.dtype, 2.0 ** -24)
    if rel > PROPAGATED_DEGRADED_U * u:
        return "degraded", f"relative error {rel:.3g} > {PROPAGATED_DEGRADED_U:g}u of {dtype}"
    return "ok", ""


def param_grad_errors(reference: dict, runs: dict) -> dict:
    """Per parameter: relative L2 error of the (unscaled) gradient of each
    precision against float64, NaN/Inf counts, `flagged` (precisions over
    10% or non-finite) and `negligible` (no real gradient to compare)."""
    out = {}
    norms = {name: float(torch.linalg.vector_norm(ref.double())) for name, ref in reference.items()}
    largest = max((n for n in norms.values() if math.isfinite(n)), default=0.0)
    for name, ref in reference.items():
        negligible = norms[name] <= PARAM_GRAD_NEGLIGIBLE * largest
        entry = {"rel_err": {}, "nonfinite": {}, "flagged": [], "negligible": negligible}
        for precision, grads in runs.items():
            g = grads.get(name)
            if g is None:
                continue
            stats = ErrorStats().add(g, ref)
            entry["rel_err"][precision] = stats.rel_l2
            entry["nonfinite"][precision] = stats.nonfinite_new
            if stats.nonfinite_new or (stats.rel_l2 > PARAM_GRAD_FLAG_REL and not negligible):
                entry["flagged"].append(precision)
        out[name] = entry
    return out


def _dtype_name(dtype) -> str:
    return "?" if dtype is None else str(dtype).replace("torch.", "")


THRESHOLDS = {
    "local_degraded_ratio_to_rounding": DEGRADED_RATIO,
    "local_broken_rel_err": BROKEN_REL,
    "propagated_degraded_units_of_roundoff": PROPAGATED_DEGRADED_U,
    "propagated_broken_rel_err": PROPAGATED_BROKEN_REL,
    "param_grad_flag_rel_err": PARAM_GRAD_FLAG_REL,
}


# ------------------------------------------------------------- comparisons
@dataclass
class ModuleComparison:
    """One call of a module, one phase, one precision, merged over the
    micro-batches: the k-th call of a module in each micro-batch is one
    comparison, so a module called twice (an activation applied before and
    after a gate) is two, named apart (`label`)."""
    name: str
    phase: str                      # "forward" | "backward"
    order: int                      # first position in the reference's execution order
    call: int = 0                   # which call of the module in its micro-batch (from 0)
    label: str = ""                 # the name people read: `act#1` for a module called more than once
    propagated: ErrorStats = field(default_factory=ErrorStats)
    local: ErrorStats = field(default_factory=ErrorStats)
    local_done: bool = False
    local_input_nonfinite: int = 0  # values made NaN/Inf by rounding the float64 inputs
    local_error: str | None = None  # the module could not be run alone

    @property
    def status(self) -> tuple[str, str]:
        if not self.local_done:
            return "n/a", self.local_error or "not replayed alone"
        return local_status(self.local)


def compare_run(session, reference, run, *, local: bool = True, modules=None) -> list:
    """Propagated and local comparisons of `run` against the float64
    `reference` (which must have kept its inputs for the local ones)."""
    scale = run.loss_scale
    # The yardstick of every tensor is the precision's dtype: a float32 result
    # of a fp16 run (a parameter gradient, a softmax under the CUDA policy)
    # was computed from float16 operands.
    dtype = run.config.dtype
    ref_config = run.config.replace(precision="fp64", policy=None, fp32_modules=())
    found: dict = {}
    for key, ref_call in reference.calls.items():
        run_call = run.calls.get(key)
        if run_call is None:
            continue
        name, call = ref_call.name, ref_call.call
        fwd = found.setdefault((name, call, "forward"),
                               ModuleComparison(name, "forward", ref_call.forward_order, call))
        fwd.order = min(fwd.order, ref_call.forward_order)
        for x, r in zip(run_call.outputs, ref_call.outputs):
            fwd.propagated.add(x, r, dtype=dtype)
        bwd = None
        if ref_call.backward_order is not None:
            bwd = found.setdefault((name, call, "backward"),
                                   ModuleComparison(name, "backward", ref_call.backward_order, call))
            bwd.order = min(bwd.order, ref_call.backward_order)
            for g, r in zip(run_call.grad_outputs, ref_call.grad_outputs):
                if g is not None and r is not None:
                    bwd.propagated.add(g, r, scale, dtype=dtype)
        if local and ref_call.inputs is not None and (modules is None or name in modules):
            _compare_local(session, ref_config, run.config, ref_call, run_call, fwd, bwd, scale)
    called = {}
    for name, call, _ in found:
        called[name] = max(called.get(name, 0), call + 1)
    for c in found.values():
        c.label = call_label(c.name, c.call, called[c.name])
    return sorted(found.values(), key=lambda c: (c.phase != "forward", c.order))


def call_label(name: str, call: int, calls: int) -> str:
    """A module call as people read it: the module's name, with `#k` (its
    k-th call in a micro-batch, from 0) when it is called more than once."""
    return name if calls <= 1 else f"{name}#{call}"


def _named(c) -> dict:
    """The keys that say which module call a comparison is (`--json`)."""
    return {"name": c.name, "call": c.call, "label": c.label}


def _compare_local(session, ref_config, config, ref_call, run_call, fwd, bwd, scale):
    from .capture import is_floating, round_to
    from recorders.format.tensors import iter_tensors
    floats = [t for t in iter_tensors(ref_call.inputs) if is_floating(t)]
    dtypes = list(run_call.input_dtypes)
    if len(dtypes) != len(floats):
        fwd.local_error = "its inputs differ between the float64 and the replayed run"
        return
    grads_run = grads_ref = None
    if bwd is not None:
        grads_run, grads_ref = [], []
        for i, g in enumerate(ref_call.grad_outputs):
            dtype = run_call.outputs[i].dtype if i < len(run_call.outputs) else config.dtype
            travelled = None if g is None else (g * scale).to(dtype)
            grads_run.append(travelled)
            grads_ref.append(None if g is None else travelled.to(torch.float64) / scale)
            if g is not None:
                bwd.local_input_nonfinite += int((torch.isfinite(g) & ~torch.isfinite(travelled)).sum())
    try:
        out_run, got_run = session.rerun_call(config, ref_call, dtypes, grads=grads_run)
        out_ref, got_ref = session.rerun_call(ref_config, ref_call, dtypes, grads=grads_ref, reference=True)
    except Exception as exc:  # noqa: BLE001 - some modules cannot run outside their parent
        fwd.local_error = f"could not be replayed alone: {type(exc).__name__}: {exc}"
        if bwd is not None:
            bwd.local_error = fwd.local_error
        return
    fwd.local_done = True
    fwd.local_input_nonfinite += sum(int((torch.isfinite(t) & ~torch.isfinite(round_to(t, d))).sum())
                                     for t, d in zip(floats, dtypes))
    for x, r in zip(out_run, out_ref):
        fwd.local.add(x, r, dtype=config.dtype)
    if bwd is not None:
        bwd.local_done = True
        for k, g in (got_run or {}).items():
            r = (got_ref or {}).get(k)
            if g is not None and r is not None:
                bwd.local.add(g, r, scale, dtype=config.dtype)


def _is_inside(name: str, parent: str) -> bool:
    return name != parent and (parent == "" or name.startswith(parent + "."))


def find_culprit(comparisons: list, precision: str) -> dict | None:
    """First module, forward then backward in execution order, whose own
    arithmetic is broken. Not a culprit: a module whose rounded inputs were
    already non-finite (it only propagates), and a module that contains a
    broken one (the inner module is named instead). When the backward's very
    start, the output gradient times the loss scale, does not fit the dtype,
    the culprit is `<loss>`: the loss scale."""
    for phase in ("forward", "backward"):
        if phase == "backward":
            root = next((c for c in comparisons if c.phase == "backward" and c.name == ""), None)
            if root is not None and root.local_input_nonfinite:
                return {"name": schema.LOSS_NAME, "phase": "backward", "precision": precision,
                        "reason": f"the gradient of the loss w.r.t. the model's outputs times the loss "
                                  f"scale overflows ({root.local_input_nonfinite} values): the loss scale is "
                                  "too large for this step"}
        broken = [c for c in comparisons if c.phase == phase and c.local_done
                  and c.status[0] == "broken" and not c.local_input_nonfinite]
        inner = [c for c in broken if not any(_is_inside(o.name, c.name) for o in broken)]
        if inner:
            c = min(inner, key=lambda c: c.order)
            return {**_named(c), "phase": phase, "precision": precision, "reason": c.status[1]}
    return None


def first_propagated(comparisons: list, precision: str) -> dict | None:
    """First module call (in `comparisons`' order: forward, then backward,
    each by execution) whose end-to-end error crosses the threshold."""
    for c in comparisons:
        status, reason = propagated_status(c.propagated, precision)
        if status == "broken":
            return {**_named(c), "phase": c.phase, "precision": precision,
                    "rel_err": c.propagated.rel_l2, "reason": reason}
    return None


def broken_inside(comparisons: list, c) -> str | None:
    """The first broken module inside `c` (same phase), if any."""
    inner = [o for o in comparisons if o.phase == c.phase and o.local_done and _is_inside(o.name, c.name)
             and o.status[0] == "broken" and not o.local_input_nonfinite]
    return min(inner, key=lambda o: o.order).name if inner else None


def rank_by_local_error(comparisons: list, precision: str) -> list:
    """Modules by their own (local) error, worst first."""
    done = [c for c in comparisons if c.local_done and not c.local.empty]
    done.sort(key=lambda c: (-c.local.rel_l2, -c.local.ratio_to_rounding, c.phase, c.order))
    return [{**_named(c), "phase": c.phase, "precision": precision, "local_rel_err": c.local.rel_l2,
             "ratio_to_rounding": c.local.ratio_to_rounding, "status": c.status[0]} for c in done]
