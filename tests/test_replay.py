"""Replay of a saved step: precisions, local/propagated attribution, culprit,
policy emulation, fidelity, what-if hooks and the CLI command.

Bundles are built in memory by `make_bundle` (a model run once, its weights,
inputs, RNG and output gradients put in a `Bundle`), and, for fidelity, from
a run recorded by the real recorder (`conftest.record_run`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_postmortem.reading.bundle import Bundle
from amp_postmortem.names import BackwardStart
from amp_postmortem.replaying import ReplaySession, RunConfig, recorded_precision, replay
from amp_postmortem.replaying import attribution
from amp_postmortem.replaying.attribution import ErrorStats
from amp_postmortem.replaying.policy import get_policy
from interrupt import default_sigint
from recorders.stats import iter_tensors
from tiny_models import (BackwardBlowup, BlowupNet, BoomNet, ConvBN, DropMLP, ScoreNet, TinyNet,
                         recorder_at, train)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_bundle(model, args, loss_fn, *, device_type="cpu", dtype="float16", autocast=True,
                loss_scale=None, micro_batches=None, reason="request", step=3):
    """Run `model` once per micro-batch (CPU autocast when the recorded
    device is the CPU) and fill a Bundle as the recorder would."""
    rng = torch.get_rng_state()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    inputs, grads, losses = [], [], []
    for a in (micro_batches or [args]):
        with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=autocast and device_type == "cpu"):
            out = model(*a)
        outs = [t for t in iter_tensors(out) if t.is_floating_point() and t.requires_grad]
        loss = loss_fn(out)
        g = torch.autograd.grad(loss, outs, allow_unused=True)
        inputs.append((tuple(t.detach().clone() for t in a), {}))
        grads.append([None if x is None else x.detach().clone() for x in g])
        losses.append(float(loss.detach()))
    torch.set_rng_state(rng)
    return Bundle(path="", step=step, rank=0, params=params, buffers=buffers, inputs=inputs,
                  grad_outputs=grads, loss=sum(losses) / len(losses), loss_scale=loss_scale,
                  autocast={"enabled": autocast, "device_type": device_type, "dtype": dtype},
                  precision_flags={}, scaler=None, rng={"cpu": rng}, model_class="tests.Unknown",
                  optimizer=None, env={"device_type": device_type}, reason=reason)


def square_loss(out):
    return (out.float() ** 2).mean()


def by_name(result, name, phase="forward"):
    return next(m for m in result.modules if m["name"] == name and m["phase"] == phase)


# ------------------------------------------------------------------ models
def planted_bundle(**kw):
    torch.manual_seed(0)
    model = BlowupNet()
    with torch.no_grad():
        model.block.fc.weight.mul_(60)
    return make_bundle(model, (torch.randn(16, 8),), square_loss, loss_scale=256.0, **kw)


def ce_loss(out):
    return F.cross_entropy(out.float(), torch.arange(out.shape[0]) % out.shape[1])


# ------------------------------------------------------------------ metrics
def test_error_stats_pin_rounding_ratio_and_nonfinite():
    ref = torch.tensor([1.0 / 3, 2.0 / 3, 1.0 / 7, 1000.3, 0.0], dtype=torch.float64)
    rounded = ref.to(torch.float16)
    s = ErrorStats().add(rounded, ref)
    assert s.ratio_to_rounding == pytest.approx(1.0)
    assert s.nonfinite_new == 0
    assert s.rel_l2 == pytest.approx(float((rounded.double() - ref).norm() / ref.norm()))
    assert s.sqnr_db == pytest.approx(10 * math.log10(float(ref.norm() ** 2 / (rounded.double() - ref).norm() ** 2)))

    big = torch.tensor([70000.0, 1.0], dtype=torch.float64)
    s = ErrorStats().add(big.to(torch.float16), big)
    assert (s.nonfinite_new, s.unrepresentable, s.rel_l2) == (1, 1, math.inf)
    assert attribution.local_status(s)[0] == "broken"

    # A gradient travelled times the scale; it is compared unscaled.
    g = torch.tensor([1e-3, -2e-3], dtype=torch.float64)
    s = ErrorStats().add((g * 1024).to(torch.float16), g, scale=1024.0)
    assert s.ratio_to_rounding == pytest.approx(1.0) and s.rel_l2 < 1e-3


# ------------------------------------------------------------------ culprit
def test_planted_fp16_overflow_is_the_culprit_and_its_parents_are_not():
    result = replay(planted_bundle(), model=BlowupNet, loss_fn=lambda out, mb: square_loss(out))
    assert result.culprit["name"] == "block.blowup"
    assert (result.culprit["phase"], result.culprit["precision"]) == ("forward", "fp16")
    assert "NaN/Inf in float16 where float64 is finite" in result.culprit["reason"]
    blowup, block, model = by_name(result, "block.blowup"), by_name(result, "block"), by_name(result, "")
    assert blowup["status"] == {"fp32": "ok", "fp16": "broken", "bf16": "ok"}
    # The parents are broken only through their child, and say so.
    assert block["status"]["fp16"] == model["status"]["fp16"] == "broken"
    assert block["broken_inside"]["fp16"] == model["broken_inside"]["fp16"] == "block.blowup"
    # The LayerNorm after it only propagates the Inf: its own arithmetic is fine.
    assert by_name(result, "block.norm")["status"]["fp16"] == "ok"
    assert by_name(result, "block.fc")["status"]["fp16"] == "ok"
    assert result.first_propagated["fp16"]["name"] == "block.blowup"
    assert result.loss["fp16"] != result.loss["fp16"]  # NaN, as recorded
    assert result.loss["fp64"] == pytest.approx(result.loss["fp32"], rel=1e-6)
    assert result.param_grads["embed.weight"]["flagged"] == ["fp16"]
    assert result.reproduced is True and result.fidelity["basis"] == "loss saved in the bundle"


def test_bf16_replay_of_the_fp16_overflow_shows_no_overflow():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,bf16",
                    loss_fn=lambda out, mb: square_loss(out))
    assert result.culprits == {"bf16": None} and result.culprit is None
    assert all(m["propagated"]["bf16"]["nonfinite_new"] == 0 for m in result.modules)
    assert math.isfinite(result.loss["bf16"])
    assert result.loss["bf16"] == pytest.approx(result.loss["fp64"], rel=0.02)


def test_nan_saved_output_gradient_is_said_and_forward_culprit_still_found():
    result = replay(planted_bundle(), model=BlowupNet, precisions=("fp64", "fp16"))
    assert any("saved output gradient holds" in n for n in result.notes)
    assert result.culprit["name"] == "block.blowup"


def test_overflowing_loss_scale_is_named_as_the_culprit():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    bundle = make_bundle(model, (torch.randn(8, 4),), lambda o: (o.float() * 10).pow(2).sum(),
                         loss_scale=2.0 ** 16)
    result = replay(bundle, model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)),
                    precisions="fp64,fp16")
    assert result.culprit["name"] == "<loss>" and result.culprit["phase"] == "backward"
    assert "loss scale is too large" in result.culprit["reason"]


def test_anomaly_reports_the_backward_op_and_the_forward_traceback():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16", anomaly=True, local=False,
                    loss_fn=lambda out, mb: square_loss(out))
    assert result.anomaly["precision"] == "fp16" and result.anomaly["raised"] is True
    assert result.anomaly["op"].endswith("Backward0")
    assert "tiny_models.py" in result.anomaly["traceback"]


# ------------------------------------------------------------------ policy
def test_cuda_recorded_step_is_replayed_on_cpu_under_the_emulated_cuda_policy():
    torch.manual_seed(0)
    model = ScoreNet()
    with torch.no_grad():
        model.proj.weight.mul_(300)
    bundle = make_bundle(model, (torch.randn(4, 8),), square_loss, device_type="cuda", loss_scale=128.0)
    recorded = replay(bundle, model=ScoreNet, precisions="fp64,fp16")
    assert recorded.policy == {"mode": "recorded", "device_type": "cuda", "emulated": True, "loss_scale": 128.0}
    assert recorded.culprit is None
    assert by_name(recorded, "scores")["status"]["fp16"] == "ok"
    # The same step under the CPU policy: pow stays in float16 and overflows.
    as_cpu = replay(bundle, model=ScoreNet, precisions="fp64,fp16", policy="cpu")
    assert as_cpu.policy["emulated"] is False
    assert as_cpu.culprit["name"] == "scores" and as_cpu.culprit["phase"] == "forward"
    # What-if: `scores` kept in float32 under the CPU policy saves the step;
    # under the emulated CUDA policy a float32 module stays float32 too.
    session = ReplaySession(bundle, ScoreNet())
    cpu16 = RunConfig("fp16", policy=get_policy("cpu", "fp16"), loss_scale=128.0)
    assert not session.run(cpu16, capture=False).finite
    assert session.run(cpu16.replace(fp32_modules=("scores",)), capture=False).finite
    cuda16 = cpu16.replace(policy=get_policy("cuda", "fp16"), fp32_modules=("proj",))
    calls = session.run(cuda16).calls
    assert calls[(0, "proj", 0)].outputs[0].dtype == torch.float32
    assert calls[(0, "head", 0)].outputs[0].dtype == torch.float16


def test_recorded_precision_follows_autocast():
    bundle = planted_bundle()
    assert recorded_precision(bundle) == "fp16"
    bundle.autocast = {"enabled": False, "device_type": None, "dtype": None}
    assert recorded_precision(bundle) == "fp32"


# ------------------------------------------------------------------ healthy
@pytest.mark.parametrize("name", ["transformer", "conv_bn", "dropout_mlp"])
def test_healthy_models_stay_within_calibrated_bounds(name):
    torch.manual_seed(0)
    cls, args = {"transformer": (TinyNet, (torch.randn(4, 6, 8),)),
                 "conv_bn": (ConvBN, (torch.randn(8, 3, 8, 8),)),
                 "dropout_mlp": (DropMLP, (torch.randn(16, 32),))}[name]
    model = cls()
    loss = ce_loss if name != "transformer" else square_loss
    for device_type in ("cpu", "cuda"):
        bundle = make_bundle(model, args, loss, device_type=device_type, loss_scale=2.0 ** 16)
        result = replay(bundle, model=cls)
        assert result.culprit is None and not result.errors
        degraded = 0
        for m in result.modules:
            for p in ("fp32", "fp16", "bf16"):
                assert m["status"][p] in ("ok", "degraded"), (m["name"], m["phase"], p, m["reason"][p])
                assert m["propagated_status"][p] in ("ok", "degraded")
                assert m["local_rel_err"][p] <= attribution.BROKEN_REL[p] / 3
                assert m["propagated_rel_err"][p] <= attribution.PROPAGATED_BROKEN_REL[p] / 2
                degraded += m["status"][p] == "degraded"
        assert degraded <= 0.1 * 3 * len(result.modules)
        assert not [n for n, g in result.param_grads.items() if "fp16" in g["flagged"]]
        # Dropout masks match across precisions (RNG restored before each run).
        assert result.loss["fp64"] is None or math.isfinite(result.loss["fp64"])


# ------------------------------------------------------------------ engine
def test_fp32_replay_of_an_fp32_step_reproduces_its_gradients_bit_for_bit():
    torch.manual_seed(0)
    model = DropMLP()
    x = torch.randn(16, 32)
    rng = torch.get_rng_state()
    ce_loss(model(x)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.set_rng_state(rng)
    bundle = make_bundle(model, (x,), ce_loss, autocast=False)
    session = ReplaySession(bundle, DropMLP())
    run = session.run(RunConfig("fp32"))
    assert all(torch.equal(run.param_grads[n].float(), g) for n, g in expected.items())


def test_micro_batches_accumulate_and_shared_modules_are_seen_per_call():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    model = Shared()
    mbs = [(torch.randn(3, 4),), (torch.randn(3, 4),)]
    bundle = make_bundle(model, None, square_loss, micro_batches=mbs, autocast=False)
    for a in mbs:
        square_loss(model(*a)).backward()
    session = ReplaySession(bundle, Shared())
    run = session.run(RunConfig("fp64"))
    assert sorted(k for k in run.calls if k[1] == "fc") == [(0, "fc", 0), (0, "fc", 1), (1, "fc", 0), (1, "fc", 1)]
    assert torch.allclose(run.param_grads["fc.weight"], model.fc.weight.grad.double(), rtol=1e-5)


def test_what_if_replays_do_not_claim_fidelity():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16", local=False, batch=[0, 1],
                    loss_fn=lambda out, mb: square_loss(out))
    assert result.reproduced is None and "a slice of the batch" in result.fidelity["basis"]


def test_local_replays_can_be_limited_to_named_modules():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16", local=["block.blowup"])
    assert result.culprit["name"] == "block.blowup"
    assert by_name(result, "block")["status"]["fp16"] == "n/a"


def test_what_if_hooks_fp32_module_loss_scale_and_batch_slice():
    bundle = planted_bundle()
    session = ReplaySession(bundle, BlowupNet())
    fp16 = RunConfig("fp16", policy=get_policy("cpu", "fp16"), loss_scale=256.0)
    assert not session.run(fp16).finite
    kept = session.run(fp16.replace(fp32_modules=("block.blowup",)))
    assert kept.calls[(0, "block.blowup", 0)].outputs[0].dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in kept.outputs[0])
    sliced = session.run(RunConfig("fp32", batch=[0, 3]))
    assert sliced.outputs[0][0].shape == (2, 4)
    assert session.run(fp16.replace(loss_scale=2.0 ** 20), capture=False).loss_scale == 2.0 ** 20
    # The session's models are restored: the plain fp16 run still overflows.
    assert not session.run(fp16, capture=False).finite


def test_global_state_is_restored_after_a_replay():
    bundle = planted_bundle()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    precision = torch.get_float32_matmul_precision()
    replay(bundle, model=BlowupNet, precisions="fp64,fp32,fp16", local=False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_float32_matmul_precision() == precision
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


def test_json_contract():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16")
    d = result.to_dict()
    for key in ("step", "rank", "device", "policy", "reproduced", "culprit", "modules", "loss", "param_grads"):
        assert key in d
    assert set(d["culprit"]) >= {"name", "phase", "precision", "reason"}
    for m in d["modules"]:
        assert set(m) >= {"name", "phase", "status", "local_rel_err", "propagated_rel_err"}
    from recorders.format.plain import plain
    json.loads(json.dumps(plain(d), allow_nan=False))
    table = result.table()
    assert list(table.columns[:5]) == ["name", "phase", "fp16", "fp16_local", "fp16_prop"]
    assert result.lines()[1].startswith("fidelity: unknown (no recorded statistics")


# ------------------------------------------------------------------ fidelity
def _record_with_bundle(path, gain_in_replay):
    """Record conftest's overflow run (Boom x1e6 at step 7) with the real
    recorder and build the bundle of step 7 from a plant hook; the replayed
    model's Boom gain is `gain_in_replay` (the training set it outside the
    state dict, so a plain factory replays with gain 1)."""
    from conftest import OVERFLOW_STEP, record_run
    saved = {}

    def plant(step, model, x):
        model.block.boom.gain = 1e6 if step == OVERFLOW_STEP else 1.0
        if step != OVERFLOW_STEP:
            return
        saved.update(params={n: p.detach().clone() for n, p in model.named_parameters()},
                     buffers={n: b.detach().clone() for n, b in model.named_buffers()},
                     x=x.clone(), rng=torch.get_rng_state())

        def grab(module, args, output):
            output.register_hook(lambda g: saved.__setitem__("grad", g.detach().clone()))
            handle.remove()
        handle = model.register_forward_hook(grab)

    run = record_run(path, steps=OVERFLOW_STEP + 2, plant=plant,
                     scaler_kwargs={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6})
    scale = 2.0 ** 8
    bundle = Bundle(path="", step=OVERFLOW_STEP, rank=0, params=saved["params"], buffers=saved["buffers"],
                    inputs=[((saved["x"],), {})], grad_outputs=[[saved["grad"].double() / scale]],
                    loss=None, loss_scale=scale,
                    autocast={"enabled": True, "device_type": "cpu", "dtype": "float16"},
                    precision_flags={}, scaler=None, rng={"cpu": saved["rng"]}, model_class="x.Net",
                    optimizer=None, env={"device_type": "cpu"}, reason="nonfinite_loss")

    def factory():
        net = BoomNet()
        net.block.boom.gain = gain_in_replay
        return net
    return run, bundle, factory


def test_replay_of_a_recorded_nonfinite_step_reproduces_it(tmp_path):
    run, bundle, factory = _record_with_bundle(tmp_path / "overflow", gain_in_replay=1e6)
    result = replay(bundle, model=factory, precisions="fp64,fp16", run_dir=run)
    assert result.reproduced is True
    assert result.fidelity["basis"] == "recorded statistics (forward only)"  # substitute start
    assert result.fidelity["recorded_nonfinite_modules"][0] == "block.boom (activation)"
    assert result.culprit["name"] == "block.boom" and result.culprit["phase"] == "forward"


def test_a_step_that_does_not_reproduce_says_so(tmp_path):
    run, bundle, factory = _record_with_bundle(tmp_path / "overflow", gain_in_replay=1.0)
    result = replay(bundle, model=factory, precisions="fp64,fp16", run_dir=run)
    assert result.reproduced is False
    # The forward stays finite in the replay; only the saved (NaN) output
    # gradient makes its backward non-finite.
    assert result.fidelity["recorded_nonfinite_modules"][0] == "block.boom (activation)"
    assert not [m for m in result.fidelity["replayed_nonfinite_modules"] if m.endswith("(activation)")]
    assert "did NOT reproduce" in result.notes[0]
    # Without the run, the bundle's trigger is the evidence.
    assert replay(bundle, model=factory, precisions="fp64,fp16", local=False).reproduced is False


def test_sample_run_bundle_reproduces_when_bundles_are_saved(overflow_run):
    """The recorder's own bundle of the overflow run."""
    from conftest import OVERFLOW_STEP
    assert (overflow_run / "bundles").is_dir()

    def factory():
        net = BoomNet()
        net.block.boom.gain = 1e6
        return net
    result = replay(overflow_run, step=OVERFLOW_STEP, model=factory, precisions="fp64,fp16")
    assert result.reproduced is True
    assert result.culprit["name"] == "block.boom"


