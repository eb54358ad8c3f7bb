"""Loss-scale dynamics: is the scaler healthy, collapsing or stuck?

The scale is a time series; a collapse is a trend with an onset, not a count
of backoffs. The steps:

1. Calibration: a fresh GradScaler starts high (65536 by default) and backs
   off on its first steps until the scaled gradients fit in float16. The
   leading run of skipped steps of a run that starts at the scaler's
   `init_scale` is that calibration: counted (`calibration_steps`), but left
   out of the trend and of `backoffs` (a calibration skip is no back-off
   from a scale that worked).
2. Onset: the best two-segment piecewise-linear least-squares fit of
   log2(scale) over step (exact, over every break, with cumulative sums)
   finds the break; the onset is the first back-off of the run of back-offs
   that leads to the collapse, never a clean step before it: the fit can
   land inside the run when its first back-offs come a few clean steps
   apart, so earlier back-offs join it while each came at most
   `ONSET_SPACING_RATIO` times the spacing of the next one, the scale did
   not grow in between and it is no growth probe (calibration skips are
   never the onset). When that segment is not a
   collapse, the fit is repeated on it (binary segmentation), since a
   collapse is a decline that lasts until the end of the run.
3. Trend after the onset: Kendall's tau (significance `ALPHA`) and the
   Theil-Sen slope with its confidence interval, in halvings per 1000 steps.
4. Status, first match wins:
   - `no_scaler`: no enabled scaler recorded;
   - `collapse`: after the onset the trend is significantly negative, there
     are more backoffs than growths and the scale fell by at least
     `COLLAPSE_MIN_HALVINGS` halvings below its level before the onset;
   - `stuck_low`: in the last half of the run the scale sits at or below
     `LOW_SCALE` (it amplifies nothing: small gradients underflow as if
     unscaled), or the scaler skips at least `STUCK_SKIP_RATE` of the steps
     (and at least `STUCK_MIN_SKIPS` steps) on real overflows: skips that do
     not follow a growth, i.e. are not the scaler probing upwards;
   - `growth_blocked`: the scale never grew although some run of clean steps
     was at least `growth_interval` long;
   - `healthy` otherwise (growth and backoff oscillation).
5. Drivers: at the skipped steps that matter (after the onset of a collapse,
   else after calibration), the layer where the overflow was born: the
   forward origin when the step's forward was non-finite, else the backward
   origin (`analyses.nans`).
6. Underflow level: the scale at which the smallest per-layer largest
   gradient (unscaled `grad_output` absmax of the last clean recorded step)
   would fall below the float16 normal limit (`underflow_scale`). When the
   scale already sits below it at the end of the run,
   `underflow_reached_step` is the step since which it has stayed below
   (the first step of the final stretch whose scale after the update is
   below the level) and `projected_underflow_step` is null; otherwise the
   collapse rate says when the scale gets there
   (`projected_underflow_step`, a step after the run's end) and
   `underflow_reached_step` is null.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np
import pandas as pd
from scipy import stats

from recorders.format import plain, schema

from ..names import Word, display_name as _display
from ..reading.loader import Run
from .nans import attribute_shared_all, origins_of
from .trend import theil_sen
from ..display import report_html, report_repr
from ..result import CommandResult

ALPHA = 0.01                  # significance level of the trend test
COLLAPSE_MIN_HALVINGS = 3.0   # net fall below the pre-onset level for a collapse (factor 8)
LOW_SCALE = 1.0               # a scale at or below this protects nothing
STUCK_SKIP_RATE = 0.05        # real-overflow skips per step that pin the scale...
STUCK_MIN_SKIPS = 5           # ...counted over at least this many skips
MIN_TREND_STEPS = 8           # fewer post-calibration steps: no trend test
MIN_SEGMENT = 3               # shortest segment of the change-point fit
ONSET_SPACING_RATIO = 2.0     # an earlier back-off joins the collapse's run when it came at most this
                              # many times the spacing of the next back-off (a run that speeds up)
MAX_DRIVER_STEPS = 500        # most recent skipped steps read for drivers
MAX_THEILSEN_POINTS = 2000    # Theil-Sen is O(n^2): subsample evenly above this


class ScaleStatus(Word):
    """The loss scale's status (the module's doc, step 4); `value` is the
    `--json` "status"."""
    NO_SCALER = "no_scaler"
    COLLAPSE = "collapse"
    STUCK_LOW = "stuck_low"
    GROWTH_BLOCKED = "growth_blocked"
    HEALTHY = "healthy"


@dataclass
class ScaleReport(CommandResult):
    status: ScaleStatus
    reason: str
    onset_step: int | None
    halvings_per_kstep: float | None
    skipped_steps: int
    skip_rate: float
    longest_skip_streak: int
    final_scale: float | None
    drivers: list[str]
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    initial_scale: float | None = None
    min_scale: float | None = None
    max_scale: float | None = None
    growths: int = 0
    backoffs: int = 0             # after calibration: its skips are `calibration_steps`
    calibration_steps: int = 0
    skip_rate_before_onset: float | None = None
    skip_rate_after_onset: float | None = None
    longest_skip_streak_start: int | None = None
    halvings_per_kstep_ci: list | None = None
    trend_tau: float | None = None
    trend_p_value: float | None = None
    underflow_scale: float | None = None
    projected_underflow_step: int | None = None   # future crossing; None when already below
    underflow_reached_step: int | None = None     # already below since this step; None when not yet
    driver_steps: dict = field(default_factory=dict)  # layer -> number of skipped steps it drove
    # The skipped steps the drivers were read from, and how many of them
    # recorded per-layer rows (a sentinel's: those re-executed or sampled).
    driver_candidate_steps: int = 0
    driver_recorded_steps: int = 0

    def document(self) -> dict:
        return plain(dict(asdict(self), status=self.status.value))

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

    def table(self) -> pd.DataFrame:
        d = self.to_dict()
        d["drivers"] = ", ".join(_display(n) for n in self.drivers) or "-"
        d["driver_steps"] = ", ".join(f"{_display(k)}: {v}" for k, v in self.driver_steps.items()) or "-"
        if self.halvings_per_kstep_ci:
            d["halvings_per_kstep_ci"] = "[{:.3g}, {:.3g}]".format(*self.halvings_per_kstep_ci)
        return pd.DataFrame({"field": list(d), "value": ["-" if v is None else v for v in d.values()]})

    def lines(self) -> list[str]:
        return [f"loss scale: {self.status.value.upper()}: {self.reason}"]


def scale_dynamics(run: Run) -> ScaleReport:
    """Classify the loss-scale series of `run` (see the module docstring)."""
    series = _series(run)
    n = len(series)
    skipped = series["skipped"].to_numpy(bool) if n else np.zeros(0, bool)
    streak, streak_start = _longest_streak(skipped, series["step"].to_numpy() if n else [])
    base = dict(skipped_steps=int(skipped.sum()), skip_rate=float(skipped.mean()) if n else 0.0,
                longest_skip_streak=streak, longest_skip_streak_start=streak_start, steps=n,
                first_step=int(series["step"].iloc[0]) if n else None,
                last_step=int(series["step"].iloc[-1]) if n else None)
    if run.scaler is None or n == 0 or series["loss_scale"].isna().all():
        why = "no enabled GradScaler recorded" if run.scaler is None or n == 0 else "no loss scale recorded"
        return ScaleReport(status=ScaleStatus.NO_SCALER, reason=why, onset_step=None, halvings_per_kstep=None,
                           final_scale=None, drivers=[], **base)

    series = series[series["loss_scale"].notna()].reset_index(drop=True)
    steps = series["step"].to_numpy(np.int64)
    before = series["loss_scale_before"].to_numpy(float)
    after = series["loss_scale"].to_numpy(float)
    skipped = series["skipped"].to_numpy(bool)
    y = np.log2(np.clip(after, 1e-300, None))
    grew, shrank = after > before, after < before
    init = (run.scaler or {}).get("init_scale")
    calib = 0
    if init is not None and before[0] == init:
        while calib < len(skipped) and skipped[calib]:
            calib += 1

    report = ScaleReport(status=ScaleStatus.HEALTHY, reason="", onset_step=None, halvings_per_kstep=None,
                         final_scale=float(after[-1]), drivers=[], initial_scale=float(before[0]),
                         min_scale=float(after.min()), max_scale=float(after.max()),
                         growths=int(grew.sum()), backoffs=int(shrank[calib:].sum()), calibration_steps=calib,
                         **base)
    x, yy = steps[calib:].astype(float), y[calib:]
    m = len(x)
    if m == 0:
        report.reason = "every recorded step was skipped while the scaler calibrated"
        report.status = ScaleStatus.STUCK_LOW
        return report

    # Trend after calibration as a whole (reported when there is no collapse).
    if m >= MIN_TREND_STEPS and np.ptp(yy) > 0:
        slope, lo, hi = theil_sen(x, yy, alpha=ALPHA, max_points=MAX_THEILSEN_POINTS)
        report.halvings_per_kstep = -slope * 1000 + 0.0  # no "-0.0"
        report.halvings_per_kstep_ci = [-hi * 1000 + 0.0, -lo * 1000 + 0.0]
        tau, p = stats.kendalltau(x, yy)
        report.trend_tau, report.trend_p_value = float(tau), float(p)
    elif m:
        report.halvings_per_kstep = 0.0

    collapse = None
    if m >= MIN_TREND_STEPS and np.ptp(yy) > 0:
        collapse = _collapse(x, yy, grew[calib:], shrank[calib:])
    if collapse is not None:
        k, slope, lo, hi, tau, p, drop = collapse
        k = _first_fall(shrank[calib:], k, grew[calib:])
        onset = int(x[k])
        seg_skips = skipped[calib:]
        report.status = ScaleStatus.COLLAPSE
        report.onset_step = onset
        report.halvings_per_kstep = -slope * 1000
        report.halvings_per_kstep_ci = [-hi * 1000, -lo * 1000]
        report.trend_tau, report.trend_p_value = tau, p
        report.skip_rate_before_onset = float(seg_skips[:k].mean()) if k else None
        report.skip_rate_after_onset = float(seg_skips[k:].mean())
        report.underflow_scale = _underflow_scale(run, series)
        _place_underflow(report, steps, after, slope)
        report.reason = (f"log2(scale) falls {report.halvings_per_kstep:.3g} halvings per 1000 steps "
                         f"since step {onset} (Kendall tau {tau:.2f}, p={p:.2g}); "
                         f"{drop:.1f} halvings below the level before; scale now {after[-1]:.3g}"
                         + underflow_phrase(report, "; "))
        driver_from = onset
    else:
        last_half = slice(calib + m // 2, None)
        median_late = float(np.median(after[last_half]))
        real_skips, n_real = _real_skips(skipped[last_half], grew[last_half], shrank[last_half])
        clean_streak = _longest_streak(~skipped[calib:], x)[0]
        interval = (run.scaler or {}).get("growth_interval")
        if median_late <= LOW_SCALE:
            report.status = ScaleStatus.STUCK_LOW
            report.reason = (f"the scale sits at {median_late:.3g} (<= {LOW_SCALE:g}) in the last half "
                             f"of the run: it amplifies nothing, small gradients underflow")
        elif real_skips >= STUCK_SKIP_RATE and n_real >= STUCK_MIN_SKIPS:
            report.status = ScaleStatus.STUCK_LOW
            report.reason = (f"{real_skips:.1%} of the late steps skip on overflows that are not growth "
                             f"probes; the scale is pinned at about {median_late:.3g}")
        elif report.growths == 0 and interval and clean_streak >= int(interval):
            report.status = ScaleStatus.GROWTH_BLOCKED
            report.reason = (f"the scale never grew although {clean_streak} consecutive steps were clean "
                             f"(growth_interval {interval})")
        else:
            report.reason = (f"{report.growths} growth(s), {report.backoffs} backoff(s) after "
                             f"{calib} calibration skip(s); scale now {after[-1]:.3g}")
        driver_from = int(x[0])

    (report.drivers, report.driver_steps, report.driver_candidate_steps,
     report.driver_recorded_steps) = _drivers(run, series, skipped, steps, driver_from)
    return report


# ------------------------------------------------------------------ pieces
def _series(run: Run) -> pd.DataFrame:
    """One row per step that the lowest rank recorded: its scale, skipped
    on any rank (from the run's per-step reduction across ranks)."""
    s = run.step_series().steps
    if s.empty:
        return pd.DataFrame(columns=["step", "loss_scale_before", "loss_scale", "skipped"])
    lowest = s[s["rank"] == s["rank"].min()]
    return pd.DataFrame({"step": lowest["step"], "loss_scale_before": lowest["loss_scale_before"],
                         "loss_scale": lowest["loss_scale"],
                         "skipped": lowest["skipped_any"]}).reset_index(drop=True)


def _longest_streak(flags, steps) -> tuple[int, int | None]:
    best, best_start, cur, start = 0, None, 0, None
    for i, f in enumerate(flags):
        if f:
            if cur == 0:
                start = i
            cur += 1
            if cur > best:
                best, best_start = cur, start
        else:
            cur = 0
    return best, (int(steps[best_start]) if best_start is not None else None)


def two_segment_breakpoint(x: np.ndarray, y: np.ndarray, min_segment: int = MIN_SEGMENT) -> int | None:
    """Index k minimising the summed squared error of two separate straight
    lines fitted to x[:k] and x[k:]; None when the series is too short."""
    n = len(x)
    if n < 2 * min_segment:
        return None
    xc = x - x.mean()
    yc = y - y.mean()

    def sse(cx, cy, cxx, cxy, cyy, cnt):
        with np.errstate(invalid="ignore", divide="ignore"):
            sxx = cxx - cx * cx / cnt
            sxy = cxy - cx * cy / cnt
            syy = cyy - cy * cy / cnt
            fit = np.where(sxx > 1e-12, sxy * sxy / np.where(sxx > 1e-12, sxx, 1.0), 0.0)
        return np.maximum(syy - fit, 0.0)

    cum = [np.concatenate([[0.0], np.cumsum(v)]) for v in (xc, yc, xc * xc, xc * yc, yc * yc)]
    tot = [c[-1] for c in cum]
    ks = np.arange(min_segment, n - min_segment + 1)
    left = sse(*(c[ks] for c in cum), ks.astype(float))
    right = sse(*(t - c[ks] for t, c in zip(tot, cum)), (n - ks).astype(float))
    total = left + right
    return int(ks[np.argmin(total)])


def _collapse(x, y, grew, shrank, max_splits: int = 64):
    """Binary segmentation towards the end of the series: a collapse is a
    decline that lasts until the last step, so when the best break of
    x[lo:] does not start one, look again right of it (an earlier regime,
    say a growth/backoff sawtooth, can win the first split)."""
    lo = 0
    for _ in range(max_splits):
        k = two_segment_breakpoint(x[lo:], y[lo:])
        if k is None:
            return None
        found = _collapse_at(x, y, grew, shrank, lo + k)
        if found is not None:
            return found
        lo += k
    return None


def _collapse_at(x, y, grew, shrank, k):
    xs, ys = x[k:], y[k:]
    if len(xs) < MIN_SEGMENT or np.ptp(ys) == 0:
        return None
    tau, p = stats.kendalltau(xs, ys)
    if not (tau < 0 and p < ALPHA):
        return None
    if int(shrank[k:].sum()) <= int(grew[k:].sum()):
        return None
    level = float(np.median(y[max(0, k - 20):k])) if k else float(y[0])
    drop = level - float(y[-1])
    if drop < COLLAPSE_MIN_HALVINGS:
        return None
    slope, lo, hi = theil_sen(xs, ys, alpha=ALPHA, max_points=MAX_THEILSEN_POINTS)
    return k, slope, lo, hi, float(tau), float(p), drop




def _first_fall(shrank, k: int, grew=None) -> int:
    """The onset as the data has it: the first back-off of the run of
    back-offs that leads to the collapse. The fitted break can land on a
    clean step just before the first back-off (or just after one): back
    over falls that directly precede it, then forward to the first fall.
    It can also land inside the run when the run's first back-offs come a
    few clean steps apart (an overflow that grows more frequent): so go on
    back over earlier back-offs while each came at most
    `ONSET_SPACING_RATIO` times the spacing of the back-off after it, the
    scale did not grow in between (a growth: it had recovered) and it is
    no growth probe (a back-off right after a growth returns the scale to
    where it was: the decline starts after it)."""
    grew = np.asarray(grew if grew is not None else np.zeros(len(shrank)), bool)
    j = k
    while j > 0 and shrank[j - 1] and not _is_probe(grew, shrank, j - 1):
        j -= 1
    while j < len(shrank) - 1 and not shrank[j]:
        j += 1
    falls = [int(i) for i in np.flatnonzero(np.asarray(shrank, bool))]
    if j not in falls:
        return j
    grown = np.cumsum(grew)
    at = falls.index(j)
    while at > 0:
        earlier, here = falls[at - 1], falls[at]
        spacing_after = falls[at + 1] - here if at + 1 < len(falls) else 1
        if grown[here] != grown[earlier] or here - earlier > ONSET_SPACING_RATIO * spacing_after:
            break
        if _is_probe(grew, shrank, earlier):
            break  # the scaler finding its ceiling after a growth: back to where it was, no decline
        at -= 1
    return falls[at]


def _is_probe(grew, shrank, i: int) -> bool:
    """Whether the back-off at i follows a growth (no back-off in between):
    a growth probe, as `_real_skips` counts it."""
    for j in range(i - 1, -1, -1):
        if grew[j]:
            return True
        if shrank[j]:
            return False
    return False


def _real_skips(skipped, grew, shrank) -> tuple[float, int]:
    """Share and number of steps skipped on an overflow that is not a growth
    probe (a skip right after the scale grew is how the scaler finds its
    ceiling)."""
    if len(skipped) == 0:
        return 0.0, 0
    last_change, real = None, 0
    for s, g, b in zip(skipped, grew, shrank):
        if s and last_change != "growth":
            real += 1
        if g:
            last_change = "growth"
        elif b:
            last_change = "backoff"
    return real / len(skipped), real


def _underflow_scale(run: Run, series: pd.DataFrame) -> float | None:
    st = run.step_series().steps
    clean = st[st["clean_recorded_any"]]  # a rank's row not skipped, with tensor rows
    if clean.empty:
        return None
    step = int(clean["step"].max())
    rows = run.scan_tensors(["step", "rank", "absmax"], steps=[step], kinds=["grad_output"],
                            label="reading gradients")
    scale = series.loc[series["step"] == step, "loss_scale_before"]
    if rows.empty or scale.empty or not scale.iloc[0]:
        return None
    unscaled = rows["absmax"].to_numpy(float) / float(scale.iloc[0])
    unscaled = unscaled[np.isfinite(unscaled) & (unscaled > 0)]
    if len(unscaled) == 0:
        return None
    return float(schema.FP16_MIN_NORMAL / unscaled.min())


def _place_underflow(report: ScaleReport, steps, after, slope: float) -> None:
    """`underflow_reached_step` when the scale already sits below the
    underflow level, else `projected_underflow_step` at the fitted rate."""
    level = report.underflow_scale
    if level is None:
        return
    below = after < level
    if below[-1]:
        start = len(below) - 1
        while start > 0 and below[start - 1]:
            start -= 1
        report.underflow_reached_step = int(steps[start])
    elif slope < 0:
        gap = math.log2(after[-1]) - math.log2(level)
        report.projected_underflow_step = int(steps[-1] + math.ceil(gap / -slope))


def underflow_phrase(report: ScaleReport, lead: str = "") -> str:
    """Where the scale stands against the gradient underflow level, for
    sentences (empty when unknown)."""
    if report.underflow_reached_step is not None:
        return (f"{lead}already below the gradient underflow level {report.underflow_scale:.3g} since step "
                f"{report.underflow_reached_step}")
    if report.projected_underflow_step is not None:
        return (f"{lead}at this rate it reaches the gradient underflow level {report.underflow_scale:.3g} at "
                f"step {report.projected_underflow_step} (projected, after the run's last step {report.last_step})")
    return ""


def _drivers(run: Run, series, skipped, steps, from_step) -> tuple[list[str], dict, int, int]:
    """(the layers whose overflows drove the skips from `from_step`, most
    first; the skipped steps each drove; the skipped steps read; how many of
    them recorded per-layer rows: a sentinel's others have none, so its
    ranking rests on fewer steps than an every-step run's)."""
    picked = [int(s) for s, k in zip(steps, skipped) if k and s >= from_step]
    if not picked:
        picked = [int(s) for s, k in zip(steps, skipped) if k]
    picked = picked[-MAX_DRIVER_STEPS:]
    if not picked:
        return [], {}, 0, 0
    table = run.step_series().steps
    recorded = int(table.loc[table["step"].isin(picked), "recorded_any"].sum())
    cols = ["step", "rank", "name", "kind", "phase", "order", "call", "nan_count", "inf_count",
            "input_nonfinite"]
    rows = run.scan_tensors(cols, steps=picked, nonfinite_only=True, label="reading skipped steps")
    groups = {int(step): g[g["rank"] == g["rank"].min()] for step, g in rows.groupby("step", sort=True)}
    # A step whose recorded rows cannot decide names no driver.
    origins = {step: o for step, o in origins_of(run, groups).items() if o is not None and not o.undetermined}
    counts: dict[str, int] = {}
    for o in attribute_shared_all(run, origins).values():
        counts[o.name] = counts.get(o.name, 0) + 1
    ordered = sorted(counts, key=lambda k: -counts[k])  # stable: first seen wins ties
    return ordered, {k: counts[k] for k in ordered}, len(picked), recorded
