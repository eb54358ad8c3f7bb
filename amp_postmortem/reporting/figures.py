"""The report's plots: plotly figures drawn from `data.ReportData`.

Only this module (and `page.py`) imports plotly, the `report` extra. Every
trace is SVG (`scatter`, `heatmap`, `bar`), never WebGL: the page must draw
in any browser, headless ones without a GPU included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .data import Heatmap, ReportData, Spread
from ..analyses.nans import OriginBasis
from ..names import display_name

_UNDETERMINED = (OriginBasis.UNRECORDED.value, OriginBasis.WITHIN.value, OriginBasis.AFTER_UPDATE.value,
                 OriginBasis.NOT_REPRODUCED.value)

LOW_RANGE_BITS = 64.0   # headroom below this: a float16/float8 tensor (float16 spans about 2^40)
COLORS = {"loss": "#1f77b4", "scale": "#2ca02c", "skipped": "#ff7f0e", "nonfinite": "#d62728",
          "onset": "#9467bd", "grad_norm": "#17becf", "forward": "#1f77b4", "backward": "#ff7f0e"}


@dataclass
class Plot:
    id: str           # the HTML anchor findings link to
    title: str
    figure: object    # plotly.graph_objects.Figure
    points: int       # data points drawn (line points, markers, heatmap cells, bars)
    note: str = ""    # a sentence under the title


def plots(data: ReportData, replay: dict | None = None) -> list[Plot]:
    out = [loss_and_scale(data), headroom(data)]
    spread = first_nan(data)
    if spread is not None:
        out.append(spread)
    out.append(grad_norm_and_underflow(data))
    if replay is not None:
        out.append(replay_errors(replay))
    # A plot with nothing to draw (a run without tensor rows, say) is left
    # out rather than shown empty.
    return [p for p in out if p is not None and p.points > 0]


def _go():
    import plotly.graph_objects as go
    return go


def _list(a) -> list:
    return [None if isinstance(v, float) and not math.isfinite(v) else v for v in np.asarray(a).tolist()]


# ------------------------------------------------------------ loss, scale
def loss_and_scale(data: ReportData) -> Plot:
    go = _go()
    s = data.series
    fig = go.Figure()
    points = 0
    for rank, line in s.loss.items():
        name = "loss" if len(s.loss) == 1 else f"loss (rank {rank})"
        fig.add_trace(go.Scatter(x=_list(line.steps), y=_list(line.values), mode="lines", name=name,
                                 line={"color": COLORS["loss"] if len(s.loss) == 1 else None, "width": 1}))
        points += len(line.steps)
    top = max((float(np.max(l.values)) for l in s.loss.values() if len(l.values)), default=1.0)
    if len(s.nonfinite_loss.steps):
        fig.add_trace(go.Scatter(
            x=_list(s.nonfinite_loss.steps), y=[top] * len(s.nonfinite_loss.steps), mode="markers",
            name="loss NaN/Inf", marker={"symbol": "x", "color": COLORS["nonfinite"], "size": 8},
            customdata=_list(s.nonfinite_loss.counts),
            hovertemplate="step %{x}: loss NaN/Inf (%{customdata} step(s))<extra></extra>"))
        points += len(s.nonfinite_loss.steps)
    if s.log2_scale is not None:
        fig.add_trace(go.Scatter(
            x=_list(s.log2_scale.steps), y=_list(s.log2_scale.values), mode="lines", name="loss scale",
            yaxis="y2", line={"color": COLORS["scale"], "width": 1.5, "shape": "hv"},
            hovertemplate="step %{x}: scale 2^%{y}<extra></extra>"))
        points += len(s.log2_scale.steps)
        if len(s.skipped.steps):
            fig.add_trace(go.Scatter(
                x=_list(s.skipped.steps), y=_list(s.skipped_log2_scale), mode="markers", yaxis="y2",
                name="skipped step", marker={"symbol": "triangle-down", "color": COLORS["skipped"], "size": 8},
                customdata=_list(s.skipped.counts),
                hovertemplate="step %{x}: skipped at scale 2^%{y} (%{customdata} step(s))<extra></extra>"))
            points += len(s.skipped.steps)
    elif len(s.skipped.steps):
        fig.add_trace(go.Scatter(x=_list(s.skipped.steps), y=[top] * len(s.skipped.steps), mode="markers",
                                 name="skipped step", marker={"symbol": "triangle-down",
                                                              "color": COLORS["skipped"]}))
        points += len(s.skipped.steps)
    shapes, notes = [], []
    onset = data.collapse_onset_step
    if onset is not None:
        _vline(shapes, notes, onset, f"collapse onset, step {onset}", COLORS["onset"], 1.0)
    first = data.first_nonfinite_step
    if first is not None and first in data.calibration_steps:
        # A fresh scaler backing off from its init_scale: how it calibrates,
        # drawn as a skip, not in the red of a failure.
        calib = data.calibration_steps
        span = f"step {calib[0]}" if len(calib) == 1 else f"steps {calib[0]}-{calib[-1]}"
        _vline(shapes, notes, first, f"scaler calibration skip ({span}, normal)", COLORS["skipped"], 0.79,
               dash="dot")
    elif data.first_skip_step is not None:
        # Overflowing gradients the scaler skipped before any failure: an
        # ordinary backoff, drawn as a skip, never as the failure.
        _vline(shapes, notes, data.first_skip_step, f"first scaler skip, step {data.first_skip_step} "
               "(gradients overflowed, the step was skipped: normal)", COLORS["skipped"], 0.79, dash="dot")
    failure = data.failure_step
    if failure is not None:
        _vline(shapes, notes, failure, f"first non-finite value, step {failure}", COLORS["nonfinite"], 0.93)
    if data.first_nonfinite_loss_step is not None and data.first_nonfinite_loss_step != failure:
        _vline(shapes, notes, data.first_nonfinite_loss_step,
               f"first non-finite loss, step {data.first_nonfinite_loss_step}", COLORS["nonfinite"], 0.86)
    fig.update_layout(
        xaxis={"title": {"text": "step"}}, yaxis={"title": {"text": "loss"}},
        yaxis2={"title": {"text": "log2(loss scale)"}, "overlaying": "y", "side": "right",
                "dtick": log2_dtick(s.log2_scale.values if s.log2_scale is not None else ()),
                "tickprefix": "2^", "showgrid": False},
        shapes=shapes, annotations=notes, height=420, margin={"t": 40, "r": 70},
        legend={"orientation": "h", "y": -0.2}, hovermode="closest")
    return Plot("loss-scale", "Loss and loss scale", fig, points,
                _downsampled_note(data) + "Skipped steps sit on the scale in force when they overflowed; "
                "NaN/Inf losses are marked at the top of the loss axis.")


# The right-hand axis of the loss plot is 420 px high: at a 12 px font, more
# than about this many labels touch each other.
MAX_SCALE_TICKS = 10


def log2_dtick(values) -> int:
    """The step between the log2(scale) ticks: 1, 2, 5, 10, 20, ... exponents,
    the smallest that keeps the labels within MAX_SCALE_TICKS (a collapse
    from 2^16 to 2^-40 spans 56 exponents: a tick every 2 overlaps)."""
    finite = [float(v) for v in np.asarray(values, dtype=float).ravel() if math.isfinite(v)]
    span = (max(finite) - min(finite)) if finite else 0.0
    step, k = 1, 0
    while span / step > MAX_SCALE_TICKS:
        k += 1
        step = (1, 2, 5)[k % 3] * 10 ** (k // 3)
    return step


# A log axis spanning under two decades gets plotly's minor labels (every
# digit: "1 9 8 7 ... 2" crowded together); above that, one label per
# decade, or per 2, 5, 10 ... decades, keeps them within this many.
MAX_LOG_TICKS = 8


def log10_axis(values) -> dict:
    """The tick settings of a log axis showing `values`: labels at 1, 2 and
    5 times each power of ten over a short span, else at powers of ten, a
    power every 1, 2, 5, 10, ... decades."""
    finite = [math.log10(v) for v in np.asarray(values, dtype=float).ravel() if math.isfinite(v) and v > 0]
    span = (max(finite) - min(finite)) if finite else 0.0
    if span < 2:
        return {"type": "log", "dtick": "D2", "exponentformat": "power"}
    step, k = 1, 0
    while span / step > MAX_LOG_TICKS:
        k += 1
        step = (1, 2, 5)[k % 3] * 10 ** (k // 3)
    return {"type": "log", "dtick": step, "exponentformat": "power"}


def _vline(shapes, notes, step, text, color, y, dash="dash"):
    shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
                   "line": {"color": color, "dash": dash, "width": 1.5}})
    notes.append({"x": step, "y": y, "xref": "x", "yref": "paper", "text": text, "showarrow": False,
                  "xanchor": "left", "font": {"color": color, "size": 11}, "bgcolor": "rgba(255,255,255,0.8)"})


def _downsampled_note(data: ReportData) -> str:
    if not data.series.downsampled:
        return ""
    return (f"{data.series.steps:,} steps, downsampled for display: each line keeps every bucket's "
            f"minimum and maximum; marked steps are kept one by one. ")


# ---------------------------------------------------------------- heatmap
def headroom(data: ReportData) -> Plot | None:
    go = _go()
    from plotly.subplots import make_subplots
    maps = data.heatmaps
    if not maps:
        fig = go.Figure()
        return Plot("headroom", "Headroom per layer", fig, 0, "No tensor rows recorded.")
    titles = {"forward": "forward: inputs and activations", "backward": "backward: gradients (scaled)"}
    fig = make_subplots(rows=1, cols=len(maps), shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[titles[h.phase] for h in maps])
    layers = _union_layers(maps)
    zmin, zmax = _color_range(np.concatenate([h.headroom[np.isfinite(h.headroom)] for h in maps]))
    points = 0
    for i, h in enumerate(maps, start=1):
        z = _align(h, layers)
        bad = _align(h, layers, h.nonfinite.astype(float))
        fig.add_trace(go.Heatmap(
            x=_list(h.column_steps), y=layers, z=[_list(r) for r in z], zmin=zmin, zmax=zmax,
            colorscale="RdYlBu", showscale=i == 1, hoverongaps=False,
            colorbar={"title": {"text": "bits"}, "x": 1.01},
            hovertemplate="%{y}<br>step %{x}: %{z:.2f} bits of headroom<extra>" + h.phase + "</extra>"),
            row=1, col=i)
        points += h.cells
        r, c = np.nonzero(bad > 0)
        if len(r):
            fig.add_trace(go.Scatter(
                x=_list(h.column_steps[c]), y=[layers[j] for j in r], mode="markers",
                name=f"NaN/Inf ({h.phase})", showlegend=i == 1,
                marker={"symbol": "x-thin", "size": 6, "color": "black", "line": {"width": 1.2, "color": "black"}},
                hovertemplate="%{y}<br>step %{x}: NaN/Inf<extra></extra>"), row=1, col=i)
            points += len(r)
    fig.update_yaxes(autorange="reversed", tickfont={"size": 9}, automargin=True)
    fig.update_xaxes(title_text="step")
    width = maps[0].column_width
    # Room for the longest layer name at the 9 px tick font (automargin
    # alone does not widen a shared y axis of subplots).
    left = min(320, 6 * max((len(n) for n in layers), default=8) + 20)
    fig.update_layout(height=max(360, 16 * len(layers) + 140), margin={"t": 50, "l": left},
                      legend={"orientation": "h", "y": -0.08})
    dtypes = sorted({d for h in maps for d in h.dtypes})
    note = (f"Bits between each layer's largest value and its dtype's overflow limit ({', '.join(dtypes)}), "
            "0 where a value was NaN/Inf (marked x); gradients are the scaled values that travelled; blank: "
            "not recorded, or every value zero (a gradient flushed to zero). "
            "Layers in model (forward execution) order.")
    if width > 1:
        note += f" Each column is the worst of {width} steps."
    return Plot("headroom", "Headroom per layer and step", fig, points, note)


def _color_range(values: np.ndarray) -> tuple[float, float]:
    """Colours spent where the danger is: a float16 (or float8) tensor has
    at most about 40 bits of headroom, a float32 or bfloat16 one about 128,
    so with any cell under `LOW_RANGE_BITS` the scale runs from 0 (overflow)
    to the 99th percentile of those cells and wider-range tensors saturate;
    otherwise it spans the cells' own 1st to 99th percentile."""
    if not len(values):
        return 0.0, 1.0
    low = values[values < LOW_RANGE_BITS]
    if len(low):
        return 0.0, max(float(np.percentile(low, 99)), 1.0)
    lo, hi = float(np.percentile(values, 1)), float(np.percentile(values, 99))
    return lo, max(hi, lo + 1.0)


