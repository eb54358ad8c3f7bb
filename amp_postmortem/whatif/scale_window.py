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
the longest run of consecutive usable scales.

Estimated (`estimate_scale_window`, no replay, no torch): from one recorded
step's float16 `grad_output` rows (a clean full-tier step by default), at the
scale S that step ran with:
- overflow edge: 2^k with k = floor(log2(65504 / max unscaled absmax)),
  where the unscaled absmax of a layer is its recorded absmax / S. An upper
  bound: an op inside a module may overflow before its output gradient does;
- underflow edge: per layer, log2|g| of the non-zero values is modelled as
  normal, fitted through the recorded points of its distribution: the share
  below 2^-14 (`below_normal_share`) and the largest value (absmax, taken as
  the 1 - 1/(2n) quantile), or, when nothing sat below 2^-14, absmax and the
  rms of the non-zero values. Shifting the scale by d bits shifts log2|g| by
  d; the edge is the smallest k whose numel-weighted share is at most
  `max_underflow`.

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
from dataclasses import dataclass, field

import pandas as pd

from recorders import schema

from ..analyses.ranges import zeros_look_flushed
from ..plain import plain
from . import report_progress

SCALES = (-16, 40)            # k range of the replayed scales 2^k
MAX_UNDERFLOW = 0.05          # usable: at most 5% of the gradient values flushed/subnormal
WIDE_WINDOW_BITS = 4
LOG2_MIN_NORMAL = -14         # log2(FP16_MIN_NORMAL)
ASSUMED_LOG2_SIGMA = 3.0      # spread (bits) assumed when every value sits below the normal limit
SCALE_COLUMNS = ["k", "scale", "forward_finite", "overflow", "underflow_share", "param_grad_lost_share",
                 "usable", "recorded"]
LAYER_COLUMNS = ["name", "numel", "absmax_unscaled", "below_normal_share", "zero_share", "overflow_k",
                 "underflow_k", "log2_mu", "log2_sigma"]


@dataclass
class ScaleWindow:
    method: str                     # "replay" | "estimate"
    step: int | None
    rank: int | None
    recorded_scale: float | None
    window: dict | None             # {"min_k", "max_k", "min_scale", "max_scale", "width_bits"}
    recorded_position: str | None   # "inside" | "above" | "below" | None
    settings: dict | None           # GradScaler keyword arguments
    code: str | None
    rows: list                      # replay: per scale; estimate: per layer
    max_underflow: float = MAX_UNDERFLOW
    notes: list = field(default_factory=list)
    recorded_scaler: dict | None = None

    def to_dict(self) -> dict:
        return plain({"method": self.method, "step": self.step, "rank": self.rank,
                      "recorded_scale": self.recorded_scale, "window": self.window,
                      "recorded_position": self.recorded_position, "settings": self.settings, "code": self.code,
                      "max_underflow": self.max_underflow, "recorded_scaler": self.recorded_scaler,
                      "notes": self.notes, ("scales" if self.method == "replay" else "layers"): self.rows})

    def table(self) -> pd.DataFrame:
        cols = SCALE_COLUMNS if self.method == "replay" else LAYER_COLUMNS
        return pd.DataFrame(self.rows, columns=cols)

    def lines(self) -> list[str]:
        what = "replayed" if self.method == "replay" else "estimated from recorded statistics"
        out = [f"loss-scale window, {what}: step {self.step}"
               + (f", rank {self.rank}" if self.rank is not None else "")
               + (f", recorded scale {self.recorded_scale:g}" if self.recorded_scale else "")]
        w = self.window
        if w is None:
            out.append("no usable scale: " + (self.notes[0] if self.notes else "every scale overflows or underflows"))
        else:
            out.append(f"window: 2^{w['min_k']} .. 2^{w['max_k']} ({w['min_scale']:g} .. {w['max_scale']:g}, "
                       f"{w['width_bits']} bits); the recorded scale is {self.recorded_position or 'unknown'}")
        if self.code:
            out.append(f"GradScaler settings that stay inside it: {self.code}")
        out += [f"note: {n}" for n in self.notes[(1 if w is None and self.notes else 0):]]
        return out


@dataclass
class ScaleWindowReport:
    """`scale-window`: the replayed window when a model is given, and the
    estimate from recorded statistics when the run directory is at hand."""
    replay: ScaleWindow | None
    estimate: ScaleWindow | None

    @property
    def main(self) -> ScaleWindow:
        return self.replay or self.estimate

    def to_dict(self) -> dict:
        return {"replay": self.replay.to_dict() if self.replay else None,
                "estimate": self.estimate.to_dict() if self.estimate else None}

    def table(self) -> pd.DataFrame:
        return self.main.table()

    def lines(self) -> list[str]:
        out = self.main.lines()
        if self.replay and self.estimate:
            e = self.estimate
            out.append("estimate from the recorded statistics alone: " + (
                f"2^{e.window['min_k']} .. 2^{e.window['max_k']}" if e.window else "no usable scale"))
        return out


