"""Exports to experiment trackers. `export_mlflow(run, tracking_uri=...,
experiment=...)`: a run as an MLflow run, and `export_wandb(run, project=...,
offline=...)` as a W&B run, so teams see it in the tracker they already use. (Not named `export_mlflow.py`: the package's API
function of that name would be shadowed by the submodule once imported.)

Metrics per step: `loss`, `loss_scale`, `grad_norm`, `skipped` (1 or 0),
and per layer `headroom/<kind>/<layer>` (bits to the dtype's overflow limit,
0 when the tensor held a NaN/Inf): the same values as the TensorBoard export,
from the same data preparation (`export.step_values`, `export.layer_values`).
The findings of `summary` go in as tags (`amp_postmortem.findings`, one
`amp_postmortem.finding.<kind>` each) and as the table artifact
`findings.json`. One MLflow run per rank.

Written through `MlflowClient` (the `mlflow` extra's `mlflow-skinny`), not the
fluent `mlflow.start_run`: no global active run is left behind in the
caller's process.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from .errors import ExportError, MissingExtraError
from .export import layer_values, step_values
from .reading.loader import Run
from .result import CommandResult

EXTRA_HINT = "pip install 'amp-postmortem[mlflow]'"
DEFAULT_EXPERIMENT = "amp-postmortem"
# MLflow 3's own default is sqlite:///mlflow.db, a database this export can write too (the
# `mlflow` extra holds SQLAlchemy); a directory is the store that asks for nothing more.
DEFAULT_TRACKING_URI = "./mlruns"
FINDINGS_ARTIFACT = "findings.json"
# MLflow's limits: at most 1000 metrics per log_batch call, tag values of 8000 characters.
METRICS_PER_BATCH = 1000
TAG_VALUE_CHARS = 8000
# Metric keys may hold only these characters (the Windows set: the file store
# makes each key a file); `(model)` and `<input>` become `_model_`, `_input_`.
_KEY_BAD = re.compile(r"[^/\w.\- ]")


@dataclass
class MlflowExportResult(CommandResult):
    tracking_uri: str
    experiment: str
    experiment_id: str
    run_ids: list[str]
    steps: int
    metrics: list[str] = field(default_factory=list)
    values: int = 0
    findings: int = 0

    def document(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment": self.experiment,
                "experiment_id": self.experiment_id, "run_ids": self.run_ids, "steps": self.steps,
                "metrics": len(self.metrics), "values": self.values, "findings": self.findings}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"metric": self.metrics})

    def lines(self) -> list[str]:
        return [f"logged {self.values} metric values of {self.steps} step(s) under {len(self.metrics)} metrics "
                f"and {self.findings} finding(s) to MLflow run(s) {', '.join(self.run_ids)} in experiment "
                f"{self.experiment!r}",
                f"view: mlflow ui --backend-store-uri {self.tracking_uri}"]

    show_table = False


def require_mlflow():
    try:
        import mlflow.tracking  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"the MLflow export needs mlflow: {EXTRA_HINT}") from None


def metric_key(tag: str) -> str:
    return _KEY_BAD.sub("_", tag)


def export_mlflow(run, *, tracking_uri: str | os.PathLike | None = None, experiment: str | None = None,
                  rank: int | None = None, window: int = 1000) -> MlflowExportResult:
    """Log `run` (a run directory or a loaded `Run`) to MLflow at
    `tracking_uri` (default: $MLFLOW_TRACKING_URI, else `./mlruns`), in
    `experiment` (default: `amp-postmortem`; created if missing). `window`
    as for `summary`."""
    require_mlflow()
    experiment = experiment or DEFAULT_EXPERIMENT
    from mlflow.entities import Metric, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from .analyses.summary import summarize
    from .reporting.data import DTYPE_MAX  # the same overflow limits as the report and the TensorBoard export

    if not isinstance(run, Run):
        from .reading.loader import load_run
        run = load_run(run, rank=rank)
    uri = str(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    findings = summarize(run, window=window).findings
    tags = _finding_tags(findings)
    table = pd.DataFrame([{**f.to_dict(), "evidence": json.dumps(f.evidence, default=str)} for f in findings],
                         columns=["kind", "severity", "step", "layer", "message", "next_command", "evidence"])
    metrics, values, run_ids = set(), 0, []
    try:
        with _file_store_allowed(uri):
            client = MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            for r in run.ranks:
                name = Path(str(run.path)).name + ("" if len(run.ranks) == 1 else f" rank {r}")
                mlrun = client.create_run(experiment_id, run_name=name, tags={
                    "amp_postmortem.run_id": run.run_id, "amp_postmortem.path": str(run.path),
                    "amp_postmortem.rank": str(r)})
                run_id = mlrun.info.run_id
                batch: list = []

                def flush():
                    client.log_batch(run_id, metrics=batch)
                    batch.clear()

                for step, vals, wall in _values(run, r, DTYPE_MAX):
                    stamp = int((wall if wall is not None and math.isfinite(wall) else time.time()) * 1000)  # ms
                    for tag, value in vals:
                        key = metric_key(tag)
                        batch.append(Metric(key, value, stamp, step))
                        metrics.add(key)
                        if len(batch) == METRICS_PER_BATCH:
                            flush()
                    values += len(vals)
                if batch:
                    flush()
                client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                client.log_table(run_id, data=table, artifact_file=FINDINGS_ARTIFACT)
                client.set_terminated(run_id)
                run_ids.append(run_id)
    except MlflowException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"MLflow at {uri} refused the export: {first}") from None
    return MlflowExportResult(tracking_uri=uri, experiment=experiment, experiment_id=experiment_id,
                              run_ids=run_ids, steps=int(run.steps["step"].nunique()),
                              metrics=sorted(metrics), values=values, findings=len(findings))


def _values(run: Run, rank: int, limits: dict):
    """(step, [(tag, value)], wall_time) in step order: the step scalars and
    the per-layer headroom (absmax stays in TensorBoard: one metric per layer
    and kind is already hundreds of keys in MLflow's run view)."""
    steps = run.steps[run.steps["rank"] == rank].sort_values("step")
    per_step = {int(row.step): step_values(row) for row in steps.itertuples(index=False)}
    wall = dict(zip(steps["step"].astype(int), steps["wall_time"].astype(float)))
    for step, of_layers in layer_values(run, rank, limits):
        yield step, per_step.pop(step, []) + [(t, v) for t, v in of_layers if t.startswith("headroom/")], \
            wall.get(step)
    for step in sorted(per_step):  # steps without tensor rows (MLflow needs no step order)
        yield step, per_step[step], wall.get(step)


def _finding_tags(findings) -> dict[str, str]:
    tags = {"amp_postmortem.findings": str(len(findings)),
            "amp_postmortem.finding_kinds": ",".join(f.kind for f in findings)}
    for f in findings:
        key = f"amp_postmortem.finding.{metric_key(f.kind)}"
        n = 2
        while key in tags:  # one kind twice (two ranks' first NaNs): number the later ones
            key, n = f"amp_postmortem.finding.{metric_key(f.kind)}.{n}", n + 1
        where = f"step {'-' if f.step is None else f.step}" + ("" if f.layer is None else f" layer {f.layer}")
        tags[key] = f"{f.severity} {where}: {f.message}"[:TAG_VALUE_CHARS]
    return tags


@contextlib.contextmanager
def _file_store_allowed(uri: str):
    """MLflow 3 refuses its file store (a directory path or a `file:` URI)
    unless MLFLOW_ALLOW_FILE_STORE is set; the file store is what
    mlflow-skinny can write without a server or SQLAlchemy, so allow it for
    this export only, and leave the caller's environment as it was."""
    local = "://" not in uri or uri.startswith("file:")
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    if local and before is None:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if local and before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


# ------------------------------------------------------------------ W&B
WANDB_HINT = "pip install 'amp-postmortem[wandb]'"
DEFAULT_PROJECT = "amp-postmortem"


@dataclass
class WandbExportResult(CommandResult):
    project: str
    mode: str
    run_ids: list[str]
    run_dirs: list[str]
    steps: int
    metrics: list[str] = field(default_factory=list)
    values: int = 0
    findings: int = 0

    def document(self) -> dict:
        return {"project": self.project, "mode": self.mode, "run_ids": self.run_ids, "run_dirs": self.run_dirs,
                "steps": self.steps, "metrics": len(self.metrics), "values": self.values,
                "findings": self.findings}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"metric": self.metrics})

    def lines(self) -> list[str]:
        out = [f"logged {self.values} metric values of {self.steps} step(s) under {len(self.metrics)} metrics "
               f"and {self.findings} finding(s) to W&B run(s) {', '.join(self.run_ids)} in project "
               f"{self.project!r} ({self.mode})"]
        if self.mode == "offline":
            out.append(f"upload: wandb sync {' '.join(self.run_dirs)}")
        return out

    show_table = False


