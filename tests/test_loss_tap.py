"""recorders.loss_tap: every micro-batch's loss, captured where the job
scales it (GradScaler.scale) or where the model returns it, combined with a
loss passed to `rec.step()`."""
from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from framework_runs import read_table
from recorders import AmpRecorder
from recorders.loss_tap import find_loss
from recorders.unwrap import unwrap_optimizer
from tiny_models import recorder_at, train

ACCUM, STEPS = 2, 3


class LossNet(nn.Module):
    """Returns `(logits, loss)`, nanoGPT's convention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        logits = self.fc(x)
        return logits, ((logits.float() - y) ** 2).mean()


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS * ACCUM)]


def loop(run=None, *, scaler=True, pass_loss=False, nan_micro_batch=None, **options):
    """fp16 CPU autocast, ACCUM micro-batches per step, each loss divided by
    ACCUM before scaling. Returns (the losses as backpropagated per step, the
    model, the scaler)."""
    model = LossNet()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    data = _data()
    if nan_micro_batch is not None:
        x, y = data[nan_micro_batch]
        x = x.clone()
        x[0, 0] = math.nan
        data[nan_micro_batch] = (x, y)
    backpropagated = []

    def loss_fn(model, x, y, step, accumulate):
        loss = model(x, y)[1] / accumulate
        backpropagated.append(loss.item())
        return loss

    train(model, data, recorder=recorder_at(run, **options) if run else None, scaler=sc, accumulate=ACCUM, lr=0.1,
          loss_fn=loss_fn, pass_loss=pass_loss)
    per_step = [backpropagated[i:i + ACCUM] for i in range(0, len(backpropagated), ACCUM)]
    return per_step, model, sc


def _losses(run):
    return read_table(run, "steps").sort_values("step")["loss"].tolist()


def test_scale_tap_records_the_sum_of_every_micro_batch_loss_bit_identically(tmp_path):
    per_step, recorded, scaler = loop(tmp_path / "run")
    _, plain, _ = loop()
    assert all(torch.equal(a, b) for a, b in zip(recorded.parameters(), plain.parameters()))
    # float64 sum of the float32 losses, recorded as float32
    expected = [float(torch.tensor(math.fsum(s), dtype=torch.float32)) for s in per_step]
    assert _losses(tmp_path / "run") == pytest.approx(expected, rel=1e-7)
    assert "scale" not in scaler.__dict__  # close() restored the class's method


def test_a_nan_in_an_earlier_micro_batch_wins_over_the_finite_loss_passed(tmp_path):
    per_step, _, _ = loop(tmp_path / "run", pass_loss=True, nan_micro_batch=2)
    losses = _losses(tmp_path / "run")
    # Step 1's first micro-batch was NaN, its last (the one passed) finite.
    assert math.isfinite(per_step[1][1]) and math.isnan(losses[1])
    # Otherwise the loss passed wins: the last micro-batch's, as before.
    assert losses[0] == pytest.approx(per_step[0][1], rel=1e-7)
    assert losses[2] == pytest.approx(per_step[2][1], rel=1e-7)


def test_without_a_scaler_the_mean_of_the_losses_the_model_returns_is_captured(tmp_path):
    per_step, _, _ = loop(tmp_path / "run", scaler=False)
    # The model returns ACCUM * (the loss backpropagated); the mean of its
    # micro-batches' losses, as a replay computes it.
    assert _losses(tmp_path / "run") == pytest.approx([math.fsum(ACCUM * v for v in s) / ACCUM
                                                       for s in per_step], rel=1e-6)


def test_a_disabled_scaler_still_hands_over_every_loss(tmp_path):
    """nanoGPT's bf16 path scales through GradScaler(enabled=False)."""
    model = LossNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    passed = []
    # Its own loop: nanoGPT's, which backpropagates loss / ACCUM and passes rec.step() the undivided loss.
    with AmpRecorder(tmp_path / "run", model, optimizer=opt, scaler=scaler, bundles=False) as rec:
        for i, (x, y) in enumerate(_data()[:4]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x * math.nan if i == 2 else x, y)
            scaler.scale(loss / ACCUM).backward()
            if i % ACCUM:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                rec.step(loss)
                passed.append(loss.item())
    losses = _losses(tmp_path / "run")
    # Micro-batch 2 opens step 1; the loss passed, micro-batch 3's, was finite.
    assert all(math.isfinite(v) for v in passed)
    assert math.isfinite(losses[0]) and math.isnan(losses[1])
    assert "scale" not in scaler.__dict__


def test_capture_loss_off_leaves_an_unpassed_loss_null(tmp_path):
    loop(tmp_path / "run", capture_loss=False)
    assert all(v is None or math.isnan(v) for v in _losses(tmp_path / "run"))


def _loss_dtypes(run):
    return read_table(run, "steps").sort_values("step")["loss_dtype"].tolist()


@pytest.mark.parametrize("cast", [torch.float16, torch.float32])
def test_loss_dtype_is_the_backpropagated_loss_own_dtype(tmp_path, cast):
    """The step's recorded loss is combined in float32 at least; `loss_dtype`
    is the dtype of the loss that went through the scaler (its gradient is
    the scale in that dtype)."""
    train(LossNet(), _data()[:2], recorder=recorder_at(tmp_path / "run"), scaler={"init_scale": 2.0 ** 8},
          loss_fn=lambda model, x, y, step, accumulate: model(x, y)[1].to(cast), pass_loss=False)
    assert _loss_dtypes(tmp_path / "run") == [str(cast).removeprefix("torch.")] * 2
    assert read_table(tmp_path / "run", "steps")["loss"].notna().all()


