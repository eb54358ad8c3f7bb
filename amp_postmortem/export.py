"""`export_tensorboard(run, logdir)`: a run as TensorBoard scalars,
histograms and text, so users see it where they already look.

Scalars per step: `loss`, `loss_scale` (after the step's update),
`grad_norm`, `skipped` (1 or 0). Per layer, one tag each:
`absmax/<kind>/<layer>` (the largest finite absolute value; repeated calls
merged by their maximum) and `headroom/<kind>/<layer>` (bits to the
tensor's dtype overflow limit, 0 when the tensor held a NaN/Inf), for the
kinds `input`, `activation`, `grad_output` and `grad_input` (gradients: the
scaled values that travelled). Values are written as recorded: a NaN loss
stays NaN.

Histograms per step and kind: `log2_absmax/<kind>`, the log2 of the absmax
of every layer recorded at that step (one value per layer, in buckets one
bit wide), so a dashboard shows the whole model's range drifting towards
the dtype's limit. A layer whose absmax is 0 (an all-zero tensor) or has
no finite value has no log2: it is left out of the histogram and counted in
the result's `histogram_left_out`.

Text: `findings`, the findings of `summary` as `summary` prints them (one
text summary with TensorBoard's text-plugin metadata, at the rank's last
step), the same findings in every rank's file.

Written with TensorBoard's own event writer and protos (the `report`
extra), without torch. One event file per rank: in `logdir` for a one-rank
run, else in `logdir/rank=R`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ExportError, MissingExtraError
from .reading.loader import Run
from .names import display_name
from .result import CommandResult

EXTRA_HINT = "pip install 'amp-postmortem[report]'"
LAYER_KINDS = ("input", "activation", "grad_output", "grad_input")
STEP_TAGS = ("loss", "loss_scale", "grad_norm", "skipped")
HISTOGRAM_TAG = "log2_absmax/{kind}"
FINDINGS_TAG = "findings"


@dataclass
class ExportResult(CommandResult):
    logdir: str
    files: list[str]
    steps: int
    tags: list[str] = field(default_factory=list)   # the scalar tags
    values: int = 0                                   # scalar values written
    histogram_tags: list[str] = field(default_factory=list)
    histograms: int = 0           # histogram values written (one per step, kind and rank)
    histogram_left_out: int = 0   # layer values with absmax 0 or no finite value: no log2
    findings: int = 0

    def document(self) -> dict:
        return {"logdir": self.logdir, "files": self.files, "steps": self.steps, "tags": len(self.tags),
                "step_tags": [t for t in self.tags if t in STEP_TAGS],
                "layer_tags": [t for t in self.tags if t not in STEP_TAGS], "values": self.values,
                "histogram_tags": self.histogram_tags, "histograms": self.histograms,
                "histogram_left_out": self.histogram_left_out, "text_tags": [FINDINGS_TAG],
                "findings": self.findings}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"tag": self.tags + self.histogram_tags + [FINDINGS_TAG]})

    def lines(self) -> list[str]:
        return [f"wrote {self.values} scalar values of {self.steps} step(s) under {len(self.tags)} tags, "
                f"{self.histograms} histograms under {len(self.histogram_tags)} tags and {self.findings} "
                f"finding(s) as text to {', '.join(self.files)}",
                f"view: tensorboard --logdir {self.logdir}"]

    show_table = False


@dataclass
class Log2Histogram:
    """One step's log2(absmax) of the layers of one kind, in buckets one bit
    wide: `bucket[i]` counts the values in [bucket_limit[i] - 1,
    bucket_limit[i]) (TensorBoard's convention: a limit is its bucket's
    right edge)."""
    count: int
    min: float
    max: float
    sum: float
    sum_squares: float
    bucket_limit: list[float]
    bucket: list[int]
    left_out: int = 0   # layers with absmax 0 or no finite value


def log2_histogram(absmax) -> Log2Histogram:
    """The histogram of log2 of the positive finite values of `absmax`."""
    a = np.asarray(absmax, dtype=float)
    usable = np.isfinite(a) & (a > 0)
    v = np.log2(a[usable])
    left_out = int(a.size - usable.sum())
    if not v.size:
        return Log2Histogram(0, 0.0, 0.0, 0.0, 0.0, [], [], left_out)
    low, high = int(math.floor(v.min())), int(math.floor(v.max()))
    counts = np.bincount(np.floor(v).astype(int) - low, minlength=high - low + 1)
    return Log2Histogram(int(v.size), float(v.min()), float(v.max()), float(v.sum()), float((v * v).sum()),
                         [float(k + 1) for k in range(low, high + 1)], [int(c) for c in counts], left_out)


def require_tensorboard():
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"the TensorBoard export needs tensorboard: {EXTRA_HINT}") from None


def export_tensorboard(run, logdir, *, rank: int | None = None, window: int = 1000) -> ExportResult:
    """Write `run` (a run directory or a loaded `Run`) to `logdir` as
    scalars, `log2_absmax/<kind>` histograms and the `findings` text.
    `window` as for `summary`."""
    require_tensorboard()
    from tensorboard.compat.proto import event_pb2

    from .analyses.summary import summarize
    from .reporting.data import DTYPE_MAX  # the same overflow limits as the report's heatmap

    if not isinstance(run, Run):
        from .reading.loader import load_run
        run = load_run(run, rank=rank)
    findings = summarize(run, window=window).findings
    logdir = Path(logdir)
    for r in run.ranks:
        target = _target(logdir, run, r)
        if target.is_dir() and any(target.glob("events.out.tfevents.*")):
            # A second file in one directory replays the steps from 0: the
            # reader takes that for a restart and drops data.
            raise ExportError(f"{target} already holds TensorBoard event files; export into an empty "
                              f"directory (or delete them)")
    files, tags, histogram_tags = [], set(), set()
    counts = {"values": 0, "histograms": 0, "left_out": 0}
    for r in run.ranks:
        target = _target(logdir, run, r)
        writer = _Writer(target, event_pb2, tags, histogram_tags, counts)
        try:
            steps = run.steps[run.steps["rank"] == r].sort_values("step")
            per_step = {int(row.step): step_values(row) for row in steps.itertuples(index=False)}
            wall = dict(zip(steps["step"].astype(int), steps["wall_time"].astype(float)))
            # Events strictly in step order: TensorBoard's reader treats a
            # step going backwards as a restart and drops the later data.
            only_steps = iter(sorted(per_step))
            nxt = next(only_steps, None)
            for step, rows in layer_rows(run, r, DTYPE_MAX):
                while nxt is not None and nxt < step:
                    writer.write(nxt, wall.get(nxt), per_step[nxt])
                    nxt = next(only_steps, None)
                if nxt == step:
                    nxt = next(only_steps, None)
                writer.write(step, wall.get(step), per_step.get(step, []) + layer_scalars(rows),
                             kind_histograms(rows))
            while nxt is not None:  # steps after the last tensor row
                writer.write(nxt, wall.get(nxt), per_step[nxt])
                nxt = next(only_steps, None)
            writer.text(FINDINGS_TAG, findings_markdown(findings))
        finally:
            writer.close()
        # The writer names its file itself (time, host, pid): the new one.
        files.extend(str(f) for f in sorted(target.glob("events.out.tfevents.*")))
    return ExportResult(logdir=str(logdir), files=files, steps=int(run.steps["step"].nunique()),
                        tags=sorted(tags, key=lambda t: (t not in STEP_TAGS, t)), values=counts["values"],
                        histogram_tags=[t for t in (HISTOGRAM_TAG.format(kind=k) for k in LAYER_KINDS)
                                        if t in histogram_tags],
                        histograms=counts["histograms"], histogram_left_out=counts["left_out"],
                        findings=len(findings))


def _target(logdir: Path, run: Run, rank: int) -> Path:
    return logdir if len(run.ranks) == 1 else logdir / f"rank={rank}"


def step_values(row) -> list[tuple[str, float]]:
    """[(tag, value)] of one row of `run.steps`: the step scalars every
    export writes (`export_mlflow` too)."""
    out = [("loss", row.loss), ("grad_norm", row.grad_norm), ("skipped", 1.0 if row.skipped else 0.0)]
    if row.loss_scale is not None and not pd.isna(row.loss_scale):
        out.append(("loss_scale", row.loss_scale))
    return [(t, float(v)) for t, v in out if v is not None]


def layer_rows(run: Run, rank: int, limits: dict):
    """(step, DataFrame) in step order, shard by shard: one row per kind and
    layer (`kind`, `name`, `absmax`, `headroom`), repeated calls merged by
    their maximum, a step whose rows straddle two record batches merged."""
    cols = ["step", "rank", "name", "kind", "dtype", "absmax", "nan_count", "inf_count"]
    pending = None
    # A sharded parameter's rows merged across ranks: one row per step,
    # under the lowest rank holding a shard of it.
    for df in run.iter_tensor_frames(cols, kinds=LAYER_KINDS, label="exporting tensors"):
        df = df[df["rank"] == rank]
        if df.empty:
            continue
        df["bad"] = (df["nan_count"] + df["inf_count"]) > 0
        for step, rows in _merged(df).groupby("step", sort=True):
            if pending is not None and pending[0] == int(step):
                pending = (pending[0], _merged(pd.concat([pending[1], rows])))
                continue
            if pending is not None:
                yield pending[0], _with_headroom(pending[1], limits)
            pending = (int(step), rows)
    if pending is not None:
        yield pending[0], _with_headroom(pending[1], limits)


def _merged(df: pd.DataFrame) -> pd.DataFrame:
    return df.groupby(["step", "kind", "name"], sort=True).agg(
        absmax=("absmax", "max"), bad=("bad", "any"), dtype=("dtype", "first")).reset_index()


def _with_headroom(g: pd.DataFrame, limits: dict) -> pd.DataFrame:
    limit = g["dtype"].map(limits).fillna(limits["float32"]).to_numpy(float)
    absmax = g["absmax"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        head = np.where(absmax > 0, np.log2(limit / absmax), np.nan)
    return g.assign(headroom=np.where(g["bad"].to_numpy(), 0.0, head))


def layer_scalars(rows: pd.DataFrame) -> list[tuple[str, float]]:
    """[(tag, value)] of one step's `layer_rows`: per layer its absmax and
    headroom (shared with `export_mlflow`)."""
    vals = []
    for kind, name, a, h in zip(rows["kind"], rows["name"], rows["absmax"], rows["headroom"]):
        layer = display_name(name)
        if not pd.isna(a):
            vals.append((f"absmax/{kind}/{layer}", float(a)))
        if not math.isnan(h):
            vals.append((f"headroom/{kind}/{layer}", float(h)))
    return vals


def layer_values(run: Run, rank: int, limits: dict):
    """(step, [(tag, value)]) in step order: `layer_scalars` of each step."""
    for step, rows in layer_rows(run, rank, limits):
        yield step, layer_scalars(rows)


def kind_histograms(rows: pd.DataFrame) -> list[tuple[str, Log2Histogram]]:
    """[(tag, histogram)] of one step's `layer_rows`: per kind recorded at
    that step, the log2 absmax of its layers."""
    return [(HISTOGRAM_TAG.format(kind=kind), log2_histogram(rows.loc[rows["kind"] == kind, "absmax"]))
            for kind in LAYER_KINDS if (rows["kind"] == kind).any()]


def findings_markdown(findings) -> str:
    """The findings as `summary` prints them (`Finding.lines`), in a fenced
    block: TensorBoard's text dashboard renders Markdown, and the block keeps
    the columns. The fence is longer than any run of backticks inside (a
    layer name may hold some)."""
    body = "\n".join(line for f in findings for line in f.lines())
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", body)), default=0))
    return f"{fence}\n{body}\n{fence}"


class _Writer:
    """One rank's event file: events in step order, the tags and counts
    gathered for the result."""

    def __init__(self, target: Path, event_pb2, tags: set, histogram_tags: set, counts: dict):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self.file = EventFileWriter(str(target))
        self.event_pb2, self.tags, self.histogram_tags, self.counts = event_pb2, tags, histogram_tags, counts
        self.last_step, self.last_wall = 0, 0.0

    def write(self, step: int, wall_time, vals, histograms=()) -> None:
        from tensorboard.compat.proto import summary_pb2
        value = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in vals]
        for tag, h in histograms:
            self.counts["left_out"] += h.left_out
            if h.count:
                value.append(summary_pb2.Summary.Value(tag=tag, histo=summary_pb2.HistogramProto(
                    min=h.min, max=h.max, num=h.count, sum=h.sum, sum_squares=h.sum_squares,
                    bucket_limit=h.bucket_limit, bucket=h.bucket)))
                self.histogram_tags.add(tag)
                self.counts["histograms"] += 1
        self.last_step, self.last_wall = step, wall_time or 0.0
        if not value:
            return
        self.file.add_event(self.event_pb2.Event(wall_time=wall_time or 0.0, step=step,
                                                 summary=summary_pb2.Summary(value=value)))
        self.tags.update(t for t, _ in vals)
        self.counts["values"] += len(vals)

    def text(self, tag: str, markdown: str) -> None:
        """A text summary at the last step written (never before it: the
        reader would take a step going back for a restart)."""
        from tensorboard.plugins.text.summary_v2 import text_pb
        self.file.add_event(self.event_pb2.Event(wall_time=self.last_wall, step=self.last_step,
                                                 summary=text_pb(tag, markdown)))

    def close(self) -> None:
        self.file.close()
