"""What the report shows, gathered from a loaded run: plain arrays and
tables, already downsampled for display. No plotting here (`figures.py`
draws these), so this half needs neither plotly nor a browser.

One scan of the tensors table (the watched tensors' `absmax`, non-finite
counts and, on full-tier steps, the float16 underflow shares) feeds the
layers x steps heatmaps and the underflow series; it aggregates each shard's
rows into step buckets with pyarrow as it reads them, so memory stays
bounded by the display grid, not by the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recorders.format import schema

from ..reading.loader import Run
from ..names import display_name
from .downsample import MAX_LINE_BUCKETS, Markers, bucket_of, marked_steps, minmax_line

# Largest finite value of each floating dtype the recorder can name: the
# overflow limit a tensor's headroom is measured against.
DTYPE_MAX = {
    "float16": schema.FP16_MAX,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}
HEATMAP_CELLS = 120_000      # per panel: layers x step columns, bounds the file size
MAX_HEATMAP_COLUMNS = 400    # step columns of the heatmap
MAX_SPREAD_LAYERS = 40       # first-NaN view: the first layers of each phase's spread, per rank
MAX_SPREAD_RANKS = 8         # per-rank spread views of a multi-rank run

FORWARD_KINDS = ("input", "activation")
BACKWARD_KINDS = ("grad_output", "grad_input")
_SCAN_COLUMNS = ["step", "name", "kind", "order", "dtype", "numel", "absmax", "nan_count",
                 "inf_count", "below_normal_share", "below_subnormal_share"]


@dataclass
class Line:
    steps: np.ndarray
    values: np.ndarray


@dataclass
class StepSeries:
    """The steps table, downsampled: per rank the loss; the loss scale (of
    the lowest rank, as `scale` reads it); marked steps."""
    first_step: int | None
    last_step: int | None
    steps: int
    loss: dict[int, Line]                 # rank -> line
    log2_scale: Line | None               # log2 of the scale after each step's update
    skipped: Markers                      # skipped on any rank
    skipped_log2_scale: np.ndarray        # where the skip markers sit: log2 of the scale in force
    nonfinite_loss: Markers               # loss NaN/Inf on any rank
    grad_norm: Line
    nonfinite_grad_norm: Markers
    downsampled: bool


@dataclass
class Heatmap:
    """Headroom in bits to each tensor's dtype overflow limit, per layer and
    step column (the column's worst step: its largest absmax; 0 where a
    value was NaN/Inf), for one phase."""
    phase: str
    layers: list[str]                     # display names, model (execution) order
    column_steps: np.ndarray              # first step of each column
    column_width: int                     # steps per column
    headroom: np.ndarray                  # layers x columns, NaN where nothing was recorded
    nonfinite: np.ndarray                 # layers x columns, bool
    dtypes: list[str]

    @property
    def cells(self) -> int:
        return int(np.isfinite(self.headroom).sum())


@dataclass
class Underflow:
    """Per full-tier step, over the `grad_output` rows (the scaled gradients
    that travel): the numel-weighted share of non-zero values below the
    float16 normal limit, the worst layer's share, and the share that rounds
    to zero."""
    below_normal: Line
    worst_layer_below_normal: Line
    below_subnormal: Line


@dataclass
class Spread:
    """First-NaN view of one rank (or of all ranks together): layers in the
    order they first held a NaN/Inf: the forward's, then the backward's."""
    rank: int | None
    origin: dict | None
    origins: dict
    layers: pd.DataFrame                  # name, kind, phase, first_step, order, origin
    total_layers: int


@dataclass
class ReportData:
    series: StepSeries
    heatmaps: list[Heatmap]
    underflow: Underflow
    spreads: list[Spread]
    facts: dict
    findings: list[dict]
    scale: dict
    first_nonfinite_step: int | None
    first_nonfinite_loss_step: int | None
    warnings: list[str] = field(default_factory=list)
    # The scaler's leading calibration skips (normal, not a failure), and the
    # first step whose forward pass turned non-finite (a failure, never one).
    calibration_steps: list = field(default_factory=list)
    first_nonfinite_forward_step: int | None = None
    # The onset of a loss-scale collapse (`ScaleStatus.COLLAPSE`), else None.
    collapse_onset_step: int | None = None
    # The failure: the first step whose forward or loss went non-finite, or
    # whose non-finite gradients the optimizer applied; None when none did.
    failure_step: int | None = None
    # The first non-finite value when it came earlier than the failure in a
    # step the scaler skipped after its calibration (an ordinary skip: how a
    # dynamic loss scale probes), else None.
    first_skip_step: int | None = None


# ------------------------------------------------------------------ gather
def gather(run: Run) -> ReportData:
    """Everything the report shows about `run`."""
    # The analyses, through as few call sites as possible.
    from ..analyses.nans import applied_nonfinite_steps, calibration_steps, find_nans
    from ..analyses.scale import ScaleStatus, scale_dynamics
    from ..analyses.summary import summarize

    summary = summarize(run)
    scale = scale_dynamics(run)
    nans = find_nans(run)
    spreads = [_spread(None, nans)]
    if len(run.ranks) > 1:
        from ..reading.loader import load_run
        for r in run.ranks[:MAX_SPREAD_RANKS]:
            spreads.append(_spread(r, find_nans(load_run(run.path, rank=r))))

    series = step_series(run)
    heatmaps, underflow = scan_tensors(run)
    nd = nans.to_dict()
    calibration = sorted(calibration_steps(run))
    forward = nans.origins["forward"].step if nans.origins.get("forward") else None
    failure = _failure_step(forward, nd["first_nonfinite_loss_step"], applied_nonfinite_steps(run))
    first = nd["first_nonfinite_step"]
    skip = (first if first is not None and first not in calibration and (failure is None or first < failure)
            else None)
    return ReportData(
        series=series, heatmaps=heatmaps, underflow=underflow, spreads=spreads,
        facts=facts(run, summary.run), findings=[f.to_dict() for f in summary.findings],
        scale=scale.to_dict(), first_nonfinite_step=nd["first_nonfinite_step"],
        first_nonfinite_loss_step=nd["first_nonfinite_loss_step"], warnings=list(run.warnings),
        calibration_steps=calibration, first_nonfinite_forward_step=forward,
        collapse_onset_step=scale.onset_step if scale.status is ScaleStatus.COLLAPSE else None,
        failure_step=failure, first_skip_step=skip)


def _failure_step(forward: int | None, loss: int | None, applied: list) -> int | None:
    """The first step that failed training: a non-finite forward or loss, or
    non-finite gradients applied (a skipped step is the scaler's business)."""
    steps = [s for s in (forward, loss, applied[0] if applied else None) if s is not None]
    return min(steps) if steps else None


def step_series(run: Run, *, buckets: int = MAX_LINE_BUCKETS) -> StepSeries:
    s = run.steps
    first, last = run.first_step, run.last_step
    if s.empty:
        empty = Line(np.zeros(0, np.int64), np.zeros(0))
        none = Markers(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return StepSeries(None, None, 0, {}, None, none, np.zeros(0), none, empty, none, False)
    loss = {}
    for rank, g in s.groupby("rank", sort=True):
        x, y = minmax_line(g["step"].to_numpy(), g["loss"].to_numpy(float), first=first, last=last,
                           buckets=buckets)
        loss[int(rank)] = Line(x, y)
    lowest = s[s["rank"] == s["rank"].min()]
    log2_scale = None
    skip_steps = np.unique(s.loc[s["skipped"], "step"].to_numpy(np.int64))
    skipped = marked_steps(skip_steps, first=first, last=last)
    skipped_y = np.zeros(len(skipped.steps))
    if lowest["loss_scale"].notna().any():
        sc = lowest[lowest["loss_scale"].notna()]
        with np.errstate(divide="ignore"):
            y = np.log2(sc["loss_scale"].to_numpy(float))
        x, y = minmax_line(sc["step"].to_numpy(), y, first=first, last=last, buckets=buckets)
        log2_scale = Line(x, y)
        before = lowest.set_index("step")["loss_scale_before"]
        at = before.reindex(skipped.steps).to_numpy(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            skipped_y = np.log2(at)
    bad_loss = marked_steps(s.loc[s["loss_nonfinite"], "step"].to_numpy(np.int64), first=first, last=last)
    gn = s.groupby("step", sort=True)["grad_norm"].max()  # a global norm: the same on every rank
    finite_gn = gn[np.isfinite(gn.to_numpy(float))]
    x, y = minmax_line(finite_gn.index.to_numpy(), finite_gn.to_numpy(float), first=first, last=last,
                       buckets=buckets)
    # A NaN grad_norm is also how a missing one reads: count a step only
    # when the norm is infinite or a parameter's gradient held a NaN/Inf.
    bad = np.isinf(s["grad_norm"].to_numpy(float)) | (s["nonfinite_param_grads"].fillna(0).to_numpy() > 0)
    bad_gn = marked_steps(s.loc[bad, "step"].to_numpy(np.int64), first=first, last=last)
    n = int(s["step"].nunique())
    return StepSeries(first, last, n, loss, log2_scale, skipped, skipped_y, bad_loss, Line(x, y), bad_gn,
                      downsampled=n > 2 * buckets)


def scan_tensors(run: Run) -> tuple[list[Heatmap], Underflow]:
    """One pass over the tensors table: per (layer, kind, dtype, step column)
    the largest absmax and the non-finite count; per full-tier step the
    grad_output underflow shares."""
    first, last = run.first_step, run.last_step
    empty = Line(np.zeros(0, np.int64), np.zeros(0))
    if first is None:
        return [], Underflow(empty, empty, empty)
    layer_count = _layer_count(run)
    span = last - first + 1
    columns = max(1, min(MAX_HEATMAP_COLUMNS, span, HEATMAP_CELLS // max(layer_count, 1)))
    parts, under_parts = [], []
    for batch in run.iter_tensor_batches(_SCAN_COLUMNS, kinds=FORWARD_KINDS + BACKWARD_KINDS,
                                         label="reading tensors for the report", merged=True):
        if not batch.num_rows:
            continue
        t = pa.Table.from_batches([batch])
        col = pa.array(bucket_of(t["step"].to_numpy(), first, last, columns))
        bad = pc.add(t["nan_count"], t["inf_count"])
        t = t.append_column("column", col).append_column("bad", bad)
        parts.append(t.group_by(["name", "kind", "dtype", "column"], use_threads=False).aggregate(
            [("absmax", "max"), ("bad", "sum"), ("order", "min")]))
        full = t.filter(pc.and_(pc.equal(t["kind"], "grad_output"), pc.is_valid(t["below_normal_share"])))
        if full.num_rows:
            numel = pc.cast(full["numel"], pa.float64())
            full = full.append_column("w_normal", pc.multiply(numel, full["below_normal_share"]))
            full = full.append_column("w_sub", pc.multiply(numel, full["below_subnormal_share"]))
            full = full.append_column("w", numel)
            under_parts.append(full.group_by(["step"], use_threads=False).aggregate(
                [("w_normal", "sum"), ("w_sub", "sum"), ("w", "sum"), ("below_normal_share", "max")]))
    heatmaps = _heatmaps(run, parts, first, span, columns)
    return heatmaps, _underflow(under_parts, first, last)


def _layer_count(run: Run) -> int:
    mods = run.manifest.get("modules") or []
    return max(1, sum(1 for m in mods if m.get("watched", True)) + 1)


def _heatmaps(run: Run, parts, first: int, span: int, columns: int) -> list[Heatmap]:
    if not parts:
        return []
    df = pa.concat_tables(parts).to_pandas()
    df = df.rename(columns={"absmax_max": "absmax", "bad_sum": "bad", "order_min": "order"})
    # Merge the shards' partial buckets (a column can straddle two shards).
    df = df.groupby(["name", "kind", "dtype", "column"], sort=False, dropna=False).agg(
        absmax=("absmax", "max"), bad=("bad", "sum"), order=("order", "min")).reset_index()
    limit = df["dtype"].map(DTYPE_MAX).fillna(DTYPE_MAX["float32"]).to_numpy(float)
    absmax = df["absmax"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        head = np.where(absmax > 0, np.log2(limit / absmax), np.nan)
    head = np.where(df["bad"].to_numpy() > 0, 0.0, head)
    df["headroom"] = head
    df["phase"] = np.where(df["kind"].isin(FORWARD_KINDS), "forward", "backward")

    # Model (execution) order: the forward order of each module; modules
    # seen only in the backward follow in `named_modules()` order.
    fwd = df[df["phase"] == "forward"].groupby("name")["order"].min().sort_values(kind="stable")
    listed = [m["name"] for m in (run.manifest.get("modules") or [])]
    names = list(fwd.index) + [n for n in listed if n not in fwd.index]
    names += sorted(set(df["name"]) - set(names))
    rank_of = {n: i for i, n in enumerate(names)}

    width = max(1, math.ceil(span / columns))
    col_steps = first + (np.arange(columns, dtype=np.int64) * span + columns - 1) // columns
    out = []
    for phase in ("forward", "backward"):
        g = df[df["phase"] == phase]
        if g.empty:
            continue
        # One row per module: grad_output and grad_input of a module share
        # its row (the worst of the two), as the forward's input/activation.
        cell = g.groupby(["name", "column"], sort=False).agg(
            headroom=("headroom", "min"), bad=("bad", "sum")).reset_index()
        layer_names = sorted(set(cell["name"]), key=lambda n: rank_of.get(n, len(rank_of)))
        row = {n: i for i, n in enumerate(layer_names)}
        z = np.full((len(layer_names), columns), np.nan)
        bad = np.zeros((len(layer_names), columns), dtype=bool)
        r = cell["name"].map(row).to_numpy()
        c = cell["column"].to_numpy(np.int64)
        z[r, c] = cell["headroom"].to_numpy(float)
        bad[r, c] = cell["bad"].to_numpy() > 0
        dtypes = sorted({str(d) for d in g["dtype"].dropna()})
        out.append(Heatmap(phase, [display_name(n) for n in layer_names], col_steps, width, z, bad, dtypes))
    return out


def _underflow(parts, first: int, last: int) -> Underflow:
    empty = Line(np.zeros(0, np.int64), np.zeros(0))
    if not parts:
        return Underflow(empty, empty, empty)
    df = pa.concat_tables(parts).to_pandas().groupby("step", sort=True).agg(
        w_normal=("w_normal_sum", "sum"), w_sub=("w_sub_sum", "sum"), w=("w_sum", "sum"),
        worst=("below_normal_share_max", "max"))
    steps = df.index.to_numpy(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        normal = (df["w_normal"] / df["w"]).to_numpy(float)
        sub = (df["w_sub"] / df["w"]).to_numpy(float)

    def line(values):
        return Line(*minmax_line(steps, values, first=first, last=last))
    return Underflow(line(normal), line(df["worst"].to_numpy(float)), line(sub))


def _spread(rank: int | None, nans) -> Spread:
    layers = nans.layers
    cols = ["name", "kind", "phase", "first_step", "order", "rank", "origin"]
    # Forward then backward, each from its origin in first-appearance order
    # (`nans` orders by step first: a backward overflow the scaler skipped
    # early would otherwise open the forward's story).
    shown = pd.concat([layers[layers["phase"] == phase][cols].head(MAX_SPREAD_LAYERS)
                       for phase in ("forward", "backward")], ignore_index=True)
    d = nans.to_dict()
    return Spread(rank=rank, origin=d["origin"], origins=d["origins"], layers=shown, total_layers=len(layers))


def facts(run: Run, summary_run: dict) -> dict:
    """The run's facts: what `summary` says about it, plus the recorder's and
    the optimizer's settings from the manifest."""
    m = run.manifest
    opt = m.get("optimizer") or {}
    out = {
        "run_id": summary_run.get("run_id"), "path": summary_run.get("path"),
        "model_class": summary_run.get("model_class"),
        "device": f"{summary_run.get('device_type')} ({summary_run.get('device_name')})",
        "autocast": summary_run.get("autocast"), "dtype": summary_run.get("dtype"),
        "scaler": summary_run.get("scaler"), "scale_status": summary_run.get("scale_status"),
        "final_scale": summary_run.get("final_scale"),
        "steps": summary_run.get("steps"), "first_step": summary_run.get("first_step"),
        "last_step": summary_run.get("last_step"), "ranks": summary_run.get("ranks"),
        "world_size": summary_run.get("world_size"), "status": summary_run.get("status"),
        "skipped_steps": summary_run.get("skipped_steps"),
        "nonfinite_loss_steps": summary_run.get("nonfinite_loss_steps"),
        "optimizer": opt.get("class"), "optimizer_defaults": opt.get("defaults"),
        "recorder": m.get("recorder"), "bundles": [b.get("step") for b in m.get("bundles") or []],
        "torch_version": m.get("torch_version"), "package_version": m.get("package_version"),
    }
    return out



