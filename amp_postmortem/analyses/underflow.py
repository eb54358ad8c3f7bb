"""What counts as underflow in `ranges` (and in `summary` and the estimated
loss-scale window): exact zeros told apart (`zero_split`: flushed by the
float16 range, or structural, zero at any scale), the share of a row's
values below its dtype's smallest normal with the flushed zeros
(`row_shares`), the steps where gradients underflow (`flushing_steps`), and
when a layer's shares were measured (`underflow_evidence`). The rules in
words: `ranges.py`'s doc."""
from __future__ import annotations

import enum
import math
import typing

import numpy as np
import pandas as pd

from recorders.format import schema

from .range_limits import (LOG2_FLUSH_EDGE, LOG2_MIN_NORMAL, MIN_FIT_SPREAD, MIN_GAP_VALUES, RECENT_PART, STALE_PART,
                           UNDERFLOW_SHARE)


# The rows a flushing step can flush whole (`row_shares`): the backward's.
GRADIENT_KINDS = ("grad_output", "grad_input", "param_grad")


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
    """Per row: (underflow share, flushed zero share, `Zeros` verdict,
    told), as Series; `told` is False where the recorded distribution could
    not split the row's zeros (at the flush edge with no other row of its
    layer to ask, or nothing but zeros) and the verdict is a default, not
    evidence: a replay of a saved step can tell (`whatif/flush.py`).

    A row whose values sit at the flush edge can ask its layer's other
    rows: with `layer` (the column naming a row's layer), the median
    structural share of the layer's rows that could split theirs is
    structural in these rows too (a mask is the same from step to step),
    and only the zeros beyond it are flushed; without that, its zeros
    count as flushed (its non-zero values say the range was reached).

    A row of nothing but zeros has no non-zero value to say where the
    range was, and its layer's other steps are no evidence either: a
    zero-initialised weight or bias (Keras' Dense biases, a zero kernel)
    makes whole rows zero in the first steps of a layer whose later
    gradients have no zero at all. Such a row is undetermined (NaN share,
    not told), except a gradient row in a step of `flushing_steps` (where
    other gradients of the step underflow): the range flushed it whole and
    it counts as flushed. A forward row (input, activation) is never
    flushed that way: the gradients' underflow says nothing of the
    forward's values. `full`'s optional boolean column `gradient` says
    which rows are gradients (absent: all of them).

    Against a wider dtype the flushed zeros are not counted: a float32
    row's zeros are not its own range's, a float16 gradient before it
    flushed them and is judged on its own row."""
    split = zero_split(full["zero_share"], full["below_normal_share"], full["absmax"], _values(full))
    z = full["zero_share"].to_numpy(dtype=float)
    flushed = split.flushed.copy()
    whole = split.unsplit & (z >= 1)  # nothing but zeros: undetermined unless a flushing step's gradient
    edge = split.unsplit & (z > 0) & ~whole
    if layer is not None and edge.any():
        structural = pd.Series(np.where(~split.unsplit & np.isfinite(flushed), z - flushed, np.nan), index=full.index)
        typical = structural.groupby(full[layer].to_numpy()).transform("median").to_numpy()
        known = edge & np.isfinite(typical)
        flushed[known] = np.maximum(0.0, z[known] - typical[known])
        edge &= ~known
    told = ~(edge | whole)
    if flushing_steps is not None and len(flushing_steps):
        gradient = full["gradient"].to_numpy(dtype=bool) if "gradient" in full else True
        in_flush = whole & gradient & full["step"].isin(list(flushing_steps)).to_numpy()
        flushed[in_flush] = 1.0
        whole &= ~in_flush
    verdict = verdicts(z, flushed)
    counted = np.nan_to_num(flushed, nan=0.0) if limit == "float16" else np.zeros(len(full))
    share = below_normal(full, limit).to_numpy(dtype=float) + counted
    share[whole] = np.nan
    index = full.index
    return (pd.Series(share, index=index), pd.Series(flushed, index=index), pd.Series(verdict, index=index),
            pd.Series(told, index=index))


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


def below_normal(full: pd.DataFrame, limit: str) -> pd.Series:
    """Per row: the share of non-zero values below `limit`'s smallest normal,
    NaN where the recorded float16 shares cannot tell (see the module doc)."""
    if limit == "float16":
        return full["below_normal_share"]
    none_below_fp16_subnormal = full["below_subnormal_share"] == 0
    return pd.Series(np.where(none_below_fp16_subnormal, 0.0, np.nan), index=full.index)


def underflow_evidence(full, limit: str, shares_by_limit: dict, full_all, first: int, last: int) -> dict:
    """A layer's underflow evidence: its full-tier rows of the window
    (`full`, one per step), their shares and what their zeros are, and when.

    - `underflow_share`, `zero_share`, `structural_zero_share`,
      `flushed_zero_share`: medians over the evidence steps; `zeros`: the
      `Zeros` verdict at the latest of them, and `zeros_told` whether the
      recorded distribution told that step's zeros apart (False: the
      verdict is the default of a row that cannot, see `row_shares`).
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
           "flushed_zero_share": None, "zeros": None, "zeros_told": None, "evidence_steps": 0, "evidence_first_step": None,
           "evidence_last_step": None, "recent_underflow_share": None, "recent_from_step": None,
           "underflow_episode_share": None, "underflow_first_step": None, "underflow_last_step": None}
    if full is None or not len(full):
        return out
    if limit not in shares_by_limit:  # a share per row: computed once per limit
        shares_by_limit[limit] = row_shares(full_all, limit, flushing_steps=shares_by_limit["flushing_steps"],
                                            layer="lid")
    shares, flushed, verdict, told = (x.loc[full.index] for x in shares_by_limit[limit])
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
    out["zeros_told"] = bool(told.to_numpy()[order][-1])
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
