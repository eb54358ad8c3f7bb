"""`export_tensorboard(run, logdir)`: a run as TensorBoard scalars, so users
see it where they already look.

Per step: `loss`, `loss_scale` (after the step's update), `grad_norm`,
`skipped` (1 or 0). Per layer, one tag each: `absmax/<kind>/<layer>` (the
largest finite absolute value; repeated calls merged by their maximum) and
`headroom/<kind>/<layer>` (bits to the tensor's dtype overflow limit, 0 when
the tensor held a NaN/Inf), for the kinds `input`, `activation`,
`grad_output` and `grad_input` (gradients: the scaled values that
travelled). Values are written as recorded: a NaN loss stays NaN.

Written with TensorBoard's own event writer (the `report` extra), without
torch. One event file per rank: in `logdir` for a one-rank run, else in
`logdir/rank=R`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ExportError, MissingExtraError
from .loader import Run
from .names import display_name

EXTRA_HINT = "pip install 'amp-postmortem[report]'"
LAYER_KINDS = ("input", "activation", "grad_output", "grad_input")
STEP_TAGS = ("loss", "loss_scale", "grad_norm", "skipped")


@dataclass
class ExportResult:
    logdir: str
    files: list[str]
    steps: int
    tags: list[str] = field(default_factory=list)
    values: int = 0

    def to_dict(self) -> dict:
        return {"logdir": self.logdir, "files": self.files, "steps": self.steps, "tags": len(self.tags),
                "step_tags": [t for t in self.tags if t in STEP_TAGS],
                "layer_tags": [t for t in self.tags if t not in STEP_TAGS], "values": self.values}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"tag": self.tags})

    def lines(self) -> list[str]:
        return [f"wrote {self.values} scalar values of {self.steps} step(s) under {len(self.tags)} tags "
                f"to {', '.join(self.files)}",
                f"view: tensorboard --logdir {self.logdir}"]

    show_table = False


def require_tensorboard():
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"the TensorBoard export needs tensorboard: {EXTRA_HINT}") from None


def export_tensorboard(run, logdir, *, rank: int | None = None) -> ExportResult:
    """Write `run` (a run directory or a loaded `Run`) as scalars to `logdir`."""
    require_tensorboard()
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    from .report.data import DTYPE_MAX  # the same overflow limits as the report's heatmap

    if not isinstance(run, Run):
        from .loader import load_run
        run = load_run(run, rank=rank)
    logdir = Path(logdir)
    files, tags, values = [], set(), 0
    for r in run.ranks:
        steps = run.steps[run.steps["rank"] == r].sort_values("step")
        target = logdir if len(run.ranks) == 1 else logdir / f"rank={r}"
        before = set(target.glob("events.out.tfevents.*")) if target.is_dir() else set()
        if before:
            # A second file in one directory replays the steps from 0: the
            # reader takes that for a restart and drops data.
            raise ExportError(f"{target} already holds TensorBoard event files; export into an empty "
                              f"directory (or delete them)")
        writer = EventFileWriter(str(target))
        try:
            per_step = {int(row.step): step_values(row) for row in steps.itertuples(index=False)}
            wall = dict(zip(steps["step"].astype(int), steps["wall_time"].astype(float)))
            # Events strictly in step order: TensorBoard's reader treats a
            # step going backwards as a restart and drops the later data.
            only_steps = iter(sorted(per_step))
            nxt = next(only_steps, None)
            for step, of_layers in layer_values(run, r, DTYPE_MAX):
                while nxt is not None and nxt < step:
                    values += _write(writer, event_pb2, summary_pb2, nxt, wall.get(nxt), per_step[nxt], tags)
                    nxt = next(only_steps, None)
                if nxt == step:
                    nxt = next(only_steps, None)
                vals = per_step.get(step, []) + of_layers
                values += _write(writer, event_pb2, summary_pb2, step, wall.get(step), vals, tags)
            while nxt is not None:  # steps after the last tensor row
                values += _write(writer, event_pb2, summary_pb2, nxt, wall.get(nxt), per_step[nxt], tags)
                nxt = next(only_steps, None)
        finally:
            writer.close()
        # The writer names its file itself (time, host, pid): the new one.
        files.extend(str(f) for f in sorted(set(target.glob("events.out.tfevents.*")) - before))
    return ExportResult(logdir=str(logdir), files=files, steps=int(run.steps["step"].nunique()),
                        tags=sorted(tags, key=lambda t: (t not in STEP_TAGS, t)), values=values)


def step_values(row) -> list[tuple[str, float]]:
    """[(tag, value)] of one row of `run.steps`: the step scalars every
    export writes (`export_mlflow` too)."""
    out = [("loss", row.loss), ("grad_norm", row.grad_norm), ("skipped", 1.0 if row.skipped else 0.0)]
    if row.loss_scale is not None and not pd.isna(row.loss_scale):
        out.append(("loss_scale", row.loss_scale))
    return [(t, float(v)) for t, v in out if v is not None]


def layer_values(run: Run, rank: int, limits: dict):
    """(step, [(tag, value)]) in step order, shard by shard: per layer its
    absmax and headroom (shared with `export_mlflow`)."""
    cols = ["step", "rank", "name", "kind", "dtype", "absmax", "nan_count", "inf_count"]
    pending = None
    for batch in run.iter_tensor_batches(cols, kinds=LAYER_KINDS, label="exporting tensors"):
        df = batch.to_pandas()
        df = df[df["rank"] == rank]
        if df.empty:
            continue
        df["bad"] = (df["nan_count"] + df["inf_count"]) > 0
        g = df.groupby(["step", "kind", "name"], sort=True).agg(
            absmax=("absmax", "max"), bad=("bad", "any"), dtype=("dtype", "first")).reset_index()
        limit = g["dtype"].map(limits).fillna(limits["float32"]).to_numpy(float)
        absmax = g["absmax"].to_numpy(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            head = np.where(absmax > 0, np.log2(limit / absmax), np.nan)
        g["headroom"] = np.where(g["bad"].to_numpy(), 0.0, head)
        for step, rows in g.groupby("step", sort=True):
            vals = []
            for kind, name, a, h in zip(rows["kind"], rows["name"], rows["absmax"], rows["headroom"]):
                layer = display_name(name)
                if not pd.isna(a):
                    vals.append((f"absmax/{kind}/{layer}", float(a)))
                if not math.isnan(h):
                    vals.append((f"headroom/{kind}/{layer}", float(h)))
            # A step's rows can straddle two record batches: merge them.
            if pending is not None and pending[0] == int(step):
                pending[1].extend(vals)
                continue
            if pending is not None:
                yield pending
            pending = (int(step), vals)
    if pending is not None:
        yield pending


def _write(writer, event_pb2, summary_pb2, step, wall_time, vals, tags) -> int:
    if not vals:
        return 0
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in vals])
    writer.add_event(event_pb2.Event(wall_time=wall_time or 0.0, step=step, summary=summary))
    tags.update(t for t, _ in vals)
    return len(vals)
