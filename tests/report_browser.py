"""Load a report in a real browser (Debian's headless `chromium`) and read
back what happened: a harness script, put at the top of a copy of the page,
records errors (window.onerror, unhandled rejections, console.error) and,
once the page says its plots are drawn (`window.ampPostmortemReady`), each
plot's traces, data points and drawn SVG marks into the DOM, which
`--dump-dom` prints. One chromium launch per page also takes the screenshot.

Per plot it also reads what was drawn, as the browser laid it out: the
annotations' text and colour, the shapes' stroke and dash, and each axis's
tick labels with their bounding boxes (`ticks`, keyed by plotly's tick
class: `xtick`, `ytick`, `y2tick`, ...); per page every table's cell text
(`tables`). `overlapping(labels)` finds tick labels drawn over each other.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

HARNESS = r"""<script>
(function () {
  var errors = [];
  window.addEventListener('error', function (e) { errors.push('error: ' + e.message); });
  window.addEventListener('unhandledrejection', function (e) { errors.push('rejection: ' + e.reason); });
  var original = console.error;
  console.error = function () {
    errors.push('console.error: ' + Array.prototype.join.call(arguments, ' '));
    return original.apply(console, arguments);
  };
  function points(t) {
    if (t.type === 'heatmap') {
      var n = 0;
      (t.z || []).forEach(function (row) { row.forEach(function (v) { if (v !== null && isFinite(v)) n++; }); });
      return n;
    }
    return (t.x || []).length;
  }
  function box(el) {
    var r = el.getBoundingClientRect();
    return {left: r.left, top: r.top, right: r.right, bottom: r.bottom};
  }
  function ticks(gd) {
    var out = {};
    // An overlaying axis (the loss plot's y2) draws its labels under .overaxes-above.
    var labels = '.xaxislayer-above > g > text, .yaxislayer-above > g > text, .overaxes-above > g > g > text';
    gd.querySelectorAll(labels).forEach(function (t) {
      var axis = t.parentNode.getAttribute('class');
      (out[axis] = out[axis] || []).push({text: t.textContent, box: box(t)});
    });
    return out;
  }
  function report(state) {
    var plots = [].map.call(document.querySelectorAll('.js-plotly-plot'), function (gd) {
      var data = gd._fullData || [];
      return {id: gd.id, traces: data.length,
              points: data.reduce(function (s, t) { return s + points(t); }, 0),
              declared: Number(gd.getAttribute('data-points')),
              marks: gd.querySelectorAll('.scatterlayer .trace path, .scatterlayer .point, .hm image, .barlayer .point').length,
              annotations: [].map.call(gd.querySelectorAll('.annotation-text'), function (a) {
                return {text: a.textContent, fill: getComputedStyle(a).fill, box: box(a)};
              }),
              shapes: [].map.call(gd.querySelectorAll('.shapelayer path'), function (p) {
                var style = getComputedStyle(p);
                return {stroke: style.stroke, dash: style.strokeDasharray, box: box(p)};
              }),
              ticks: ticks(gd)};
    });
    var tables = [].map.call(document.querySelectorAll('table'), function (t) {
      var r = t.getBoundingClientRect();
      return {class: t.className, shown: r.width > 0 && r.height > 0,
              row_classes: [].map.call(t.rows, function (row) { return row.className; }),
              rows: [].map.call(t.rows, function (row) {
                return [].map.call(row.cells, function (c) { return c.innerText; });
              })};
    });
    var pre = document.createElement('pre');
    pre.id = 'amp-pm-harness';
    pre.textContent = JSON.stringify({state: state, errors: errors, plots: plots, tables: tables,
                                      ready_ms: Math.round(performance.now()),
                                      divs: document.querySelectorAll('div.plot').length});
    document.body.appendChild(pre);
  }
  window.addEventListener('load', function () {
    if (!window.ampPostmortemReady) { errors.push('no window.ampPostmortemReady'); report('failed'); return; }
    window.ampPostmortemReady.then(function () { report('ready'); },
                                   function (e) { errors.push('not drawn: ' + e); report('failed'); });
  });
})();
</script>"""


def check_page(html: Path, screenshot: Path, *, budget_ms: int = 60000, timeout: float = 120,
               window: str = "1400,3200") -> dict:
    """The harness's record of `html` rendered in chromium; writes `screenshot`."""
    assert CHROMIUM, "chromium is not installed (apt-get install -y chromium)"
    text = html.read_text(encoding="utf-8")
    probe = html.with_name(html.stem + ".probe.html")
    probe.write_text(text.replace("<head>", "<head>" + HARNESS, 1), encoding="utf-8")
    profile = html.with_name(html.stem + ".chromium-profile")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
           f"--window-size={window}", f"--virtual-time-budget={budget_ms}",
           f"--screenshot={screenshot}", "--dump-dom", probe.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    shutil.rmtree(profile, ignore_errors=True)
    m = re.search(r'<pre id="amp-pm-harness">(.*?)</pre>', out.stdout, re.S)
    assert m, f"the harness wrote nothing (rc {out.returncode}):\n{out.stderr[-3000:]}"
    import html as html_mod
    return json.loads(html_mod.unescape(m.group(1)))


def overlapping(labels: list[dict]) -> list[tuple[str, str]]:
    """Pairs of tick labels (harness `ticks` entries) whose drawn boxes
    overlap: labels that collide on the page."""
    def hit(a, b):
        return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]
    return [(a["text"], b["text"]) for i, a in enumerate(labels) for b in labels[i + 1:] if hit(a["box"], b["box"])]