def require_wandb():
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"the W&B export needs wandb: {WANDB_HINT}") from None


def export_wandb(run, *, project: str | None = None, directory: str | os.PathLike | None = None,
                 offline: bool = False, rank: int | None = None, window: int = 1000) -> WandbExportResult:
    """Log `run` to Weights & Biases in `project` (default:
    `amp-postmortem`): the same metrics as `export_mlflow`, the findings as
    run tags (their kinds), summary keys and the table `findings`.
    `offline` (or WANDB_MODE=offline): write the run under `directory`
    (default: ./wandb) for `wandb sync`, no network."""
    require_wandb()
    import wandb

    from .analyses.summary import summarize
    from .reporting.data import DTYPE_MAX

    if not isinstance(run, Run):
        from .reading.loader import load_run
        run = load_run(run, rank=rank)
    project = project or DEFAULT_PROJECT
    # WANDB_MODE read here, per call: wandb reads it once per process (its
    # setup singleton), so a later change would be missed.
    mode = "offline" if offline else os.environ.get("WANDB_MODE") or None
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)  # wandb.init warns and falls back otherwise
    findings = summarize(run, window=window).findings
    tags = _finding_tags(findings)
    columns = ["kind", "severity", "step", "layer", "message", "next_command", "evidence"]
    rows = [[f.kind, f.severity, f.step, f.layer, f.message, f.next_command, json.dumps(f.evidence, default=str)]
            for f in findings]
    metrics, values, run_ids, run_dirs, used_mode = set(), 0, [], [], "online"
    for r in run.ranks:
        per_step: dict[int, dict] = {}
        # W&B drops a step logged after a later one: gather, then log in step order.
        for step, vals, _wall in _values(run, r, DTYPE_MAX):
            row = per_step.setdefault(step, {})
            row.update((metric_key(t), v) for t, v in vals)
        name = Path(str(run.path)).name + ("" if len(run.ranks) == 1 else f" rank {r}")
        wrun = wandb.init(project=project, name=name, dir=None if directory is None else str(directory),
                          mode=mode, tags=sorted({f.kind for f in findings})[:20],
                          config={"amp_postmortem.run_id": run.run_id, "amp_postmortem.path": str(run.path),
                                  "amp_postmortem.rank": r},
                          # console off: wandb would wrap the caller's stdout; git: the run is not this directory's code
                          settings=wandb.Settings(console="off", silent=True, disable_git=True))
        try:
            for step in sorted(per_step):
                wrun.log(per_step[step], step=step)
                metrics.update(per_step[step])
                values += len(per_step[step])
            wrun.summary.update(tags)
            wrun.log({"findings": wandb.Table(columns=columns, data=rows)}, step=max(per_step, default=0))
            used_mode = "offline" if wrun.offline else "online"
            run_ids.append(wrun.id)
            run_dirs.append(str(Path(wrun.dir).parent))
        finally:
            wrun.finish()
    # finish() can return before wandb's core process has written the run's
    # last records (the final step, the exit): teardown waits for it, so the
    # offline folder is whole when we return (a later wandb.init starts anew).
    wandb.teardown()
    return WandbExportResult(project=project, mode=used_mode, run_ids=run_ids, run_dirs=run_dirs,
                             steps=int(run.steps["step"].nunique()), metrics=sorted(metrics), values=values,
                             findings=len(findings))
