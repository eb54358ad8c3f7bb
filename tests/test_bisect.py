"""`bisect`: the samples of the saved batch whose replay is non-finite.
Samples 3 and 11 of one batch are planted 1000x too large (a data
problem); in the `scores` overflow run every sample fails (a model
problem)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.cli import main
from amp_postmortem.whatif.bisect import BisectKind, SliceMethod, bisect_samples, slicing_note


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bisection_finds_the_planted_bad_samples():
    r = bisect_samples(W.bad_samples_run(), W.BAD_STEP, model=W.AttnNet)
    assert r.kind is BisectKind.DATA and r.bad_samples == list(W.BAD_SAMPLES)
    assert r.batch_size == W.BATCH and r.bad_share == 2 / 16 and r.unresolved == []
    for s in r.samples:
        assert s.fp64_finite is True and s.input_nonfinite == 0 and s.input_absmax > 500
    assert "3, 11" in r.message and "float64 computes them fine" in r.message
    # Whole batch, two halves, then only the failing groups: far fewer than 2n.
    assert r.replays <= 1 + 2 * 2 * 4


def test_every_sample_failing_is_a_model_problem():
    r = bisect_samples(W.attn_overflow_run(), 0, model=W.AttnNet)
    assert r.kind is BisectKind.MODEL and r.bad_samples == list(range(W.BATCH))
    assert r.replays == 2 * W.BATCH - 1


def test_a_finite_step_has_nothing_to_bisect():
    r = bisect_samples(W.healthy_run(), W.HEALTHY_BUNDLE_STEP, model=W.AttnNet)
    assert r.kind is BisectKind.NOT_REPRODUCED and r.bad_samples == [] and r.replays == 1


def test_the_replay_budget_leaves_groups_unresolved():
    r = bisect_samples(W.attn_overflow_run(), 0, model=W.AttnNet, max_replays=4)
    assert r.replays <= 4 and r.unresolved
    assert sorted(i for g in r.unresolved for i in g) + r.bad_samples == sorted(
        set(range(W.BATCH)) - set(r.bad_samples)) + r.bad_samples


def test_cli_bisect():
    res = CliRunner().invoke(main, ["bisect", str(W.bad_samples_run()), "--step", str(W.BAD_STEP),
                                    "--model", f"{W.__file__}:AttnNet", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["kind"] == "data" and doc["bad_samples"] == [3, 11]
    res = CliRunner().invoke(main, ["bisect", str(W.bad_samples_run()), "--step", str(W.BAD_STEP),
                                    "--model", f"{W.__file__}:AttnNet", "--csv"])
    # stdout alone: a progress bar or warning on stderr is no CSV line.
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith("index,forward_finite")
    assert [line.split(",")[0] for line in res.stdout.splitlines()[1:]] == ["3", "11"]


class TokenNet(torch.nn.Module):
    """Token ids in; the embedding row of token 7 is huge, so float16
    overflows in `proj` for the samples that hold a 7 and only those."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, W.D)
        self.proj = torch.nn.Linear(W.D, W.D)
        self.head = torch.nn.Linear(W.D, 1)

    def forward(self, idx):
        return self.head(torch.relu(self.proj(self.emb(idx))))


TOKEN_SAMPLES = (5, 12)   # the samples of step 0 that hold token 7


def token_batch(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 7, (W.BATCH, W.SEQ), generator=g)
    idx[list(TOKEN_SAMPLES), 1] = 7
    return idx, torch.randn(W.BATCH, W.SEQ, 1, generator=g)


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    torch.manual_seed(0)
    model = TokenNet()
    with torch.no_grad():
        model.emb.weight[7].mul_(3e3)
    return W.record(tmp_path_factory.mktemp("bisect") / "token_7_overflows", model, steps=1,
                    batch_fn=token_batch, bundle_steps=[0])


def test_a_few_failing_samples_with_ordinary_inputs_are_a_model_problem(token_run):
    """Token ids cannot be NaN/Inf or out of range: samples that fail alone
    trigger a model (precision) problem, not a data problem."""
    r = bisect_samples(token_run, 0, model=TokenNet)
    assert r.bad_samples == list(TOKEN_SAMPLES) and r.kind is BisectKind.MODEL
    assert r.suspicious_samples == []
    for s in r.samples:
        # Integer inputs: nothing meaningless (a 0 absmax) is reported.
        assert s.input_absmax is None and s.input_nonfinite is None and s.suspicious is None
        assert s.fp64_finite is True and s.to_dict()["not_saved_by"] == "NaN/Inf"
    assert "5, 12" in r.message and "a model (or precision) problem that these samples trigger" in r.message
    assert "data problem" in r.message and "not a data problem" in r.message
    assert r.to_dict()["suspicious_samples"] == []


