"""The one output path of the CLI: options, formatting, warnings, progress.

A command decorated with `run_options` and `output_options` receives the run
directory and `--rank`, calls its API function and returns the result (an
object with `to_dict()`, `table()` and `lines()`, and the loader's
`warnings`; see `amp_postmortem.analyses`), optionally with an exit code as
`(report, code)`. The decorator prints it as a readable table (default), one
JSON document (`--json`: `to_dict()`) or CSV (`--csv`, where the report is a
table), then the warnings on stderr.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import sys
import time
from pathlib import Path

import click

from recorders.plain import plain

from .names import ROOT_DISPLAY

_RUNS_KEY = "amp_postmortem.runs"


# ------------------------------------------------------------------ options
def run_options(f):
    """RUN argument and --rank."""
    f = click.option("--rank", type=click.IntRange(min=0), default=None,
                     help="Analyse this rank only (default: all ranks together).")(f)
    f = click.argument("run", metavar="RUN", type=click.Path(path_type=Path))(f)
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


def open_run(run_dir, rank=None):
    """Load a run for a command that has no API function yet: progress bar
    wired, warnings kept for `emit`."""
    from .loader import load_run

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
        for line in report.lines():
            click.echo(line)
        if getattr(report, "show_table", True):
            table = report.table()
            if table is not None and len(table):
                click.echo("")
                click.echo(render_table(table))
    for w in warnings:
        click.echo(f"Warning: {w}", err=True)


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
    a scan is still running after `delay` seconds, so quick commands stay
    quiet and stdout stays clean for --json/--csv."""

    def __init__(self, delay: float = 1.0, file=None):
        self.delay = delay
        self.file = file
        self._start = None
        self._label = None
        self._bar = None
        self._shown = 0

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == 0 or label != self._label:
            self._finish()
            self._start, self._label, self._shown = now, label, 0
        if self._bar is None and total and done < total and now - (self._start or now) >= self.delay:
            self._bar = click.progressbar(length=total, label=label, file=self.file or sys.stderr)
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