# ------------------------------------------------------------------ replay
def replay_scale_window(source, step=None, *, rank=None, model=None, device: str = "cpu",
                        policy: str = "recorded", precision: str | None = None, loss_fn=None,
                        fp32_modules=(), scales=SCALES, max_underflow: float = MAX_UNDERFLOW,
                        progress=None, prepared=None) -> ScaleWindow:
    """Replay the step's backward at every scale 2^k and find the window."""
    from . import prepare

    p = prepared or prepare(source, step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=loss_fn)
    lo, hi = (int(k) for k in scales)
    if lo > hi:
        raise ValueError(f"scale range {lo}..{hi} is empty; give min <= max (powers of two)")
    recorded_k = math.log2(p.loss_scale) if p.loss_scale > 0 else None
    rows, notes = [], list(p.notes)
    ks = list(range(lo, hi + 1))
    for i, k in enumerate(ks):
        run = p.run(capture=True, loss_scale=2.0 ** k, fp32_modules=tuple(fp32_modules))
        rows.append(_scale_row(k, run, p.reference, max_underflow, recorded_k))
        report_progress(progress, "replaying loss scales", i + 1, len(ks))
    if fp32_modules:
        notes.append(f"replayed with {', '.join(fp32_modules)} kept in float32")
    if rows and all(r["underflow_share"] is None for r in rows):
        notes.append(f"no float16 gradient in the {p.precision} replay: its range is float32's, "
                     "a loss scale is not needed")
    window = _window([r["k"] for r in rows if r["usable"]])
    if window is None:
        if rows and not any(r["forward_finite"] for r in rows):
            notes.insert(0, "the forward pass is non-finite at every scale: no loss scale helps "
                            "(see `fix` for the module to keep in float32)")
        else:
            notes.insert(0, f"every scale from 2^{lo} to 2^{hi} overflows or leaves more than "
                            f"{max_underflow:.0%} of the gradients flushed or subnormal")
    settings, code = scaler_settings(window, device_type=_device_type(p))
    return ScaleWindow(method="replay", step=p.step, rank=p.rank, recorded_scale=p.loss_scale, window=window,
                       recorded_position=_position(window, recorded_k), settings=settings, code=code,
                       rows=rows, max_underflow=max_underflow, notes=notes + _calibration(p.bundle.scaler, window),
                       recorded_scaler=p.bundle.scaler)


def _scale_row(k, run, reference, max_underflow, recorded_k) -> dict:
    import torch
    fwd_bad = run.error is not None or any(not bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb)
    bwd_bad = bool(run.nonfinite_param_grads)
    total = small = 0
    for key, ref_call in reference.calls.items():
        run_call = run.calls.get(key)
        if run_call is None:
            continue
        for g, r in zip(run_call.grad_outputs, ref_call.grad_outputs):
            if g is None or r is None:
                continue
            if not bool(torch.isfinite(g).all()):
                bwd_bad = True
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
    overflow = not fwd_bad and bwd_bad
    usable = not fwd_bad and not bwd_bad and (underflow is None or underflow <= max_underflow)
    return {"k": k, "scale": 2.0 ** k, "forward_finite": not fwd_bad, "overflow": overflow,
            "underflow_share": underflow, "param_grad_lost_share": lost / ref_total if ref_total else None,
            "usable": usable, "recorded": recorded_k is not None and k == recorded_k}


def _device_type(p) -> str:
    ac = p.bundle.autocast or {}
    return ac.get("device_type") or (p.bundle.env or {}).get("device_type") or "cuda"


