"""`amp-postmortem`: the command line. It holds no logic: each command parses
its options, calls one analysis and returns the report to the shared output
path (`output.py`).

Adding a command: a small function under `@main.command()`, decorated with
`run_options` (RUN and --rank) and `output_options(...)`, that imports what
it needs inside its body (so `--help` and the other commands never import
torch or pay for another command's dependencies) and returns a report.
Library errors (`PostmortemError`) become `Error: ...` and exit code 2.
"""
from __future__ import annotations

import os

import click

from .output import engine_options, open_run, output_options, run_options

EXIT_USAGE = 2  # unusable input, like click's usage errors


class CliError(click.ClickException):
    exit_code = EXIT_USAGE


class _Group(click.Group):
    """Turns library errors into one `Error: ...` line and exit code 2."""

    def invoke(self, ctx):
        from .errors import PostmortemError
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except PostmortemError as exc:
            raise CliError(str(exc)) from None
        except BrokenPipeError:
            # `amp-postmortem nans RUN | head`: the reader left early; not an
            # error. Point stdout at /dev/null so the final flush is quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            raise click.exceptions.Exit(0) from None
        except (OSError, ValueError) as exc:
            if os.environ.get("AMP_POSTMORTEM_DEBUG"):
                raise
            raise CliError(f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - never a traceback for a user
            if os.environ.get("AMP_POSTMORTEM_DEBUG"):
                raise
            raise CliError(f"internal error: {type(exc).__name__}: {exc} "
                           f"(set AMP_POSTMORTEM_DEBUG=1 for the traceback)") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="amp-postmortem")
def main():
    """Post-mortems of mixed-precision (AMP) training runs recorded by
    `recorders.AmpRecorder`. Start with `summary`:

    \b
        amp-postmortem summary runs/exp1

    Every command takes the run directory, prints a readable table, and
    takes --json (and --csv for tables) for machines. Exit code 0 when the
    analysis ran, 2 for unusable input.
    """


@main.command()
@run_options
@click.option("--from-step", type=int, default=None, help="Ignore steps before this one.")
@click.option("--to-step", type=int, default=None, help="Ignore steps after this one.")
@engine_options
@output_options(csv=True)
def nans(run_dir, rank, from_step, to_step, engine, scheduler):
    """Rank layers by their first NaN/Inf and name the origin.

    Order: by first step; within a step forward before backward, then in the
    order the tensors were produced. ORIGIN marks the layer that made the
    non-finite value (forward: output non-finite while its inputs were
    finite, or `<input>` for a bad batch; backward: gradient to its inputs
    or parameters non-finite while the gradient it received was finite, or
    `<loss>`); every other layer only propagated it.

    \b
        amp-postmortem nans runs/exp1
        amp-postmortem nans runs/exp1 --from-step 1000 --json
    """
    from .analyses.nans import find_nans
    return find_nans(open_run(run_dir, rank, engine, scheduler), from_step=from_step, to_step=to_step)


@main.command()
@run_options
@engine_options
@output_options(csv=False)
def scale(run_dir, rank, engine, scheduler):
    """Loss-scale dynamics: healthy, collapse, stuck_low, growth_blocked or
    no_scaler, with the onset and rate of a collapse, skip rates before and
    after it, the longest skip streak, the step at which the scale would make
    the gradients underflow, and the layers whose overflows drive the
    backoffs.

    \b
        amp-postmortem scale runs/exp1
        amp-postmortem scale runs/exp1 --json | jq .status
    """
    from .analyses.scale import scale_dynamics
    return scale_dynamics(open_run(run_dir, rank, engine, scheduler))


@main.command()
@run_options
@click.option("--window", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Analyse the last N recorded steps (0: the whole run).")
@engine_options
@output_options(csv=True)
def ranges(run_dir, rank, window, engine, scheduler):
    """Per layer float16 range: headroom to overflow in bits
    (log2(65504/absmax)) and its trend, the step at which the trend reaches
    zero headroom, and the share of gradient values in the float16
    subnormal range at the recorded scale. Flags: overflow_risk, underflow.

    \b
        amp-postmortem ranges runs/exp1
        amp-postmortem ranges runs/exp1 --window 0 --csv > ranges.csv
    """
    from .analyses.ranges import layer_ranges
    return layer_ranges(open_run(run_dir, rank, engine, scheduler), window=window or None)


def _fail_on(ctx, param, value):
    from .analyses.summary import FINDING_KINDS
    if not value:
        return set()
    kinds = {k.strip() for k in value.split(",") if k.strip()}
    unknown = sorted(kinds - set(FINDING_KINDS))
    if unknown:
        raise click.BadParameter(f"unknown finding kind(s) {', '.join(unknown)}; "
                                 f"valid: {', '.join(FINDING_KINDS)}")
    return kinds


@main.command()
@run_options
@click.option("--fail-on", metavar="KIND[,KIND]", callback=_fail_on, default=None,
              help="Exit with code 1 when a finding of these kinds exists (for CI): nonfinite, "
                   "scale_collapse, stuck_low_scale, grad_underflow, overflow_risk, healthy.")
@engine_options
@output_options(csv=True)
def summary(run_dir, rank, fail_on, engine, scheduler):
    """Run facts and findings (non-finite values, loss-scale collapse, low
    scale, gradient underflow, overflow risk) most severe first, each with
    its evidence and the next command to run.

    \b
        amp-postmortem summary runs/exp1
        amp-postmortem summary runs/exp1 --fail-on nonfinite,scale_collapse
    """
    from .analyses.summary import summarize
    report = summarize(open_run(run_dir, rank, engine, scheduler))
    failing = fail_on & report.kinds()
    return report, (1 if failing else 0)


from .cli_replay import replay_command; main.add_command(replay_command, "replay")  # noqa: E402,E702
from .cli_whatif import COMMANDS as _WHATIF_COMMANDS  # noqa: E402  (fix, scale-window, bisect, compare, recommend)
for _command in _WHATIF_COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
