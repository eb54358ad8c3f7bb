"""The safe loss-scale window: scales at which a step's float16 gradients
neither overflow nor underflow (the playbook's step 5).

Replayed (`replay_scale_window`): the saved step's backward is replayed in
float16 at every scale 2^k, k in `scales` (default -16..40). At each:
- overflow: a NaN/Inf parameter gradient or module gradient, while the
  forward is finite (a non-finite forward is no loss-scale matter: no scale
  helps, `fix` does);
- underflow share: among the float16 module gradients whose float64 value
  is non-zero, the share that is zero or subnormal (|g| < 2^-14) in the
  replay: flushed or losing precision. Structural zeros (a ReLU's) are
  zeros in float64 too and do not count.
A scale is usable when it does not overflow and its underflow share is at
most `max_underflow` (default 5%, the `ranges` underflow flag). The window is
the longest run of consecutive usable scales. `verify_window` then replays
the run's other saved steps at its top and lowers it until they are finite
too, so the printed settings keep every saved step finite that a scale can.

Estimated (`estimate_scale_window`, no replay, no torch): from one recorded
step's float16 `grad_output` rows (a clean full-tier step by default), at the
scale S that step ran with:
- overflow edge: 2^k with k = floor(log2(65504 / max unscaled absmax)),
  where the unscaled absmax of a layer is its recorded absmax / S, over the
  float16 module gradients and the weight gradients computed in float16
  (`param_grad` rows, unscaled, of the parameters of modules whose gradient
  travelled in float16: the weight-gradient matmul's result is that gradient
  times the scale; a tied parameter counts when any module using it ran in
  float16). Still an upper bound: an op inside a module may overflow before
  its output gradient does, so the estimate is marked not verified;
- underflow edge: per layer, log2|g| of the non-zero values is modelled as
  normal, fitted through the recorded points of its distribution: the share
  below 2^-14 (`below_normal_share`) and the largest value (absmax, taken as
  the 1 - 1/(2n) quantile), or, when nothing sat below 2^-14, absmax and the
  rms of the non-zero values. Shifting the scale by d bits shifts log2|g| by
  d; the edge is the smallest k whose numel-weighted share is at most
  `max_underflow`. Exact zeros the float16 range flushed are values below
  the limit (censored, fitted with the survivors); zeros that are zero at
  any scale (a mask, a ReLU, an absent token's row: `ranges.zero_split`
  tells them apart) are left out, as the replay leaves out values whose
  float64 value is zero.

Both count the loss itself. `GradScaler.scale` multiplies the loss by a
float32 scale, so the backward's first gradient, d(scaled loss)/d(loss), is
the scale rounded to the loss's own dtype: a float16 loss is Inf at 2^16
(65536 > 65504) and above on every step, whatever the model's gradients.
The estimate takes the loss's dtype from the steps table (`loss_dtype`,
schema 1.3; unknown before, and it says so); the replay starts from the
loss where it has it (a loss output of the model, seeded with the scale in
its dtype; `loss_fn`'s loss computed under autocast and scaled as
GradScaler does), else from the saved output gradient with the recorded
loss dtype standing for the loss. Each names what sets the overflow edge
(`EdgeCause`).

GradScaler settings that keep a run inside a window [2^lo, 2^hi]: start at
`init_scale` = 2^max(lo, hi - 1), one bit below the overflow edge (no
calibration skips); keep `growth_factor` 2 and `backoff_factor` 0.5 (one
backoff from the first overflowing scale 2^(hi+1) lands back inside); and
`growth_interval` 2000 (one probing overflow per 2000 steps) for a window
of at least `WIDE_WINDOW_BITS`, 500 for a narrower one, where a few
backoffs in a row leave the window and the scale must come back quickly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from recorders.format import schema

from ..errors import OptionError
from ..names import BackwardFrom
from . import report_progress
from .scale_estimate import estimate_scale_window
from .scale_result import (LOSS_ROW, MAX_UNDERFLOW, SCALES, EdgeCause, SavedStepScale, ScaleWindow, calibration_notes,
                           WindowMethod, loss_max_k, position_in_window, scaler_settings, usable_window)
from ..result import CommandResult

# Seeded at a loss: its dtype is the loss's (the scale itself is its first gradient).
_FROM_A_LOSS = (BackwardFrom.LOSS, BackwardFrom.LOSS_FN)


@dataclass
class ScaleWindowReport(CommandResult):
    """`scale-window`: the replayed window when a model is given, and the
    estimate from recorded statistics when the run directory is at hand."""
    replay: ScaleWindow | None
    estimate: ScaleWindow | None

    def __post_init__(self):
        if self.replay is not None and self.estimate is not None:
            self.estimate.why = f"the replay of step {self.replay.step} is the verified window"

    @property
    def main(self) -> ScaleWindow:
        return self.replay or self.estimate

    def document(self) -> dict:
        return {"replay": self.replay.to_dict() if self.replay else None,
                "estimate": self.estimate.to_dict() if self.estimate else None}

    def table(self) -> pd.DataFrame:
        return self.main.table()

    def lines(self) -> list[str]:
        out = self.main.lines()
        if self.replay and self.estimate:
            e = self.estimate
            out.append("estimate from the recorded statistics alone (not verified; the replay above is): " + (
                f"2^{e.window['min_k']} .. 2^{e.window['max_k']}" if e.window else "no usable scale"))
        return out


# ------------------------------------------------------------------ replay
def kept_note(fp32_modules) -> str:
    """The note of a window replayed with `fp32_modules` in float32 (the
    one place its words are made: `recommend` leaves it out by equality)."""
    return f"replayed with {', '.join(fp32_modules)} kept in float32"


def replay_scale_window(source, step=None, *, rank=None, model=None, device: str = "cpu",
                        policy: str = "recorded", precision: str | None = None, loss_fn=None,
                        fp32_modules=(), scales=SCALES, max_underflow: float = MAX_UNDERFLOW,
                        progress=None, prepared=None, verify: bool = False,
                        loss_dtype: str | None = None, loss=None, command: str = "scale-window") -> ScaleWindow:
    """Replay the step's backward at every scale 2^k and find the window;
    with `verify`, check it on the run's other saved steps (`verify_window`).

    The backward starts from the loss where the replay has it: the model's
    own loss output (seeded with the scale in the loss's dtype), or
    `loss_fn`'s loss computed under autocast and scaled as GradScaler does.
    Otherwise from the saved output gradient, and `loss_dtype` (the
    recorded one, `scale_result.recorded_loss_dtype`) stands for the loss:
    a scale that is Inf in it overflows, as the scaled loss's backward does
    in training, whatever the output gradient. `loss` (the loop's loss, as
    for `rerun`) and `command` are the window check's (`check_over_window`)."""
    from . import prepare

    p = prepared or prepare(source, step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=loss_fn)
    lo, hi = (int(k) for k in scales)
    if lo > hi:
        raise OptionError(f"scale range {lo}:{hi} is empty; give MIN:MAX with MIN <= MAX (exponents, e.g. -16:40)")
    recorded_k = math.log2(p.loss_scale) if p.loss_scale > 0 else None
    rows, notes = [], list(p.notes)
    ks = list(range(lo, hi + 1))
    started = None
    for i, k in enumerate(ks):
        run = _replay_at(p, k, fp32_modules, loss_fn, capture=True)
        if started is None and run.backward_from is not None:
            started = (run.backward_from, run.loss_dtype)
        dtype = run.loss_dtype if run.backward_from in _FROM_A_LOSS else loss_dtype
        rows.append(_scale_row(k, run, p.reference, max_underflow, recorded_k, dtype))
        report_progress(progress, "replaying loss scales", i + 1, len(ks))
    backward_from, seen_dtype = started or (None, None)
    loss_dtype = seen_dtype if backward_from in _FROM_A_LOSS else loss_dtype
    if backward_from is BackwardFrom.OUTPUT_GRADIENT and loss_dtype not in ("float32", "float64"):
        notes.append("the backward started from the saved output gradient (the loss is computed outside the "
                     "model call): " + (f"the recorded loss dtype {loss_dtype} stands for the loss (a scale "
                                        f"Inf in {loss_dtype} overflows)" if loss_dtype else
                                        "the loss's dtype is unknown, so whether the loss itself bounds the "
                                        "scale is not checked; pass --loss-fn to start from the loss"))
    if fp32_modules:
        notes.append(kept_note(fp32_modules))
    if rows and all(r["underflow_share"] is None for r in rows):
        notes.append(f"no float16 gradient in the {p.precision} replay: its range is float32's, "
                     "a loss scale is not needed")
    window = usable_window([r["k"] for r in rows if r["usable"]])
    if window is None:
        if rows and not any(r["forward_finite"] for r in rows):
            notes.insert(0, "the forward pass is non-finite at every scale: no loss scale helps "
                            "(see `fix` for the module to keep in float32)")
        else:
            notes.insert(0, f"every scale from 2^{lo} to 2^{hi} overflows or leaves more than "
                            f"{max_underflow:.0%} of the gradients flushed or subnormal")
    settings, code = scaler_settings(window, device_type=_device_type(p))
    above = next((r for r in rows if window is not None and r["k"] == window["max_k"] + 1), None)
    cause = EdgeCause(above["overflow_cause"]) if above and above["overflow_cause"] else None
    sw = ScaleWindow(method=WindowMethod.REPLAY, step=p.step, rank=p.rank, recorded_scale=p.loss_scale, window=window,
                     recorded_position=position_in_window(window, recorded_k), settings=settings, code=code,
                     rows=rows, max_underflow=max_underflow, notes=notes + calibration_notes(p.bundle.scaler, window),
                     recorded_scaler=p.bundle.scaler, verified=True, overflow_cause=cause,
                     overflow_edge_by=LOSS_ROW if cause is EdgeCause.LOSS_DTYPE else None, loss_dtype=loss_dtype,
                     loss_max_k=loss_max_k(loss_dtype), backward_from=backward_from)
    if not verify:
        return sw
    sw = verify_window(sw, p, fp32_modules=fp32_modules, progress=progress, loss_fn=loss_fn)
    if sw.settings and model is not None:  # the settings printed (the window narrowed by the saved steps)
        from .window_check import check_over_window, run_of_bundle
        init_scale = sw.settings["init_scale"]
        sw.window_check = check_over_window(
            run_of_bundle(p.bundle), p.step, f"init_scale={init_scale:g}", model=model, rank=p.rank,
            fp32_modules=fp32_modules, init_scale=init_scale, precision=p.precision, device=device,
            policy=policy, loss_fn=loss_fn, loss=loss, command=command)
    return sw


def _replay_at(p, k: int, fp32_modules, loss_fn, *, capture: bool):
    """The step replayed at scale 2^k, its backward from `loss_fn`'s loss
    when one is given (`RunConfig.backward_from_loss`)."""
    config = p.config.replace(loss_scale=2.0 ** k, fp32_modules=tuple(fp32_modules),
                              backward_from_loss=loss_fn is not None)
    return p.session.run(config, capture=capture, loss_fn=loss_fn)


def _loss_overflows(k: int, loss_dtype: str | None) -> bool:
    """The scale 2^k is Inf in the loss's dtype: the scaled loss's backward
    hands the loss that gradient first (d(scale * loss)/d(loss) = scale)."""
    top = loss_max_k(loss_dtype)
    return top is not None and k > top


def verify_window(sw: ScaleWindow, prepared, *, fp32_modules=(), progress=None, loss_fn=None) -> ScaleWindow:
    """The replayed window checked on every other saved step of the run:
    each is replayed at the window's top scale 2^max_k (forward and
    backward, every float16 tensor including the parameter gradients) and,
    when that overflows, one scale lower at a time down to 2^min_k for the
    highest at which it is finite; the window's top becomes the lowest such
    scale, so the GradScaler settings printed from it keep every saved step
    finite that any scale in the window can keep finite. A step whose
    forward is non-finite at the bottom of the window is one no loss scale
    saves (`fix` or `recommend` say what does); it does not narrow it."""
    import dataclasses

    from . import other_bundles, prepare_like
    others = other_bundles(prepared)
    if sw.window is None or not others:
        return sw
    lo, hi = sw.window["min_k"], sw.window["max_k"]
    top, checked, notes = hi, [], list(sw.notes)
    modules = tuple(fp32_modules)
    for i, (step, path) in enumerate(others):
        q = prepare_like(prepared, path)
        max_finite_k, why = hi, None
        run = _replay_at(q, hi, modules, loss_fn, capture=False)
        if not run.finite:
            max_finite_k = None
            for k in range(hi - 1, lo - 1, -1):
                run = _replay_at(q, k, modules, loss_fn, capture=False)
                if run.finite:
                    max_finite_k = k
                    break
            if max_finite_k is not None:
                top = min(top, max_finite_k)
                why = (f"overflows at 2^{hi}; finite up to 2^{max_finite_k}: the window's top "
                       "is lowered to keep it finite")
            else:
                why = ("its forward is non-finite at every scale of the window: no loss scale saves it"
                       if not _forward_finite(run) else f"non-finite at every scale from 2^{lo} to 2^{hi}")
        checked.append(SavedStepScale(step, finite_at_max=max_finite_k == hi, max_finite_k=max_finite_k, why=why))
        report_progress(progress, "checking the window on the saved steps", i + 1, len(others))
    window = usable_window(range(lo, top + 1)) if top >= lo else None
    if window is None:
        notes.insert(0, f"no scale keeps every saved step finite: the top of the window falls below 2^{lo}")
    elif top < hi:
        notes.append(f"narrowed from 2^{lo}..2^{hi} (step {sw.step} alone) to keep the other saved steps finite")
    if top < hi:
        # The edge is another saved step's now; what overflows there is not told apart.
        by = next((c.step for c in checked if c.max_finite_k == top), None)
        sw = dataclasses.replace(sw, overflow_cause=None, overflow_edge_by=f"saved step {by}" if by is not None else None)
    settings, code = scaler_settings(window, device_type=_device_type(prepared))
    return dataclasses.replace(sw, window=window, settings=settings, code=code, notes=notes, checked_steps=checked,
                               recorded_position=position_in_window(window, math.log2(sw.recorded_scale)
                                                           if sw.recorded_scale else None))


def _forward_finite(run) -> bool:
    import torch
    return run.error is None and all(bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb)


def _scale_row(k, run, reference, max_underflow, recorded_k, loss_dtype=None) -> dict:
    import torch
    fwd_bad = run.error is not None or any(not bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb)
    weight_bad = bwd_bad = bool(run.nonfinite_param_grads)
    module_bad = False
    total = small = 0
    for key, ref_call in reference.calls.items():
        run_call = run.calls.get(key)
        if run_call is None:
            continue
        for g, r in zip(run_call.grad_outputs, ref_call.grad_outputs):
            if g is None or r is None:
                continue
            if not bool(torch.isfinite(g).all()):
                bwd_bad = module_bad = True
            if g.dtype != torch.float16:
                continue
            nz = r != 0
            total += int(nz.sum())
            small += int((nz & (g.abs() < schema.FP16_MIN_NORMAL)).sum())
    lost = ref_total = 0
    for name, r in reference.param_grads.items():
        g = run.param_grads.get(name)
        if g is not None:
            nz = r != 0
            ref_total += int(nz.sum())
            lost += int((nz & (g == 0)).sum())
    underflow = small / total if total else None
    loss_bad = _loss_overflows(k, loss_dtype)
    bwd_bad = bwd_bad or loss_bad
    overflow = not fwd_bad and bwd_bad
    usable = not fwd_bad and not bwd_bad and (underflow is None or underflow <= max_underflow)
    cause = None
    if overflow:
        cause = (EdgeCause.LOSS_DTYPE if loss_bad else EdgeCause.ACTIVATION_GRAD if module_bad
                 else EdgeCause.WEIGHT_GRAD if weight_bad else None)
    return {"k": k, "scale": 2.0 ** k, "forward_finite": not fwd_bad, "overflow": overflow,
            "underflow_share": underflow, "param_grad_lost_share": lost / ref_total if ref_total else None,
            "usable": usable, "recorded": recorded_k is not None and k == recorded_k,
            "loss_overflow": loss_bad, "overflow_cause": cause.value if cause else None}


def _device_type(p) -> str:
    ac = p.bundle.autocast or {}
    return ac.get("device_type") or (p.bundle.env or {}).get("device_type") or "cuda"


__all__ = ["replay_scale_window", "verify_window", "estimate_scale_window", "scaler_settings", "ScaleWindow", "ScaleWindowReport"]
