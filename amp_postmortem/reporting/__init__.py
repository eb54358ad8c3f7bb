"""`report(run)`: one self-contained HTML file of a run's post-mortem.

The findings at the top (as `summary` ranks them, each linking to its plot),
loss and loss scale over steps, per-layer headroom heatmaps (forward and
backward), the first-NaN spread, the gradient norm and underflow shares, the
run's facts and, given `replay --json` output, the per-module error of each
precision and the op trace of the culprit (op, line, dtype, absmax, local
error). Downsampled for display (`downsample.py`): a million-step run
stays a few MB. Three parts: `data` gathers (no plotting), `figures` draws
(plotly), `page` writes the HTML.

Needs the `report` extra (plotly): `pip install 'amp-postmortem[report]'`.

The package is `reporting`, not `report`: `amp_postmortem.report` is the API
function, which a subpackage of that name would shadow once imported.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import MissingExtraError, ReplayFileError
from ..reading.loader import Run
from ..result import CommandResult

EXTRA_HINT = "pip install 'amp-postmortem[report]'"


@dataclass
class ReportResult(CommandResult):
    path: str
    bytes: int
    steps: int
    downsampled: bool
    findings: int
    plots: list[dict] = field(default_factory=list)   # {"id", "title", "points"}
    replay: str | None = None

    def document(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "steps": self.steps, "downsampled": self.downsampled,
                "findings": self.findings, "plots": self.plots, "replay": self.replay}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.plots, columns=["id", "title", "points"])

    def lines(self) -> list[str]:
        size = f"{self.bytes / 2**20:.1f} MiB"
        return [f"wrote {self.path} ({size}, {len(self.plots)} plots, {self.findings} finding(s)"
                + (", downsampled for display" if self.downsampled else "") + ")",
                "open it in a browser: it needs no network"]


def require_plotly():
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"the HTML report needs plotly: {EXTRA_HINT}") from None


def report(run, output=None, replay=None, *, rank: int | None = None) -> ReportResult:
    """Write the HTML report of `run` (a run directory or a loaded `Run`) to
    `output` (default: `<run name>-report.html` in the current directory);
    `replay`: a file written by `amp-postmortem replay --json`. Returns what
    was written: path, size, and each plot's number of data points."""
    require_plotly()
    if not isinstance(run, Run):
        from ..reading.loader import load_run
        run = load_run(run, rank=rank)
    replay_doc = _read_replay(replay) if replay is not None else None
    out = Path(output) if output is not None else Path(f"{Path(run.path).resolve().name}-report.html")

    from .data import gather
    from .figures import plots
    from .page import render

    data = gather(run)
    plot_list = plots(data, replay_doc)
    title = f"amp-postmortem report: {data.facts.get('run_id') or run.path}"
    traces = (replay_doc or {}).get("op_trace") or []  # a replay --json from before op traces has none
    text = render(data, plot_list, title=title, op_trace=traces[0] if traces else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return ReportResult(
        path=str(out), bytes=out.stat().st_size, steps=data.series.steps, downsampled=data.series.downsampled,
        findings=len(data.findings),
        plots=[{"id": p.id, "title": p.title, "points": p.points} for p in plot_list],
        replay=None if replay is None else str(replay))


def _read_replay(path) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ReplayFileError(f"replay file not found: {p}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReplayFileError(f"{p} is not JSON ({type(exc).__name__}); pass the output of "
                              f"`amp-postmortem replay RUN --step N --json`") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("modules"), list) or "precisions" not in doc:
        raise ReplayFileError(f"{p} is not the output of `amp-postmortem replay --json` "
                              f"(no 'modules' list and 'precisions')")
    return doc
