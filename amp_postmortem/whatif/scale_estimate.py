"""The safe loss-scale window estimated from recorded statistics alone.

`estimate_scale_window` needs neither the model nor a bundle, nor torch: it
fits, per layer, a log2-normal through the recorded float16 gradient
statistics of one step and reads the overflow and underflow edges off the
fit (the method is described in `scale_window.py`'s docstring). It is
separate from the replayed window because it is a different computation on
different input (a loaded run, not a saved step), and it is re-exported from
`scale_window` where callers import it.
"""
from __future__ import annotations

import math

from recorders.format import schema

from ..analyses.nans import tied_aliases
from ..analyses.ranges import zero_split
from ..errors import StepNotFoundError
from .scale_result import (LAYER_COLUMNS, LOSS_ROW, MAX_UNDERFLOW, SCALES, EdgeCause, ScaleWindow, calibration_notes,
                           WindowMethod, loss_max_k, position_in_window, recorded_loss_dtype, scaler_settings,
                           usable_window)

LOG2_MIN_NORMAL = -14         # log2(FP16_MIN_NORMAL)
NO_SCALE_APPLIED = ("the run applied no loss scale: its float16 gradients were recorded unscaled, flushed where "
                    "they underflow, and cannot say which scale would keep them (replay a saved step at each "
                    "scale: scale-window --model; or add a GradScaler, which finds its scale itself)")
ASSUMED_LOG2_SIGMA = 3.0      # spread (bits) assumed when every value sits below the normal limit


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
        raise StepNotFoundError(f"step {step} is not in the run (recorded steps {run.first_step}..{run.last_step})")
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
    layers += _weight_gradients(run, int(step), set(df["name"]),
                                int(math.ceil(shift)) if len(scale) else None)
    lo_k, hi_k = int(scales[0]), int(scales[1])
    loss_dtype, unknown = recorded_loss_dtype(run, int(step))
    if unknown:
        notes.append(unknown)
    overflow_k, cause, edge_by = overflow_edge(layers, loss_max_k(loss_dtype))
    usable = []
    for k in range(lo_k, hi_k + 1):
        if overflow_k is not None and k > overflow_k:
            break
        share = _estimated_share(layers, k, norm)
        if share is None or share <= max_underflow:
            usable.append(k)
    for lay in layers:
        if lay.get("weight_gradient"):
            continue
        lay["underflow_k"] = next((k for k in range(lo_k, hi_k + 1)
                                   if (_estimated_share([lay], k, norm) or 0.0) <= max_underflow), None)
    if any(lay.get("assumed_spread") for lay in layers):
        notes.append(f"some gradients lie entirely below the float16 normal limit at the recorded scale: "
                     f"their spread is assumed ({ASSUMED_LOG2_SIGMA:g} bits), the underflow edge is approximate")
    if not any(lay["log2_sigma"] is not None for lay in layers):
        notes.append("no full-tier statistics at this step: the underflow edge is unknown (overflow edge only)")
    window = usable_window(usable)
    if window is None and not len(scale):
        # No scale was applied: the statistics are those of gradients float16
        # already flushed at scale 1, which cannot place the underflow edge.
        notes.insert(0, NO_SCALE_APPLIED + (f"; they overflow above 2^{overflow_k}" if overflow_k is not None else ""))
    elif window is None:
        notes.insert(0, "the estimated overflow edge lies below the estimated underflow edge")
    settings, code = scaler_settings(window, device_type=(run.autocast or {}).get("device_type")
                                     or run.manifest.get("device_type") or "cuda")
    ranks = sorted(df["rank"].unique())
    return ScaleWindow(method=WindowMethod.ESTIMATE, step=int(step), rank=int(ranks[0]) if len(ranks) == 1 else None,
                       recorded_scale=recorded_scale if len(scale) else None, window=window,
                       recorded_position=position_in_window(window, shift if len(scale) else None), settings=settings,
                       code=code, rows=[{k: lay[k] for k in LAYER_COLUMNS} for lay in layers],
                       max_underflow=max_underflow, notes=notes + calibration_notes(run.scaler, window),
                       recorded_scaler=run.scaler, verified=False, why=unverified_why(run),
                       overflow_cause=cause, overflow_edge_by=edge_by, loss_dtype=loss_dtype,
                       loss_max_k=loss_max_k(loss_dtype))


