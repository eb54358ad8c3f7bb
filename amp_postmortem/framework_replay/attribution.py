"""Compare a Keras or Flax replay with its float32 reference and name the
culprit: numpy only, the framework runners hand over host arrays.

Per layer call (forward), as `replaying/attribution.py` does for PyTorch:
- propagated: the call's output in the end-to-end run of the precision,
  against the float32 run;
- local: the layer alone, fed the float32 run's inputs rounded to the
  dtypes the precision run gave it, against the float32 output. Only the
  layer's own arithmetic differs.

Statuses (`CallStatus`): `broken` (NaN/Inf where float32 is finite, from
inputs that are all finite after rounding; or a relative L2 error above
`BROKEN_REL`), `inputs_nonfinite` (the rounded inputs already hold NaN/Inf:
whoever made them is the culprit, not this layer), `reference_nonfinite`
(float32 itself is not finite there), `ok`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

# The PyTorch replay's thresholds (replaying/attribution.py, calibrated there).
BROKEN_REL = {"fp16": 0.25, "bf16": 0.5, "fp32": 0.25}


class CallStatus(enum.Enum):
    OK = "ok"
    BROKEN = "broken"
    INPUTS_NONFINITE = "inputs_nonfinite"
    REFERENCE_NONFINITE = "reference_nonfinite"


@dataclass
class ErrorStats:
    """One comparison of arrays with their float32 reference."""
    numel: int = 0
    rel_l2: float = 0.0
    nonfinite_new: int = 0       # NaN/Inf where the reference is finite
    ref_nonfinite: int = 0

    def to_dict(self) -> dict:
        return {"numel": self.numel, "rel_l2": self.rel_l2, "nonfinite_new": self.nonfinite_new,
                "ref_nonfinite": self.ref_nonfinite}


def compare(ref: list, run: list) -> ErrorStats:
    """Error of `run`'s arrays against `ref`'s (same shapes), in float64,
    over the values finite in both."""
    sq_err = sq_ref = 0.0
    stats = ErrorStats()
    for r, x in zip(ref, run):
        r = np.asarray(r, dtype=np.float64)
        x = np.asarray(x, dtype=np.float64)
        if r.shape != x.shape:
            raise ValueError(f"replayed output of shape {x.shape} against a reference of shape {r.shape}")
        ref_ok, run_ok = np.isfinite(r), np.isfinite(x)
        both = ref_ok & run_ok
        stats.numel += r.size
        stats.nonfinite_new += int(np.sum(ref_ok & ~run_ok))
        stats.ref_nonfinite += int(np.sum(~ref_ok))
        sq_err += float(np.sum((x[both] - r[both]) ** 2))
        sq_ref += float(np.sum(r[both] ** 2))
    stats.rel_l2 = math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf)
    return stats


@dataclass
class CallComparison:
    name: str
    call: int
    order: int                    # place in the reference run (children finish before parents)
    propagated: ErrorStats
    local: ErrorStats | None      # None: the layer could not be replayed alone (see `local_error`)
    inputs_nonfinite: int = 0     # NaN/Inf in the rounded inputs of the local replay
    local_error: str | None = None

    def status(self, precision: str) -> CallStatus:
        c = self.local if self.local is not None else self.propagated
        if c.ref_nonfinite:
            return CallStatus.REFERENCE_NONFINITE
        if c.nonfinite_new or c.rel_l2 > BROKEN_REL[precision]:
            return CallStatus.INPUTS_NONFINITE if self.inputs_nonfinite else CallStatus.BROKEN
        return CallStatus.OK

    def reason(self, precision: str) -> str:
        c = self.local if self.local is not None else self.propagated
        where = "alone, on float32's inputs rounded to its dtypes" if self.local is not None else "end to end"
        if c.nonfinite_new:
            return f"{c.nonfinite_new} of {c.numel} output values NaN/Inf where float32 is finite ({where})"
        return f"relative error {c.rel_l2:.3g} against float32 ({where})"


@dataclass
class Culprit:
    name: str
    call: int
    precision: str
    reason: str
    phase: str = "forward"

    def to_dict(self) -> dict:
        return {"name": self.name, "call": self.call, "phase": self.phase, "precision": self.precision,
                "reason": self.reason}


def find_culprit(comparisons: list, precision: str) -> Culprit | None:
    """The first call, in the order calls finish, whose own arithmetic
    breaks (a parent finishes after the child that broke inside it)."""
    for c in sorted(comparisons, key=lambda c: c.order):
        if c.status(precision) is CallStatus.BROKEN:
            return Culprit(c.name, c.call, precision, c.reason(precision))
    return None


@dataclass
class Fidelity:
    reproduced: bool | None
    basis: str

    def to_dict(self) -> dict:
        return {"reproduced": self.reproduced, "basis": self.basis}


def check_fidelity(recorded_nonfinite: list, replayed_nonfinite: list, precision: str) -> Fidelity:
    """Whether the replay in the recorded precision made the step's forward
    go non-finite where the recorded step did: the first layer call with
    NaN/Inf, recorded (bundle.json's `recorded_nonfinite`) and replayed."""
    first = (lambda calls: None if not calls else (calls[0]["name"], int(calls[0].get("call", 0))))
    rec, rep = first(recorded_nonfinite), first(replayed_nonfinite)
    if rec is None and rep is None:
        return Fidelity(None, "the recorded forward was finite and so is the replayed one; the backward, "
                              "where the step failed, is not replayed for this framework")
    if rec == rep:
        return Fidelity(True, f"the first layer with NaN/Inf is {rec[0] or '<root>'} in the step as "
                              f"recorded and in the {precision} replay")
    said = (lambda f: "none" if f is None else (f[0] or "<root>"))
    return Fidelity(False, f"the first layer with NaN/Inf: recorded {said(rec)}, replayed in {precision} "
                           f"{said(rep)}")


LOSS_CALL = "<loss>"  # recorders.format.schema.LOSS_NAME: the loss's own backward


@dataclass
class CallGrads:
    """One layer call's gradients in a backward replay, unscaled, as host
    float64 arrays: `outputs` reaching the call's floating outputs,
    `inputs` it handed its floating inputs, `params` its layer's variables'
    (on the layer's call 0 only: a variable's gradient sums its calls)."""
    outputs: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    params: list = field(default_factory=list)


@dataclass
class BackwardComparison:
    """One call's gradients against float32's. The call's own backward
    broke when what it handed on (`inputs`, `params`) holds NaN/Inf where
    float32's is finite while the gradient that reached it (`outputs`) is
    finite; non-finite values that reached it came from later calls."""
    name: str
    call: int
    order: int                       # place in the backward (the last call to finish goes first)
    outputs: ErrorStats
    inputs: ErrorStats
    params: ErrorStats

    def status(self, precision: str) -> CallStatus:
        if self.outputs.ref_nonfinite or self.inputs.ref_nonfinite or self.params.ref_nonfinite:
            return CallStatus.REFERENCE_NONFINITE
        if self.outputs.nonfinite_new:
            return CallStatus.INPUTS_NONFINITE
        if self.inputs.nonfinite_new or self.params.nonfinite_new:
            return CallStatus.BROKEN
        return CallStatus.OK

    def reason(self, precision: str) -> str:
        if self.outputs.nonfinite_new:
            return (f"{self.outputs.nonfinite_new} of {self.outputs.numel} values of the gradient reaching its "
                    "output NaN/Inf where float32's is finite (made later in the backward)")
        parts = [f"{c.nonfinite_new} of {c.numel} {what} values NaN/Inf where float32's are finite"
                 for c, what in ((self.inputs, "input-gradient"), (self.params, "variable-gradient"))
                 if c.nonfinite_new]
        if parts:
            return "its backward made " + " and ".join(parts) + " from a finite output gradient"
        return f"input-gradient relative error {self.inputs.rel_l2:.3g} against float32"

    def to_dict(self) -> dict:
        return {"outputs": self.outputs.to_dict(), "inputs": self.inputs.to_dict(),
                "params": self.params.to_dict()}


def compare_backward(reference: RunCalls, run: RunCalls) -> list:
    """Each call's gradients in `run` against `reference`'s, in backward
    order; the loss's own backward first (its output gradient is the one
    reaching the last call's output)."""
    keys = [k for k in reversed(reference.order) if k in reference.grads and k in run.grads]
    out = []
    for order, key in enumerate(keys):
        ref, got = reference.grads[key], run.grads[key]
        out.append(BackwardComparison(key[0], key[1], order + 1, compare(ref.outputs, got.outputs),
                                      compare(ref.inputs, got.inputs), compare(ref.params, got.params)))
    if out:
        first = out[0]
        # The loss's backward: from d(loss)/d(loss) to the last call's
        # output; a forward already non-finite there made it so (counted as
        # what reached the loss).
        last = run.outputs.get(keys[0], [])
        reached = ErrorStats(numel=1, nonfinite_new=int(any(not np.all(np.isfinite(a)) for a in last)))
        out.insert(0, BackwardComparison(LOSS_CALL, 0, 0, reached, first.outputs, ErrorStats()))
    return out


def find_backward_culprit(comparisons: list, precision: str) -> Culprit | None:
    """The first call, in backward order, whose own backward breaks."""
    for c in sorted(comparisons, key=lambda c: c.order):
        if c.status(precision) is CallStatus.BROKEN:
            return Culprit(c.name, c.call, precision, c.reason(precision), phase="backward")
    return None


@dataclass
class RunCalls:
    """What a runner returns for one precision: its calls' outputs as host
    arrays, by (name, call), in the order they finished."""
    precision: str
    outputs: dict = field(default_factory=dict)   # (name, call) -> [np arrays]
    order: list = field(default_factory=list)     # (name, call) in finishing order
    error: str | None = None
    # The backward replay (None: not run; `backward_error` says why).
    grads: dict = field(default_factory=dict)     # (name, call) -> CallGrads
    backward_error: str | None = None

    def nonfinite_grads(self) -> list:
        """Calls, in backward order, with a NaN/Inf among their gradients."""
        return [{"name": n, "call": c} for n, c in reversed(self.order) if (n, c) in self.grads and any(
            not np.all(np.isfinite(a)) for part in (self.grads[(n, c)].outputs, self.grads[(n, c)].inputs,
                                                     self.grads[(n, c)].params) for a in part)]

    def nonfinite_calls(self) -> list:
        return [{"name": n, "call": c} for n, c in self.order
                if any(not np.all(np.isfinite(np.asarray(a, dtype=np.float64))) for a in self.outputs[(n, c)])]
