"""`amp-postmortem`: the command line, a thin layer over the Python API
(`amp_postmortem/__init__.py`). This package: `main` and the analysis
commands here, the other commands in `replay`, `whatif` and `report`, and
`output`, the one output path. Each command parses its options, calls the
API function of the same name with them as keyword arguments, and returns
the result to that output path.

Adding a command: add its function to the API first, then a small function
under `@main.command()`, decorated with `run_options` (RUN and --rank), its
options (defaults read from the API function with `api_default`) and
`output_options(...)`, that returns `api.<command>(run, **options)`.

Errors: a `PostmortemError` (the user's to fix) becomes one line
`Error: ...` and exit code 2, like click's usage errors; any other exception
is a bug: exit code 1 with one line `Error: internal error: ...`, and the
traceback with `--debug` (or AMP_POSTMORTEM_DEBUG=1).
"""
from __future__ import annotations

import os

import click

import amp_postmortem as api
from recorders.schedule import MODES as RECORD_MODES

from ..errors import PostmortemError
from ..analyses.fail_on import SEVERITIES, fail_rule
from ..names import FINDING_KINDS
from .replay import replay_command
from .report import export_group, report_command
from .whatif import COMMANDS as WHATIF_COMMANDS
from .whatif import LOSS_HELP, replay_options
from .output import (StderrProgress, api_default, emit_event, engine_options, output_options, run_options,
                     stream_options)

# --model and the replay's options on `nans` and `summary`: the op origin of a saved step.
op_origin_options = replay_options(
    step_required=False, precision=False,
    step_help="With --model: the step whose bundle to replay for the op origin (default: the bundle saved at "
              "the forward origin's step, else the one `recommend` replays).")

EXIT_USAGE = 2  # unusable input, like click's usage errors
EXIT_BUG = 1    # an unexpected exception: a bug to report
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT), as shells report it


class CliError(click.ClickException):
    exit_code = EXIT_USAGE


class InternalError(click.ClickException):
    exit_code = EXIT_BUG


class _Group(click.Group):
    """Turns library errors into one `Error: ...` line (exit 2), bugs into
    one `Error: internal error: ...` line (exit 1) and Ctrl-C into one
    `stopped (interrupted)` line (exit 130)."""

    def invoke(self, ctx):
        debug = ctx.params.get("debug") or os.environ.get("AMP_POSTMORTEM_DEBUG")
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except PostmortemError as exc:
            if debug:
                raise
            raise CliError(str(exc)) from None
        except KeyboardInterrupt:
            # Stopped by the user: not a finding or a bug (1), nor unusable input (2).
            click.echo("stopped (interrupted)", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            # `amp-postmortem nans RUN | head`: the reader left early; not an
            # error. Point stdout at /dev/null so the final flush is quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            raise click.exceptions.Exit(0) from None
        except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback on request
            if debug:
                raise
            text = (str(exc).strip().splitlines() or [""])[0]
            raise InternalError(f"internal error: {type(exc).__name__}: {text} "
                                f"(re-run with --debug for the traceback)") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="amp-postmortem")
@click.option("--debug", is_flag=True,
              help="Show the traceback of an error instead of one line (also AMP_POSTMORTEM_DEBUG=1).")
def main(debug):
    """Post-mortems of mixed-precision (AMP) training runs recorded by
    `recorders.AmpRecorder`. Start with `summary`:

    \b
        amp-postmortem summary runs/exp1

    Every command takes the run directory, prints a readable table, and
    takes --json (and --csv for tables) for machines. Each is also a Python
    function: `amp_postmortem.summary("runs/exp1").to_dict()` is what
    `--json` prints. Exit code 0 when the analysis ran, 2 for unusable
    input, 1 for an internal error (or a `--fail-on` finding), 130 when
    stopped with Ctrl-C.
    """


@main.command()
@run_options
@click.option("--from-step", type=int, default=None, help="Ignore steps before this one.")
@click.option("--to-step", type=int, default=None, help="Ignore steps after this one.")
@op_origin_options
@engine_options
@output_options(csv=True)
def nans(run, **options):
    """Rank layers by their first NaN/Inf and name the origin; with --model,
    also the op origin: a saved step replayed, the first operation (and
    source line) whose output turned NaN/Inf from finite inputs, as `replay`
    names it.

    Order: by first step; within a step forward before backward, then in the
    order the tensors were produced. ORIGIN marks the layer that made the
    non-finite value (forward: output non-finite while its inputs were
    finite, or `<input>` for a bad batch; backward: gradient to its inputs
    or parameters non-finite while the gradient it received was finite, or
    `<loss>`); every other layer only propagated it.

    \b
        amp-postmortem nans runs/exp1
        amp-postmortem nans runs/exp1 --from-step 1000 --json
        amp-postmortem nans runs/exp1 --model mypkg.models:build
    """
    return api.nans(run, **options, progress=StderrProgress())


