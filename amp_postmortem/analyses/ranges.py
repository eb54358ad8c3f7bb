"""Per-layer range: headroom to overflow, its trend, and underflow, each
against the limits of the dtype the tensor really had (`range_dtype`, from
the recorded `dtype` column: 65504 for float16; bfloat16 has float32's
exponent range, so its headroom is to 3.39e38; float16's limits when the
dtype is not a known float).

For each layer (module name and row kind: `input`, `activation`,
`grad_output`, `grad_input`) over the last `window` recorded steps:

- `headroom_bits` = log2(max / absmax) at the latest recorded step (ranks
  and repeated calls merged by their maximum). Gradient rows hold the
  *scaled* values that really travel in float16, so their headroom is the
  real one. 0 when the latest row already holds Inf/NaN; null when the
  latest absmax is 0 (nothing to overflow).
- `headroom_trend_per_kstep`: Theil-Sen slope of the headroom over step
  (finite, non-zero rows of the window), in bits per 1000 steps.
- `overflow_forecast_step`: where that trend reaches zero headroom, when the
  fall is significant (the upper end of its `1 - ALPHA` confidence interval
  is below zero).
- `underflow_share`: median over the window's full-tier rows of the share
  of values in the float16 subnormal range (non-zero, below 6.1e-5: they
  lose precision) plus the exact zeros the float16 range flushed.
  The recorder counts against float16's limits; a wider dtype's smallest
  normal (1.2e-38 for bfloat16 and float32) lies below float16's subnormal
  limit (6e-8), so its share is 0 where the recorded share below 6e-8 is 0,
  and unknown (null) otherwise.
- Exact zeros are not underflow by themselves: a mask, a ReLU, the
  embedding rows of tokens absent from the batch or a zero-initialised
  gamma make zeros that are zero at any scale. `zero_split` tells them
  apart by the recorded distribution of the non-zero values (flushed zeros
  are its tail below 2^-25, which passes through the ten subnormal binades
  first): `flushed_zero_share` (counted in `underflow_share`),
  `structural_zero_share` (not counted), and `zeros`, the verdict at the
  latest evidence step (`structural`, `flushed`, `mixed`, `none`, or
  `undetermined`: not counted), with `zeros_told`: whether the recorded
  distribution told them apart there (false: the verdict is the default
  below, and only a replay of a saved step can tell, `whatif/flush.py`). Where a row's values
  sit at the flush edge, the layer's structural share at the steps that
  could tell is structural there too, the rest flushed (`row_shares`). A
  row of nothing but zeros is `undetermined` (a zero-initialised weight or
  bias makes one in a layer whose other steps have no zero: they are no
  evidence), except a gradient row in a step where other gradients
  underflow, counted as flushed whole; a forward row never is. `zero_share` is
  reported beside them, and `share_sample_size`: how many values of the
  tensor the shares were counted on (the recorder samples at most 65,536
  per tensor; null for runs recorded before the format said).
- Dating (`underflow.underflow_evidence`): `evidence_first_step`..`evidence_last_step` (and
  `evidence_steps`, how many) are the full-tier steps the shares come
  from (those whose share is known); `recent_underflow_share` is the median over the recent ones (from
  `recent_from_step`: the window's last `RECENT_PART`, or the latest
  evidence step when none lies there; null when that step lies in the
  window's first `STALE_PART`); `underflow_first_step`..`underflow_last_step`
  the evidence steps at or above `UNDERFLOW_SHARE`, with
  `underflow_episode_share` the median between them.

Inside probed modules (runs recorded with `AmpRecorder(probe=...)`: the
`intermediate` rows, one per operation of a probed module's forward), one
row per module in `intermediates`: at its latest recorded step, the
operation nearest to its dtype's overflow (`op`, `source` line, `op_index`,
`dtype`, `absmax`, `headroom_bits` against that dtype's largest value, ranks
and calls merged by their maximum), the window's closest approach
(`min_headroom_bits`, at `min_headroom_step`, by `min_headroom_op`), the
module's own `activation` headroom beside it (`output_headroom_bits`) and
`nonfinite_ops` (operations of the latest step with a NaN/Inf: counted, not
flagged, as a mask's -Inf is often meant). Flag `overflow_risk`: that op
has less than `OVERFLOW_RISK_BITS` of headroom, whether or not the module's
output shows it (a float16 variance `x * x` at 60,000 before a finite
normalised output).

Flags (each row against its own dtype's limits):
- `overflow_risk`: an `input`/`activation` row with less than
  `OVERFLOW_RISK_BITS` of headroom, or a significant fall forecast to reach
  zero within `FORECAST_IMMINENT` steps, or within `FORECAST_HORIZON` steps
  while less than `FORECAST_RISK_BITS` remain (early in training
  activations grow before they settle: a slow trend far from the limit is
  no alarm yet). Gradient rows are not flagged: a
  dynamic loss scaler keeps them close to the limit on purpose and backs off
  when they overflow.
- `underflow`: a `grad_output` row whose `recent_underflow_share` is at
  least `UNDERFLOW_SHARE`: it underflows now.
- `underflow_lapsed`: a `grad_output` row that underflowed during
  `underflow_first_step`..`underflow_last_step`, before its recent part,
  but no more (the recent share is below `UNDERFLOW_SHARE`), or whose
  evidence is stale: no warning (`summary` says it as an info).
- `nonfinite`: the latest row holds Inf/NaN.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from recorders.format import schema

from ..reading.loader import Run
from ..reading.step_series import recorded_steps
from .range_limits import (DTYPE_LIMITS, FALLBACK_DTYPE, FORECAST_HORIZON, FORECAST_IMMINENT, FORECAST_RISK_BITS,
                           OVERFLOW_RISK_BITS, UNDERFLOW_SHARE, range_dtype)
from .ranges_report import RangesReport, lapsed_words, recent_words, sampled_values
from .ranges_shards import KINDS, reduce_window
from .trend import theil_sen
from .underflow import GRADIENT_KINDS, flushing_steps, underflow_evidence, underflow_share_of_rows, zero_split

# The entry point, and what other modules take from here, re-exported: the
# limits (range_limits.py), the report and its sentences (ranges_report.py),
# the rows read (ranges_shards.py) and the underflow rules (underflow.py).
__all__ = ["DTYPE_LIMITS", "INTERMEDIATE_COLUMNS", "KINDS", "LAYER_COLUMNS", "WINDOW", "RangesReport",
           "intermediate_ranges", "lapsed_words", "layer_ranges", "probed", "recent_words", "sampled_values",
           "underflow_share_of_rows", "zero_split"]

WINDOW = 1000                 # default: the last 1000 recorded steps
ALPHA = 0.01
MIN_TREND_POINTS = 5
MAX_THEILSEN_POINTS = 200     # Theil-Sen is O(n^2) per layer: subsample evenly above this

# Where each layer's underflow evidence comes from (`underflow_evidence`): steps.
_EVIDENCE_STEPS = ("evidence_first_step", "evidence_last_step", "recent_from_step", "underflow_first_step",
                   "underflow_last_step")
LAYER_COLUMNS = ["name", "kind", "dtype", "range_dtype", "step", "absmax", "headroom_bits",
                 "headroom_trend_per_kstep", "overflow_forecast_step", "underflow_share", "zero_share",
                 "share_sample_size", "flags", "structural_zero_share", "flushed_zero_share", "zeros",
                 "zeros_told", "evidence_steps", *_EVIDENCE_STEPS[:2], "recent_underflow_share", _EVIDENCE_STEPS[2],
                 "underflow_episode_share", *_EVIDENCE_STEPS[3:]]


INTERMEDIATE_COLUMNS = ["name", "op", "source", "op_index", "dtype", "range_dtype", "step", "absmax",
                        "headroom_bits", "output_headroom_bits", "nonfinite_ops", "min_headroom_bits",
                        "min_headroom_step", "min_headroom_op", "flags"]
_INTERMEDIATE_READ = ["step", "name", "kind", "op", "op_index", "source", "dtype", "absmax", "nan_count",
                      "inf_count"]


def window_start(run: Run, window: int) -> int | None:
    """The first step of the last `window` recorded steps (those with module
    rows on any rank), None when the run has no more: the whole run. A
    sentinel run has rows on one step in `cheap_every` (and the re-executed
    ones), so a window counted in step numbers would hold one sampled step
    or none, and no trend; an every-step run's window is its last `window`
    steps either way."""
    recorded = recorded_steps(run.step_series().steps)
    return int(recorded.iloc[-window]) if len(recorded) > window else None


def layer_ranges(run: Run, *, window: int | None = WINDOW) -> RangesReport:
    """Headroom, trend, forecast and underflow per layer over the last
    `window` recorded steps (`window_start`; None or 0: all)."""
    last = run.last_step
    if last is None:
        return RangesReport(layers=_empty(), first_step=None, last_step=None, intermediates=_empty_intermediates())
    lo = None if not window else window_start(run, int(window))
    lo_step = run.first_step if lo is None else lo
    per_step = reduce_window(run, lo)
    if per_step is None:
        return RangesReport(layers=_empty(), first_step=lo, last_step=last,
                            intermediates=intermediate_ranges(run, lo))
    cols, bounds = per_step.cols, per_step.bounds
    top_of = np.array([DTYPE_LIMITS[range_dtype(d)][0] for d in per_step.dtypes]
                      + [DTYPE_LIMITS[FALLBACK_DTYPE][0]])  # code -1: no dtype recorded
    full_all = per_step.full[per_step.full["below_normal_share"].notna() & ~per_step.full["bad"]]
    # Which rows are gradients: only those can be flushed whole by a flushing step (`row_shares`).
    gradient = np.array([kind in GRADIENT_KINDS for _, kind in per_step.layers] + [False])
    full_all = full_all.assign(gradient=gradient[full_all["lid"].to_numpy()])
    full_of = full_all.groupby("lid", sort=False).indices  # row positions per layer, not 1,000s of frames
    # Steps where some float16 gradient underflows: an all-zero row there was flushed whole.
    shares_by_limit: dict = {"flushing_steps": flushing_steps(full_all, per_step.layers)}

    rows = []
    for lid in per_step.order:
        name, kind = per_step.layers[lid]
        s = slice(bounds[lid], bounds[lid + 1])
        g_step, g_absmax, g_bad, g_dtype = cols["step"][s], cols["absmax"][s], cols["bad"][s], cols["dtype"][s]
        step = int(g_step[-1])
        dtype = per_step.dtypes[g_dtype[-1]] if g_dtype[-1] >= 0 else None
        limit = range_dtype(dtype)
        absmax = float(g_absmax[-1]) if pd.notna(g_absmax[-1]) else None
        bad = bool(g_bad[-1])
        if bad:
            headroom = 0.0
        elif absmax is None or absmax <= 0:
            headroom = None
        else:
            headroom = math.log2(DTYPE_LIMITS[limit][0] / absmax)

        with np.errstate(invalid="ignore"):
            ok = ~g_bad & (g_absmax > 0)
        trend = forecast = None
        if int(ok.sum()) >= MIN_TREND_POINTS:  # one row per step: the count of distinct steps
            x = g_step[ok].astype(float)
            h = np.log2(top_of[g_dtype[ok]] / g_absmax[ok].astype(float))
            slope, lo_s, hi_s = theil_sen(x, h, alpha=ALPHA, max_points=MAX_THEILSEN_POINTS)
            trend = slope * 1000
            if hi_s < 0 and headroom is not None and headroom > 0:
                forecast = int(step + math.ceil(headroom / -slope))

        at = full_of.get(lid)
        full = full_all.iloc[at] if at is not None else None
        ev = underflow_evidence(full, limit, shares_by_limit, full_all, lo_step, last)
        flags = []
        if bad:
            flags.append("nonfinite")
        if kind in ("input", "activation") and not bad:
            near = headroom is not None and headroom < OVERFLOW_RISK_BITS
            soon = forecast is not None and (
                forecast - step <= FORECAST_IMMINENT
                or (forecast - step <= FORECAST_HORIZON and headroom < FORECAST_RISK_BITS))
            if near or soon:
                flags.append("overflow_risk")
        if kind == "grad_output" and ev["recent_underflow_share"] is not None \
                and ev["recent_underflow_share"] >= UNDERFLOW_SHARE:
            flags.append("underflow")
        elif kind == "grad_output" and ev["underflow_episode_share"] is not None and (
                ev["recent_from_step"] is None or ev["underflow_last_step"] < ev["recent_from_step"]):
            flags.append("underflow_lapsed")  # it was, before the recent part; it is no more (or nothing says)
        rows.append({"name": name, "kind": kind, "dtype": dtype, "range_dtype": limit,
                     "step": step, "absmax": absmax,
                     "headroom_bits": headroom, "headroom_trend_per_kstep": trend,
                     "overflow_forecast_step": forecast, **ev, "flags": flags,
                     "_phase": 0 if cols["fwd"][s][-1] == 1 else 1, "_order": int(cols["order"][s][-1])})
    layers = pd.DataFrame(rows).sort_values(["_phase", "_order"], kind="stable")
    layers = layers[LAYER_COLUMNS].reset_index(drop=True)
    for col in ("step", "overflow_forecast_step", "share_sample_size") + _EVIDENCE_STEPS:
        layers[col] = layers[col].astype("Int64")  # integers with missing values
    inside = intermediate_ranges(run, lo)
    if len(inside):
        outputs = layers[layers["kind"] == "activation"].set_index("name")["headroom_bits"]
        inside["output_headroom_bits"] = [_finite_or_none(outputs.get(n)) for n in inside["name"]]
    return RangesReport(layers=layers, first_step=int(cols["step"].min()), last_step=last,
                        full_tier_steps=per_step.full_steps, intermediates=inside)


def probed(run: Run) -> bool:
    """Whether a rank of the run was recorded with an op probe that hooked a
    module (its manifest says)."""
    probes = [(m.get("recorder") or {}).get("probe") for m in [run.manifest, *run.rank_manifests.values()]
              if isinstance(m.get("recorder"), dict)]
    return any(isinstance(p, dict) and (p.get("probed") or p.get("full_tier_leaves")) for p in probes)


def intermediate_ranges(run: Run, lo=None) -> pd.DataFrame:
    """INTERMEDIATE_COLUMNS: per probed module, the operation nearest to its
    dtype's overflow at the module's latest step from `lo` on (see the
    module doc). A run without an op probe is not read again."""
    if not probed(run):
        return _empty_intermediates()
    df = run.scan_tensors(_INTERMEDIATE_READ, kinds=[schema.INTERMEDIATE_KIND], step_range=(lo, None),
                          label="reading probed operations")
    df = df[df["kind"] == schema.INTERMEDIATE_KIND]
    if df.empty:
        return _empty_intermediates()
    df = df.assign(source=df["source"].fillna(""), op_index=df["op_index"].fillna(-1).astype(int),
                   bad=(df["nan_count"] + df["inf_count"]) > 0)
    # Ranks and calls merged: the largest magnitude, any NaN/Inf, the first dtype.
    ops = (df.groupby(["name", "step", "op_index", "op", "source"], sort=False)
           .agg(absmax=("absmax", "max"), bad=("bad", "any"), dtype=("dtype", "first")).reset_index())
    ops["range_dtype"] = [range_dtype(d) for d in ops["dtype"]]
    top = ops["range_dtype"].map(lambda d: DTYPE_LIMITS[d][0])
    with np.errstate(divide="ignore", invalid="ignore"):
        ops["headroom_bits"] = np.where(ops["absmax"] > 0, np.log2(top / ops["absmax"]), np.nan)
    rows = []
    for name, g in ops.groupby("name", sort=False):
        latest = g[g["step"] == g["step"].max()]
        known = latest.dropna(subset=["headroom_bits"])
        near = known.sort_values(["headroom_bits", "op_index"], kind="stable").iloc[0] if len(known) else None
        window = g.dropna(subset=["headroom_bits"]).sort_values(["headroom_bits", "step", "op_index"],
                                                                kind="stable")
        closest = window.iloc[0] if len(window) else None
        headroom = float(near["headroom_bits"]) if near is not None else None
        pick = near if near is not None else latest.iloc[0]
        rows.append({"name": name, "op": pick["op"], "source": pick["source"] or None,
                     "op_index": int(pick["op_index"]), "dtype": pick["dtype"], "range_dtype": pick["range_dtype"],
                     "step": int(pick["step"]), "absmax": float(pick["absmax"]) if near is not None else None,
                     "headroom_bits": headroom, "output_headroom_bits": None,
                     "nonfinite_ops": int(latest["bad"].sum()),
                     "min_headroom_bits": float(closest["headroom_bits"]) if closest is not None else None,
                     "min_headroom_step": int(closest["step"]) if closest is not None else None,
                     "min_headroom_op": closest["op"] if closest is not None else None,
                     "flags": ["overflow_risk"] if headroom is not None and headroom < OVERFLOW_RISK_BITS else []})
    out = pd.DataFrame(rows, columns=INTERMEDIATE_COLUMNS)
    for col in ("step", "min_headroom_step"):
        out[col] = out[col].astype("Int64")
    return out


def _empty_intermediates() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in INTERMEDIATE_COLUMNS})


def _finite_or_none(v):
    return float(v) if v is not None and pd.notna(v) else None


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in LAYER_COLUMNS})
