"""Runs whose loss is float16 (or float32), for the loss-scale window's loss
constraint, recorded once per test session by the real recorder on the CPU
(float16 CPU autocast, `torch.amp.GradScaler("cpu")`):

- `half_loss_run`: the loss is computed outside the model and made float16
  explicitly (`.half()`: planted, not left to which ops CPU autocast keeps
  in float16). Under GradScaler the backward's first gradient is the scale
  itself in float16: at 2^16 (65536 > 65504) and above it is Inf on every
  step, whatever the gradients of the model are;
- `float_loss_run`: the same job with a float32 loss: no such limit;
- `half_loss_inside_run`: the float16 loss computed inside the model's
  forward (`LossNet`), so a replay starts from it;
- `low_scale_half_loss_run`: the float16-loss job at a scale so low its
  gradients underflow, for which `recommend` proposes settings.

`train` is the truth: the same job re-run (no recorder) at a fixed scale,
one fresh scaler per step, and which steps the scaler skipped.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

D_IN, BATCH, STEPS = 8, 16, 4
RECORDED_SCALE = 2.0 ** 8
BUNDLE_STEPS = (1,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 16)
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


class LossNet(nn.Module):
    """`Net` with its float16 loss computed inside the forward."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x):
        return half_loss(self.net(x), 0)


def net():
    torch.manual_seed(0)
    return Net()


def loss_net():
    torch.manual_seed(0)
    return LossNet()


def half_loss(output, micro_batch=0):
    """The job's loss, float16 whatever autocast does (the `--loss-fn`)."""
    return (output.float() ** 2).mean().half()


def float_loss(output, micro_batch=0):
    return (output.float() ** 2).mean()


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(step))


def _loss_of(inside: bool, half: bool):
    if inside:
        return lambda model, x: model(x)
    fn = half_loss if half else float_loss
    return lambda model, x: fn(model(x))


def _train(model, loss_of, scaler, steps, optimizer=None, recorder=None):
    """The job through the tests' loop (SGD at 0.01, float16 CPU autocast)."""
    import tiny_models
    return tiny_models.train(model, [(batch(step), None) for step in steps], recorder=recorder, lr=0.01,
                             optimizer=optimizer, scaler=scaler, close=False,
                             loss_fn=lambda model, x, y, step, accumulate: loss_of(model, x))


def record(path, *, half: bool = True, inside: bool = False, init_scale: float = RECORDED_SCALE,
           steps: int = STEPS) -> Path:
    from recorders import AmpRecorder
    model = loss_net() if inside else net()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10 ** 6)
    rec = AmpRecorder(path, model, scaler=scaler, full_every=1, bundle_steps=BUNDLE_STEPS)
    _train(model, _loss_of(inside, half), scaler, range(steps), recorder=lambda m, o, s: rec)
    rec.flush()
    rec.close()
    return Path(path)


def train(init_scale: float, *, half: bool = True, inside: bool = False) -> list[bool]:
    """The job re-run at the fixed scale `init_scale` (a fresh scaler each
    step: no backoff, no growth): which steps were skipped (the scale after
    the step below `init_scale`)."""
    model = loss_net() if inside else net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return [_train(model, _loss_of(inside, half), {"init_scale": init_scale, "growth_interval": 10 ** 6},
                   [step], optimizer=opt).scales[0] < init_scale for step in range(STEPS)]


@functools.lru_cache(maxsize=None)
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="amp_loss_dtype_runs_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.lru_cache(maxsize=None)
def half_loss_run() -> Path:
    return record(_root() / "float16_loss_outside_the_model", half=True)


@functools.lru_cache(maxsize=None)
def float_loss_run() -> Path:
    return record(_root() / "float32_loss_outside_the_model", half=False)


@functools.lru_cache(maxsize=None)
def half_loss_inside_run() -> Path:
    return record(_root() / "float16_loss_inside_the_model", half=True, inside=True)


@functools.lru_cache(maxsize=None)
def low_scale_half_loss_run() -> Path:
    """The float16-loss job at a scale far too low (its gradients
    underflow): `recommend` proposes GradScaler settings."""
    return record(_root() / "float16_loss_scale_too_low", half=True, init_scale=2.0 ** -12)
