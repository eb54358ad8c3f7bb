"""How a result reads where people look at objects rather than at a
terminal: `repr()` at the Python prompt gives the command's readable lines
(and its table), `_repr_html_` in Jupyter an HTML table. The analyses'
report classes point their `__repr__` and `_repr_html_` here, so the
formats live once; both take any object of the report protocol
(`lines()`, `table()`; see `analyses/__init__.py`). Imports nothing
heavier than the report itself does."""
from __future__ import annotations

import html


def report_repr(report) -> str:
    """The lines the command prints, then its table when it prints one."""
    out = list(report.lines())
    table = report.table() if getattr(report, "show_table", True) else None
    if table is not None and len(table):
        out += ["", table.to_string(index=False, na_rep="-")]
    return "\n".join(out)


def report_html(report) -> str:
    """The lines above the table (`<pre>`), then the table (`<table>`,
    every row): a report whose table is empty shows its header."""
    lines = html.escape("\n".join(report.lines()))
    table = report.table()
    body = table.to_html(index=False, na_rep="-", border=0) if table is not None else "<table></table>"
    return f'<div class="amp-postmortem"><pre>{lines}</pre>{body}</div>'
