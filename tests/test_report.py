"""The HTML report (`amp_postmortem.report`): what it gathers from real runs,
how it downsamples, its CLI, and each sample run's page drawn in a real
browser (headless chromium) with data in every plot and no console error;
on a drawn page, the facts in words, a calibration skip drawn as a skip and
not as the failure, and tick labels that do not overlap."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from amp_postmortem.reporting import report
from amp_postmortem.reporting.data import gather
from amp_postmortem.reporting.downsample import marked_steps, minmax_line
from conftest import OVERFLOW_STEP
from report_browser import check_page, overlapping

REPO = Path(__file__).resolve().parents[1]
SAMPLES = sorted(p.name for p in (REPO / "sample_runs").iterdir() if (p / "manifest.json").is_file())
BENCH = REPO / "benchmarks"


def external_resources(page: str) -> list[str]:
    """src/href attributes of the page's elements that point outside it (a
    parser: text inside <script> is not markup)."""
    from html.parser import HTMLParser

    found = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(v for k, v in attrs if k in ("src", "href") and v and not v.startswith("#"))

    Parser().feed(page)
    return found


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ------------------------------------------------------------ downsampling
def test_minmax_line_keeps_every_bucket_extreme_so_a_one_step_spike_survives():
    steps = np.arange(1_000_000)
    values = np.sin(steps / 1000.0)
    values[654_321] = 50.0   # a one-step spike
    values[123_456] = -50.0  # and a dip
    values[777] = np.nan     # non-finite points are the markers' business
    x, y = minmax_line(steps, values, first=0, last=999_999, buckets=1000)
    assert len(x) <= 2000 and np.all(np.diff(x) > 0)
    assert 654_321 in x and y[list(x).index(654_321)] == 50.0
    assert 123_456 in x and y[list(x).index(123_456)] == -50.0
    assert np.all(np.isfinite(y))


def test_minmax_line_keeps_short_series_whole():
    x, y = minmax_line([3, 1, 2], [30.0, 10.0, float("inf")], first=1, last=3)
    assert x.tolist() == [1, 3] and y.tolist() == [10.0, 30.0]


def test_marked_steps_are_kept_one_by_one_up_to_the_cap_then_grouped_with_counts():
    few = marked_steps([5, 9, 9, 2], first=0, last=10)
    assert few.steps.tolist() == [2, 5, 9] and few.counts.tolist() == [1, 1, 1] and not few.grouped
    many = marked_steps(np.arange(0, 100_000, 2), first=0, last=99_999, cap=100)
    assert len(many.steps) == 100 and many.counts.sum() == 50_000 and many.grouped
    assert many.steps[0] == 0 and many.steps[1] == 1000  # the first marked step of each bucket


# ---------------------------------------------------------------- gather
@pytest.fixture(scope="module")
def attention_overflow():
    return gather(load_run(REPO / "sample_runs" / "attention_overflow"))


def test_attention_overflow_marks_every_skipped_and_nonfinite_loss_step(attention_overflow):
    s = attention_overflow.series
    assert (s.steps, s.first_step, s.last_step, s.downsampled) == (130, 0, 129, False)
    assert s.skipped.steps.tolist()[:4] == [32, 74, 79, 92] and len(s.skipped.steps) == 23
    assert s.nonfinite_loss.steps.tolist()[:3] == [79, 92, 93] and len(s.nonfinite_loss.steps) == 21
    # Skip markers sit on the scale in force during the skipped step.
    assert s.skipped_log2_scale[0] == 17.0  # step 32 ran at 2^17
    assert len(s.loss[0].steps) == 130 - 21  # every finite loss, nothing downsampled
    assert s.log2_scale.values[-1] == -4.0   # final scale 0.0625
    assert (attention_overflow.first_nonfinite_step, attention_overflow.first_nonfinite_loss_step) == (32, 79)
    assert attention_overflow.scale["status"] == "collapse" and attention_overflow.scale["onset_step"] == 92


def test_a_collapse_onset_is_drawn_from_the_typed_status(attention_overflow):
    """The onset line comes from `ScaleStatus.COLLAPSE` (gather decides it),
    not from the dict form's status string: a healthy run draws none."""
    import dataclasses

    from amp_postmortem.reporting.figures import loss_and_scale
    assert attention_overflow.collapse_onset_step == 92
    texts = [a.text for a in loss_and_scale(attention_overflow).figure.layout.annotations]
    assert "collapse onset, step 92" in texts
    healthy = dataclasses.replace(attention_overflow, collapse_onset_step=None)
    assert not any(t.startswith("collapse onset") for t in
                   (a.text for a in loss_and_scale(healthy).figure.layout.annotations))