# ---------------------------------------------------------------- estimate
def estimate_scale_window(run, step: int | None = None, *, scales=SCALES,
                          max_underflow: float = MAX_UNDERFLOW, before: int | None = None) -> ScaleWindow:
    """The window estimated from one recorded step's statistics (no replay).
    Without `step`, from the latest clean full-tier step, before step
    `before` when given (statistics recorded after a forward overflow
    describe the failure, not the training a scaler should fit)."""
    from scipy.stats import norm

    steps = run.steps
    notes = []
    if step is None:
        step, why = _estimate_step(run, before)
        if why:
            notes.append(why)
    if step is None:
        return _empty_estimate(None, None, notes or ["no recorded step with gradient statistics"], max_underflow)
    at = steps[steps["step"] == int(step)]
    if at.empty:
        raise ValueError(f"step {step} is not in the run (recorded steps {run.first_step}..{run.last_step})")
    scale = at["loss_scale_before"].dropna()
    recorded_scale = float(scale.iloc[0]) if len(scale) else 1.0
    if not len(scale):
        notes.append("the run has no enabled loss scaler: the statistics are taken as unscaled")
    df = run.scan_tensors(["step", "rank", "name", "kind", "dtype", "numel", "absmax", "nan_count", "inf_count",
                           "rms", "zero_share", "below_normal_share"],
                          steps=[int(step)], kinds=["grad_output"], label="reading gradient statistics")
    df = df[df["dtype"] == "float16"]
    if df.empty:
        return _empty_estimate(int(step), recorded_scale,
                               [f"step {step} has no float16 grad_output rows (no float16 gradients recorded)"],
                               max_underflow)
    if ((df["nan_count"] + df["inf_count"]) > 0).any():
        notes.append(f"step {step} holds non-finite gradients: absmax covers the finite values only")
    shift = math.log2(recorded_scale) if recorded_scale > 0 else 0.0
    layers = []
    for (name, _), g in df.groupby(["name", "rank"], sort=False):
        r = g.iloc[0]
        layers.append(_fit_layer(name, r, shift, norm))
    lo_k, hi_k = int(scales[0]), int(scales[1])
    overflow_k = min((lay["overflow_k"] for lay in layers if lay["overflow_k"] is not None), default=None)
    usable = []
    for k in range(lo_k, hi_k + 1):
        if overflow_k is not None and k > overflow_k:
            break
        share = _estimated_share(layers, k, norm)
        if share is None or share <= max_underflow:
            usable.append(k)
    for lay in layers:
        lay["underflow_k"] = next((k for k in range(lo_k, hi_k + 1)
                                   if (_estimated_share([lay], k, norm) or 0.0) <= max_underflow), None)
    if any(lay.get("assumed_spread") for lay in layers):
        notes.append(f"some gradients lie entirely below the float16 normal limit at the recorded scale: "
                     f"their spread is assumed ({ASSUMED_LOG2_SIGMA:g} bits), the underflow edge is approximate")
    if not any(lay["log2_sigma"] is not None for lay in layers):
        notes.append("no full-tier statistics at this step: the underflow edge is unknown (overflow edge only)")
    window = _window(usable)
    if window is None:
        notes.insert(0, "the estimated overflow edge lies below the estimated underflow edge")
    settings, code = scaler_settings(window, device_type=(run.autocast or {}).get("device_type")
                                     or run.manifest.get("device_type") or "cuda")
    ranks = sorted(df["rank"].unique())
    return ScaleWindow(method="estimate", step=int(step), rank=int(ranks[0]) if len(ranks) == 1 else None,
                       recorded_scale=recorded_scale if len(scale) else None, window=window,
                       recorded_position=_position(window, shift if len(scale) else None), settings=settings,
                       code=code, rows=[{k: lay[k] for k in LAYER_COLUMNS} for lay in layers],
                       max_underflow=max_underflow, notes=notes + _calibration(run.scaler, window),
                       recorded_scaler=run.scaler)


def _estimate_step(run, before: int | None = None):
    """The latest clean (not skipped) step with full-tier gradient rows,
    else the latest clean step (only steps before `before`, when given)."""
    steps = run.steps
    if before is not None:
        steps = steps[steps["step"] < int(before)]
    clean = steps[~steps["skipped"].astype(bool)]
    if clean.empty:
        return (int(steps["step"].max()) if len(steps) else None,
                "every recorded step was skipped: estimated from the last one")
    full = clean[clean["tier"] == "full"]
    pick = full if len(full) else clean
    return int(pick["step"].max()), (None if len(full) else "no clean full-tier step: overflow edge only")