@main.command()
@run_options
@engine_options
@output_options(csv=False)
def scale(run, **options):
    """Loss-scale dynamics: healthy, collapse, stuck_low, growth_blocked or
    no_scaler, with the onset and rate of a collapse, skip rates before and
    after it, the longest skip streak, the step at which the scale would make
    the gradients underflow, and the layers whose overflows drive the
    backoffs.

    \b
        amp-postmortem scale runs/exp1
        amp-postmortem scale runs/exp1 --json | jq .status
    """
    return api.scale(run, **options, progress=StderrProgress())


@main.command()
@run_options
@click.option("--window", type=click.IntRange(min=0), default=api_default(api.ranges, "window"), show_default=True,
              help="Analyse the last N recorded steps: those with module rows (a sentinel run's sampled "
                   "and re-executed steps; 0: the whole run).")
@engine_options
@output_options(csv=True)
def ranges(run, **options):
    """Per layer float16 range: headroom to overflow in bits
    (log2(65504/absmax)) and its trend, the step at which the trend reaches
    zero headroom, and the share of gradient values in the float16
    subnormal range at the recorded scale. Flags: overflow_risk, underflow.

    \b
        amp-postmortem ranges runs/exp1
        amp-postmortem ranges runs/exp1 --window 0 --csv > ranges.csv
    """
    return api.ranges(run, **options, progress=StderrProgress())


def _fail_on(ctx, param, value):
    """--fail-on: a severity or finding kinds, checked before any run is
    read (`analyses.fail_on.fail_rule`); a bad value is one `Error:` line."""
    if value is None:
        return None
    try:
        fail_rule(value)
    except PostmortemError as exc:
        raise CliError(str(exc)) from None
    return value


FAIL_ON_HELP = ("a severity (" + ", ".join(SEVERITIES) + ": a finding of it or worse) or finding kinds ("
                + ", ".join(FINDING_KINDS) + ")")


@main.command()
@run_options
@click.option("--window", type=click.IntRange(min=0), default=api_default(api.summary, "window"), show_default=True,
              help="Judge float16 ranges over the last N recorded steps (0: the whole run), as `ranges`.")
@click.option("--fail-on", metavar="LEVEL|KIND[,KIND]", callback=_fail_on, default=None,
              help="Exit with code 1 when a finding of this severity or worse, or of these kinds, exists "
                   "(for CI): " + FAIL_ON_HELP + ".")
@op_origin_options
@click.option("--loss", metavar="FILE.py:NAME", default=None, help="With --model: " + LOSS_HELP)
@engine_options
@output_options(csv=True)
def summary(run, fail_on, **options):
    """Run facts and findings (non-finite values, training instability,
    loss-scale collapse, low scale, gradient underflow, overflow risk,
    recording stopped) most severe first, each with its evidence and the
    next command to run; with --model, a run with a NaN/Inf also gets the
    op origin of a saved step (as `nans --model`), and precision or
    instability is decided by a float32 re-run of the saved window of steps
    (a run recorded with BundlePolicy(window_steps=K)); otherwise it is
    "undetermined", with the command that would decide it.

    \b
        amp-postmortem summary runs/exp1
        amp-postmortem summary runs/exp1 --fail-on nonfinite,scale_collapse
        amp-postmortem summary runs/exp1 --fail-on critical
        amp-postmortem summary runs/exp1 --model mypkg.models:build
    """
    report = api.summary(run, **options, progress=StderrProgress())
    return report, (1 if report.failing(fail_on) else 0)


@main.command()
@run_options
@click.option("--fail-on", metavar="LEVEL|KIND[,KIND]", default=api_default(api.watch, "fail_on"),
              show_default=True, callback=_fail_on,
              help="Stop with exit code 1 at the first finding of this severity or worse, or of these kinds "
                   "(as summary's --fail-on): " + FAIL_ON_HELP + ".")
