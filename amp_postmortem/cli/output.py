"""The one output path of the CLI: options, formatting, warnings, progress.

A command decorated with `run_options` and `output_options` receives the run
directory and `--rank`, calls its API function and returns the result (an
object with `to_dict()`, `table()` and `lines()`, and the loader's
`warnings`; see `amp_postmortem.analyses`), optionally with an exit code as
`(report, code)`. The decorator prints it as a readable table (default), one
JSON document (`--json`: `to_dict()`) or CSV (`--csv`, where the report is a
table), then the warnings on stderr. A command that prints events as they
come (`watch`) takes `stream_options` and prints each with `emit_event`.
Severities are coloured on a terminal only, never with NO_COLOR set.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path

import click

from recorders.format import plain

from ..names import ROOT_DISPLAY

_RUNS_KEY = "amp_postmortem.runs"


# ------------------------------------------------------------------ options
class RunLocation(click.ParamType):
    """A run directory, or a URI on a filesystem pyarrow/fsspec opens
    (`s3://bucket/runs/exp1`): kept as a string, since a Path would fold
    the `//` of the URI."""
    name = "path"

    def convert(self, value, param, ctx):
        from recorders.format.locations import is_uri
        if isinstance(value, Path) or not is_uri(value):
            return Path(value)
        return str(value).rstrip("/")


RUN_LOCATION = RunLocation()


def run_options(f):
    """RUN argument and --rank."""
    f = click.option("--rank", type=click.IntRange(min=0), default=None,
                     help="Analyse this rank only (default: all ranks together).")(f)
    f = click.argument("run", metavar="RUN", type=RUN_LOCATION)(f)
    return f


def engine_options(f):
    """--engine and --scheduler: where the per-shard reads run."""
    f = click.option("--scheduler", metavar="ADDRESS", default=None,
                     help="Dask scheduler address for --engine dask (default: $DASK_SCHEDULER_ADDRESS, "
                          "or the Dask client this process holds).")(f)
    f = click.option("--engine", type=click.Choice(["local", "dask"]), default="local", show_default=True,
                     help="Run the per-shard reads here, or as tasks on a Dask cluster (same results).")(f)
    return f


def api_default(function, name: str):
    """The default of keyword argument `name` of an API function: the CLI
    option's default, so that the two never differ."""
    return inspect.signature(function).parameters[name].default


def output_options(*, csv: bool = True):
    """--json / --csv switches, and emit the report the command returns."""
    def decorate(f):
        @functools.wraps(f)
        def command(*args, fmt: str, **kwargs):
            with stdout_to_stderr():
                result = f(*args, **kwargs)
            code = 0
            if isinstance(result, tuple):
                result, code = result
            emit(result, fmt)
            if code:
                click.get_current_context().exit(code)

        if csv:
            command = click.option("--csv", "fmt", flag_value="csv",
                                   help="Print the table as CSV.")(command)
        command = click.option("--json", "fmt", flag_value="json",
                               help="Print one JSON document (for machines).")(command)
        command = click.option("--table", "fmt", flag_value="table", default=True,
                               help="Print a readable table (the default).")(command)
        return command
    return decorate


def stream_options(f):
    """--json / --table for a command that prints events as they come."""
    f = click.option("--json", "fmt", flag_value="json",
                     help="Print one JSON object per line, one per event (for machines).")(f)
    return click.option("--table", "fmt", flag_value="table", default=True,
                        help="Print readable lines (the default).")(f)


@contextlib.contextmanager
def stdout_to_stderr():
    """Whatever runs inside prints on stderr: stdout holds the command's
    output alone, so `--json` stays one JSON document even when a `--model`
    factory or a model's `__init__` prints (nanoGPT's GPT prints its
    parameter count). Both Python's `sys.stdout` and, when it is the real
    one, file descriptor 1 (for prints from native code) are redirected."""
    sys.stdout.flush()
    saved_fd = None
    try:
        if sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2:
            saved_fd = os.dup(1)
            os.dup2(2, 1)
    except (AttributeError, OSError, ValueError):  # a captured stream (tests, notebooks): no descriptor
        saved_fd = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            if saved_fd is not None:
                os.dup2(saved_fd, 1)
                os.close(saved_fd)


def open_run(run_dir, rank=None):
    """Load a run for a command that has no API function yet: progress bar
    wired, warnings kept for `emit`."""
    from ..reading.loader import load_run

    run = load_run(run_dir, rank=rank)
    run.progress = StderrProgress()
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta.setdefault(_RUNS_KEY, []).append(run)
    return run


