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
  `undetermined`: not counted). Where a row alone cannot tell (its values
  sit at the flush edge, or it is all zeros), the layer's structural share
  at the steps that could tell is structural there too (`row_shares`); an
  all-zero row beyond that counts as flushed only in a step where other
  gradients underflow, and is no evidence otherwise. `zero_share` is
  reported beside them, and `share_sample_size`: how many values of the
  tensor the shares were counted on (the recorder samples at most 65,536
  per tensor; null for runs recorded before the format said).
- Dating (`_evidence`): `evidence_first_step`..`evidence_last_step` (and
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

import enum
import math
import typing
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recorders import schema

from ..names import display_name as _display
from ..loader import Run
from ..engines.scan import reduces_batches
from recorders.plain import plain
from .trend import theil_sen
from ..display import report_html, report_repr
from ..result import CommandResult

KINDS = ("input", "activation", "grad_output", "grad_input")
WINDOW = 1000                 # default: the last 1000 recorded steps
OVERFLOW_RISK_BITS = 2.0      # < 2 bits: absmax above 16376, a factor 4 from Inf
FORECAST_HORIZON = 1000       # steps after the latest one
FORECAST_RISK_BITS = 6.0      # a forecast alarms within a factor 64 of the limit...
FORECAST_IMMINENT = 100       # ...or, whatever the headroom, when it is this few steps away
UNDERFLOW_SHARE = 0.25        # a quarter of a gradient's values subnormal or flushed
FLUSH_MARGIN_BITS = 2.0       # no longer used (zeros are judged by `zero_split`); kept in --json's thresholds
LOG2_MIN_NORMAL = -14         # float16's smallest normal, 2^-14 = 6.1e-5
LOG2_FLUSH_EDGE = -25         # float16 rounds |x| < 2^-25 to zero (2^-24 is its smallest subnormal)
MIN_FIT_SPREAD = 1.0          # the fit's two quantiles at least this many sigmas apart, else the values sit at the edge
MIN_GAP_VALUES = 32           # non-zero values needed before an empty subnormal band proves the zeros structural
RECENT_PART = 0.25            # the recent evidence: full-tier steps of the window's last quarter...
STALE_PART = 0.5              # ...or the latest one, unless it lies in the window's first half (stale)
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
# Where each layer's underflow evidence comes from (`_evidence`): steps.
_EVIDENCE_STEPS = ("evidence_first_step", "evidence_last_step", "recent_from_step", "underflow_first_step",
                   "underflow_last_step")
LAYER_COLUMNS = ["name", "kind", "dtype", "range_dtype", "step", "absmax", "headroom_bits",
                 "headroom_trend_per_kstep", "overflow_forecast_step", "underflow_share", "zero_share",
                 "share_sample_size", "flags", "structural_zero_share", "flushed_zero_share", "zeros",
                 "evidence_steps", *_EVIDENCE_STEPS[:2], "recent_underflow_share", _EVIDENCE_STEPS[2],
                 "underflow_episode_share", *_EVIDENCE_STEPS[3:]]


INTERMEDIATE_COLUMNS = ["name", "op", "source", "op_index", "dtype", "range_dtype", "step", "absmax",
                        "headroom_bits", "output_headroom_bits", "nonfinite_ops", "min_headroom_bits",
                        "min_headroom_step", "min_headroom_op", "flags"]
_INTERMEDIATE_READ = ["step", "name", "kind", "op", "op_index", "source", "dtype", "absmax", "nan_count",
                      "inf_count"]


@dataclass
class RangesReport(CommandResult):
    layers: pd.DataFrame      # LAYER_COLUMNS, in execution order (forward, then backward)
    first_step: int | None    # the window analysed
    last_step: int | None
    full_tier_steps: int = 0  # steps of the window with full-tier statistics
    # INTERMEDIATE_COLUMNS, one row per probed module (empty: no op probe in the run)
    intermediates: pd.DataFrame | None = None

    def document(self) -> dict:
        rows = []
        for r in self.layers.to_dict("records"):
            rows.append({k: plain(v) for k, v in r.items()})
        inside = [] if self.intermediates is None else [
            {k: plain(v) for k, v in r.items()} for r in self.intermediates.to_dict("records")]
        return {"layers": rows, "first_step": self.first_step, "last_step": self.last_step,
                "full_tier_steps": self.full_tier_steps, "intermediates": inside,
                "thresholds": {"overflow_risk_bits": OVERFLOW_RISK_BITS, "forecast_horizon": FORECAST_HORIZON,
                               "forecast_risk_bits": FORECAST_RISK_BITS, "forecast_imminent": FORECAST_IMMINENT,
                               "underflow_share": UNDERFLOW_SHARE,
                               "flush_margin_bits": FLUSH_MARGIN_BITS,
                               "log2_flush_edge": LOG2_FLUSH_EDGE, "min_gap_values": MIN_GAP_VALUES,
                               "min_fit_spread": MIN_FIT_SPREAD,
                               "recent_part": RECENT_PART, "stale_part": STALE_PART,
                               "dtype_limits": {d: {"max": mx, "min_normal": mn}
                                                for d, (mx, mn) in DTYPE_LIMITS.items()}}}

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

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
        for flag in ("nonfinite", "overflow_risk", "underflow", "underflow_lapsed"):
            hit = self.flagged(flag)
            if len(hit):
                names = ", ".join(sorted({_display(n) for n in hit["name"]}))
                out.append(f"{flag}: {len(hit)} row(s): {names}")
                if flag == "underflow":
                    worst = hit.sort_values("recent_underflow_share", ascending=False, kind="stable").iloc[0]
                    out.append(f"worst underflow: {_display(worst['name'])} {worst['kind']}, "
                               f"{worst['recent_underflow_share']:.0%} of "
                               f"{sampled_values(worst['share_sample_size'])} {recent_words(worst)}")
                if flag == "underflow_lapsed":
                    worst = hit.sort_values("underflow_episode_share", ascending=False, kind="stable").iloc[0]
                    out.append(f"lapsed underflow: {_display(worst['name'])} {worst['kind']}, {lapsed_words(worst)}")
        grads = self.layers[self.layers["kind"] == "grad_output"]
        masked = grads[grads["zeros"].isin([Zeros.STRUCTURAL.value, Zeros.MIXED.value])
                       & (grads["structural_zero_share"].fillna(0) >= UNDERFLOW_SHARE)]
        if len(masked):
            out.append(f"structural zeros (zero at any scale: not underflow): {len(masked)} gradient row(s), "
                       + ", ".join(f"{_display(r['name'])} {r['structural_zero_share']:.0%}"
                                   for r in masked.head(5).to_dict("records"))
                       + (", ..." if len(masked) > 5 else ""))
        unknown = grads[grads["zeros"] == Zeros.UNDETERMINED.value]
        if len(unknown):
            out.append(f"undetermined zeros (every value zero, a zero weight's or a gradient flushed whole, or too "
                       f"few non-zero values to tell; not counted as underflow): "
                       f"{', '.join(sorted({_display(n) for n in unknown['name']}))}")
        out.extend(self._intermediate_lines())
        if self.full_tier_steps == 0:
            out.append("no full-tier step in the window: underflow shares unknown")
        return out

    def _intermediate_lines(self) -> list[str]:
        if self.intermediates is None or not len(self.intermediates):
            return []
        out = [f"probed modules: {len(self.intermediates)}"]
        for r in self.intermediates.to_dict("records"):
            if "overflow_risk" not in r["flags"]:
                continue
            where = f" at {r['source']}" if r["source"] else ""
            output = r["output_headroom_bits"]
            seen = "" if output is None or pd.isna(output) else f"; its output keeps {output:.1f} bits"
            out.append(f"overflow_risk inside {_display(r['name'])}: {r['op']}{where} reached "
                       f"{r['absmax']:,.6g} in {r['dtype']} (max {DTYPE_LIMITS[r['range_dtype']][0]:.6g}, "
                       f"{r['headroom_bits']:.2f} bits of headroom) at step {r['step']}{seen}")
        return out


def layer_ranges(run: Run, *, window: int | None = WINDOW) -> RangesReport:
    """Headroom, trend, forecast and underflow per layer over the last `window` steps (None: all)."""
    last = run.last_step
    if last is None:
        return RangesReport(layers=_empty(), first_step=None, last_step=None, intermediates=_empty_intermediates())
    lo = None if not window else max(run.first_step, last - int(window) + 1)
    lo_step = run.first_step if lo is None else lo
    per_step = _per_step(run, lo)
    if per_step is None:
        return RangesReport(layers=_empty(), first_step=lo, last_step=last,
                            intermediates=intermediate_ranges(run, lo))
    cols, bounds = per_step.cols, per_step.bounds
    top_of = np.array([DTYPE_LIMITS[range_dtype(d)][0] for d in per_step.dtypes]
                      + [DTYPE_LIMITS[FALLBACK_DTYPE][0]])  # code -1: no dtype recorded
    full_all = per_step.full[per_step.full["below_normal_share"].notna() & ~per_step.full["bad"]]
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
        ev = _evidence(full, limit, shares_by_limit, full_all, lo_step, last)
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


# One value per layer and step: ranks and repeated calls merged. Max, any,
# min and first merge shard by shard exactly; the means (full-tier columns,
# null in cheap-tier rows) are taken at the end over the full-tier rows
# only, in the order read, which is the same sum as over every row. A shard
# is reduced batch by batch as it is read (`scan.reduces_batches`), a layer
# travels as an integer id (its name and kind once per shard) and the
# merged table as a few numpy columns merged by sorting (an Arrow group-by
# holds several times its input): so the memory is bounded by a batch of
# rows plus window x layers of a few numbers (and the full-tier rows), not
# by the shard's rows nor by ranks x window x layers of strings.
_KEYS = ["lid", "step"]
# The merged columns: absmax (max; NaN: none recorded), bad (any), dtype (a
# code into the dtypes seen, the first recorded; -1: none), fwd (1 for a
# forward row: first), order (min).
_MERGED = ["absmax", "bad", "dtype", "fwd", "order"]
_MEANS = ["zero_share", "below_normal_share", "below_subnormal_share"]
# share_sample_size: the values the shares were counted on, summed over
# ranks and calls (a sum over nothing but nulls is null: unknown).
_FULL = _KEYS + _MEANS + ["rms", "share_sample_size"]
_CONSOLIDATE_ROWS = 1 << 20


@dataclass
class ShardRanges:
    """One shard's part of the per-step table (see `reduce_shard`)."""
    layers: list       # (name, kind) of each layer id of this shard
    dtypes: list       # the dtype of each dtype code of this shard
    merged: dict       # _KEYS + _MERGED + pos numpy columns, one row per layer and step (see `_merge`)
    full: pa.Table     # _FULL, the full-tier rows as read
    full_steps: set
    rows: int


@reduces_batches
def reduce_shard(batches) -> ShardRanges:
    """The per-shard map of `ranges` (runs where the shard is read): the
    shard's record batches (or one table) in, one partial bounded by its
    layers x steps out. In Arrow and numpy: at 1,000 ranks it runs once per
    shard of the window."""
    if isinstance(batches, pa.Table):
        batches = batches.to_batches()
    layers: dict = {}
    dtypes: dict = {}
    merged: list[dict] = []
    full: list[pa.Table] = []
    full_steps: set = set()
    rows = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        rows += batch.num_rows
        t = pa.Table.from_batches([batch])
        lid = _codes(t["name"], t["kind"], layers)
        has_full = pc.or_kleene(pc.or_kleene(pc.is_valid(t["zero_share"]), pc.is_valid(t["below_normal_share"])),
                                pc.is_valid(t["below_subnormal_share"]))
        # With the rows that carry only an RMS or a sample size: their
        # maximum and sum are over every row of the layer and step.
        keep = pc.or_kleene(has_full, pc.or_kleene(pc.is_valid(t["rms"]), pc.is_valid(t["share_sample_size"])))
        full.append(t.append_column("lid", pa.array(lid, pa.int32())).filter(keep).select(_FULL))
        full_steps.update(pc.unique(t.filter(pc.is_valid(t["below_normal_share"]))["step"]).to_pylist())
        merged.append(_merge([{
            "lid": lid, "step": t["step"].to_numpy(), "pos": np.arange(rows - batch.num_rows, rows),
            "absmax": t["absmax"].to_numpy().astype(float),  # null: NaN
            "bad": pc.greater(pc.add(t["nan_count"], t["inf_count"]), 0).to_numpy(),
            "dtype": _dtype_codes(t["dtype"], dtypes),
            "fwd": pc.equal(t["phase"], "forward").to_numpy().astype(np.int8),
            "order": t["order"].to_numpy()}]))
    return ShardRanges(list(layers), list(dtypes), _merge(merged),
                       pa.concat_tables(full) if full else _EMPTY_FULL, full_steps, rows)


def _codes(names: pa.ChunkedArray, kinds: pa.ChunkedArray, seen: dict) -> np.ndarray:
    """Per row, the id of its (name, kind) in `seen` (new pairs added, ids in
    order of first row): one dictionary lookup per distinct pair."""
    n = pc.dictionary_encode(names.combine_chunks())
    k = pc.dictionary_encode(kinds.combine_chunks())
    nk = len(k.dictionary)
    key = n.indices.to_numpy().astype(np.int64) * nk + k.indices.to_numpy()
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    ids = np.empty(len(uniq), dtype=np.int32)
    names_d, kinds_d = n.dictionary.to_pylist(), k.dictionary.to_pylist()
    for i in np.argsort(first, kind="stable"):  # new ids in order of first row
        ids[i] = seen.setdefault((names_d[uniq[i] // nk], kinds_d[uniq[i] % nk]), len(seen))
    return ids[inverse.ravel()]


def _dtype_codes(dtype: pa.ChunkedArray, seen: dict) -> np.ndarray:
    """Per row, the code of its dtype in `seen` (new ones added; -1 where none recorded)."""
    d = pc.dictionary_encode(dtype.combine_chunks())
    table = np.array([seen.setdefault(v, len(seen)) for v in d.dictionary.to_pylist()] + [-1], dtype=np.int32)
    return table[pc.fill_null(d.indices, len(table) - 1).to_numpy()]


def _merge(parts: list[dict]) -> dict:
    """The rows of `parts` (in the order read) with equal (layer, step)
    merged, sorted by (layer, step); `pos` is each group's first row (its
    position in the order read). A stable sort keeps each group's rows in
    the order read, so `first` is the first recorded. It consumes `parts`
    (their columns are moved out one by one) and works column by column, so
    that beside the rows only the sort and one sorted column are held."""
    if not parts:
        return {c: np.zeros(0, dtype=t) for c, t in _DTYPES.items()}
    cols = {c: np.concatenate([p.pop(c) for p in parts]) for c in _DTYPES}
    n = len(cols["lid"])
    if not n:
        return cols
    srt = np.lexsort((cols["step"], cols["lid"]))
    lid, step = cols.pop("lid")[srt], cols.pop("step")[srt]
    new = np.ones(n, dtype=bool)
    new[1:] = (lid[1:] != lid[:-1]) | (step[1:] != step[:-1])
    starts = np.flatnonzero(new)
    del new
    out = {"lid": lid[starts], "step": step[starts]}
    del lid, step
    for c, how in (("absmax", np.fmax), ("bad", np.logical_or), ("order", np.minimum), ("pos", np.minimum)):
        out[c] = how.reduceat(cols.pop(c)[srt], starts)  # fmax: NaN only when all are
    out["fwd"] = cols.pop("fwd")[srt[starts]]
    dtype = cols.pop("dtype")[srt]
    first_known = np.minimum.reduceat(np.where(dtype >= 0, np.arange(n), n), starts)
    out["dtype"] = np.where(first_known < n, dtype[np.minimum(first_known, n - 1)], -1).astype(np.int32)
    return out


_DTYPES = {"lid": np.int32, "step": np.int64, "absmax": np.float64, "bad": np.bool_, "dtype": np.int32,
           "fwd": np.int8, "order": np.int32, "pos": np.int64}
_EMPTY_FULL = pa.table({"lid": pa.array([], pa.int32()), "step": pa.array([], pa.int64()),
                        **{c: pa.array([], pa.float64()) for c in _MEANS + ["rms"]},
                        "share_sample_size": pa.array([], pa.int64())})


@dataclass
class _PerStep:
    """The merged per-step table of the window, as numpy columns sorted by
    (layer, step), plus its full-tier rows (means taken)."""
    layers: list       # (name, kind) per layer id
    dtypes: list       # dtype string (or None) per code
    cols: dict         # _KEYS + _MERGED columns, sorted by (lid, step)
    bounds: np.ndarray  # layer i's rows: cols[...][bounds[i]:bounds[i + 1]]
    order: list        # layer ids in the order their group first appears in the step-sorted table
    full: pd.DataFrame  # one row per (lid, step) with full-tier rows: means, rms max, sample sizes summed, bad
    full_steps: int


def _per_step(run: Run, lo) -> _PerStep | None:
    layers: dict = {}
    dtypes: dict = {}
    merged: list[dict] = []
    full: list[pa.Table] = []
    full_steps: set = set()
    rows = 0
    for part in run.map_tensor_shards(reduce_shard, _COLUMNS, kinds=KINDS, step_range=(lo, None),
                                      label="reading ranges"):
        rows += part.rows
        # The shard's ids and codes as the run's.
        lids = np.array([layers.setdefault(key, len(layers)) for key in part.layers] + [0], dtype=np.int32)
        codes = np.array([dtypes.setdefault(d, len(dtypes)) for d in part.dtypes] + [-1], dtype=np.int32)
        m = dict(part.merged)
        # A shard whose ids are already the run's (the first one read) keeps
        # its columns as they are, still sorted: no copy of the window.
        same_ids = np.array_equal(lids[:-1], np.arange(len(lids) - 1))
        if not same_ids:
            m["lid"] = lids[m["lid"]]
        if not np.array_equal(codes[:-1], np.arange(len(codes) - 1)):
            m["dtype"] = codes[m["dtype"]]  # code -1 stays -1
        if rows > part.rows:
            m["pos"] = m["pos"] + (rows - part.rows)  # the position in the whole read
        merged.append(m)
        if len(part.full):
            full.append(part.full.set_column(0, "lid", pa.array(lids[part.full["lid"].to_numpy()], pa.int32())))
        full_steps |= part.full_steps
        del part
        if sum(len(p["lid"]) for p in merged[1:]) >= _CONSOLIDATE_ROWS:
            merged = [_merge(merged)]
            same_ids = True
    if not rows:
        return None
    # One part merged and sorted already (one shard, or all consolidated) is the table.
    cols = merged[0] if len(merged) == 1 and same_ids else _merge(merged)
    del merged
    bounds = np.searchsorted(cols["lid"], np.arange(len(layers) + 1))
    # The layers in the order their groups first appear in the table sorted
    # by step: by earliest step, then by the first row read of that step.
    heads = bounds[:-1]
    order = [int(i) for i in np.lexsort((cols["pos"][heads], cols["step"][heads]))]
    # The means in pandas, as one pass over the full-tier rows in the order
    # read (pandas' compensated sum: the same value as over every row).
    full_rows = (pa.concat_tables(full) if full else _EMPTY_FULL).to_pandas()
    g = full_rows.groupby(_KEYS, sort=False)
    means = g[_MEANS].mean()
    means["rms"] = g["rms"].max()
    means["share_sample_size"] = g["share_sample_size"].sum(min_count=1)
    means = means.reset_index()
    # Each full-tier (layer, step) finds its merged row: keys (layer, rank
    # of the step) are sorted as the columns are.
    steps = np.unique(cols["step"])
    key = cols["lid"].astype(np.int64) * len(steps) + np.searchsorted(steps, cols["step"])
    at = np.searchsorted(key, means["lid"].to_numpy().astype(np.int64) * len(steps)
                         + np.searchsorted(steps, means["step"].to_numpy()))
    means["bad"] = cols["bad"][at]
    means["absmax"] = cols["absmax"][at]  # zero_split reads the tail's top off it
    return _PerStep([*layers], [*dtypes], cols, bounds, order, means, len(full_steps))


def _evidence(full, limit: str, shares_by_limit: dict, full_all, first: int, last: int) -> dict:
    """A layer's underflow evidence: its full-tier rows of the window
    (`full`, one per step), their shares and what their zeros are, and when.

    - `underflow_share`, `zero_share`, `structural_zero_share`,
      `flushed_zero_share`: medians over the evidence steps; `zeros`: the
      `Zeros` verdict at the latest of them.
    - `recent_underflow_share`: the median over the recent evidence, the
      full-tier steps from `recent_from_step` on: the window's last
      `RECENT_PART`, or back to the latest evidence step when none lies
      there; null when even that step lies in the window's first
      `STALE_PART` (stale: nothing recent says how it is now).
    - `underflow_first_step`..`underflow_last_step`: the first and last
      evidence step at or above `UNDERFLOW_SHARE`, and
      `underflow_episode_share` the median over the evidence between them
      (null when no step reached it)."""
    out = {"underflow_share": None, "zero_share": None, "share_sample_size": None, "structural_zero_share": None,
           "flushed_zero_share": None, "zeros": None, "evidence_steps": 0, "evidence_first_step": None,
           "evidence_last_step": None, "recent_underflow_share": None, "recent_from_step": None,
           "underflow_episode_share": None, "underflow_first_step": None, "underflow_last_step": None}
    if full is None or not len(full):
        return out
    if limit not in shares_by_limit:  # a share per row: computed once per limit
        shares_by_limit[limit] = row_shares(full_all, limit, flushing_steps=shares_by_limit["flushing_steps"],
                                            layer="lid")
    shares, flushed, verdict = (x.loc[full.index] for x in shares_by_limit[limit])
    order = np.argsort(full["step"].to_numpy(), kind="stable")
    steps = full["step"].to_numpy()[order]
    share = shares.to_numpy(dtype=float)[order]
    out["zero_share"] = float(full["zero_share"].median())
    sizes = full["share_sample_size"].dropna()
    out["share_sample_size"] = int(sizes.median()) if len(sizes) else None
    fl = flushed.dropna()
    if len(fl):
        out["flushed_zero_share"] = float(fl.median())
        out["structural_zero_share"] = float((full["zero_share"].loc[fl.index] - fl).median())
    out["zeros"] = verdict.to_numpy()[order][-1]
    known = np.isfinite(share)  # unknown: the float16 shares cannot tell, or nothing but zeros (`row_shares`)
    if not known.any():
        return out
    steps, share = steps[known], share[known]
    out.update(evidence_steps=len(steps), evidence_first_step=int(steps[0]), evidence_last_step=int(steps[-1]))
    out["underflow_share"] = float(np.median(share))
    span = max(0, last - first)
    if steps[-1] >= first + STALE_PART * span:
        recent_from = min(int(math.ceil(first + (1 - RECENT_PART) * span)), int(steps[-1]))
        out["recent_from_step"] = recent_from
        out["recent_underflow_share"] = float(np.median(share[steps >= recent_from]))
    hit = np.flatnonzero(share >= UNDERFLOW_SHARE)
    if len(hit):
        episode = share[hit[0]:hit[-1] + 1]
        if np.median(episode) >= UNDERFLOW_SHARE:
            out.update(underflow_episode_share=float(np.median(episode)), underflow_first_step=int(steps[hit[0]]),
                       underflow_last_step=int(steps[hit[-1]]))
    return out


def recent_words(row) -> str:
    """When a layer's current underflow share was measured, for sentences."""
    first, last = row["recent_from_step"], row["evidence_last_step"]
    return (f"at step {last}" if first == last else f"over the full-tier steps {first}-{last}") + (
        f" (the window's {row['evidence_steps']} full-tier steps since step {row['evidence_first_step']}: "
        f"median {row['underflow_share']:.0%})" if row["evidence_steps"] and row["evidence_steps"] > 1 else "")


def lapsed_words(row) -> str:
    """A lapsed underflow in words: when it was, and what the evidence since says."""
    a, b = row["underflow_first_step"], row["underflow_last_step"]
    was = (f"{row['underflow_episode_share']:.0%} at step {a}" if a == b
           else f"{row['underflow_episode_share']:.0%} during steps {a}-{b}")
    recent = row["recent_underflow_share"]
    if recent is None or pd.isna(recent):
        return (f"was {was}; no full-tier step since step {row['evidence_last_step']} "
                f"(the window's first half): its share now is unknown")
    first, last = row["recent_from_step"], row["evidence_last_step"]
    return f"was {was}; {recent:.1%} " + (f"at step {last}" if first == last else f"over steps {first}-{last}")


def sampled_values(size) -> str:
    """How many values a share was counted on, for sentences: "50,000
    sampled values", or "its values" for a run that did not record it."""
    if size is None or pd.isna(size):
        return "its values"
    return f"{int(size):,} sampled values"


def range_dtype(dtype) -> str:
    """The dtype whose limits apply to a row of recorded `dtype`."""
    return dtype if isinstance(dtype, str) and dtype in DTYPE_LIMITS else FALLBACK_DTYPE


class Zeros(str, enum.Enum):
    """What a row's exact zeros are, as far as its recorded statistics tell."""
    NONE = "none"                  # no exact zero
    STRUCTURAL = "structural"      # zero at any scale: a mask, a ReLU, an absent token, a zero weight
    FLUSHED = "flushed"            # values the float16 range rounded to zero
    MIXED = "mixed"                # some of each
    UNDETERMINED = "undetermined"  # every value zero, or too few non-zero values to tell


class ZeroSplit(typing.NamedTuple):
    flushed: np.ndarray   # per row: the share of all values that are flushed zeros (NaN: undetermined)
    verdict: np.ndarray   # per row: a `Zeros` value
    unsplit: np.ndarray   # per row: True where the row alone cannot split its zeros (at the edge, or all zero)


def zero_split(zero_share, below_normal_share, absmax, values=None) -> ZeroSplit:
    """Per row (array-likes, in the tensor's units): the share of all values
    that are zeros the float16 range flushed, and a `Zeros` verdict.

    float16 rounds |x| < 2^-25 to zero; every value between that edge and
    the normal limit 2^-14 survives as a subnormal (ten binades). Flushed
    zeros are the lower tail of the gradient's magnitudes below the edge,
    and a continuous distribution passes through those ten binades before it
    reaches it; a mask's zeros are no tail of anything. So the non-zero
    values' log2-magnitudes are fitted by a normal through two recorded
    points (the share below 2^-14, and absmax as the 1 - 1/(2n) quantile of
    the n non-zero values) and the zeros the fit's tail puts below 2^-25 are
    counted as flushed (never more than the zeros recorded); the rest are
    structural. In particular:
    - no non-zero value below 2^-14 (of at least `MIN_GAP_VALUES`): nothing
      reaches the edge, the zeros are structural;
    - (nearly) every non-zero value below 2^-14, so that the two points lie
      less than `MIN_FIT_SPREAD` standard deviations apart and fix no
      spread: the values sit at the edge, and the zeros are counted as
      flushed (they cannot be told apart);
    - every value zero: undetermined (NaN), a zero-initialised gamma and a
      gradient flushed whole look alike (`row_shares` asks the layer's
      other steps and the step's other gradients);
    - no non-zero value below 2^-14 among fewer than `MIN_GAP_VALUES`:
      undetermined (NaN), and the zeros not counted.
    `values`: how many values the shares were counted on (the sample size;
    `SHARE_SAMPLE_MAX` where unknown)."""
    from scipy.special import ndtr, ndtri

    z = np.asarray(zero_share, dtype=float)
    b = np.asarray(below_normal_share, dtype=float)
    a = np.asarray(absmax, dtype=float)
    n = np.full(z.shape, float(schema.SHARE_SAMPLE_MAX)) if values is None else np.asarray(values, dtype=float)
    n = np.where(np.isfinite(n) & (n > 0), n, float(schema.SHARE_SAMPLE_MAX))
    p = 1.0 - z
    nonzero = np.maximum(n * p, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(b / p, 0.0, 1.0)
        log2a = np.log2(np.where(a > 0, a, np.nan))
        z_top = ndtri(1.0 - 0.5 / nonzero)
        z_low = ndtri(np.clip(q, 1e-300, 1.0))
        sigma = (log2a - LOG2_MIN_NORMAL) / (z_top - z_low)
        mu = LOG2_MIN_NORMAL - sigma * z_low
        tail = ndtr((LOG2_FLUSH_EDGE - mu) / sigma)
        fitted = np.minimum(z, p * tail / (1.0 - tail))
    flushed = np.full(z.shape, np.nan)
    known = np.isfinite(z) & np.isfinite(b)
    none = known & (z <= 0)
    all_zero = known & (p <= 0)
    rest = known & ~none & ~all_zero
    at_edge = rest & ((q >= 1.0 - 0.5 / nonzero) | ~(log2a > LOG2_MIN_NORMAL) | ~(z_top - z_low >= MIN_FIT_SPREAD))
    gap = rest & ~at_edge & (q <= 0)
    fit = rest & ~at_edge & ~gap & np.isfinite(fitted)
    flushed[none] = 0.0
    flushed[at_edge] = z[at_edge]
    flushed[gap & (nonzero >= MIN_GAP_VALUES)] = 0.0
    flushed[fit] = fitted[fit]
    return ZeroSplit(flushed, verdicts(z, flushed), at_edge | all_zero)


def verdicts(zero_share, flushed) -> np.ndarray:
    """The `Zeros` verdict of each row from its zero share and the share of
    values that are flushed zeros (NaN: undetermined)."""
    z = np.asarray(zero_share, dtype=float)
    f = np.asarray(flushed, dtype=float)
    verdict = np.full(z.shape, None, dtype=object)
    known = np.isfinite(z)
    verdict[known] = Zeros.UNDETERMINED.value
    verdict[known & (z <= 0)] = Zeros.NONE.value
    with np.errstate(invalid="ignore", divide="ignore"):
        determined = known & (z > 0) & np.isfinite(f)
        share = np.where(determined, f / np.where(z > 0, z, 1.0), np.nan)
    verdict[determined & (share >= 0.9)] = Zeros.FLUSHED.value
    verdict[determined & (share <= 0.1)] = Zeros.STRUCTURAL.value
    verdict[determined & (share > 0.1) & (share < 0.9)] = Zeros.MIXED.value
    return verdict


def underflow_share_of_rows(full: pd.DataFrame, limit: str = "float16", *, flushing_steps=None,
                            layer: str | None = None) -> pd.Series:
    """Per full-tier row: the share `underflow_share` counts against
    `limit`'s range (values below its smallest normal plus the zeros
    `zero_split` finds flushed; structural zeros are not underflow), before
    the median over steps; NaN where the recorded float16 shares cannot
    tell, and for a row of nothing but zeros outside `flushing_steps` (see
    `row_shares`). `full` needs `step`, `zero_share`, `below_normal_share`,
    `below_subnormal_share`, `absmax` and, where recorded, `share_sample_size`."""
    return row_shares(full, limit, flushing_steps=flushing_steps, layer=layer)[0]


def row_shares(full: pd.DataFrame, limit: str = "float16", *, flushing_steps=None, layer: str | None = None):
    """Per row: (underflow share, flushed zero share, `Zeros` verdict), as
    Series. Where a row alone cannot split its zeros (its values sit at the
    flush edge, or it holds nothing but zeros), its layer's other rows can:
    with `layer` (the column naming a row's layer), the median structural
    share of the layer's rows that could split theirs is structural in
    these rows too (a mask is the same from step to step), and only the
    zeros beyond it are flushed. Without that, a row at the edge counts its
    zeros as flushed, and a row of nothing but zeros is undetermined (NaN
    share): in a step of `flushing_steps` (where other gradients of the
    step underflow) the range flushed it whole and it counts as flushed;
    elsewhere (a zero-initialised gamma in a healthy step) it is no
    evidence either way. Against a wider dtype the flushed zeros are not
    counted: a float32 row's zeros are not its own range's, a float16
    gradient before it flushed them and is judged on its own row."""
    split = zero_split(full["zero_share"], full["below_normal_share"], full["absmax"], _values(full))
    z = full["zero_share"].to_numpy(dtype=float)
    flushed = split.flushed.copy()
    unsplit = split.unsplit & (z > 0)
    if layer is not None and unsplit.any():
        structural = pd.Series(np.where(~split.unsplit & np.isfinite(flushed), z - flushed, np.nan), index=full.index)
        typical = structural.groupby(full[layer].to_numpy()).transform("median").to_numpy()
        known = unsplit & np.isfinite(typical)
        flushed[known] = np.maximum(0.0, z[known] - typical[known])
        unsplit &= ~known
    whole = unsplit & (z >= 1)
    if flushing_steps is not None and len(flushing_steps):
        in_flush = whole & full["step"].isin(list(flushing_steps)).to_numpy()
        flushed[in_flush] = 1.0
        whole &= ~in_flush
    verdict = verdicts(z, flushed)
    counted = np.nan_to_num(flushed, nan=0.0) if limit == "float16" else np.zeros(len(full))
    share = _below_normal(full, limit).to_numpy(dtype=float) + counted
    share[whole] = np.nan
    index = full.index
    return pd.Series(share, index=index), pd.Series(flushed, index=index), pd.Series(verdict, index=index)


def flushing_steps(full: pd.DataFrame, layers: list) -> set:
    """The steps where some `grad_output` row (layer ids into `layers`)
    has an underflow share of at least `UNDERFLOW_SHARE` against float16's
    range, its all-zero rows aside."""
    grad = np.array([kind == "grad_output" for _, kind in layers] + [False])[full["lid"].to_numpy()]
    rows = full[grad]
    if rows.empty:
        return set()
    share = underflow_share_of_rows(rows, "float16", layer="lid")
    return set(rows.loc[share >= UNDERFLOW_SHARE, "step"].astype(int))


def _values(full: pd.DataFrame):
    return full["share_sample_size"] if "share_sample_size" in full else None


def _below_normal(full: pd.DataFrame, limit: str) -> pd.Series:
    """Per row: the share of non-zero values below `limit`'s smallest normal,
    NaN where the recorded float16 shares cannot tell (see the module doc)."""
    if limit == "float16":
        return full["below_normal_share"]
    none_below_fp16_subnormal = full["below_subnormal_share"] == 0
    return pd.Series(np.where(none_below_fp16_subnormal, 0.0, np.nan), index=full.index)


def _finite_or_none(v):
    return float(v) if v is not None and pd.notna(v) else None


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in LAYER_COLUMNS})