@click.option("--interval", type=float, default=api_default(api.watch, "interval"), show_default=True,
              help="Seconds between looks at the run: an alert comes at most this long (plus one analysis) "
                   "after its step reaches the disk (on a store: after its shard pair is uploaded).")
@click.option("--window", type=click.IntRange(min=0), default=api_default(api.watch, "window"), show_default=True,
              help="Judge float16 ranges over the last N recorded steps (0: the whole run), as `summary`.")
@click.option("--wait-timeout", type=float, default=api_default(api.watch, "wait_timeout"), show_default=True,
              help="Seconds to wait for a run that does not exist yet (a job started a moment ago) before "
                   "giving up with exit code 2; 0: do not wait.")
@stream_options
def watch(run, fmt, **options):
    """Follow a running job's run (a directory, or a URI such as
    s3://bucket/run) and print each new finding of `summary` once, as it
    appears; a run that does not exist yet is waited for (--wait-timeout),
    so `python train.py & amp-postmortem watch runs/exp1` works. Exit
    codes: 1 at the first finding at or above --fail-on; 0
    when the job closes its recording without one; 3 when recording stops
    early (the recorder switched itself off, or the job's process on this
    host is gone without closing: never judged for a run on a store); 2
    for unusable input (a run still missing after --wait-timeout, a file,
    a recorder's local spool, a store that does not answer); 130 when
    stopped with Ctrl-C. On a store an
    alert waits for the step's shard pair to be uploaded (every
    steps_per_shard steps or flush_interval_s seconds).

    \b
        amp-postmortem watch runs/exp1
        amp-postmortem watch runs/exp1 --fail-on error --interval 5 --json
        amp-postmortem watch s3://my-bucket/runs/exp1
    """
    events = api.watch(run, **options)
    end = None
    try:
        # Inside: a Ctrl-C that lands while this line is written (its reader
        # may act on it before the write returns) is an interrupt too.
        click.echo(f"watching {run} every {options['interval']:g} s (Ctrl-C to stop)", err=True)
        for event in events:
            emit_event(event, fmt)
            end = event
    except KeyboardInterrupt:
        # Stopped by the user: not a finding (1) nor a clean close (0).
        click.echo("stopped watching (interrupted)", err=True)
        click.get_current_context().exit(EXIT_INTERRUPTED)
    click.get_current_context().exit(end.exit_code)



def _recorder_options(ctx, param, value):
    """--option KEY=VALUE (repeated) as {KEY: VALUE}; a malformed one is one `Error:` line."""
    from ..record_script import parse_option
    try:
        return dict(parse_option(text) for text in value) or None
    except PostmortemError as exc:
        raise CliError(str(exc)) from None


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--run", default=None, metavar="DIR", help="The run directory (or URI) to write "
              "[default: runs/<script>-<YYYYmmdd-HHMMSS>].")
@click.option("--mode", type=click.Choice(RECORD_MODES), default=None,
              help="The recorder's mode [default: $AMP_POSTMORTEM_MODE, else sentinel].")
@click.option("--include", multiple=True, metavar="GLOB", help="Watch only these modules (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Do not watch these modules (repeatable).")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", callback=_recorder_options,
              help="Any other AmpRecorder keyword, VALUE a Python literal (repeatable): "
                   "--option window_steps=16 --option full_every=10.")
@click.option("--loss", default=None, metavar="NAME",
              help="The loss the loop computes outside the model (loss = NAME(model(x), y)): a name at the "
                   "script's top level, or package.module:function; recorded as AmpRecorder's loss_fn "
                   "(a 16-step window: summary and recommend can then re-run the failure in float32).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(**options):
    """Run a training script with the recorder attached, no edit to it:
    the model, optimizer and GradScaler it builds (or its Hugging Face or
    Lightning Trainer) are found, one stderr line says which, and the run
    is closed when the script ends. The exit code, stdout and stderr are
    the script's; a script whose training objects cannot be told apart
    (two optimizers) runs unrecorded, with one line saying why.

    \b
        amp-postmortem record -- python train.py --lr 3e-4
        amp-postmortem record --run runs/exp1 --mode every_step -- python -m mypkg.train
        amp-postmortem record --loss criterion -- python train.py
    """
    click.get_current_context().exit(api.record(**options))


# The commands defined in their own modules, listed after this module's own.
for command in (replay_command, report_command, export_group, *WHATIF_COMMANDS):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