def _union_layers(maps: list[Heatmap]) -> list[str]:
    seen, out = set(), []
    first = maps[0].layers
    for h in maps:
        for n in h.layers:
            if n not in seen:
                seen.add(n)
                out.append(n)
    # Keep the forward's order; backward-only rows follow it.
    return [n for n in first] + [n for n in out if n not in set(first)]


def _align(h: Heatmap, layers: list[str], values=None) -> np.ndarray:
    values = h.headroom if values is None else values
    out = np.full((len(layers), values.shape[1]), np.nan)
    at = {n: i for i, n in enumerate(layers)}
    for i, n in enumerate(h.layers):
        out[at[n]] = values[i]
    return out


# -------------------------------------------------------------- first NaN
def first_nan(data: ReportData) -> Plot | None:
    spreads = [s for s in data.spreads if len(s.layers)]
    if not spreads:
        return None
    go = _go()
    per_rank = [s for s in spreads if s.rank is not None] or spreads
    fig = go.Figure()
    points = 0
    labels: list[str] = []
    for s in per_rank:
        for phase in ("forward", "backward"):
            rows = s.layers[s.layers["phase"] == phase]
            if rows.empty:
                continue
            y = [f"{display_name(n)} ({k})" for n, k in zip(rows["name"], rows["kind"])]
            labels.extend(l for l in y if l not in labels)
            who = "" if s.rank is None else f"rank {s.rank} "
            symbols = ["star" if o else "circle" for o in rows["origin"]]
            fig.add_trace(go.Scatter(
                x=_list(rows["first_step"]), y=y, mode="markers+lines", name=f"{who}{phase}",
                line={"width": 0.5, "color": COLORS[phase] if len(per_rank) == 1 else None},
                marker={"symbol": symbols, "size": [14 if o else 7 for o in rows["origin"]]},
                customdata=[[int(o), "ORIGIN" if g else "propagated"] for o, g in zip(rows["order"], rows["origin"])],
                hovertemplate="%{y}<br>first NaN/Inf at step %{x}, order %{customdata[0]}: "
                              "%{customdata[1]}<extra>" + who + phase + "</extra>"))
            points += len(rows)
    fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed", tickfont={"size": 9},
                     automargin=True)
    fig.update_layout(xaxis={"title": {"text": "first step with a NaN/Inf"}},
                      height=max(320, 15 * len(labels) + 120), margin={"t": 30},
                      legend={"orientation": "h", "y": -0.1})
    return Plot("first-nan", "First NaN/Inf: origin and spread", fig, points,
                "Each phase from its origin (star), then the layers in the order the NaN/Inf reached them.")


