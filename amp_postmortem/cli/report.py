"""`amp-postmortem report`, `amp-postmortem export tensorboard` and `export
mlflow`: the CLI faces of `amp_postmortem.report`,
`amp_postmortem.export_tensorboard`, `export_tracking.export_mlflow` and
`export_wandb`. No logic here; registered in `cli.py`. The `report` extra
(plotly, tensorboard), the `mlflow` extra and the `wandb` extra, imported
only when a command runs.
"""
from __future__ import annotations

from pathlib import Path

import click

import amp_postmortem as api

from .output import output_options, run_options


@click.command("report")
@run_options
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The HTML file to write (default: <run name>-report.html here).")
@click.option("--replay", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="FILE.json", help="Output of `replay --json`: chart its per-module error per precision.")
@output_options(csv=False)
def report_command(run, rank, output, replay):
    """One self-contained HTML file to look at: findings (each linking to its
    plot), loss and loss scale with skipped and NaN steps, per-layer headroom
    heatmaps (forward and backward), the first-NaN spread, gradient norm and
    underflow, the run's facts. Opens offline; long runs are downsampled for
    display. Needs `pip install 'amp-postmortem[report]'`.

    \b
        amp-postmortem report runs/exp1 -o exp1.html
        amp-postmortem report runs/exp1 --replay replay-1234.json --json
    """
    return api.report(run, rank=rank, output=output, replay=replay)


@click.group("export")
def export_group():
    """Export a run to other tools.

    \b
        amp-postmortem export tensorboard runs/exp1 --logdir tb/exp1 [--rank R] [--json]
        amp-postmortem export mlflow runs/exp1 [--tracking-uri URI] [--experiment NAME] [--json]
        amp-postmortem export wandb runs/exp1 [--project NAME] [--offline] [--dir DIR] [--json]
    """


@export_group.command("tensorboard")
@run_options
@click.option("--logdir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="TensorBoard log directory to write the event file into.")
@output_options(csv=False)
def tensorboard_command(run, rank, logdir):
    """Write the run to TensorBoard: loss, loss scale, grad norm and skipped
    flags per step, and per layer its absmax and its headroom to its dtype's
    overflow limit (one scalar tag per layer); per step and tensor kind a
    histogram of the layers' log2 absmax (log2_absmax/KIND); the findings of
    `summary` as text (findings). One event file per rank. Needs
    `pip install 'amp-postmortem[report]'`.

    \b
        amp-postmortem export tensorboard runs/exp1 --logdir tb/exp1
        tensorboard --logdir tb
    """
    return api.export_tensorboard(run, rank=rank, logdir=logdir)



@export_group.command("mlflow")
@run_options
@click.option("--tracking-uri", metavar="URI", default=None,
              help="MLflow tracking URI: a server (http://...), a database (sqlite:///mlflow.db), or a "
                   "directory / file: URI for MLflow's file store, which MLflow 3 opens only with "
                   "MLFLOW_ALLOW_FILE_STORE=true (default: $MLFLOW_TRACKING_URI, else ./mlruns).")
@click.option("--experiment", metavar="NAME", default=None,
              help="MLflow experiment to log into, created if missing (default: amp-postmortem).")
@output_options(csv=False)
def mlflow_command(run, rank, tracking_uri, experiment):
    """Log the run to MLflow: loss, loss scale, grad norm and skipped flags
    per step and per layer its headroom to its dtype's overflow limit as
    metrics; the findings of `summary` as tags and as the table artifact
    findings.json. One MLflow run per rank. Needs
    `pip install 'amp-postmortem[mlflow]'`.

    \b
        amp-postmortem export mlflow runs/exp1 --tracking-uri sqlite:///mlflow.db --experiment exp1
        mlflow ui --backend-store-uri sqlite:///mlflow.db
        amp-postmortem export mlflow runs/exp1 --tracking-uri mlruns
        MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri mlruns
    """
    return api.export_mlflow(run, rank=rank, tracking_uri=tracking_uri, experiment=experiment)



@export_group.command("wandb")
@run_options
@click.option("--project", metavar="NAME", default=None,
              help="W&B project to log into (default: amp-postmortem).")
@click.option("--offline", is_flag=True, default=False,
              help="Write the run to disk for `wandb sync`, no network (as WANDB_MODE=offline, also honoured).")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Directory wandb writes its run folder under (default: ./wandb).")
@output_options(csv=False)
def wandb_command(run, rank, project, offline, directory):
    """Log the run to Weights & Biases: the same metrics as `export mlflow`
    (step scalars, per-layer headroom), the findings of `summary` as run
    tags, summary keys and the table `findings`. One W&B run per rank.
    Needs `pip install 'amp-postmortem[wandb]'`.

    \b
        amp-postmortem export wandb runs/exp1 --offline --dir /tmp/wb
        wandb sync /tmp/wb/wandb/offline-run-*
    """
    return api.export_wandb(run, rank=rank, project=project, offline=offline, directory=directory)
