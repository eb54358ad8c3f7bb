"""What-if commands: `fix`, `scale-window`, `bisect`, `compare`, `recommend`.

No logic here: each parses its options, calls one function of
`amp_postmortem.whatif` or `amp_postmortem.analyses` and returns the report
to the shared output path (`output.py`: a readable table by default,
`--json`, `--csv` for tables). Replays draw a progress bar on stderr when
they take more than a second. Registered on `amp-postmortem` by one block at
the end of `cli.py` (`COMMANDS`).
"""
from __future__ import annotations

from pathlib import Path

import click

from .output import RUN_LOCATION, StderrProgress, bundle_run_options, open_run, output_options


def replay_options(*, step_required: bool = True):
    """--step, --model, --device, --policy of the commands that replay a bundle."""
    def decorate(f):
        f = click.option("--policy", type=click.Choice(["recorded", "cuda", "cpu"]), default="recorded",
                         show_default=True,
                         help="Autocast policy of the replay: the recording device's, or CUDA's / the CPU's.")(f)
        f = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                         help="Where to replay.")(f)
        f = click.option("--model", "model_spec", metavar="SPEC", default=None,
                         help="package.module:factory or path/to/file.py:factory returning the model "
                              "(default: the recorded class, built with no arguments).")(f)
        f = click.option("--step", type=int, required=step_required, default=None,
                         help="The step whose replay bundle to use.")(f)
        return f
    return decorate


@click.command("fix")
@bundle_run_options
@replay_options()
@click.option("--max-candidates", type=click.IntRange(min=1), default=12, show_default=True,
              help="Modules tried, worst local error first.")
@click.option("--max-set", type=click.IntRange(min=1), default=4, show_default=True,
              help="Largest set of modules the greedy search builds.")
@output_options(csv=True)
def fix(run_dir, rank, step, model_spec, device, policy, max_candidates, max_set):
    """Which module kept in float32 saves the step: replay it with one
    candidate module at a time outside autocast (worst local error first;
    a greedy set when no single module suffices) and print the one-line
    patch (`recorders.fp32.keep_fp32`).

    \b
        amp-postmortem fix runs/exp1 --step 1234 --model mypkg.models:build
        amp-postmortem fix runs/exp1 --step 1234 --model train.py:make_model --json
    """
    from .whatif.fix import find_fix
    return find_fix(run_dir, step, rank=rank, model=model_spec, device=device, policy=policy,
                    max_candidates=max_candidates, max_set=max_set, progress=StderrProgress())


