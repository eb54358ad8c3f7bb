"""`fix`: which module kept in float32 saves the step. Planted faults in
runs recorded by the real recorder (`whatif_runs`): `scores` overflows
float16 (q·kᵀ); `first` and `second` both do (no single module suffices);
`RootCancel` fails inside the model's own forward (nothing to keep)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.cli import main
from amp_postmortem.whatif.fix import FixSearch, find_fix, module_expression


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scores_fix():
    return find_fix(W.attn_overflow_run(), 0, model=W.AttnNet)


def test_fix_names_the_planted_module(scores_fix):
    r = scores_fix
    assert r.baseline.forward_finite is False and r.baseline.saved is False
    assert r.candidates[0]["name"] == "scores" and r.candidates[0]["status"] == "broken"
    assert "" not in [c["name"] for c in r.candidates]
    assert r.fix == ["scores"] and r.search is FixSearch.SINGLE
    trial = next(t for t in r.trials if t.modules == ("scores",))
    assert trial.finite and trial.saved and trial.grad_rel_err < 0.01
    # The backward at the recorded scale 256 overflows (k is large): the
    # trial is judged where a scaler backing off would land.
    assert trial.loss_scale < W.RECORDED_SCALE and trial.backoffs >= 1
    assert all(not t.saved for t in r.trials if t.modules != ("scores",))
    assert r.patch == "from recorders.fp32 import keep_fp32\nkeep_fp32(model.scores)"


def test_the_printed_patch_fixes_the_real_training_forward(scores_fix):
    model = W.attn_overflow_model()
    x, _ = W.batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
    exec(scores_fix.patch, {"model": model})
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert torch.isfinite(out).all()


def test_emulated_cuda_policy_is_switched_off_inside_the_kept_module():
    from amp_postmortem.whatif import prepare
    r = find_fix(W.attn_overflow_run(), 0, model=W.AttnNet, policy="cuda")
    assert r.policy == {"device_type": "cuda", "emulated": True}
    assert r.fix == ["scores"]
    p = prepare(W.attn_overflow_run(), 0, model=W.AttnNet, policy="cuda")
    run = p.run(capture=True, fp32_modules=("scores",))
    assert run.calls[(0, "scores", 0)].outputs[0].dtype == torch.float32
    assert run.calls[(0, "q", 0)].outputs[0].dtype == torch.float16  # the emulation resumes after it


def test_greedy_search_when_no_single_module_suffices():
    r = find_fix(W.two_spikes_run(), 0, model=W.TwoSpikes)
    singles = [t for t in r.trials if len(t.modules) == 1]
    assert singles and not any(t.saved for t in singles)
    assert r.search is FixSearch.GREEDY and sorted(r.fix) == ["first", "second"]
    assert r.patch.splitlines()[1:] == ["keep_fp32(model.first)", "keep_fp32(model.second)"]


def test_a_fault_in_the_models_own_forward_has_no_module_fix():
    r = find_fix(W.root_cancel_run(), 0, model=W.RootCancel)
    assert r.fix is None and r.search is FixSearch.NONE and r.patch is None
    assert any("no set of up to" in line for line in r.lines())


def test_healthy_step_needs_no_fix():
    r = find_fix(W.healthy_run(), W.HEALTHY_BUNDLE_STEP, model=W.AttnNet)
    assert r.search is FixSearch.NOT_NEEDED and r.fix is None and r.trials == []


def test_module_expression_follows_containers():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))])
    model.heads = nn.ModuleDict({"cls": nn.Linear(2, 2)})
    assert module_expression(model, "layers.0.1") == "model.layers[0][1]"
    assert module_expression(model, "heads.cls") == "model.heads['cls']"


def test_cli_fix_json_and_table():
    spec = f"{W.__file__}:AttnNet"
    res = CliRunner().invoke(main, ["fix", str(W.attn_overflow_run()), "--step", "0", "--model", spec, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["fix"] == ["scores"] and doc["search"] == "single"
    assert {"step", "rank", "baseline", "candidates", "trials", "patch"} <= set(doc)
    res = CliRunner().invoke(main, ["fix", str(W.attn_overflow_run()), "--step", "0", "--model", spec])
    assert res.exit_code == 0 and "keep_fp32(model.scores)" in res.output
    res = CliRunner().invoke(main, ["fix", str(W.attn_overflow_run()), "--step", "5", "--model", spec])
    assert res.exit_code == 2 and res.output.startswith("Error: no bundle for step 5")


class HalfNorm(nn.Module):
    """A hand-written LayerNorm whose statistics stay in the input's dtype:
    under float16 autocast (x - mean)**2 overflows for rows with
    |x - mean| > 256, the variance is Inf and the row silently becomes 0.
    Finite everywhere, wrong."""

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(W.D_IN, W.D)
        self.norm = HalfNorm()
        self.head = nn.Linear(W.D, 1)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


@pytest.fixture(scope="module")
def finite_but_broken_run(tmp_path_factory):
    """NormNet with `proj` scaled so that some rows of step 0 overflow the
    float16 variance in `norm`; bundle of step 0 asked for."""
    torch.manual_seed(0)
    model = NormNet()
    with torch.no_grad():
        model.proj.weight.mul_(300.0)
    return W.record(tmp_path_factory.mktemp("fix") / "finite_but_broken", model, steps=1, bundle_steps=[0])


def test_a_finite_step_with_a_broken_module_is_not_saved_and_the_module_is_named(finite_but_broken_run):
    r = find_fix(finite_but_broken_run, 0, model=NormNet)
    b = r.baseline
    # Finite as recorded, yet not saved: the replay's own statuses judge it.
    assert b.finite is True and b.saved is False and b.why
    assert r.search is FixSearch.SINGLE and r.fix == ["norm"]
    kept = next(t for t in r.trials if t.modules == ("norm",))
    assert kept.saved and kept.culprit is None and kept.params_off == {}
    assert kept.grad_rel_err < b.grad_rel_err / 10
    assert r.candidates[0]["name"] == "norm" and r.candidates[0]["status"] == "broken"
    assert "finite but NOT saved" in r.lines()[1]
    assert r.patch.splitlines()[1] == "keep_fp32(model.norm)"


def test_fix_judges_by_the_same_rule_as_the_replay(finite_but_broken_run):
    """The baseline's verdict is the replay's: a culprit there means not saved here."""
    from amp_postmortem.replaying import replay
    from amp_postmortem.whatif import prepare
    rep = replay(finite_but_broken_run, 0, model=NormNet, precisions="fp64,fp16")
    t = prepare(finite_but_broken_run, 0, model=NormNet).trial()
    assert rep.culprit is not None and rep.culprit["name"] == "norm"
    assert t.finite and not t.saved
    assert (t.culprit or {}).get("name") == "norm" or t.params_off


# ------------------------------------------- the fix tried on every saved step
def test_fix_tells_saved_from_not_saved_steps():
    """spike_a overflows at step 1, spike_b at step 3: spike_a in float32
    saves step 1 and not step 3, and the report says so."""
    import advice_runs as A
    r = find_fix(A.moving_overflow_run(), 1, model=A.branch_net)
    assert r.fix == ["spike_a"]
    assert (r.saved_steps, r.not_saved_steps) == ([1], [3])
    step3 = r.saved_steps_check[1]
    assert step3.step == 3 and step3.why.startswith("with spike_a in float32: NaN/Inf in the forward")
    assert "does NOT save step(s) 3" in "\n".join(r.lines())
    d = r.to_dict()
    assert (d["saved_steps"], d["not_saved_steps"]) == ([1], [3])


def test_fix_of_a_one_module_job_saves_every_saved_step():
    import advice_runs as A
    r = find_fix(A.fp32_module_run(), 1, model=A.branch_net)
    assert r.fix == ["spike_a"]
    assert (r.saved_steps, r.not_saved_steps) == ([1, 3], [])