def test_suspicious_float_inputs_are_reported_per_sample():
    r = bisect_samples(W.bad_samples_run(), W.BAD_STEP, model=W.AttnNet)
    assert r.suspicious_samples == list(W.BAD_SAMPLES)
    for s in r.samples:
        assert s.input_absmax > 10 * s.passing_absmax and "more than 10x" in s.suspicious


def test_bisect_fix_and_recommend_share_one_criterion(monkeypatch, token_run):
    """fix, bisect (and recommend, through Prepared.trial) judge a trial by
    `whatif.judge` alone."""
    import amp_postmortem.whatif as whatif
    from amp_postmortem.whatif.fix import find_fix
    calls = []
    real = whatif.judge

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.saved)
        return out
    monkeypatch.setattr(whatif, "judge", spy)
    r = bisect_samples(token_run, 0, model=TokenNet)
    assert len(calls) == r.replays
    calls.clear()
    f = find_fix(token_run, 0, model=TokenNet)
    assert len(calls) == 1 + len(f.trials) and calls[0] is f.baseline.saved


# ------------------------------------------------ a model that normalises over the batch
def test_one_sample_slices_keep_their_meaning_without_batch_statistics():
    r = bisect_samples(W.bad_samples_run(), W.BAD_STEP, model=W.AttnNet)
    d = r.to_dict()["slicing"]
    assert d["batch_statistics_modules"] == [] and d["min_slice"] == 1 and d["methods"] == ["alone"]
    assert all(s.judged is SliceMethod.ALONE for s in r.samples)
    assert not any("normalise over the batch" in n for n in r.notes)


def test_a_batchnorm_cnn_is_bisected_in_slices_of_two():
    """One-sample slices raise in BatchNorm1d (training): every slice keeps
    two samples, and the failing ones are judged paired with a passing one."""
    r = bisect_samples(W.batchnorm_bad_sample_run(), 1, model=W.BatchNormCNN)
    assert r.kind is BisectKind.DATA and r.bad_samples == [W.CNN_BAD_SAMPLE] and r.unresolved == []
    s = r.slicing
    assert s.batch_statistics_modules == ("bn", "bn1") and s.min_slice == 2
    assert s.methods() == [SliceMethod.PAIRED] and s.partner is not None and s.partner != W.CNN_BAD_SAMPLE
    assert r.samples[0].judged is SliceMethod.PAIRED and r.samples[0].fp64_finite is True
    assert f"paired with sample {s.partner} (which passes)" in r.message
    note = next(n for n in r.notes if "normalise over the batch" in n)
    assert note == slicing_note(s) and "bn, bn1" in note and "at least 2 samples" in note


def test_with_no_sample_passing_batchnorm_runs_on_its_running_statistics():
    """Every sample fails (the convolution's weight is Inf in float16): no
    partner, so each sample is judged alone with BatchNorm on its running
    statistics, and the note says so."""
    r = bisect_samples(W.batchnorm_inf_weight_run(), 0, model=W.BatchNormCNN)
    assert r.kind is BisectKind.MODEL and r.bad_samples == list(range(W.CNN_BATCH))
    assert r.slicing.methods() == [SliceMethod.RUNNING_STATISTICS] and r.slicing.partner is None
    assert {s.judged for s in r.samples} == {SliceMethod.RUNNING_STATISTICS}
    assert all(s.fp64_finite for s in r.samples)
    assert "on running statistics" in r.message
    assert any("running statistics (as in eval mode" in n for n in r.notes)


def test_without_running_statistics_the_groups_stay_whole():
    r = bisect_samples(W.batchnorm_inf_weight_run(False), 0, model=W.BatchNormCNNWithoutRunningStats)
    assert r.kind is BisectKind.BATCH and r.bad_samples == [] and r.samples == []
    assert sorted(i for g in r.unresolved for i in g) == list(range(W.CNN_BATCH))
    assert r.slicing.unsplit == r.unresolved and all(len(g) >= 2 for g in r.unresolved)
    assert "could not be isolated" in r.message
    assert any("left whole" in n for n in r.notes)


def test_cli_bisect_of_a_batchnorm_cnn():
    res = CliRunner().invoke(main, ["bisect", str(W.batchnorm_bad_sample_run()), "--step", "1",
                                    "--model", f"{W.__file__}:BatchNormCNN"])
    assert res.exit_code == 0, res.output
    assert "note: bn, bn1 normalise over the batch" in res.stdout
    res = CliRunner().invoke(main, ["bisect", str(W.batchnorm_bad_sample_run()), "--step", "1",
                                    "--model", f"{W.__file__}:BatchNormCNN", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["bad_samples"] == [W.CNN_BAD_SAMPLE] and doc["slicing"]["methods"] == ["paired"]
    assert doc["slicing"]["batch_statistics_modules"] == ["bn", "bn1"] and doc["slicing"]["min_slice"] == 2
    assert any("normalise over the batch" in n for n in doc["notes"])
