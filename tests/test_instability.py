"""Precision or instability: a tiny GPT with tied embeddings, AdamW,
clipping and a far too high learning rate diverges in float16 and in
float32 alike; a job saved by one module in float32 and a job saved by a
lower loss scale are precision problems. Runs: `advice_runs.py`."""
import json

import pytest
from click.testing import CliRunner

import advice_runs as runs
from amp_postmortem.analyses.compare import compare_runs
from amp_postmortem.analyses.instability import baseline_verdict, find_instability
from amp_postmortem.advice import recommend
from amp_postmortem.analyses.summary import summarize
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run

MODEL = f"{runs.__file__}:tied_gpt"


@pytest.fixture(scope="module")
def diverging():
    return load_run(runs.diverging_gpt_run())


@pytest.fixture(scope="module")
def healthy_fp32_baseline(tmp_path_factory):
    """The same job in float32 at a sane learning rate: it trains."""
    return load_run(runs.record_gpt(tmp_path_factory.mktemp("runs") / "tied_gpt_fp32_lr_0.01", amp=False,
                                    steps=10, lr=0.01))


def test_diverging_job_is_training_instability(diverging):
    rep = find_instability(diverging)
    assert rep.unstable and rep.failure_step == 8 and (rep.from_step, rep.to_step) == (0, 7)
    assert rep.loss_rise["from_step"] == 0 and rep.loss_rise["to_step"] == 7
    assert rep.loss_rise["from_loss"] == pytest.approx(11.094, abs=1e-3)
    assert rep.loss_rise["ratio"] == pytest.approx(20.75, abs=0.01)
    top = rep.growth[0]
    assert (top["name"], top["kind"], top["from_step"], top["to_step"]) == ("proj", "activation", 0, 7)
    assert top["to"] == 59808.0
    assert rep.grown_layer == "proj"


def test_summary_names_the_evidence_and_the_training_remedies(diverging):
    s = summarize(diverging)
    f = next(f for f in s.findings if f.kind == "training_instability")
    assert (f.severity, f.step, f.layer) == ("critical", 8, "proj")
    assert "the loss rose from 11.09 (step 0) to 230.2 (step 7)" in f.message
    assert "activations grew: proj 0.746 at step 0 -> 5.98e+04 at step 7" in f.message
    assert "lower the learning rate" in f.message and "clip the gradient norm" in f.message
    assert "keep_fp32(" not in f.message


@pytest.fixture(scope="module")
def sampled_diverging(tmp_path_factory):
    """The diverging job in sentinel mode, sampled every third step."""
    from recorders.schedule import RecordSchedule
    return load_run(runs.record_gpt(tmp_path_factory.mktemp("runs") / "sampled", amp=True, recorder_options={
        "mode": "sentinel", "schedule": RecordSchedule(cheap_every=3, full_every=0)}))


def test_growth_is_read_over_the_steps_sampled_when_the_window_holds_too_few(sampled_diverging, monkeypatch):
    """A sentinel run samples one step in `cheap_every`: a window of the last
    WINDOW steps holds one sampled step or none. Here the same diverging job
    sampled every third step (rows at 0, 3, 6 and at the re-executed
    steps), with a window of four steps (4-7, whose loss rose 2.9 times: one
    sampled step, 6): growth is read from the first of the last four steps
    with rows."""
    from amp_postmortem.analyses import instability
    run = sampled_diverging
    sampled = [s for s in sorted(set(run.steps.query("tensor_rows > 0")["step"])) if s < 8]
    assert {0, 3, 6} <= set(sampled) and not {4, 5, 7} & set(sampled)
    monkeypatch.setattr(instability, "WINDOW", 4)
    rep = find_instability(run)
    assert rep.failure_step == 8 and (rep.from_step, rep.to_step) == (4, 7) and rep.loss_rise["ratio"] >= 2
    top = rep.growth[0]
    assert rep.unstable and (top["name"], top["kind"], top["to_step"]) == ("proj", "activation", 6)
    assert top["from_step"] == sampled[max(0, len(sampled) - 4)] < 4
    monkeypatch.setattr(instability, "MIN_GROWTH_STEPS", 1)  # the window's one sampled step alone: no growth
    assert not find_instability(run).unstable


