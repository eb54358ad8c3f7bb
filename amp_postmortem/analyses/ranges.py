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
  lose precision) plus, when the zeros look flushed, the exact zeros.
  The recorder counts against float16's limits; a wider dtype's smallest
  normal (1.2e-38 for bfloat16 and float32) lies below float16's subnormal
  limit (6e-8), so its share is 0 where the recorded share below 6e-8 is 0,
  and unknown (null) otherwise.
  Exact zeros are also structural (the gradient behind a ReLU is zero
  wherever its input was negative), so they count only when the typical
  non-zero value (RMS over the non-zero values) lies within
  `FLUSH_MARGIN_BITS` of the normal limit: there the zeros are values the
  float16 range flushed, not a mask. `zero_share` is reported beside it,
  and `share_sample_size`: how many values of the tensor the shares were
  counted on (the recorder samples at most 65,536 per tensor; null for runs
  recorded before the format said).

Flags (each row against its own dtype's limits):
- `overflow_risk`: an `input`/`activation` row with less than
  `OVERFLOW_RISK_BITS` of headroom, or a significant fall forecast to reach
  zero within `FORECAST_IMMINENT` steps, or within `FORECAST_HORIZON` steps
  while less than `FORECAST_RISK_BITS` remain (early in training
  activations grow before they settle: a slow trend far from the limit is
  no alarm yet). Gradient rows are not flagged: a
  dynamic loss scaler keeps them close to the limit on purpose and backs off
  when they overflow.
- `underflow`: a `grad_output` row with `underflow_share` >= `UNDERFLOW_SHARE`.
- `nonfinite`: the latest row holds Inf/NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recorders import schema

from ..names import display_name as _display
from ..loader import Run
from recorders.plain import plain
from .trend import theil_sen

KINDS = ("input", "activation", "grad_output", "grad_input")
WINDOW = 1000                 # default: the last 1000 recorded steps
OVERFLOW_RISK_BITS = 2.0      # < 2 bits: absmax above 16376, a factor 4 from Inf
FORECAST_HORIZON = 1000       # steps after the latest one
FORECAST_RISK_BITS = 6.0      # a forecast alarms within a factor 64 of the limit...
FORECAST_IMMINENT = 100       # ...or, whatever the headroom, when it is this few steps away
UNDERFLOW_SHARE = 0.25        # a quarter of a gradient's values subnormal or flushed
FLUSH_MARGIN_BITS = 2.0       # zeros count as flushed when non-zero values sit this close to 6.1e-5
ALPHA = 0.01
MIN_TREND_POINTS = 5
MAX_THEILSEN_POINTS = 200     # Theil-Sen is O(n^2) per layer: subsample evenly above this

# (largest finite value, smallest normal) per dtype; float16's when the dtype is unknown.
DTYPE_LIMITS = {
    "float16": (schema.FP16_MAX, schema.FP16_MIN_NORMAL),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38),
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38),
    "float64": (1.7976931348623157e308, 2.2250738585072014e-308),
}
FALLBACK_DTYPE = "float16"

_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "dtype", "absmax", "nan_count",
            "inf_count", "zero_share", "below_normal_share", "below_subnormal_share", "rms", "share_sample_size"]
LAYER_COLUMNS = ["name", "kind", "dtype", "range_dtype", "step", "absmax", "headroom_bits",
                 "headroom_trend_per_kstep", "overflow_forecast_step", "underflow_share", "zero_share",
                 "share_sample_size", "flags"]