def spread_lines(spread: Spread) -> list[str]:
    """One sentence per phase: the origin, then the layers it spread to."""
    out = []
    for phase in ("forward", "backward"):
        o = spread.origins.get(phase)
        rows = spread.layers[spread.layers["phase"] == phase]
        if o is None:
            continue
        # A step without the rows that decide (`nans.OriginBasis`) names no
        # origin: its first recorded row leads, and is not repeated after.
        undetermined = o.get("basis") in _UNDETERMINED
        head = "origin undetermined, first recorded in" if undetermined else "origin"
        first = (o.get("tensor"), o.get("kind")) if undetermined else None
        chain = [f"{display_name(n)} ({k})" for n, k, g in zip(rows["name"], rows["kind"], rows["origin"])
                 if not g and (n, k) != first]
        more = "" if len(chain) <= 12 else f" ... ({len(chain) - 12} more)"
        out.append(f"{phase}: {head} {display_name(o['name'])} ({o['kind']}, step {o['step']}, rank {o['rank']})"
                   + (f", then {', '.join(chain[:12])}{more}" if chain else ""))
    return out


# ---------------------------------------------- grad norm and underflow
def grad_norm_and_underflow(data: ReportData) -> Plot:
    go = _go()
    s, u = data.series, data.underflow
    fig = go.Figure()
    points = 0
    if len(s.grad_norm.steps):
        positive = bool(np.all(s.grad_norm.values > 0))
        fig.add_trace(go.Scatter(x=_list(s.grad_norm.steps), y=_list(s.grad_norm.values), mode="lines",
                                 name="grad norm (unscaled)", line={"color": COLORS["grad_norm"], "width": 1}))
        points += len(s.grad_norm.steps)
        fig.update_layout(yaxis=log10_axis(s.grad_norm.values) if positive else {"type": "linear"})
    if len(s.nonfinite_grad_norm.steps):
        top = float(np.max(s.grad_norm.values)) if len(s.grad_norm.values) else 1.0
        fig.add_trace(go.Scatter(x=_list(s.nonfinite_grad_norm.steps), y=[top] * len(s.nonfinite_grad_norm.steps),
                                 mode="markers", name="grad norm NaN/Inf",
                                 marker={"symbol": "x", "color": COLORS["nonfinite"]}))
        points += len(s.nonfinite_grad_norm.steps)
    for line, name, dash in ((u.below_normal, "share below fp16 normal (all gradients)", None),
                             (u.worst_layer_below_normal, "share below fp16 normal (worst layer)", "dot"),
                             (u.below_subnormal, "share rounding to zero", "dash")):
        if len(line.steps):
            fig.add_trace(go.Scatter(x=_list(line.steps), y=_list(line.values), mode="lines+markers",
                                     name=name, yaxis="y2", marker={"size": 3},
                                     line={"width": 1, "dash": dash}))
            points += len(line.steps)
    fig.update_layout(
        xaxis={"title": {"text": "step"}}, yaxis_title_text="grad norm",
        yaxis2={"title": {"text": "share of gradient values"}, "overlaying": "y", "side": "right", "type": "linear",
                "range": [0, 1], "showgrid": False, "tickmode": "linear", "tick0": 0, "dtick": 0.2},
        height=380, margin={"t": 30, "r": 70}, legend={"orientation": "h", "y": -0.2})
    note = ("Underflow shares: grad_output rows (the scaled gradients that travel) of the full-tier steps; "
            "values below 6.1e-5 lose precision, below 6e-8 they round to zero.")
    if not len(u.below_normal.steps):
        note = "No full-tier statistics recorded: underflow shares unknown."
    return Plot("grad-underflow", "Gradient norm and underflow", fig, points, note)