def test_replay_evidence_reads_the_recorded_steps_before_the_failure(sampled_diverging, monkeypatch):
    """The float64 replay's "growing values" hint compares with the last
    WINDOW steps that have rows, not the last WINDOW step numbers (one
    sampled step or none in a sentinel run): with a window of four, the
    value it grew from is the first of the four sampled steps before step
    8, not step 6, the one sampled step among 4-7."""
    from types import SimpleNamespace

    import torch

    from amp_postmortem.analyses import instability
    run = sampled_diverging
    before = [s for s in sorted(set(run.steps.query("tensor_rows > 0")["step"])) if s < 8]
    monkeypatch.setattr(instability, "WINDOW", 4)
    reference = SimpleNamespace(calls={0: SimpleNamespace(name="proj", outputs=[torch.full((2,), 1e6)])})
    said = instability.replay_evidence(run, reference, 8)
    first = before[max(0, len(before) - 4)]
    assert first < 4 and said is not None and f"at step {first} (growing values" in said
    assert "proj reaches 1e+06 > 65504" in said


def test_precision_jobs_are_not_instability():
    for run in (runs.fp32_module_run(), runs.lower_scale_run()):
        assert not find_instability(load_run(run)).unstable
        assert "training_instability" not in summarize(load_run(run)).kinds()


def test_fail_on_training_instability():
    runner = CliRunner()
    bad = runner.invoke(main, ["summary", str(runs.diverging_gpt_run()), "--fail-on", "training_instability"])
    ok = runner.invoke(main, ["summary", str(runs.fp32_module_run()), "--fail-on", "training_instability"])
    assert (bad.exit_code, ok.exit_code) == (1, 0)


def test_recorded_recommendation_is_the_training_not_keep_fp32(diverging):
    rec = recommend(diverging)
    assert rec.kinds() == ["training_instability"]
    r = rec.recommendations[0]
    assert "lower the learning rate" in r.action and not r.verified
    assert "compare" in r.why


def test_fp32_twin_confirms_and_a_training_baseline_refutes(diverging, healthy_fp32_baseline):
    twin = load_run(runs.diverging_gpt_fp32_run())
    confirmed = compare_runs(twin, diverging).instability
    assert confirmed["verdict"] == "confirmed"
    assert "the float32 baseline diverges too: its loss rose from 11.09 (step 0)" in confirmed["why"]
    refuted = baseline_verdict(diverging, healthy_fp32_baseline)
    assert refuted["verdict"] == "refuted" and "precision problem" in refuted["why"]
    # two float16 runs: no float32 word on it
    assert compare_runs(diverging, diverging).instability is None


def test_compare_json_carries_the_verdict():
    out = CliRunner().invoke(main, ["compare", str(runs.diverging_gpt_fp32_run()), str(runs.diverging_gpt_run()),
                                    "--json"])
    assert out.exit_code == 0
    assert json.loads(out.stdout)["instability"]["verdict"] == "confirmed"


def test_replayed_recommendation_cites_float64_and_never_prints_keep_fp32(diverging, one_torch_thread):
    rec = recommend(diverging, model=MODEL)
    assert rec.step == 8 and rec.kinds()[0] == "training_instability"
    assert "keep_fp32" not in rec.kinds()
    r = rec.recommendations[0]
    # A float64 replay beyond float16's range is what a range problem looks
    # like too: without a saved window to re-run in float32 it stays
    # undetermined (issue 23), and says what would decide it.
    assert not r.verified and "window_steps" in r.why
    assert any(e.startswith("precision or instability undetermined: no window") for e in r.evidence)
    beyond = next(e for e in r.evidence if e.startswith("the float64 replay of step 8"))
    assert "proj reaches" in beyond and "> 65504" in beyond
    # what keep_fp32 would do is evidence, not advice
    assert any(e.startswith("with proj in float32 step 8 replays finite") for e in r.evidence)
    # no finding or recommendation contradicts another
    kinds = summarize(diverging).kinds()
    assert "healthy" not in kinds and "no_change" not in rec.kinds()