def _scale_range(ctx, param, value):
    try:
        lo, hi = (int(v) for v in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not MIN:MAX (powers of two, e.g. -16:40)") from None
    if lo > hi:
        raise click.BadParameter(f"{value!r}: MIN must not exceed MAX")
    return lo, hi


@click.command("scale-window")
@bundle_run_options
@replay_options(step_required=False)
@click.option("--scales", default="-16:40", show_default=True, callback=_scale_range, metavar="MIN:MAX",
              help="Exponents k of the scales 2^k tried (replay) or considered (estimate).")
@click.option("--max-underflow", type=click.FloatRange(0, 1), default=0.05, show_default=True,
              help="Largest share of float16 gradient values flushed or subnormal at a usable scale.")
@click.option("--keep-fp32", "keep", metavar="MODULE[,MODULE]", default="",
              help="Replay with these modules kept in float32 (e.g. the ones `fix` names).")
@output_options(csv=True)
def scale_window(run_dir, rank, step, model_spec, device, policy, scales, max_underflow, keep):
    """The safe loss-scale window: scales 2^k at which the step's float16
    gradients neither overflow (NaN/Inf) nor underflow (more than
    --max-underflow flushed or subnormal), where the recorded scale stood,
    and GradScaler settings that stay inside it. With --model (and --step)
    the step is replayed at every scale; the estimate from the recorded
    statistics alone (no replay) is always given when RUN is a run.

    \b
        amp-postmortem scale-window runs/exp1
        amp-postmortem scale-window runs/exp1 --step 1234 --model mypkg.models:build --json
    """
    from .whatif.scale_window import ScaleWindowReport, estimate_scale_window, replay_scale_window
    replayed = estimate = None
    is_run = (Path(run_dir) / "manifest.json").is_file()
    if model_spec is not None:
        if step is None and is_run:
            raise click.UsageError("--model replays a bundle: give its --step too")
        modules = tuple(m.strip() for m in keep.split(",") if m.strip())
        replayed = replay_scale_window(run_dir, step, rank=rank, model=model_spec, device=device, policy=policy,
                                       fp32_modules=modules, scales=scales, max_underflow=max_underflow,
                                       progress=StderrProgress())
    if is_run or model_spec is None:
        estimate = estimate_scale_window(open_run(run_dir, rank), step, scales=scales, max_underflow=max_underflow)
    return ScaleWindowReport(replay=replayed, estimate=estimate)


@click.command("bisect")
@bundle_run_options
@replay_options()
@click.option("--max-replays", type=click.IntRange(min=1), default=256, show_default=True,
              help="Replay budget; failing groups left unsplit are listed.")
@output_options(csv=True)
def bisect(run_dir, rank, step, model_spec, device, policy, max_replays):
    """Which samples of the saved batch make the step non-finite: bisect
    the batch (dimension 0) with replays. Every sample failing alone is a
    model problem; a few are a data problem, listed with their indices.

    \b
        amp-postmortem bisect runs/exp1 --step 1234 --model mypkg.models:build
    """
    from .whatif.bisect import bisect_samples
    return bisect_samples(run_dir, step, rank=rank, model=model_spec, device=device, policy=policy,
                          max_replays=max_replays, progress=StderrProgress())


@click.command("compare")
@click.argument("run_a", metavar="RUN_A", type=RUN_LOCATION)
@click.argument("run_b", metavar="RUN_B", type=RUN_LOCATION)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Compare this rank only (default: ranks averaged).")
@click.option("--threshold", type=click.FloatRange(min=0, min_open=True), default=0.1, show_default=True,
              help="Relative difference (to RUN_A) at which two curves have parted.")
@click.option("--persist", type=click.IntRange(min=1), default=3, show_default=True,
              help="Consecutive steps over the threshold needed to call it parted (a value "
                   "NaN/Inf in one run only parts at once).")
@output_options(csv=True)
def compare(run_a, run_b, rank, threshold, persist):
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
    from .analyses.compare import compare_runs
    return compare_runs(open_run(run_a, rank), open_run(run_b, rank), threshold=threshold, persist=persist)


@click.command("recommend")
@bundle_run_options
@click.option("--model", "model_spec", metavar="SPEC", default=None,
              help="Model factory: confirm the recommendations with what-if replays of a bundle.")
@click.option("--step", type=int, default=None,
              help="Bundle step to replay (default: by the reason it was saved for: the earliest "
                   "nonfinite_loss/nonfinite_tensor bundle, else scale_low, else skipped, else an "
                   "explicit request).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--policy", type=click.Choice(["recorded", "cuda", "cpu"]), default="recorded", show_default=True)
@output_options(csv=True)
def recommend(run_dir, rank, model_spec, step, device, policy):
    """What to change, each with its evidence: modules to keep in float32,
    GradScaler settings, whether bfloat16 avoids the problem, and when mixed
    precision should not be used. With --model the recommendations come
    from replays of one of the run's bundles (fix, scale window, bf16,
    bisect): the one --step names, else the earliest saved for a non-finite
    loss or tensor, else for a scale below its floor (scale_low), else for a
    skipped step, else on request. Without --model, from the recorded
    statistics.

    \b
        amp-postmortem recommend runs/exp1
        amp-postmortem recommend runs/exp1 --model mypkg.models:build --json
    """
    from .analyses.recommend import recommend as make
    return make(open_run(run_dir, rank), model=model_spec, step=step, rank=rank, device=device, policy=policy,
                progress=StderrProgress())


COMMANDS = (fix, scale_window, bisect, compare, recommend)