# ----------------------------------------------------------------- replay
def replay_errors(replay: dict) -> Plot:
    """Per module (forward, then backward, in replay order) the local error
    of each replayed precision relative to float64; a module whose output
    is NaN/Inf where float64 is finite is drawn at the top, marked."""
    go = _go()
    precisions = [p for p in replay.get("precisions", []) if p != "fp64"]
    modules = replay.get("modules") or []
    labels = [f"{m.get('phase', '')[:3]} {m.get('label') or display_name(m.get('name'))}" for m in modules]
    finite = [v for m in modules for p in precisions
              for v in [(m.get("local_rel_err") or {}).get(p)] if isinstance(v, (int, float)) and v > 0]
    ceiling = max(finite, default=1.0) * 10
    floor = min(finite, default=1e-8) / 10
    fig = go.Figure()
    points = 0
    for p in precisions:
        ys, broken = [], []
        for m in modules:
            v = (m.get("local_rel_err") or {}).get(p)
            bad = v is None and ((m.get("local") or {}).get(p) or {}).get("nonfinite_new", 0) > 0
            broken.append(bad)
            ys.append(ceiling if bad else (floor if v == 0 else v))
        fig.add_trace(go.Bar(x=labels, y=ys, name=f"{p} local error",
                             marker={"line": {"color": [COLORS["nonfinite"] if b else "rgba(0,0,0,0)"
                                                        for b in broken], "width": 2}},
                             text=["NaN/Inf" if b else "" for b in broken], textposition="outside",
                             hovertemplate="%{x}: %{y:.3g}<extra>" + p + "</extra>"))
        points += sum(1 for y in ys if y is not None)
    heights = [y for trace in fig.data for y in trace.y if y is not None]
    fig.update_layout(barmode="group", yaxis={**log10_axis(heights), "title": {"text": "relative error vs float64"}},
                      xaxis={"tickangle": -60, "tickfont": {"size": 9}}, height=460,
                      margin={"t": 30, "b": 160}, legend={"orientation": "h", "y": 1.08})
    culprit = replay.get("culprit")
    note = (f"Replay of step {replay.get('step')}, rank {replay.get('rank')}: each module's own (local) error, "
            "fed the float64 run's inputs rounded to the precision. ")
    if culprit:
        note += f"Culprit: {display_name(culprit.get('name'))}, {culprit.get('phase')}, {culprit.get('precision')}."
    return Plot("replay", "Replay: per-module error per precision", fig, points, note)
