"""Runs for the counterfactual-window tests (`rerun`, the precision verdict,
`fix` over the window), recorded once per test session by the real recorder
on tiny CPU models under float16 CPU autocast and `torch.amp.GradScaler`,
each named after the fault planted in it. The models return their loss
(forward(x, y)), so a re-run needs no loss function.

The truth of each story comes from training the same job again with the
remedy (`train(..., autocast=False)`), never from the code under test.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

WINDOW_STEPS = 4
SHIFT_STEP = 6          # precision run: the batches from this step on overflow float16 inside `amp`
STEPS = 12
AMP_GAIN = 1e4          # `amp` multiplies by it and divides back: float16 overflows above 6.55


class Amplify(nn.Module):
    """x * 1e4 / 1e4: the identity in float32; Inf in float16 once |x| > 6.55."""

    def forward(self, x):
        return (x * AMP_GAIN) / AMP_GAIN


class GainNet(nn.Module):
    """fc1 -> amp -> fc2, MSE loss returned by the model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.amp = Amplify()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x, y):
        return ((self.fc2(self.amp(self.fc1(x))).float() - y) ** 2).mean()


class LinearNet(nn.Module):
    """One linear layer and its MSE loss: with lr 1e8 the weights run away
    in any precision."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).float() - y) ** 2).mean()


def gain_net():
    torch.manual_seed(0)
    return GainNet()


def linear_net():
    torch.manual_seed(0)
    return LinearNet()


def precision_batch(step: int):
    """Small inputs, then (from SHIFT_STEP) inputs 200x larger: fc1's
    outputs exceed 6.55, which `amp` takes beyond float16's range."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g) * (0.1 if step < SHIFT_STEP else 20.0)
    return x, torch.randn(8, 1, generator=g)


def linear_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


PRECISION_LR = 1e-4
INSTABILITY_LR = 1e8


def train(model, batch, *, lr, steps=STEPS, autocast=True, recorder=None):
    """The job: SGD, float16 CPU autocast with a GradScaler (or float32
    without either). Returns the losses, one per step. With a recorder the
    windows restart at steps 0, 4, 8, ...: the precision run's holds steps
    4-10 (the failure at 6), the runaway's 0-5 (the failure at 1)."""
    import tiny_models

    def flush(step, rec):
        # The writer decides before the next step: the window restarts
        # every WINDOW_STEPS steps, as on a job whose writer keeps up.
        rec.flush()

    return tiny_models.train(model, [batch(step) for step in range(steps)], recorder=recorder, lr=lr,
                             dtype=torch.float16 if autocast else None,
                             scaler={"init_scale": 2.0 ** 8} if autocast else None,
                             loss_fn=lambda model, x, y, step, accumulate: model(x, y),
                             after_step=flush if recorder else None).losses


def record(path, model, batch, *, lr, window_steps=WINDOW_STEPS) -> Path:
    from recorders import AmpRecorder, BundlePolicy
    policy = BundlePolicy(window_steps=window_steps)
    train(model, batch, lr=lr, recorder=lambda m, o, s: AmpRecorder(path, m, optimizer=o, scaler=s, bundles=policy))
    return Path(path)


_ROOT = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="window-runs-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


@functools.lru_cache(maxsize=None)
def precision_run() -> Path:
    """float16 overflows inside `amp` from step SHIFT_STEP on; float32 is fine."""
    return record(_root() / "fp16_overflow_only", gain_net(), precision_batch, lr=PRECISION_LR)


@functools.lru_cache(maxsize=None)
def instability_run(window_steps: int = WINDOW_STEPS) -> Path:
    """lr 1e8 on a linear model: the weights run away in any precision."""
    return record(_root() / f"lr_1e8_window{window_steps}", linear_net(), linear_batch, lr=INSTABILITY_LR,
                  window_steps=window_steps)