@dataclass
class RangesReport:
    layers: pd.DataFrame      # LAYER_COLUMNS, in execution order (forward, then backward)
    first_step: int | None    # the window analysed
    last_step: int | None
    full_tier_steps: int = 0  # steps of the window with full-tier statistics

    def to_dict(self) -> dict:
        rows = []
        for r in self.layers.to_dict("records"):
            rows.append({k: plain(v) for k, v in r.items()})
        return {"layers": rows, "first_step": self.first_step, "last_step": self.last_step,
                "full_tier_steps": self.full_tier_steps,
                "thresholds": {"overflow_risk_bits": OVERFLOW_RISK_BITS, "forecast_horizon": FORECAST_HORIZON,
                               "forecast_risk_bits": FORECAST_RISK_BITS, "forecast_imminent": FORECAST_IMMINENT,
                               "underflow_share": UNDERFLOW_SHARE,
                               "flush_margin_bits": FLUSH_MARGIN_BITS,
                               "dtype_limits": {d: {"max": mx, "min_normal": mn}
                                                for d, (mx, mn) in DTYPE_LIMITS.items()}}}

    def table(self) -> pd.DataFrame:
        t = self.layers.copy()
        t["flags"] = [",".join(f) for f in t["flags"]]
        return t

    def flagged(self, flag: str) -> pd.DataFrame:
        return self.layers[[flag in f for f in self.layers["flags"]]]

    def lines(self) -> list[str]:
        if self.first_step is None:
            return ["No tensor rows recorded."]
        out = [f"steps {self.first_step}-{self.last_step} ({self.full_tier_steps} with full-tier statistics)"]
        used = self.layers["range_dtype"].value_counts()
        out.append("limits: " + ", ".join(f"{d} (max {DTYPE_LIMITS[d][0]:.6g}) for {n} row(s)"
                                          for d, n in sorted(used.items())))
        for flag in ("nonfinite", "overflow_risk", "underflow"):
            hit = self.flagged(flag)
            if len(hit):
                names = ", ".join(sorted({_display(n) for n in hit["name"]}))
                out.append(f"{flag}: {len(hit)} row(s): {names}")
                if flag == "underflow":
                    worst = hit.sort_values("underflow_share", ascending=False, kind="stable").iloc[0]
                    out.append(f"worst underflow: {_display(worst['name'])} {worst['kind']}, "
                               f"{worst['underflow_share']:.0%} of {sampled_values(worst['share_sample_size'])}")
        if self.full_tier_steps == 0:
            out.append("no full-tier step in the window: underflow shares unknown")
        return out


def layer_ranges(run: Run, *, window: int | None = WINDOW) -> RangesReport:
    """Headroom, trend, forecast and underflow per layer over the last `window` steps (None: all)."""
    last = run.last_step
    if last is None:
        return RangesReport(layers=_empty(), first_step=None, last_step=None)
    lo = None if not window else max(run.first_step, last - int(window) + 1)
    per_step, full_steps = _per_step(run, lo)
    if per_step is None:
        return RangesReport(layers=_empty(), first_step=lo, last_step=last)
    per_step = per_step.sort_values("step", kind="stable")

    rows = []
    for (name, kind), g in per_step.groupby(["name", "kind"], sort=False):
        latest = g.iloc[-1]
        step = int(latest["step"])
        limit = range_dtype(latest["dtype"])
        absmax = float(latest["absmax"]) if pd.notna(latest["absmax"]) else None
        if latest["bad"]:
            headroom = 0.0
        elif absmax is None or absmax <= 0:
            headroom = None
        else:
            headroom = math.log2(DTYPE_LIMITS[limit][0] / absmax)

        ok = g[~g["bad"] & (g["absmax"] > 0)]
        trend = forecast = None
        if ok["step"].nunique() >= MIN_TREND_POINTS:
            x = ok["step"].to_numpy(float)
            top = np.array([DTYPE_LIMITS[range_dtype(d)][0] for d in ok["dtype"]])
            h = np.log2(top / ok["absmax"].to_numpy(float))
            slope, lo_s, hi_s = theil_sen(x, h, alpha=ALPHA, max_points=MAX_THEILSEN_POINTS)
            trend = slope * 1000
            if hi_s < 0 and headroom is not None and headroom > 0:
                forecast = int(step + math.ceil(headroom / -slope))

        full = g[g["below_normal_share"].notna() & ~g["bad"]]
        underflow = zeros = sampled = None
        if len(full):
            zeros = float(full["zero_share"].median())
            shares = underflow_share_of_rows(full, limit)
            if shares.notna().all():
                underflow = float(shares.median())
            sizes = full["share_sample_size"].dropna()
            sampled = int(sizes.median()) if len(sizes) else None

        flags = []
        if latest["bad"]:
            flags.append("nonfinite")
        if kind in ("input", "activation") and not latest["bad"]:
            near = headroom is not None and headroom < OVERFLOW_RISK_BITS
            soon = forecast is not None and (
                forecast - step <= FORECAST_IMMINENT
                or (forecast - step <= FORECAST_HORIZON and headroom < FORECAST_RISK_BITS))
            if near or soon:
                flags.append("overflow_risk")
        if kind == "grad_output" and underflow is not None and underflow >= UNDERFLOW_SHARE:
            flags.append("underflow")
        rows.append({"name": name, "kind": kind, "dtype": latest["dtype"], "range_dtype": limit,
                     "step": step, "absmax": absmax,
                     "headroom_bits": headroom, "headroom_trend_per_kstep": trend,
                     "overflow_forecast_step": forecast, "underflow_share": underflow, "zero_share": zeros,
                     "share_sample_size": sampled, "flags": flags, "_phase": 0 if latest["phase"] == "forward" else 1,
                     "_order": int(latest["order"])})
    layers = pd.DataFrame(rows).sort_values(["_phase", "_order"], kind="stable")
    layers = layers[LAYER_COLUMNS].reset_index(drop=True)
    for col in ("step", "overflow_forecast_step", "share_sample_size"):
        layers[col] = layers[col].astype("Int64")  # integers with missing values
    return RangesReport(layers=layers, first_step=int(per_step["step"].min()), last_step=last,
                        full_tier_steps=int(full_steps))