def test_attention_overflow_heatmaps_hold_every_layer_in_execution_order(attention_overflow):
    fwd, bwd = attention_overflow.heatmaps
    assert (fwd.phase, bwd.phase) == ("forward", "backward")
    assert fwd.layers[:4] == ["tok_emb", "pos_emb", "blocks.0.ln1", "blocks.0.attn.q_proj"]
    assert fwd.layers[-1] == "(model)" and len(fwd.layers) == 29
    assert fwd.headroom.shape == (29, 130) and fwd.column_width == 1
    attn = fwd.layers.index("blocks.1.attn")
    assert fwd.nonfinite[attn, 79] and fwd.headroom[attn, 79] == 0.0
    assert not fwd.nonfinite[attn, :79].any()
    assert np.isfinite(fwd.headroom[attn, :79]).all() and (fwd.headroom[attn, :79] > 0).all()
    assert int(fwd.nonfinite.sum()) == 231 and int(bwd.nonfinite.sum()) == 622
    assert fwd.dtypes == ["float16", "float32"]


def test_attention_overflow_spread_starts_at_each_phase_origin(attention_overflow):
    (spread,) = attention_overflow.spreads  # one rank: the run-wide view only
    fwd = spread.layers[spread.layers["phase"] == "forward"]
    assert spread.origins["forward"]["name"] == "blocks.1.attn"
    assert fwd["origin"].tolist().count(True) == 1
    assert fwd.iloc[0]["name"] == "blocks.1.attn.out_proj" and fwd.iloc[1]["name"] == "blocks.1.attn"
    assert set(fwd["first_step"]) == {79}


def test_headroom_is_measured_against_the_tensor_dtype_limit(overflow_run):
    data = gather(load_run(overflow_run))
    fwd = data.heatmaps[0]
    boom = fwd.layers.index("block.boom")
    assert fwd.nonfinite[boom, OVERFLOW_STEP] and fwd.headroom[boom, OVERFLOW_STEP] == 0.0
    rows = load_run(overflow_run).scan_tensors(["step", "name", "kind", "absmax"], steps=[3],
                                               kinds=["activation"])
    absmax = float(rows.loc[rows["name"] == "block.fc", "absmax"].max())
    assert fwd.headroom[fwd.layers.index("block.fc"), 3] == pytest.approx(math.log2(65504.0 / absmax))


def test_multi_rank_run_has_a_loss_line_and_a_spread_view_per_rank(two_rank_run):
    data = gather(load_run(two_rank_run))
    assert sorted(data.series.loss) == [0, 1]
    assert [s.rank for s in data.spreads] == [None, 0, 1]