def _fit_layer(name, r, shift, norm) -> dict:
    """log2|g| ~ N(mu, sigma) of the non-zero values, in unscaled units."""
    numel = int(r["numel"] or 0)
    zero = _num(r["zero_share"])
    nonzero = max(1, round(numel * (1 - zero))) if zero is not None else max(1, numel)
    absmax = _num(r["absmax"])
    below = _num(r["below_normal_share"])
    rms = _num(r["rms"])
    out = {"name": name, "numel": numel, "nonzero": nonzero, "below_normal_share": below, "zero_share": zero,
           "absmax_unscaled": absmax / 2 ** shift if absmax else absmax, "overflow_k": None,
           "underflow_k": None, "log2_mu": None, "log2_sigma": None}
    if not absmax or absmax <= 0:
        return out
    a = math.log2(absmax)
    out["overflow_k"] = int(math.floor(math.log2(schema.FP16_MAX) - (a - shift)))
    # Share of the fitted values below the float16 normal limit at the
    # recorded scale. Zeros the float16 range flushed are such values too
    # (censored, not absent): then the fit covers every value, not only the
    # survivors, which would otherwise make a tiny scale look sufficient.
    below_q = None
    if below is not None:
        if zero is not None and zeros_look_flushed(zero, rms):
            nonzero = max(1, numel)
            below_q = min(1.0, below + zero)
        else:
            below_q = below / max(1e-12, 1 - (zero or 0.0))
    out["nonzero"] = nonzero
    z_top = norm.ppf(1 - 0.5 / nonzero) if nonzero > 1 else 0.5
    mu = sigma = None
    if below_q is not None and (below_q >= 1 - 0.5 / nonzero or a <= LOG2_MIN_NORMAL):
        # Everything sits under the limit: only the top is known. Assume a
        # typical spread of gradient magnitudes below it.
        sigma = ASSUMED_LOG2_SIGMA
        mu = a - sigma * z_top
        out["assumed_spread"] = True
    elif below_q is not None and 0 < below_q < 1 and z_top > norm.ppf(below_q):
        z_low = norm.ppf(below_q)
        sigma = (a - LOG2_MIN_NORMAL) / (z_top - z_low)
        mu = LOG2_MIN_NORMAL - sigma * z_low
    elif rms is not None and rms > 0 and below is not None and z_top > 0:
        # E[g^2] of a log2-normal: log2(rms) = mu + ln2 * sigma^2
        rms_nz = rms / math.sqrt(max(1e-12, 1 - (zero or 0.0)))
        R = math.log2(rms_nz)
        disc = z_top ** 2 - 4 * math.log(2) * (a - R)
        sigma = (z_top - math.sqrt(disc)) / (2 * math.log(2)) if disc >= 0 else z_top / (2 * math.log(2))
        sigma = max(sigma, 0.05)
        mu = R - math.log(2) * sigma ** 2
    if sigma is not None:
        out["log2_mu"], out["log2_sigma"] = mu - shift, sigma
    return out


def _estimated_share(layers, k, norm):
    """Numel-weighted share of non-zero values below 2^-14 at scale 2^k."""
    total = weight = 0.0
    for lay in layers:
        if lay["log2_sigma"] is None:
            continue
        share = float(norm.cdf((LOG2_MIN_NORMAL - k - lay["log2_mu"]) / lay["log2_sigma"]))
        total += share * lay["nonzero"]
        weight += lay["nonzero"]
    return total / weight if weight else None


def _empty_estimate(step, scale, notes, max_underflow) -> ScaleWindow:
    return ScaleWindow(method="estimate", step=step, rank=None, recorded_scale=scale, window=None,
                       recorded_position=None, settings=None, code=None, rows=[], max_underflow=max_underflow,
                       notes=notes)


def _num(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------- shared
def _window(usable_ks) -> dict | None:
    """The longest run of consecutive usable k (the highest on a tie)."""
    best, start, prev = None, None, None
    for k in sorted(usable_ks):
        if prev is None or k != prev + 1:
            start = k
        prev = k
        if best is None or (k - start) >= (best[1] - best[0]):
            best = (start, k)
    if best is None:
        return None
    lo, hi = best
    return {"min_k": lo, "max_k": hi, "min_scale": 2.0 ** lo, "max_scale": 2.0 ** hi, "width_bits": hi - lo}


def _position(window, recorded_k) -> str | None:
    if window is None or recorded_k is None:
        return None
    if recorded_k > window["max_k"]:
        return "above"
    if recorded_k < window["min_k"]:
        return "below"
    return "inside"


def scaler_settings(window, device_type: str = "cuda") -> tuple[dict | None, str | None]:
    """GradScaler keyword arguments that keep a run inside `window`."""
    if window is None:
        return None, None
    lo, hi = window["min_k"], window["max_k"]
    settings = {"init_scale": 2.0 ** max(lo, hi - 1), "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 2000 if hi - lo >= WIDE_WINDOW_BITS else 500}
    args = ", ".join(f"{k}={_literal(v)}" for k, v in settings.items())
    return settings, f'torch.amp.GradScaler("{device_type or "cuda"}", {args})'


def _literal(v) -> str:
    if isinstance(v, float) and v >= 8 and math.log2(v).is_integer():
        return f"2.0**{int(math.log2(v))}"
    return repr(v)


def _calibration(scaler, window) -> list:
    """What the recorded GradScaler configuration costs against the window."""
    if not scaler or window is None:
        return []
    notes = []
    init = scaler.get("init_scale")
    if init and init > window["max_scale"]:
        skips = math.ceil(math.log2(init / window["max_scale"]))
        notes.append(f"the recorded init_scale {init:g} is above the window: about {skips} skipped steps "
                     "of calibration at every (re)start")
    elif init and init < window["min_scale"]:
        notes.append(f"the recorded init_scale {init:g} is below the window: gradients underflow until it "
                     f"has grown {math.ceil(math.log2(window['min_scale'] / init))} times")
    return notes


__all__ = ["replay_scale_window", "estimate_scale_window", "scaler_settings", "ScaleWindow", "ScaleWindowReport"]
