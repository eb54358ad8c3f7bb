"""What-if commands: `fix`, `scale-window`, `bisect`, `compare`, `recommend`.

No logic here: each parses its options, calls the API function of the same
name (`amp_postmortem.fix`, ...) and returns the result to the shared
output path (`output.py`: a readable table by default,
`--json`, `--csv` for tables). Replays draw a progress bar on stderr when
they take more than a second. Registered on `amp-postmortem` by one block at
the end of `cli.py` (`COMMANDS`).
"""
from __future__ import annotations

from pathlib import Path

import click

import amp_postmortem as api

from ..analyses.bundle_choice import priority_description
from .replay import LOSS_FN_HELP, MODEL_HELP
from ..names import DEVICES, PARAM_DTYPES, POLICIES, REDUCED_PRECISIONS, RERUN_PRECISIONS, UPDATE_ROUNDINGS
from .output import RUN_LOCATION, StderrProgress, api_default, output_options, run_options


LOSS_HELP = ("path/to/file.py:name (or package.module:name): the loss the loop computes outside the model "
             "(a criterion module or class, or a function), called as the loop called it on the targets the "
             "window kept (recorded with AmpRecorder(..., loss_fn=criterion)).")
# The one --loss option of the commands that re-run the saved window (rerun,
# and fix, scale-window and recommend checking their remedy over it).
loss_option = click.option("--loss", metavar="FILE.py:NAME", default=None, help=LOSS_HELP)


def replay_options(*, step_required: bool = True, precision: bool = True, step_help: str | None = None):
    """--step, --model, --loss-fn, --device, --policy and --precision of the
    what-ifs that replay a bundle (`nans` and `summary` take them without
    --precision: their replay runs in the recorded precision)."""
    def decorate(f):
        if precision:
            f = click.option("--precision", type=click.Choice(REDUCED_PRECISIONS), default=None,
                             help="Reduced precision of the replay (default: the recorded one; a step "
                                  "recorded without autocast needs it).")(f)
        f = click.option("--policy", type=click.Choice(POLICIES), default="recorded", show_default=True,
                         help="Autocast policy of the replay: the recording device's, or CUDA's / the CPU's.")(f)
        f = click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
                         help="Where to replay.")(f)
        f = click.option("--loss-fn", metavar="SPEC", default=None, help=LOSS_FN_HELP)(f)
        f = click.option("--model", metavar="SPEC", default=None, help=MODEL_HELP)(f)
        f = click.option("--step", type=int, required=step_required, default=None,
                         help=step_help or "The step whose replay bundle to use.")(f)
        return f
    return decorate


def _modules(ctx, param, value):
    return tuple(m.strip() for m in value.split(",") if m.strip())


@click.command("fix")
@run_options
@replay_options()
@click.option("--max-candidates", type=click.IntRange(min=1), default=api_default(api.fix, "max_candidates"),
              show_default=True, help="Modules tried, worst local error first.")
@click.option("--max-set", type=click.IntRange(min=1), default=api_default(api.fix, "max_set"), show_default=True,
              help="Largest set of modules the greedy search builds.")
@loss_option
@output_options(csv=True)
def fix(run, **options):
    """What saves the step in float32, the cheapest first: the culprit's
    operation at its source line (replayed with that line outside autocast,
    its float16 inputs cast up, and printed as the line rewritten), then
    modules: one candidate module at a time outside autocast (worst local
    error first; a greedy set when no single module suffices), printed as
    the one-line patch (`recorders.fp32.keep_fp32`). Each is tried on every
    saved step and ranked by the forward work it moves to float32.

    \b
        amp-postmortem fix runs/exp1 --step 1234 --model mypkg.models:build
        amp-postmortem fix runs/exp1 --step 1234 --model train.py:make_model --json
        amp-postmortem fix runs/exp1 --step 1234 --model train.py:make_model --loss train.py:criterion
    """
    return api.fix(run, **options, progress=StderrProgress())