# ------------------------------------------------------------------- CLI
def test_report_json_names_the_file_its_size_and_every_plot_with_points(overflow_run, tmp_path):
    out = tmp_path / "r.html"
    result = invoke("report", overflow_run, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["path"] == str(out) and doc["bytes"] == out.stat().st_size
    assert [p["id"] for p in doc["plots"]] == ["loss-scale", "headroom", "first-nan", "grad-underflow"]
    assert all(p["points"] > 0 for p in doc["plots"])
    assert (doc["steps"], doc["downsampled"], doc["replay"], doc["warnings"]) == (12, False, None, [])
    text = out.read_text()
    assert external_resources(text) == []  # nothing fetched at view time: plotly.js is inline
    assert '<a href="#first-nan">' in text  # the nonfinite finding links to its plot


def test_report_function_mirrors_the_command(overflow_run, tmp_path):
    result = report(overflow_run, output=tmp_path / "f.html")
    assert result.to_dict()["plots"][0] == {"id": "loss-scale", "title": "Loss and loss scale",
                                           "points": result.plots[0]["points"]}
    assert result.lines()[0].startswith(f"wrote {tmp_path / 'f.html'} (")


def test_report_refuses_a_replay_file_that_is_not_replay_json(overflow_run, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"step": 1}')
    result = invoke("report", overflow_run, "-o", tmp_path / "r.html", "--replay", bad)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: {bad} is not the output of `amp-postmortem replay --json` (no 'modules' list and 'precisions')"]
    missing = invoke("report", overflow_run, "--replay", tmp_path / "nope.json")
    assert missing.exit_code == 2 and "replay file not found" in missing.output


_WITHOUT = ("import sys\n"
            "sys.modules[{module!r}] = None  # as if the extra were not installed\n"
            "from amp_postmortem.cli import main\n"
            "main({argv!r})\n")


@pytest.mark.parametrize("module,argv,message", [
    ("plotly", ["report", "RUN", "-o", "OUT"],
     "Error: the HTML report needs plotly: pip install 'amp-postmortem[report]'"),
    ("tensorboard", ["export", "tensorboard", "RUN", "--logdir", "OUT"],
     "Error: the TensorBoard export needs tensorboard: pip install 'amp-postmortem[report]'"),
])
def test_a_missing_report_extra_is_one_error_line_and_exit_2(module, argv, message, overflow_run, tmp_path):
    argv = [str(overflow_run) if a == "RUN" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    out = subprocess.run([sys.executable, "-c", _WITHOUT.format(module=module, argv=argv)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [message]


def test_the_analysis_commands_import_neither_plotly_nor_tensorboard(overflow_run):
    code = ("import sys\n"
            "from amp_postmortem.cli import main\n"
            "for cmd in ('summary', 'nans', 'scale', 'ranges'):\n"
            "    try:\n"
            f"        main([cmd, {str(overflow_run)!r}, '--json'])\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, (cmd, e.code)\n"
            "print(sorted(m for m in ('plotly', 'tensorboard') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_report_and_export_run_without_torch(overflow_run, tmp_path):
    code = ("import sys\n"
            "from amp_postmortem.cli import main\n"
            f"for argv in (['report', {str(overflow_run)!r}, '-o', {str(tmp_path / 'r.html')!r}],\n"
            f"             ['export', 'tensorboard', {str(overflow_run)!r}, '--logdir', {str(tmp_path / 'tb')!r}]):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, (argv, e.code)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------- browser
@pytest.fixture(scope="module")
def replay_json(overflow_run, tmp_path_factory):
    """`replay --json` of the overflow run's saved step, through the real replay."""
    from amp_postmortem.replaying import replay
    from tiny_models import BoomNet

    doc = replay(overflow_run, OVERFLOW_STEP, model=BoomNet, precisions=("fp64", "fp32", "fp16")).to_dict()
    path = tmp_path_factory.mktemp("replay") / "replay.json"
    from recorders.format.plain import plain
    path.write_text(json.dumps(plain(doc)))
    return path


@pytest.mark.parametrize("sample", SAMPLES)
def test_sample_run_report_draws_every_plot_with_data_in_chromium(sample, tmp_path):
    html = tmp_path / f"{sample}.html"
    result = report(REPO / "sample_runs" / sample, output=html)
    page = check_page(html, tmp_path / f"{sample}.png")
    assert page["state"] == "ready" and page["errors"] == []
    assert page["divs"] == len(result.plots) == len(page["plots"])
    for drawn, made in zip(page["plots"], result.plots):
        assert drawn["id"] == f"plot-{made['id']}"
        assert drawn["points"] == drawn["declared"] == made["points"] > 0, drawn
        assert drawn["marks"] > 0, drawn  # SVG marks really drawn, not only data held
        for axis, labels in drawn["ticks"].items():
            if axis != "ytick" or drawn["id"] == "plot-loss-scale":  # (layer names: one per row, by design)
                assert overlapping(labels) == [], (drawn["id"], axis)
    (facts,) = [t for t in page["tables"] if t["class"] == "facts"]
    assert facts["shown"] and not any(c in cell for row in facts["rows"] for cell in row for c in "{}[]")
    png = (tmp_path / f"{sample}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_with_replay_charts_each_module_error_in_chromium(overflow_run, replay_json, tmp_path):
    html = tmp_path / "with_replay.html"
    result = report(overflow_run, output=html, replay=replay_json)
    doc = json.loads(replay_json.read_text())
    chart = result.plots[-1]
    assert chart["id"] == "replay"
    assert chart["points"] == len(doc["modules"]) * 2  # one bar per module and precision (fp32, fp16)
    page = check_page(html, tmp_path / "with_replay.png")
    assert page["state"] == "ready" and page["errors"] == []
    assert page["plots"][-1]["id"] == "plot-replay" and page["plots"][-1]["points"] == chart["points"]


def test_a_long_run_report_stays_small_and_downsampled(tmp_path):
    """Smoke size of benchmarks/report_scale.py (the million-step figure is
    in benchmarks/RESULTS.md)."""
    sys.path.insert(0, str(BENCH))
    import report_scale

    run = tmp_path / "run"
    # 12,000 steps in 3 shards: past the line buckets (2,000) and the heatmap's
    # columns (400), so every series is downsampled across shard boundaries.
    facts = report_scale.write_run(run, steps=12_000, steps_per_shard=4_000)
    result = report(run, output=tmp_path / "long.html")
    assert result.downsampled and result.steps == 12_000
    points = {p["id"]: p["points"] for p in result.plots}
    assert points["loss-scale"] <= 2 * 2000 * 2 + 5000  # loss and scale lines, plus markers
    assert result.bytes < 6 * 2**20
    data = gather(load_run(run))
    # Spikes and marked steps survive the downsampling.
    assert set(facts["loss_spikes"]) <= set(data.series.loss[0].steps.tolist())
    assert len(data.series.skipped.steps) == facts["skipped_steps"]
    assert data.series.nonfinite_loss.steps[0] == facts["nan_at"]
    assert data.heatmaps[0].headroom.shape[1] == 400


def test_the_facts_table_is_in_words_not_json(overflow_run, tmp_path):
    import re

    import amp_postmortem
    amp_postmortem.report(overflow_run, output=tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    table = page[page.index('<table class="facts">'):]
    table = table[:table.index("</table>")]
    cells = dict(re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", table))
    assert cells["autocast"] == "float16"
    assert cells["scaler"] == "init 256, growth x2 every 1000000 clean steps, backoff x0.5"
    assert cells["recorder"].startswith("watching every module; statistics every 1 step(s), the full tier every 5 "
                                        "steps")
    assert not any(c in v for v in cells.values() for c in "{}[]")


def test_a_calibration_skip_is_drawn_as_a_skip_not_as_a_failure(tmp_path):
    from conftest import record_run

    from amp_postmortem.reading.loader import load_run
    from amp_postmortem.reporting.data import gather
    from amp_postmortem.reporting.figures import loss_and_scale

    # A scaler starting at 2**40 overflows float16 on its first steps and backs off: calibration.
    run = record_run(tmp_path / "calibrating", steps=8, scaler_kwargs={"init_scale": 2.0 ** 40})
    data = gather(load_run(run))
    assert data.calibration_steps and data.calibration_steps[0] == 0
    assert data.first_nonfinite_step == 0 and data.first_nonfinite_forward_step is None
    layout = loss_and_scale(data).figure.layout
    texts = [a.text for a in layout.annotations]
    assert any(t.startswith("scaler calibration skip") for t in texts), texts
    assert not any(t.startswith("first non-finite value") for t in texts), texts
    assert {s.line.color for s in layout.shapes} == {"#ff7f0e"}  # the skip colour, no red


def test_the_log2_scale_ticks_stay_few_enough_not_to_collide():
    from amp_postmortem.reporting.figures import MAX_SCALE_TICKS, log2_dtick
    assert log2_dtick([16, 15, 14]) == 1
    assert log2_dtick([16, 4]) == 2
    assert log2_dtick([16, -40]) == 10  # 56 exponents: a label every 10, 6 labels
    for span in range(0, 400, 7):
        assert span / log2_dtick([0, span]) <= MAX_SCALE_TICKS
    assert log2_dtick([]) == 1 and log2_dtick([float("nan"), 3.0]) == 1


def _rgb(hex_colour: str) -> str:
    """`#ff7f0e` as the browser's computed style says it: `rgb(255, 127, 14)`."""
    return "rgb({}, {}, {})".format(*(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)))


def test_the_facts_in_words_the_calibration_skip_and_apart_ticks_are_on_the_drawn_page(tmp_path):
    """One page in chromium: a scaler starting at 2**40 skips its first steps
    to calibrate (24 exponents down to float16's range), then block.boom
    really overflows at step 30. The page must draw the skips as a skip and
    the overflow as the failure, say the facts in words, and keep the
    right-hand log2 labels apart."""
    from conftest import record_run

    from amp_postmortem.reporting.figures import COLORS

    def overflow_at_30(step, model, x):
        model.block.boom.gain = 1e6 if step == 30 else 1.0

    run = record_run(tmp_path / "calibrating", steps=34, plant=overflow_at_30,
                     scaler_kwargs={"init_scale": 2.0 ** 40, "growth_interval": 10 ** 6})
    report(run, output=tmp_path / "r.html")
    page = check_page(tmp_path / "r.html", tmp_path / "r.png")
    assert page["state"] == "ready" and page["errors"] == []

    (facts,) = [t for t in page["tables"] if t["class"] == "facts"]
    cells = dict(facts["rows"])
    assert facts["shown"] and cells["autocast"] == "float16"
    assert cells["scaler"] == "init 1.09951e+12, growth x2 every 1000000 clean steps, backoff x0.5"
    assert cells["recorder"].startswith("watching every module; statistics every 1 step(s)")
    assert not any(c in cell for row in facts["rows"] for cell in row for c in "{}[]")

    (loss,) = [p for p in page["plots"] if p["id"] == "plot-loss-scale"]
    notes = {a["text"]: a for a in loss["annotations"]}
    (calibration,) = [a for t, a in notes.items() if t.startswith("scaler calibration skip (steps 0-")]
    assert calibration["text"].endswith(", normal)") and calibration["fill"] == _rgb(COLORS["skipped"])
    failure = notes["first non-finite value, step 30"]
    assert failure["fill"] == _rgb(COLORS["nonfinite"])
    assert not any("non-finite" in t and "step 0" in t for t in notes)  # the skips are no failure
    # Two vertical lines: the skip's dotted in the skip colour at step 0,
    # the failure's dashed in red at step 30, each under its own label.
    skip_line, failure_line = sorted(loss["shapes"], key=lambda s: s["box"]["left"])
    assert (skip_line["stroke"], failure_line["stroke"]) == (_rgb(COLORS["skipped"]), _rgb(COLORS["nonfinite"]))
    assert skip_line["dash"] != failure_line["dash"]
    assert abs(calibration["box"]["left"] - skip_line["box"]["left"]) < 5
    assert abs(failure["box"]["left"] - failure_line["box"]["left"]) < 5

    scale_labels = loss["ticks"]["y2tick"]
    assert len(scale_labels) >= 3 and all(t["text"].startswith("2^") for t in scale_labels)
    assert overlapping(scale_labels) == []  # 2^16 .. 2^40: one label per exponent would collide


def test_an_ordinary_skip_is_drawn_as_a_skip_and_the_failure_as_the_failure(tmp_path):
    """After calibration, one step's gradients overflow and the scaler skips
    it (step 4: through `amp`'s backward only); block.boom's forward
    overflows at step 9, the failure. The skip is drawn in the skip colour, dotted,
    and never labelled the first non-finite value."""
    from conftest import record_run

    from amp_postmortem.reading.loader import load_run
    from amp_postmortem.reporting.data import gather
    from amp_postmortem.reporting.figures import COLORS, loss_and_scale

    def skip_at_4_fail_at_9(step, model, x):
        model.block.boom.gain = 1e6 if step == 9 else 1.0
        # An infinite gain on the gradient: non-finite gradients at step 4
        # whatever the float16 kernels compute, a finite forward.
        model.amp.gain = float("inf") if step == 4 else 1.0

    run = record_run(tmp_path / "skip_then_fail", steps=12, plant=skip_at_4_fail_at_9,
                     scaler_kwargs={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6})
    data = gather(load_run(run))
    assert data.failure_step == 9 and data.first_nonfinite_forward_step == 9
    layout = loss_and_scale(data).figure.layout
    notes = {a.text: a for a in layout.annotations}
    assert data.first_skip_step == 4 and data.first_nonfinite_step == 4
    skip = notes["first scaler skip, step 4 (gradients overflowed, the step was skipped: normal)"]
    assert skip.font.color == COLORS["skipped"]
    skip_line, failure_line = sorted(layout.shapes, key=lambda sh: sh.x0)
    assert (skip_line.x0, skip_line.line.color, skip_line.line.dash) == (4, COLORS["skipped"], "dot")
    assert (failure_line.x0, failure_line.line.color, failure_line.line.dash) == (9, COLORS["nonfinite"], "dash")
    failure = notes["first non-finite value, step 9"]
    assert failure.font.color == COLORS["nonfinite"]
    assert [t for t in notes if t.startswith("first non-finite value")] == ["first non-finite value, step 9"]


def test_a_skip_before_the_failure_is_never_the_failure():
    from amp_postmortem.reporting.data import _failure_step
    assert _failure_step(None, None, []) is None
    assert _failure_step(9, 9, []) == 9 and _failure_step(None, 12, [11]) == 11 and _failure_step(9, None, [3]) == 3


def test_log_axes_get_few_readable_labels():
    from amp_postmortem.reporting.figures import MAX_LOG_TICKS, log10_axis
    # Under two decades: 1, 2, 5 times each power of ten, not every digit.
    assert log10_axis([0.5, 3.0]) == {"type": "log", "dtick": "D2", "exponentformat": "power"}
    assert log10_axis([1e-3, 1e3])["dtick"] == 1          # 6 decades: one label each
    assert log10_axis([1e-30, 1e10])["dtick"] == 5        # 40 decades: every 5th
    for decades in range(2, 300, 7):
        assert decades / log10_axis([1.0, 10.0 ** decades])["dtick"] <= MAX_LOG_TICKS
    assert log10_axis([]) == log10_axis([float("nan"), 0.0, -1.0])  # nothing to place: the short form