# One value per layer and step: ranks and repeated calls merged. Max, any,
# min and first merge shard by shard exactly; the means (full-tier columns,
# null in cheap-tier rows) are taken at the end over the full-tier rows
# only, in the order read, which is the same sum as over every row: so the
# memory is bounded by window x layers (plus the full-tier rows), not by
# ranks x window x layers.
_KEYS = ["name", "kind", "step"]
# share_sample_size: the values the shares were counted on, summed over
# ranks and calls (Arrow's sum over nothing but nulls is null: unknown).
_MERGED = {"absmax": "max", "bad": "any", "dtype": "first", "phase": "first", "order": "min", "rms": "max",
           "share_sample_size": "sum"}
_MEANS = ["zero_share", "below_normal_share", "below_subnormal_share"]
_PER_STEP = _KEYS + ["absmax", "bad", "dtype", "phase", "order", "zero_share", "below_normal_share",
                     "below_subnormal_share", "rms", "share_sample_size"]
_CONSOLIDATE_ROWS = 1 << 20


@dataclass
class ShardRanges:
    """One shard's part of the per-step table (see `reduce_shard`)."""
    merged: pa.Table   # _KEYS + _MERGED, one row per layer and step, in order of first row
    full: pa.Table     # _KEYS + _MEANS, the full-tier rows as read
    full_steps: set
    rows: int


def reduce_shard(rows: pa.Table) -> ShardRanges:
    """The per-shard map of `ranges` (runs where the shard is read). In
    Arrow: at 1,000 ranks it runs once per shard of the window."""
    bad = pc.greater(pc.add(rows["nan_count"], rows["inf_count"]), 0)
    rows = rows.append_column("bad", bad)
    has_full = pc.or_kleene(pc.or_kleene(pc.is_valid(rows["zero_share"]), pc.is_valid(rows["below_normal_share"])),
                            pc.is_valid(rows["below_subnormal_share"]))
    full = rows.filter(has_full).select(_KEYS + _MEANS)
    steps = pc.unique(rows.filter(pc.is_valid(rows["below_normal_share"]))["step"]).to_pylist()
    return ShardRanges(_merge(rows.select(_KEYS + list(_MERGED))), full, set(steps), rows.num_rows)


def _merge(table: pa.Table) -> pa.Table:
    """Rows of equal (name, kind, step) merged, groups in order of their
    first row (a single-threaded Arrow group-by keeps that order)."""
    out = table.group_by(_KEYS, use_threads=False).aggregate([(c, f) for c, f in _MERGED.items()])
    return pa.table({**{k: out[k] for k in _KEYS}, **{c: out[f"{c}_{f}"] for c, f in _MERGED.items()}})