def _scale_range(ctx, param, value):
    try:
        lo, hi = (int(v) for v in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not MIN:MAX (powers of two, e.g. -16:40)") from None
    if lo > hi:
        raise click.BadParameter(f"{value!r}: MIN must not exceed MAX")
    return lo, hi


@click.command("scale-window")
@run_options
@replay_options(step_required=False)
@click.option("--scales", default="{}:{}".format(*api_default(api.scale_window, "scales")), show_default=True,
              callback=_scale_range, metavar="MIN:MAX",
              help="Exponents k of the scales 2^k tried (replay) or considered (estimate).")
@click.option("--max-underflow", type=click.FloatRange(0, 1), default=api_default(api.scale_window, "max_underflow"),
              show_default=True,
              help="Largest share of float16 gradient values flushed or subnormal at a usable scale.")
@click.option("--keep-fp32", metavar="MODULE[,MODULE]", default="", callback=_modules,
              help="Replay with these modules kept in float32 (e.g. the ones `fix` names).")
@loss_option
@output_options(csv=True)
def scale_window(run, **options):
    """The safe loss-scale window: scales 2^k at which the step's float16
    gradients neither overflow (NaN/Inf) nor underflow (more than
    --max-underflow flushed or subnormal), where the recorded scale stood,
    and GradScaler settings that stay inside it. With --model (and --step)
    the step is replayed at every scale, and the run's other saved steps at
    the window's top (lowered until they are finite too); the estimate from
    the recorded statistics alone (no replay: marked "estimate, not
    verified") is always given when RUN is a run.

    \b
        amp-postmortem scale-window runs/exp1
        amp-postmortem scale-window runs/exp1 --step 1234 --model mypkg.models:build --json
        amp-postmortem scale-window runs/exp1 --step 1234 --model train.py:make_model --loss train.py:criterion
    """
    return api.scale_window(run, **options, progress=StderrProgress())


@click.command("bisect")
@run_options
@replay_options()
@click.option("--keep-fp32", metavar="MODULE[,MODULE]", default="", callback=_modules,
              help="Replay with these modules kept in float32 (e.g. the ones `fix` names).")
@click.option("--max-replays", type=click.IntRange(min=1), default=api_default(api.bisect, "max_replays"),
              show_default=True, help="Replay budget; failing groups left unsplit are listed.")
@output_options(csv=True)
def bisect(run, **options):
    """Which samples of the saved batch make the step non-finite: bisect
    the batch (dimension 0) with replays. Every sample failing alone is a
    model problem; a few are a data problem, listed with their indices.

    \b
        amp-postmortem bisect runs/exp1 --step 1234 --model mypkg.models:build
    """
    return api.bisect(run, **options, progress=StderrProgress())


@click.command("compare")
@click.argument("run_a", metavar="RUN_A", type=RUN_LOCATION)
@click.argument("run_b", metavar="RUN_B", type=RUN_LOCATION)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Compare this rank only (default: ranks averaged).")
@click.option("--threshold", type=click.FloatRange(min=0, min_open=True), default=api_default(api.compare, "threshold"),
              show_default=True,
              help="Relative difference (to RUN_A) at which two curves have parted.")
@click.option("--persist", type=click.IntRange(min=1), default=api_default(api.compare, "persist"), show_default=True,
              help="Consecutive steps over the threshold needed to call it parted (a value "
                   "NaN/Inf in one run only parts at once).")
@output_options(csv=True)
def compare(run_a, run_b, **options):
    """Where two runs of the same model and data part (e.g. an fp32
    baseline RUN_A and its AMP twin RUN_B): the first step where the loss
    curves differ by more than --threshold for --persist steps in a row,
    and the layers whose gradient norms and activation ranges part first,
    ranked. Values that are rounding noise (below 1e-4 of the largest of
    their kind in that step, or 1e-3 of the layer's own median) are not
    compared.

    \b
        amp-postmortem compare runs/fp32 runs/amp
        amp-postmortem compare runs/fp32 runs/amp --threshold 0.05 --json
    """
    return api.compare(run_a, run_b, **options, progress=StderrProgress())


@click.command("recommend")
@run_options
@click.option("--model", metavar="SPEC", default=None,
              help="Model factory: confirm the recommendations with what-if replays of a bundle.")
@click.option("--step", type=int, default=None,
              help=f"Bundle step to replay (default: {priority_description()}).")
@click.option("--loss-fn", metavar="SPEC", default=None, help=LOSS_FN_HELP)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True, help="Where to replay.")
@click.option("--policy", type=click.Choice(POLICIES), default="recorded", show_default=True,
              help="Autocast policy of the replays: the recording device's, or CUDA's / the CPU's.")