def overflow_edge(layers, loss_k: int | None):
    """(the overflow edge k, its EdgeCause, the tensor that sets it): the
    lowest of the layers' edges (module output gradients, float16 weight
    gradients) and the loss's own (`loss_k`: the scale itself rounded to the
    loss's dtype, the backward's first gradient; it wins a tie, being first).
    Marks each layer with its `edge_cause`."""
    edges = []
    if loss_k is not None:
        edges.append((loss_k, 0, EdgeCause.LOSS_DTYPE, LOSS_ROW))
    for lay in layers:
        lay["edge_cause"] = (EdgeCause.WEIGHT_GRAD if lay.get("weight_gradient") else EdgeCause.ACTIVATION_GRAD).value
        if lay["overflow_k"] is not None:
            edges.append((lay["overflow_k"], 1, EdgeCause(lay["edge_cause"]), lay["name"]))
    if not edges:
        return None, None, None
    k, _, cause, name = min(edges, key=lambda e: (e[0], e[1]))
    return k, cause, name


def unverified_why(run, check: str = "replay the saved steps at the window's edges") -> str:
    """Why advice from recorded statistics is not verified by a replay:
    no bundle to replay, or no model to replay it with (`check` says what
    the replay would have done)."""
    if not run.manifest.get("bundles"):
        return (f"the run holds no replay bundle to {check} (AmpRecorder saves one on a non-finite step, or on "
                "request: bundle_steps)")
    return f"no --model given to {check}"


def _weight_gradients(run, step: int, fp16_modules: set, scale_k: int | None) -> list:
    """Overflow edges of the weight gradients computed in float16: the
    parameters of modules whose output gradient travelled in float16 (their
    weight-gradient matmul ran in float16 too), a tied parameter when any
    module using it did. `param_grad` rows hold the unscaled gradient: at
    scale 2^k the matmul's result is that times 2^k, and overflows above
    65504. Overflow edge only: a parameter gradient's distribution is not
    what the scale shifts into the subnormal range (the module gradients
    are)."""
    aliases = tied_aliases(run)
    df = run.scan_tensors(["step", "rank", "name", "kind", "numel", "absmax", "nan_count", "inf_count"],
                          steps=[step], kinds=["param_grad"], label="reading weight gradients")
    out = []
    for name, g in df.groupby("name", sort=False):
        users = [n.rpartition(".")[0] for n in [name] + aliases.get(name, [])]
        if not any(u in fp16_modules for u in users):
            continue
        absmax = _num(g["absmax"].max())
        edge = int(math.floor(math.log2(schema.FP16_MAX / absmax))) if absmax and absmax > 0 else None
        if ((g["nan_count"] + g["inf_count"]) > 0).any() and scale_k is not None:
            edge = scale_k - 1 if edge is None else min(edge, scale_k - 1)
        if edge is None:
            continue
        out.append({"name": name, "numel": int(g["numel"].max() or 0), "nonzero": 0, "below_normal_share": None,
                    "zero_share": None, "structural_zero_share": None, "flushed_zero_share": None,
                    "absmax_unscaled": absmax, "overflow_k": edge, "underflow_k": None,
                    "log2_mu": None, "log2_sigma": None, "weight_gradient": True})
    return out


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
           "structural_zero_share": None, "flushed_zero_share": None,
           "absmax_unscaled": absmax / 2 ** shift if absmax else absmax, "overflow_k": None,
           "underflow_k": None, "log2_mu": None, "log2_sigma": None}
    # A gradient that overflowed at the recorded scale 2^shift says so
    # itself, whatever its finite values: the edge lies below that scale.
    overflowed = (_num(r.get("inf_count")) or 0) + (_num(r.get("nan_count")) or 0) > 0
    cap = int(math.ceil(shift)) - 1 if overflowed else None
    out["overflow_k"] = cap
    if not absmax or absmax <= 0:
        return out
    a = math.log2(absmax)
    out["overflow_k"] = int(math.floor(math.log2(schema.FP16_MAX) - (a - shift)))
    if cap is not None:
        out["overflow_k"] = min(out["overflow_k"], cap)
    # Share of the fitted values below the float16 normal limit at the
    # recorded scale. Zeros the float16 range flushed are such values too
    # (censored, not absent): the fit covers them with the survivors, which
    # would otherwise make a tiny scale look sufficient. Structural zeros
    # (a mask, a ReLU, an absent token's row: zero at any scale) are no
    # values a scale could move: left out (`zero_split` tells them apart).
    below_q = None
    if below is not None:
        flushed = 0.0
        if zero:
            f = zero_split([zero], [below], [absmax], [numel]).flushed[0]
            flushed = float(f) if math.isfinite(f) else 0.0
            out["flushed_zero_share"], out["structural_zero_share"] = flushed, zero - flushed
        kept = max(1e-12, 1 - zero + flushed) if zero is not None else 1.0
        nonzero = max(1, round(numel * kept)) if zero is not None else max(1, numel)
        below_q = min(1.0, (below + flushed) / kept)
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
    return ScaleWindow(method=WindowMethod.ESTIMATE, step=step, rank=None, recorded_scale=scale, window=None,
                       recorded_position=None, settings=None, code=None, rows=[], max_underflow=max_underflow,
                       notes=notes, verified=False, why="no recorded statistics to estimate from")


def _num(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