def _per_step(run: Run, lo) -> tuple[pd.DataFrame | None, int]:
    merged = None
    pending: list[pa.Table] = []
    full: list[pa.Table] = []
    full_steps: set = set()
    rows = 0
    for part in run.map_tensor_shards(reduce_shard, _COLUMNS, kinds=KINDS, step_range=(lo, None),
                                      label="reading ranges"):
        rows += part.rows
        pending.append(part.merged)
        full.append(part.full)
        full_steps |= part.full_steps
        if sum(p.num_rows for p in pending) >= _CONSOLIDATE_ROWS:
            merged = _merge(pa.concat_tables(([merged] if merged is not None else []) + pending))
            pending = []
    if not rows:
        return None, 0
    if pending:
        merged = _merge(pa.concat_tables(([merged] if merged is not None else []) + pending))
    # The means in pandas, as one pass over the full-tier rows in the order
    # read (pandas' compensated sum: the same value as over every row).
    full_rows = pa.concat_tables(full).to_pandas()
    means = full_rows.groupby(_KEYS, sort=False)[_MEANS].mean().reset_index()
    per_step = merged.to_pandas().merge(means, on=_KEYS, how="left")
    return per_step[_PER_STEP], len(full_steps)


def sampled_values(size) -> str:
    """How many values a share was counted on, for sentences: "50,000
    sampled values", or "its values" for a run that did not record it."""
    if size is None or pd.isna(size):
        return "its values"
    return f"{int(size):,} sampled values"


def range_dtype(dtype) -> str:
    """The dtype whose limits apply to a row of recorded `dtype`."""
    return dtype if isinstance(dtype, str) and dtype in DTYPE_LIMITS else FALLBACK_DTYPE


def zeros_look_flushed(zero_share, rms, min_normal: float = schema.FP16_MIN_NORMAL) -> bool:
    """Whether a gradient's exact zeros are values the range flushed (its
    non-zero values are tiny: RMS over them within FLUSH_MARGIN_BITS of the
    normal limit `min_normal`, float16's by default) rather than a
    structural mask such as a ReLU's. All zeros count as flushed against
    float16's limit only: a wider dtype holding nothing but zeros got them
    from upstream (a float16 gradient flushed before it), not from its own
    range."""
    if zero_share is None or not zero_share > 0:
        return False
    nonzero = 1.0 - zero_share
    if nonzero <= 0 or rms is None or not math.isfinite(rms):
        return min_normal >= schema.FP16_MIN_NORMAL
    return rms / math.sqrt(nonzero) < min_normal * 2 ** FLUSH_MARGIN_BITS


def underflow_share_of_rows(full: pd.DataFrame, limit: str = "float16") -> pd.Series:
    """Per full-tier row: the share `underflow_share` counts against
    `limit`'s range (values below its smallest normal plus zeros that look
    flushed), before the median over steps; NaN where the recorded float16
    shares cannot tell."""
    return _below_normal(full, limit) + _flushed_zeros(full, DTYPE_LIMITS[limit][1])


def _below_normal(full: pd.DataFrame, limit: str) -> pd.Series:
    """Per row: the share of non-zero values below `limit`'s smallest normal,
    NaN where the recorded float16 shares cannot tell (see the module doc)."""
    if limit == "float16":
        return full["below_normal_share"]
    none_below_fp16_subnormal = full["below_subnormal_share"] == 0
    return pd.Series(np.where(none_below_fp16_subnormal, 0.0, np.nan), index=full.index)


def _flushed_zeros(full: pd.DataFrame, min_normal: float = schema.FP16_MIN_NORMAL) -> pd.Series:
    """Per row: the zero share when those zeros look flushed, else 0."""
    flushed = [zeros_look_flushed(_finite_or_none(z), _finite_or_none(r), min_normal)
               for z, r in zip(full["zero_share"], full["rms"])]
    return full["zero_share"].where(pd.Series(flushed, index=full.index), 0.0)


def _finite_or_none(v):
    return float(v) if v is not None and pd.notna(v) else None




def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in LAYER_COLUMNS})
