"""A silent failure freezes a counterfactual window (issue 42 item 3): the
first recorded step whose measured updates were mostly lost to rounding is
the window event `lost_updates` (`recorders/bundles/triggers.py`). The jobs
(`silent_runs`): a language model cast with `model.to(torch.bfloat16)` and
trained by AdamW at lr 1e-5 with `AmpRecorder(..., window_steps=K)` and no
`save_bundle()`; and, quiet, the same model in float32 and under bfloat16
autocast over float32 weights."""
from __future__ import annotations

import json

from click.testing import CliRunner

import silent_runs as runs
from amp_postmortem.cli import main
from recorders.bundles.triggers import LOST_UPDATE_SHARE, BundleTriggers


def _windows(path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(path.rglob("window.json"))]


def test_half_the_updates_lost_is_a_window_event_once_per_run():
    t = BundleTriggers(has_scaler=False)
    t.watch_window = True
    assert LOST_UPDATE_SHARE == 0.5
    for step, counts in enumerate([None, (0, 0), (1000, 499), (1000, 500), (1000, 900)]):
        assert t.decide({"step": step, "skipped": False, "loss": 1.0, "lost_updates": counts}) == ([], False)
    # A window event, never a bundle's reason; later steps that lose as much open no other.
    assert t.take_window_events() == {3: ["lost_updates"]}
    t.decide({"step": 5, "skipped": False, "loss": float("nan"), "lost_updates": (10, 10)}, ["request"])
    assert t.take_window_events() == {5: ["nonfinite_loss", "request"]}


def test_a_bf16_weights_job_keeps_a_window_of_its_lost_updates_and_summary_verifies_a_remedy():
    path = runs.bf16_weights_unasked_window_run()
    manifest = json.loads(next(path.rglob("manifest.json")).read_text())
    lost = manifest["lost_updates"]
    first = lost["steps"][0]
    assert sum(lost["unchanged"][0]) >= LOST_UPDATE_SHARE * sum(lost["moved"][0])
    # Frozen at the first measured step, run on K steps, written; no bundle asked for, none kept.
    (window,) = _windows(path)
    assert window["reasons"] == ["lost_updates"] and window["version"] == "1.2"
    assert (window["first_step"], window["trigger_step"], window["last_step"]) == (first, first,
                                                                                  first + runs.WINDOW_STEPS)
    assert not list(path.rglob("bundle.json"))
    out = CliRunner().invoke(main, ["summary", str(path), "--model", "tests/silent_runs.py:TinyLM", "--json"])
    assert out.exit_code == 0, out.output
    finding = next(f for f in json.loads(out.output)["findings"] if f["kind"] == "lost_updates")
    v = finding["evidence"]["verification"]
    assert v["window"] == [window["first_step"], window["last_step"]]
    checks = {c["remedy"]: c for c in v["remedies"]}
    assert checks["fp32_master_weights"]["status"] == "verified"
    assert checks["fp32_master_weights"]["trial"]["lost_share"] < 0.01 < v["as_recorded"]["lost_share"]


def test_float32_and_bf16_autocast_jobs_keep_no_window():
    for name, path in runs.quiet_window_runs().items():
        manifest = json.loads(next(path.rglob("manifest.json")).read_text())
        assert manifest["recorder"]["bundles"]["window_steps"] == runs.WINDOW_STEPS, name
        assert "lost_updates" not in manifest, name
        assert _windows(path) == [], name