# ------------------------------------------------------------------ CLI
MODEL_FILE = """
import torch.nn as nn


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, x):
        return x * self.gain


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.boom = Boom()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.boom(self.inp(x)))


def planted():
    net = Net()
    net.boom.gain = 1e6
    return net
"""


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run by the real recorder with bundles at step 2 (asked for) and at
    step 3, where `boom` multiplies by 1e6 and float16 overflows."""
    import importlib.util
    root = tmp_path_factory.mktemp("replay_cli")
    (root / "planted_model.py").write_text(MODEL_FILE)
    spec = importlib.util.spec_from_file_location("planted_model_rec", root / "planted_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(5)]

    def plant(step, model, x):
        model.boom.gain = 1e6 if step == 3 else 1.0

    rec = train(mod.Net(), data, recorder=recorder_at(root / "run", bundle_steps=[2], hold_steps=3), lr=0.01,
                scaler={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6}, on_step=plant).rec
    assert [b["step"] for b in rec.bundles.saved] == [2, 3]
    return root


def cli(*args):
    from click.testing import CliRunner
    from amp_postmortem.cli import main
    return CliRunner().invoke(main, ["replay", *[str(a) for a in args]])


def test_cli_replays_a_saved_bundle_and_names_the_culprit(saved_run):
    spec = f"{saved_run / 'planted_model.py'}:planted"
    result = cli(saved_run / "run", "--step", 3, "--model", spec, "--precisions", "fp16,bf16")
    assert result.exit_code == 0, result.output
    assert "fidelity: reproduced (recorded statistics (forward only))" in result.output
    assert "culprit: boom, forward, fp16:" in result.output
    doc = json.loads(cli(saved_run / "run", "--step", 3, "--model", spec, "--json").stdout)
    assert doc["reproduced"] is True and doc["culprit"]["name"] == "boom"
    assert doc["policy"] == {"mode": "recorded", "device_type": "cpu", "emulated": False, "loss_scale": 256.0}


def test_cli_says_when_the_replay_does_not_reproduce(saved_run):
    # The plain factory leaves boom's gain at 1: the overflow does not happen.
    result = cli(saved_run / "run", "--step", 3, "--model", f"{saved_run / 'planted_model.py'}:Net",
                 "--precisions", "fp16")
    assert result.exit_code == 0, result.output
    assert "fidelity: NOT REPRODUCED" in result.output and "culprit: none" in result.output


def test_cli_healthy_requested_step(saved_run):
    doc = json.loads(cli(saved_run / "run", "--step", 2, "--model", f"{saved_run / 'planted_model.py'}:Net",
                         "--json").stdout)
    assert doc["reproduced"] is True and doc["culprit"] is None
    assert doc["fidelity"]["absmax_agreed"] == doc["fidelity"]["absmax_compared"] > 0


@pytest.mark.parametrize("args, message", [
    (("--step", 9), "no bundle for step 9"),
    (("--step", 3, "--model", "no_such_module_xyz:build"), "cannot import 'no_such_module_xyz'"),
    (("--step", 3), "the replay needs the model (the run recorded 'planted_model_rec.Net'): pass --model"),
    (("--step", 3, "--model", "recorded"), "cannot import the recorded model class 'planted_model_rec.Net' from "
                                           "installed code; pass --model"),
    (("--step", 3, "--precisions", "fp8"), "'fp8' is not one of"),
])
def test_cli_errors_are_one_line(saved_run, args, message):
    result = cli(saved_run / "run", *args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_without_step_replays_the_first_failure_and_says_so(saved_run):
    spec = f"{saved_run / 'planted_model.py'}:planted"
    result = cli(saved_run / "run", "--model", spec, "--precisions", "fp16")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == ("no --step given: replaying the bundle of step 3 (rank 0, saved for nonfinite_loss, "
                        "nonfinite_tensor): the first failure's")
    assert lines[1].startswith("step 3, rank 0: replayed on cpu")
    doc = json.loads(cli(saved_run / "run", "--model", spec, "--precisions", "fp16", "--json").stdout)
    assert doc["step"] == 3 and doc["bundle_choice"] == {"step": 3, "rank": 0, "failure": True,
                                                         "reasons": ["nonfinite_loss", "nonfinite_tensor"]}
    named = json.loads(cli(saved_run / "run", "--step", 3, "--model", spec, "--precisions", "fp16",
                           "--json").stdout)
    assert named["bundle_choice"] is None  # a step given: nothing chosen


def test_cli_without_step_on_a_run_with_no_bundle_is_one_line(saved_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(saved_run / "run", run)
    shutil.rmtree(run / "bundles")
    result = cli(run, "--model", f"{saved_run / 'planted_model.py'}:planted")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"Error: no replay bundles in {run} (nothing under bundles/)")


def test_a_typo_in_the_factory_name_names_the_users_file_and_the_missing_name(saved_run):
    path = saved_run / "planted_model.py"
    result = cli(saved_run / "run", "--step", 3, "--model", f"{path}:planted_modle")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"Error: model spec '{path}:planted_modle': 'planted_modle' not found in "
                             f"'{path}'; did you mean 'planted'?\n")
    assert "_amp_postmortem_model" not in result.output


SLOW_FACTORY = """
import sys, time


