"""One self-contained HTML page: plotly.js inlined once, each plot's figure
as JSON, the findings and the run's facts as plain HTML. Nothing is fetched
at view time.

When every plot has drawn, the page sets `window.ampPostmortemReady` (a
promise, resolved with the number of plots) and `data-plots-drawn` on its
<body>: what a browser test or a screenshot waits for.
"""
from __future__ import annotations

import html
import json

from recorders.format import plain

from ..analyses.summary import autocast_words, scaler_words
from .data import ReportData
from ..names import display_name
from ..op_words import trace_line, trace_rows
from .figures import Plot, spread_lines

# Which plot shows the evidence of each finding kind.
FINDING_PLOT = {"nonfinite": "first-nan", "scale_collapse": "loss-scale", "stuck_low_scale": "loss-scale",
                "grad_underflow": "grad-underflow", "underflow_lapsed": "grad-underflow", "overflow_risk": "headroom",
                "healthy": "loss-scale"}
_SEVERITY_COLOR = {"critical": "#b71c1c", "error": "#e65100", "warning": "#f9a825", "info": "#2e7d32"}

_STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:1400px;padding:16px 24px;color:#222}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;margin:1.4em 0 .3em;border-bottom:1px solid #ddd}
.sub{color:#555}.note{color:#555;font-size:.9em;margin:.2em 0 .5em}
ol.findings{padding-left:1.2em}ol.findings li{margin:.5em 0}
.sev{display:inline-block;color:#fff;border-radius:3px;padding:0 6px;font-size:.8em;font-weight:600}
code{background:#f4f4f4;padding:1px 4px;border-radius:3px}
table.facts{border-collapse:collapse;font-size:.9em}table.facts td{border-bottom:1px solid #eee;padding:3px 10px;vertical-align:top}
table.facts td:first-child{color:#555;white-space:nowrap}
.warn{color:#8a6d3b}.plot{width:100%}
table.ops{border-collapse:collapse;font-size:.85em}table.ops td,table.ops th{border-bottom:1px solid #eee;padding:2px 8px;text-align:left}
table.ops td.num{text-align:right}table.ops tr.origin{background:#fde0dc;font-weight:600}
"""


MAX_OP_ROWS = 200  # of the culprit's op trace: the origin is near the top of a module's ops, or shown anyway


def render(data: ReportData, plot_list: list[Plot], *, title: str, op_trace: dict | None = None) -> str:
    """`op_trace`: one entry of a replay's `op_trace` (the culprit's), drawn as a table."""
    import plotly.offline

    facts = data.facts
    parts = [
        "<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{_e(title)}</title>", f"<style>{_STYLE}</style>",
        # plotly.js itself, inline: the page opens offline.
        f"<script type=\"text/javascript\">{plotly.offline.get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class=\"sub\">{_e(_headline(facts))}</p>",
    ]
    for w in data.warnings:
        parts.append(f"<p class=\"warn\">Warning: {_e(w)}</p>")
    parts.append("<h2 id=\"findings\">Findings</h2>")
    parts.append(_findings(data.findings, {p.id for p in plot_list}))
    for p in plot_list:
        parts.append(f"<h2 id=\"{p.id}\">{_e(p.title)}</h2>")
        if p.note:
            parts.append(f"<p class=\"note\">{_e(p.note)}</p>")
        if p.id == "first-nan":
            parts.append(_spread_text(data))
        parts.append(f"<div class=\"plot\" id=\"plot-{p.id}\" data-points=\"{p.points}\"></div>")
        if p.id == "replay" and op_trace is not None:
            parts.append(_op_trace_table(op_trace))
    parts.append("<h2 id=\"facts\">Run facts</h2>")
    parts.append(_facts_table(facts))
    parts.append(_script(plot_list))
    parts.append("</body></html>")
    return "\n".join(parts)


def _headline(f: dict) -> str:
    ac = f.get("autocast") or {}
    steps = f"{f.get('steps')} steps ({f.get('first_step')}-{f.get('last_step')})" if f.get("steps") else "no steps"
    return (f"{f.get('model_class')} on {f.get('device')}, autocast "
            f"{ac.get('dtype') if ac.get('enabled') else 'off'}; {steps}; ranks {f.get('ranks')} of "
            f"world_size {f.get('world_size')}; recorder {f.get('status')}")


def _findings(findings: list[dict], plot_ids: set[str]) -> str:
    items = []
    for f in findings:
        color = _SEVERITY_COLOR.get(f["severity"], "#555")
        target = FINDING_PLOT.get(f["kind"])
        link = f" <a href=\"#{target}\">see the plot</a>" if target in plot_ids else ""
        items.append(
            f"<li><span class=\"sev\" style=\"background:{color}\">{_e(f['severity'].upper())}</span> "
            f"<b>{_e(f['kind'])}</b> step {_e(f['step'] if f['step'] is not None else '-')}, "
            f"layer {_e(display_name(f['layer']) if f['layer'] is not None else '-')}{link}<br>"
            f"{_e(f['message'])}<br><span class=\"note\">next: <code>{_e(f['next_command'])}</code></span></li>")
    return "<ol class=\"findings\">" + "".join(items) + "</ol>"


def _spread_text(data: ReportData) -> str:
    blocks = []
    for s in data.spreads:
        lines = spread_lines(s)
        if not lines:
            continue
        who = "all ranks" if s.rank is None else f"rank {s.rank}"
        blocks.append(f"<p class=\"note\"><b>{who}</b><br>" + "<br>".join(_e(l) for l in lines) + "</p>")
    return "".join(blocks)


def _op_trace_table(trace: dict) -> str:
    """The culprit's ops in the order they ran: op, source line, dtype, output
    absmax, local error vs float64; the first op that made NaN/Inf from finite
    inputs highlighted."""
    rows = trace_rows(trace)
    shown = rows[:MAX_OP_ROWS] + [r for r in rows[MAX_OP_ROWS:] if r["origin"]]
    cells = []
    for r in shown:
        err = r["local_rel_err"]
        err = "-" if err is None else ("inf" if err == float("inf") else f"{err:.3g}")
        absmax = "-" if r["absmax"] is None else f"{r['absmax']:.4g}"
        nonfinite = f" ({r['nonfinite']} NaN/Inf)" if r["nonfinite"] else ""
        row_class = ' class="origin"' if r["origin"] else ""
        cells.append(f"<tr{row_class}><td>{_e(r['op'])}</td>"
                     f"<td>{_e(r['line'])}</td><td><code>{_e(r['code'])}</code></td><td>{_e(r['dtype'] or '-')}</td>"
                     f"<td class=\"num\">{_e(absmax + nonfinite)}</td><td class=\"num\">{_e(err)}</td></tr>")
    more = (f"<p class=\"note\">{len(rows) - len(shown)} more ops not shown.</p>"
            if len(rows) > len(shown) else "")
    return (f"<h2 id=\"op-trace\">Op trace of the culprit</h2><p class=\"note\">{_e(trace_line(trace))}</p>"
            "<table class=\"ops\"><tr><th>op</th><th>line</th><th>code</th><th>dtype</th><th>absmax</th>"
            "<th>local error vs float64</th></tr>" + "".join(cells) + "</table>" + more)


def _facts_table(facts: dict) -> str:
    """The run's facts in words: the settings as `summary` says them
    (autocast, scaler), the recorder's and the optimizer's as phrases,
    never raw JSON."""
    rows = []
    for k, v in facts.items():
        if k == "autocast":
            v = autocast_words(v)
        elif k == "scaler":
            v = scaler_words(v)
        elif k == "recorder" and isinstance(v, dict):
            v = _recorder_words(v)
        elif isinstance(v, dict):
            v = _pairs(v)
        elif isinstance(v, list):
            v = ", ".join(str(x) for x in plain(v)) or "none"
        rows.append(f"<tr><td>{_e(k.replace('_', ' '))}</td><td>{_e('-' if v is None else v)}</td></tr>")
    return "<table class=\"facts\">" + "".join(rows) + "</table>"


def _recorder_words(rec: dict) -> str:
    """`AmpRecorder`'s settings as a sentence; what it does not name, as
    `key value` pairs after it."""
    said = {"include", "exclude", "cheap_every", "full_every", "full_after_event", "steps_per_shard", "bundles"}
    include, exclude = rec.get("include") or ["*"], rec.get("exclude") or []
    watched = ("every module" if include == ["*"] else "modules " + ", ".join(include)) + (
        f" except {', '.join(exclude)}" if exclude else "")
    parts = [f"watching {watched}",
             f"statistics every {rec.get('cheap_every', 1)} step(s), the full tier every "
             f"{rec.get('full_every')} steps and for {rec.get('full_after_event')} steps after an event",
             f"{rec.get('steps_per_shard')} steps per shard"]
    b = rec.get("bundles")
    if isinstance(b, dict):
        parts.append(f"replay bundles: up to {b.get('max_bundles')} on "
                     f"{', '.join(b.get('bundle_triggers') or []) or 'no trigger'}" if b.get("bundles")
                     else "replay bundles: off")
    rest = {k: v for k, v in rec.items() if k not in said}
    return "; ".join(parts) + (f"; {_pairs(rest)}" if rest else "")


def _pairs(d: dict) -> str:
    """A settings dict as `key value, key value` (lists joined by `/`)."""
    def value(v):
        v = plain(v)
        if isinstance(v, list):
            return "/".join(str(x) for x in v) or "none"
        if isinstance(v, dict):
            return "(" + _pairs(v) + ")"
        return "-" if v is None else ("yes" if v is True else "no" if v is False else str(v))
    return ", ".join(f"{k} {value(v)}" for k, v in d.items())


def _script(plot_list: list[Plot]) -> str:
    import plotly.io as pio

    figs = ",\n".join(f"[{json.dumps('plot-' + p.id)}, {pio.to_json(p.figure, validate=False)}]"
                      for p in plot_list)
    figs = figs.replace("</", "<\\/")  # a layer name holding "</script>" must not end the script
    return f"""<script type="text/javascript">
(function () {{
  var figures = [{figs}];
  var config = {{responsive: true, displaylogo: false}};
  window.ampPostmortemReady = Promise.all(figures.map(function (f) {{
    return Plotly.newPlot(f[0], f[1].data, f[1].layout, config);
  }})).then(function () {{
    document.body.setAttribute("data-plots-drawn", String(figures.length));
    return figures.length;
  }});
}})();
</script>"""


def _e(v) -> str:
    return html.escape(str(v), quote=True)