def test_loss_dtype_is_null_when_no_loss_tensor_was_seen(tmp_path):
    loop(tmp_path / "run", capture_loss=False)
    assert read_table(tmp_path / "run", "steps")["loss_dtype"].isna().all()


def test_add_loss_feeds_the_step_loss(tmp_path):
    model = nn.Linear(2, 1)
    with AmpRecorder(tmp_path / "run", model, capture_loss=False, bundles=False) as rec:
        rec.add_loss(torch.tensor(0.25))
        rec.add_loss(torch.tensor(0.5))
        rec.step()
        rec.add_loss(torch.tensor(math.inf))
        rec.step(torch.tensor(1.0))
    assert _losses(tmp_path / "run") == [0.75, math.inf]


def test_find_loss_takes_the_loss_a_model_returns():
    loss = torch.tensor(1.0, requires_grad=True) * 2
    logits = torch.ones(2, 3, requires_grad=True) * 2
    assert find_loss({"loss": loss, "logits": logits}) is loss
    assert find_loss((logits, loss)) is loss
    assert find_loss(type("Out", (), {"loss": loss})()) is loss
    assert find_loss((loss, loss * 2)) is loss          # the first, as HF's Trainer takes it
    assert find_loss((logits, loss, loss * 2)) is None  # two candidates, none first: ambiguous
    assert find_loss(logits) is None
    assert find_loss((torch.ones(1, 1, requires_grad=True) * 2,)) is None  # a prediction of one sample


def test_the_output_tap_takes_no_loss_without_a_gradient(tmp_path):
    """A loss the model detached trains nothing: the tap leaves the step's
    loss to what `rec.step()` is given (here nothing: null)."""
    model = ReturnsOutputs(lambda logits, loss, aux: {"loss": loss.detach(), "logits": logits})
    recorded = _recorded_loss(tmp_path / "run", model)
    assert recorded is None or math.isnan(recorded)


@dataclass
class CausalLMOutput:  # Hugging Face's ModelOutput as a dataclass
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class ReturnsOutputs(nn.Module):
    """Returns `shape(logits, loss, aux)`: a loss and a second 0-d value
    (an auxiliary loss) computed from a linear layer's logits."""

    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)
        self.shape = shape

    def forward(self, x):
        logits = self.fc(x)
        return self.shape(logits, (logits ** 2).mean(), logits.abs().mean() * 0.01)


OUTPUT_SHAPES = {  # name -> (outputs from logits, loss, aux; what the loss is)
    "loss itself": (lambda logits, loss, aux: loss, "loss"),
    "dict with loss": (lambda logits, loss, aux: {"loss": loss, "logits": logits}, "loss"),
    "dict without loss": (lambda logits, loss, aux: OrderedDict(logits=logits), None),
    "ModelOutput dataclass": (lambda logits, loss, aux: CausalLMOutput(logits, loss), "loss"),
    "ModelOutput without labels": (lambda logits, loss, aux: CausalLMOutput(logits), None),
    "namedtuple": (lambda logits, loss, aux: Pair(logits, loss), "loss"),
    "tuple with one 0-d tensor": (lambda logits, loss, aux: (logits, loss), "loss"),
    "tuple with two 0-d tensors, loss first": (lambda logits, loss, aux: (loss, aux, logits), "loss"),
    "tuple with two 0-d tensors, neither first": (lambda logits, loss, aux: (logits, loss, aux), None),
    "no loss": (lambda logits, loss, aux: logits, None),
}
Pair = namedtuple("Pair", "logits loss")


def _recorded_loss(run, model):
    """The recorded loss of one step of `model` under the real recorder
    (no scaler and no loss passed: the loss comes from the outputs)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with AmpRecorder(run, model, bundles=False) as rec:
        model(x)
        rec.step()
    return _losses(run)[0]


@pytest.mark.parametrize("name", OUTPUT_SHAPES)
def test_the_tap_and_the_replay_take_the_same_loss(tmp_path, name):
    from amp_postmortem.replaying.outputs import find_loss as replay_find_loss
    shape, expected = OUTPUT_SHAPES[name]
    model = ReturnsOutputs(shape)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    logits = model.fc(x)
    loss = (logits ** 2).mean()
    replayed = replay_find_loss(model(x))
    recorded = _recorded_loss(tmp_path / "run", model)
    if expected is None:
        assert replayed is None and (recorded is None or math.isnan(recorded))
    else:
        assert torch.equal(replayed, loss)
        assert recorded == pytest.approx(float(loss.detach()), rel=1e-6)  # recorded as float32


def test_unwrap_optimizer_reaches_the_torch_optimizer_under_wrappers():
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)

    class Wrapper:  # Accelerate's AcceleratedOptimizer keeps it in .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    class Private:  # Lightning's LightningOptimizer keeps it in ._optimizer
        def __init__(self, inner):
            self._optimizer = inner

        def __getattr__(self, name):  # ... and forwards what it lacks
            return getattr(self._optimizer, name)

    assert unwrap_optimizer(Wrapper(Private(opt))) is opt
    assert unwrap_optimizer(opt) is opt
    odd = object()
    assert unwrap_optimizer(odd) is odd