def slow():
    print("building", file=sys.stderr, flush=True)
    time.sleep(120)
"""


def test_ctrl_c_during_a_replay_is_one_line_and_exit_130(saved_run, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    (tmp_path / "slow_model.py").write_text(SLOW_FACTORY)
    repo = Path(__file__).resolve().parents[1]
    replay_cli = subprocess.Popen(
        [sys.executable, "-m", "amp_postmortem", "replay", str(saved_run / "run"), "--step", "3", "--model",
         f"{tmp_path / 'slow_model.py'}:slow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(repo)), preexec_fn=default_sigint)
    try:
        assert replay_cli.stderr.readline() == "building\n"  # inside the user's factory
        replay_cli.send_signal(signal.SIGINT)
        out, err = replay_cli.communicate(timeout=60)
    finally:
        replay_cli.kill()
    assert replay_cli.returncode == 130 and out == ""
    assert err == "stopped (interrupted)\n"


TWICE_MODEL_FILE = """
import torch.nn as nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, x):
        return x * self.gain


class Twice(nn.Module):
    \"\"\"`act` runs before and after `gate`: two calls of one module.\"\"\"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.gate = Gate()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.act(self.gate(self.act(self.fc(x)))))


def planted():
    net = Twice()
    net.gate.gain = 1e6
    return net