# --------------------------------------------------------------- formatting
def emit(report, fmt: str = "table") -> None:
    warnings = list(getattr(report, "warnings", None) or [])
    warnings += [w for w in _warnings() if w not in warnings]
    if fmt == "json":
        doc = report.to_dict()
        if isinstance(doc, dict) and "warnings" not in doc:
            doc = {**doc, "warnings": warnings}
        click.echo(json.dumps(plain(doc), indent=2))
    elif fmt == "csv":
        table = report.table()
        click.echo(table.to_csv(index=False), nl=False)
    else:
        colour = colour_enabled()
        for line in report.lines():
            click.echo(paint(line) if colour else line, color=colour)
        if getattr(report, "show_table", True):
            table = report.table()
            if table is not None and len(table):
                click.echo("")
                click.echo(render_table(table))
    for w in warnings:
        warn(w)


def warn(text: str) -> None:
    colour = colour_enabled(sys.stderr)
    click.echo(click.style("Warning:", fg="yellow") + f" {text}" if colour else f"Warning: {text}",
               err=True, color=colour)


def emit_event(event, fmt: str = "table") -> None:
    """One event of a stream (`watch`): one JSON object on one line
    (`--json`), or its lines; flushed at once, since a pipe would hold them."""
    if fmt == "json":
        click.echo(json.dumps(plain(event.to_dict())))
    else:
        colour = colour_enabled()
        for line in event.lines():
            click.echo(paint(line) if colour else line, color=colour)
    sys.stdout.flush()


# ------------------------------------------------------------------ colour
# A finding's first line starts with its severity in capitals (`Finding.lines`).
_SEVERITY_COLOURS = {"CRITICAL": "red", "ERROR": "red", "WARNING": "yellow", "INFO": "green"}


def colour_enabled(stream=None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set to
    anything non-empty (https://no-color.org): logs and pipes get plain text."""
    if os.environ.get("NO_COLOR"):
        return False
    stream = stream if stream is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def paint(line: str) -> str:
    """`line` with its leading severity word coloured (bold for the worst)."""
    stripped = line.lstrip()
    word = stripped.split(" ", 1)[0]
    if word not in _SEVERITY_COLOURS:
        return line
    indent = line[:len(line) - len(stripped)]
    return indent + click.style(word, fg=_SEVERITY_COLOURS[word], bold=word == "CRITICAL") + stripped[len(word):]


def render_table(df) -> str:
    """A fixed-width table: floats to 4 significant digits, missing as "-",
    the root module's name "" as `names.ROOT_DISPLAY`."""
    names = {"name", "layer", "module"}
    cols = list(df.columns)
    cells = [[_cell(v, c in names) for v in df[c]] for c in cols]
    widths = [max([len(str(c))] + [len(x) for x in col]) for c, col in zip(cols, cells)]
    numeric = [df[c].dtype.kind in "iuf" or
               (len(df) > 0 and all(v is None or _is_number(v) for v in df[c])) for c in cols]
    out = ["  ".join(str(c).rjust(w) if num else str(c).ljust(w) for c, w, num in zip(cols, widths, numeric)).rstrip()]
    for i in range(len(df)):
        out.append("  ".join(col[i].rjust(w) if num else col[i].ljust(w)
                             for col, w, num in zip(cells, widths, numeric)).rstrip())
    return "\n".join(out)


def _cell(v, is_name: bool) -> str:
    if is_name and v == "":
        return ROOT_DISPLAY
    if v is None or v is _pandas_na() or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v) or "-"
    try:
        import numpy as np
        if isinstance(v, np.floating):
            return _cell(float(v), is_name)
        if isinstance(v, np.bool_):
            return _cell(bool(v), is_name)
    except ImportError:  # pragma: no cover
        pass
    return str(v)


def _pandas_na():
    pd = sys.modules.get("pandas")
    return pd.NA if pd is not None else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _warnings() -> list[str]:
    ctx = click.get_current_context(silent=True)
    out: list[str] = []
    for run in (ctx.meta.get(_RUNS_KEY, []) if ctx is not None else []):
        out.extend(w for w in run.warnings if w not in out)
    return out


# ----------------------------------------------------------------- progress
class StderrProgress:
    """Progress callback for `Run.progress`: draws a bar on stderr only when
    a scan is still running after `delay` seconds and stderr is a terminal
    (`tty_only`), so quick commands stay quiet, logs and captured output
    hold no bar, and stdout stays clean for --json/--csv."""

    def __init__(self, delay: float = 1.0, file=None, tty_only: bool = True):
        self.delay = delay
        self.file = file
        self.tty_only = tty_only
        self._start = None
        self._label = None
        self._bar = None
        self._shown = 0

    def _shows(self, stream) -> bool:
        if not self.tty_only:
            return True
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):
            return False

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == 0 or label != self._label:
            self._finish()
            self._start, self._label, self._shown = now, label, 0
        stream = self.file or sys.stderr
        if (self._bar is None and total and done < total and now - (self._start or now) >= self.delay
                and self._shows(stream)):
            self._bar = click.progressbar(length=total, label=label, file=stream)
            self._bar.__enter__()
        if self._bar is not None:
            self._bar.update(done - self._shown)
            self._shown = done
        if total and done >= total:
            self._finish()

    def _finish(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None