@loss_option
@output_options(csv=True)
def recommend(run, **options):
    """What to change, each with its evidence: modules to keep in float32,
    GradScaler settings, whether bfloat16 avoids the problem, and when mixed
    precision should not be used. With --model the recommendations come
    from replays of one of the run's bundles (fix, scale window, bf16,
    bisect): the one --step names, else the one saved for the most telling
    reason (see --step). Without --model, from the recorded statistics.

    \b
        amp-postmortem recommend runs/exp1
        amp-postmortem recommend runs/exp1 --model mypkg.models:build --json
        amp-postmortem recommend runs/exp1 --model train.py:make_model --loss train.py:criterion
    """
    return api.recommend(run, **options, progress=StderrProgress())


@click.command("rerun")
@click.argument("run", metavar="RUN", type=RUN_LOCATION)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="The rank whose window to re-run (default: the lowest with one).")
@click.option("--from", "from_step", type=int, default=None,
              help="First step re-run under the remedy (default: the window's first); earlier steps of the "
                   "window are re-run as recorded to reach it.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Steps re-run from --from (default: to the window's end).")
@click.option("--precision", type=click.Choice(RERUN_PRECISIONS), default=api_default(api.rerun, "precision"),
              show_default=True, help="Precision of the re-run: autocast off (fp32, fp64) or on in that dtype.")
@click.option("--keep-fp32", "keep_fp32", metavar="MODULE", multiple=True,
              help="Keep this module (its dotted name; repeatable, or comma-separated) in float32.")
@click.option("--init-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Start the GradScaler at this scale (default: the recorded one).")
@click.option("--lr-scale", type=click.FloatRange(min=0, min_open=True), default=api_default(api.rerun, "lr_scale"),
              show_default=True, help="Multiply every recorded learning rate by this factor.")
@click.option("--param-dtype", type=click.Choice(PARAM_DTYPES), default=None,
              help="The parameters' dtype: as the window saved them (recorded), or float32 (master weights); "
                   "default: float32 for --precision fp32/fp64, else recorded.")
@click.option("--update-rounding", type=click.Choice(UPDATE_ROUNDINGS),
              default=api_default(api.rerun, "update_rounding"), show_default=True,
              help="How updates of bfloat16/float16 parameters are rounded: to nearest (as torch does), or "
                   "stochastically.")
@click.option("--model", metavar="SPEC", default=None, help=MODEL_HELP)
@click.option("--loss-fn", metavar="SPEC", default=None,
              help="package.module:function or path/to/file.py:function, called as loss_fn(output, micro_batch): "
                   "the loss when the model does not return it (targets outside its inputs are not recorded).")
@loss_option
@click.option("--optimizer", metavar="SPEC", default=None,
              help="package.module:factory called as factory(model), returning the optimizer: needed when the "
                   "run's optimizer is not a torch.optim class the re-run rebuilds (SGD, Adam, AdamW, RMSprop, ...).")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True, help="Where to re-run.")
@click.option("--policy", type=click.Choice(POLICIES), default="recorded", show_default=True,
              help="Autocast policy of fp16/bf16 re-runs: the recording device's, or CUDA's / the CPU's.")
@output_options(csv=True)
def rerun(run, **options):
    """Re-run the saved window of steps (recorded with
    BundlePolicy(window_steps=K)) under a remedy: forward, backward through
    a GradScaler and the optimizer's step, from the weights, optimizer and
    scaler state saved at the window's start. Per step: finite or not, the
    loss vs the recorded loss, skipped; overall whether the run stays finite.

    \b
        amp-postmortem rerun runs/exp1 --precision fp32 --model mypkg.models:build
        amp-postmortem rerun runs/exp1 --from 120 --steps 16 --keep-fp32 attn --model train.py:make_model
        amp-postmortem rerun runs/exp1 --precision fp32 --model train.py:make_model --loss train.py:criterion
        amp-postmortem rerun runs/exp1 --precision bf16 --param-dtype float32 --model train.py:make_model
    """
    return api.rerun(run, **options)


COMMANDS = (fix, scale_window, bisect, compare, recommend, rerun)
