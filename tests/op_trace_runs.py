"""Runs for the op-trace tests, recorded once per test session by the real
recorder on tiny CPU models (float16 CPU autocast, a GradScaler), each with
one op-level fault planted on a line marked `# PLANTED`: the tests find
that line with `inspect` and expect the replay to name it. Every fault is
far past float16's limit (65504), so no CPU kernel's rounding decides it."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn

from whatif_runs import _root, record

D_IN, D = 4, 16


class ExpGate(nn.Module):
    """exp of a float16 activation near 50: exp overflows float16 past 11.1."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D)

    def forward(self, x):
        h = self.fc(x)
        return torch.exp(h)  # PLANTED


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = ExpGate()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.gate(x))


class ExpNormGate(ExpGate):
    """A hand-written softmax without the max subtracted: exp overflows
    float16 past 11.1, while the normalised result is in (0, 1]."""

    def forward(self, x):
        h = self.fc(x)
        e = torch.exp(h)  # PLANTED
        return e / e.sum(-1, keepdim=True)


class ExpNormNet(ExpNet):
    def __init__(self):
        super().__init__()
        self.gate = ExpNormGate()


class HandNorm(nn.Module):
    """A hand-written RMS norm whose `x * x` overflows float16 for |x| > 256."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x):
        var = (x * x).mean(-1, keepdim=True)  # PLANTED
        return self.weight * x * torch.rsqrt(var + 1e-6)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.norm = HandNorm()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


class RawAttention(nn.Module):
    """Attention without the 1/sqrt(d) scale: q·kᵀ of activations near 300
    over d=16 is about 10^6, past float16's range."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2)  # PLANTED
        return torch.softmax(scores, dim=-1) @ v


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([nn.Identity(), RawAttention()])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class HalfLoss(nn.Module):
    """Returns its loss, a sum of squares taken in float16: every square fits,
    their sum over the batch (about 10^6) does not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D)

    def forward(self, x, y):
        out = self.fc(x)
        d = out - y.to(out.dtype)
        return (d * d).sum()  # PLANTED


def planted_line(cls) -> int:
    """The line number of the `# PLANTED` line in `cls`'s source."""
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if "# PLANTED" in line)


def _batch(step: int, *, d_out: int = 1):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, D_IN, generator=g), torch.randn(16, 4, d_out, generator=g)


def _scaled(model, scale: dict):
    with torch.no_grad():
        for name, factor in scale.items():
            model.get_submodule(name).weight.fill_(factor)
            model.get_submodule(name).bias.zero_()
    return model


def exp_model():
    torch.manual_seed(0)
    return _scaled(ExpNet(), {"gate.fc": 6.0})          # |h| ~ 24 * |x|: exp far past 65504


def exp_norm_model():
    torch.manual_seed(0)
    return _scaled(ExpNormNet(), {"gate.fc": 6.0})


def norm_model():
    torch.manual_seed(0)
    return _scaled(NormNet(), {"embed": 200.0})         # |x| ~ 800 * |input|


def attn_model():
    torch.manual_seed(0)
    return _scaled(AttnNet(), {"embed": 1.0, "blocks.1.q": 20.0, "blocks.1.k": 20.0})


def half_loss_model():
    torch.manual_seed(0)
    return _scaled(HalfLoss(), {"fc": 20.0})          # |d| ~ 100 at most: squares fit, their sum not


def _model_loss(model, x, y, step, accumulate):
    return model(x, y)


@functools.lru_cache(maxsize=None)
def exp_run():
    return record(_root() / "exp_overflows", exp_model(), steps=1, batch_fn=_batch, bundle_steps=(0,))


@functools.lru_cache(maxsize=None)
def exp_norm_run():
    return record(_root() / "exp_normalised_overflows", exp_norm_model(), steps=1, batch_fn=_batch,
                  bundle_steps=(0,))


@functools.lru_cache(maxsize=None)
def norm_run():
    return record(_root() / "norm_square_overflows", norm_model(), steps=1, batch_fn=_batch, bundle_steps=(0,))


@functools.lru_cache(maxsize=None)
def attn_run():
    return record(_root() / "unscaled_scores_overflow", attn_model(), steps=1, batch_fn=_batch, bundle_steps=(0,))


@functools.lru_cache(maxsize=None)
def half_loss_run():
    from tiny_models import recorder_at, train
    path = _root() / "float16_loss_overflows"
    rec = train(half_loss_model(), [_batch(0, d_out=D)], recorder=recorder_at(path, bundle_steps=(0,)),
                loss_fn=_model_loss,
                scaler={"init_scale": 2.0 ** 8}, lr=0.0, close=False).rec
    try:
        rec.flush()
        assert rec.enabled, f"the recorder failed: {rec.failure!r}"
    finally:
        rec.close()
    return path