"""


def test_a_module_called_twice_has_its_calls_named_apart_and_the_true_first_is_named(tmp_path):
    """`gate` overflows float16 between the two calls of `act`: the first
    over the threshold is `gate`, not `act` (whose second call only carries
    the Inf on); the calls are `act#0` and `act#1`."""
    import importlib.util
    (tmp_path / "twice_model.py").write_text(TWICE_MODEL_FILE)
    spec = importlib.util.spec_from_file_location("twice_model_rec", tmp_path / "twice_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(4)]

    def plant(step, model, x):
        model.gate.gain = 1e6 if step == 2 else 1.0

    train(mod.Twice(), data, recorder=recorder_at(tmp_path / "run", hold_steps=3), lr=0.01,
          scaler={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6}, on_step=plant)
    args = (tmp_path / "run", "--step", 2, "--model", f"{tmp_path / 'twice_model.py'}:planted", "--precisions", "fp16")
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "first over the threshold end to end in fp16: gate, forward" in result.stdout
    assert "culprit: gate, forward, fp16:" in result.stdout
    doc = json.loads(cli(*args, "--json").stdout)
    forward = [(m["label"], m["name"], m["call"]) for m in doc["modules"] if m["phase"] == "forward"]
    assert forward == [("fc", "fc", 0), ("act#0", "act", 0), ("gate", "gate", 0), ("act#1", "act", 1),
                       ("head", "head", 0), ("", "", 0)]  # the root last: forwards complete inside out
    assert doc["first_propagated"]["fp16"]["label"] == "gate"
    table = cli(*args, "--csv").stdout.splitlines()
    assert [row.split(",")[0] for row in table[1:5]] == ["fc", "act#0", "gate", "act#1"]


# ------------------------------------------------- backward start, anomaly
def test_nonfinite_saved_gradient_starts_every_backward_from_one_documented_substitute():
    """replay, fix and bisect start the backward by one rule (the engine's):
    a NaN/Inf saved output gradient is replaced by the gradient of the mean
    output there, for every precision, and the result says so."""
    from amp_postmortem.whatif import prepare
    bundle = planted_bundle()  # square_loss of a fp16 NaN output: NaN saved gradient
    assert not all(bool(torch.isfinite(g).all()) for mb in bundle.grad_outputs for g in mb)
    session = ReplaySession(bundle, BlowupNet())
    assert session.backward_start is BackwardStart.SUBSTITUTE_MEAN and session.grad_outputs_nonfinite == 0
    saved, start = bundle.grad_outputs[0][0], session.grad_outputs[0][0]
    bad = ~torch.isfinite(saved)
    assert torch.equal(start[~bad], saved[~bad]) and bool((start[bad] == 1.0 / saved.numel()).all())
    result = replay(bundle, model=BlowupNet, precisions="fp64,fp32,fp16")
    assert result.backward_start is BackwardStart.SUBSTITUTE_MEAN
    assert result.to_dict()["backward_start"] == "substitute_mean"  # the enum's value: the --json string
    assert any("backward_start: substitute_mean" in n and "not from the step's true gradient" in n
               for n in result.notes)
    # From a finite start, float32's backward is plain float32 rounding: no artefacts.
    assert all(m["status"]["fp32"] == "ok" for m in result.modules if m["phase"] == "backward")
    assert "(backward from the substitute_mean start)" in "\n".join(result.lines())
    p = prepare(bundle, model=BlowupNet)
    assert p.backward_start is BackwardStart.SUBSTITUTE_MEAN
    assert torch.equal(p.session.grad_outputs[0][0], start)
    # A real loss_fn replaces the substitute, and says so.
    with_loss = replay(bundle, model=BlowupNet, precisions="fp64,fp16", local=False,
                       loss_fn=lambda out, mb: square_loss(out))
    assert with_loss.backward_start is BackwardStart.LOSS_FN


def test_finite_saved_gradient_is_used_as_saved():
    torch.manual_seed(0)
    bundle = make_bundle(DropMLP(), (torch.randn(8, 32),), ce_loss)
    result = replay(bundle, model=DropMLP, precisions="fp64,fp16", local=False)
    assert result.backward_start is BackwardStart.SAVED
    assert not any("substitute" in n for n in result.notes)


def test_loss_line_says_when_the_model_returns_no_loss():
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16", local=False)
    assert result.loss["fp64"] is None
    line = next(x for x in result.lines() if x.startswith("loss:"))
    assert line.startswith("loss: recorded nan; the model returns outputs, not a loss")
    assert "fp64 -" not in line


def test_anomaly_after_a_nonfinite_forward_points_at_the_forward_culprit():
    import os
    result = replay(planted_bundle(), model=BlowupNet, precisions="fp64,fp16", anomaly=True)
    a = result.anomaly
    assert a["precision"] == "fp16" and a["forward_nonfinite"] is True
    assert a["forward_origin"] == "block.blowup" == result.culprit["name"]
    assert "anomaly mode checks the backward only" in a["explanation"]
    assert "made in block.blowup" in a["explanation"]
    # Tracebacks hold the model's frames, relative to the current directory.
    assert "tests/tiny_models.py" in a["traceback"] and os.getcwd() not in a["traceback"]
    assert "torch/nn/modules" not in a["traceback"]


def test_anomaly_on_a_backward_overflow_says_why_it_raised_nothing():
    torch.manual_seed(0)
    bundle = make_bundle(BackwardBlowup(), (torch.rand(64, 4) * 100 + 50,), lambda o: o.float().sum(),
                         loss_scale=2.0 ** 10)
    result = replay(bundle, model=BackwardBlowup, precisions="fp64,fp16", anomaly=True)
    a = result.anomaly
    assert a["precision"] == "fp16" and a["raised"] is False and a["forward_nonfinite"] is False
    assert a["first_nonfinite_op"]["values"] == "Inf"
    assert a["first_nonfinite_op"]["op"].endswith("Backward0")
    assert a["first_nonfinite_op"]["module"] == "fc"
    assert "anomaly mode raised nothing" in a["explanation"] and "loss scale 1024" in a["explanation"]
    line = next(x for x in result.lines() if x.startswith("anomaly (fp16):"))
    assert "None" not in line
