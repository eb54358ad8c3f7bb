"""Runs for the what-if tests (fix, scale window, bisect, recommend),
recorded once per test session by the real recorder on tiny CPU models
(float16 CPU autocast, `torch.amp.GradScaler("cpu")`), each named after the
fault planted in it. Bundles are saved by the recorder's own triggers
(`nonfinite_loss`) or its `bundle_steps` option."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

BATCH, SEQ, D_IN, D = 16, 4, 4, 16
BAD_SAMPLES = (3, 11)       # samples of the bad batch holding huge values
BAD_STEP = 1                # the step whose batch holds them
HEALTHY_BUNDLE_STEP = 2
RECORDED_SCALE = 2.0 ** 8


class Scores(nn.Module):
    """softmax(q·kᵀ): overflows float16 when q and k are large."""

    def forward(self, q, k):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)


class AttnNet(nn.Module):
    """Single-head attention over a short sequence per sample."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.scores = Scores()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        return self.head(self.scores(self.q(h), self.k(h)) @ self.v(h))


class Spike(nn.Module):
    """softmax(4000 x): the product overflows float16 for |x| > 16."""

    def forward(self, x):
        return torch.softmax(x * 4000.0, dim=-1)


class TwoSpikes(nn.Module):
    """Two separate planted overflows: no single module kept in float32 helps."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.first = Spike()
        self.mid = nn.Linear(D, D)
        self.second = Spike()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.second(self.mid(self.first(self.embed(x)))))


class RootCancel(nn.Module):
    """The model's own forward divides by the difference of two nearly equal
    products: equal once rounded to float16 or bfloat16 (1/0 = Inf), apart in
    float32. Only the whole model in float32 avoids it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_IN, 2))
        with torch.no_grad():
            self.w[:, 1] = self.w[:, 0] * (1 + 1e-4)
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        h = x @ self.w
        return self.head(1.0 / (h[..., :1] - h[..., 1:]) * 1e-3)


def attn_overflow_model():
    torch.manual_seed(0)
    model = AttnNet()
    with torch.no_grad():
        model.embed.weight.mul_(1000.0)
    return model


def batch(step: int, *, bad_step=None, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(BATCH, SEQ, D_IN, generator=g)
    y = torch.randn(BATCH, SEQ, 1, generator=g)
    if step == bad_step:
        x[list(BAD_SAMPLES)] *= 1000.0
    return x, y


def record(path, model, *, steps, batch_fn=batch, init_scale=RECORDED_SCALE, lr=0.0, **recorder_kwargs):
    from tiny_models import recorder_at, train
    rec = train(model, [batch_fn(step) for step in range(steps)], recorder=recorder_at(path, **recorder_kwargs),
                scaler={"init_scale": init_scale, "growth_interval": 10 ** 6}, lr=lr, close=False).rec
    try:
        rec.flush()
        assert rec.enabled, f"the recorder failed: {rec.failure!r}"
    finally:
        rec.close()
    return Path(path)


_ROOT = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="whatif-runs-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


@functools.lru_cache(maxsize=None)
def attn_overflow_run() -> Path:
    """scores (q·kᵀ) overflows float16 at every step; bundle of step 0."""
    return record(_root() / "overflow_in_scores", attn_overflow_model(), steps=2)


@functools.lru_cache(maxsize=None)
def bad_samples_run() -> Path:
    """Healthy model; samples 3 and 11 of step 1's batch are 1000x too large."""
    torch.manual_seed(0)
    return record(_root() / "bad_samples_3_11", AttnNet(), steps=3,
                  batch_fn=functools.partial(batch, bad_step=BAD_STEP))


@functools.lru_cache(maxsize=None)
def healthy_run() -> Path:
    """Healthy model and data; a bundle of step 2 asked for up front."""
    torch.manual_seed(0)
    return record(_root() / "healthy", AttnNet(), steps=4, bundle_steps=(HEALTHY_BUNDLE_STEP,), full_every=1)


@functools.lru_cache(maxsize=None)
def two_spikes_run() -> Path:
    """`first` and `second` both overflow float16; bundle of step 0."""
    torch.manual_seed(0)
    model = TwoSpikes()
    with torch.no_grad():
        model.embed.weight.mul_(20.0)
        model.mid.weight.mul_(400.0)
    return record(_root() / "overflow_in_first_and_second", model, steps=1)


@functools.lru_cache(maxsize=None)
def root_cancel_run() -> Path:
    """RootCancel: non-finite in float16 and bfloat16 inside the root's own code."""
    torch.manual_seed(0)
    return record(_root() / "cancellation_in_root", RootCancel(), steps=1)


# ------------------------------------------------ a BatchNorm CNN
CNN_BATCH, CNN_BAD_SAMPLE = 8, 3


class BatchNormCNN(nn.Module):
    """A small image classifier's shape: BatchNorm2d after the convolution
    and BatchNorm1d on the pooled features, which a one-sample slice leaves
    one value per channel (torch raises in training)."""
    track_running_stats = True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, track_running_stats=self.track_running_stats)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 8)
        self.bn1 = nn.BatchNorm1d(8, track_running_stats=self.track_running_stats)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)
        return self.head(torch.relu(self.bn1(self.fc(h))))


class BatchNormCNNWithoutRunningStats(BatchNormCNN):
    track_running_stats = False


def cnn_batch(step: int, *, bad_step=None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(CNN_BATCH, 2, 4, 4, generator=g), torch.randn(CNN_BATCH, 1, generator=g)
    if step == bad_step:
        x[CNN_BAD_SAMPLE] *= 1e6   # beyond float16 (65504) as the convolution casts it: Inf
    return x, y


@functools.lru_cache(maxsize=None)
def batchnorm_bad_sample_run() -> Path:
    """BatchNormCNN; sample 3 of step 1's batch is 1e6x too large."""
    torch.manual_seed(0)
    return record(_root() / "batchnorm_bad_sample_3", BatchNormCNN(), steps=3,
                  batch_fn=functools.partial(cnn_batch, bad_step=1))


def _inf_conv(model):
    torch.manual_seed(0)
    with torch.no_grad():
        model.conv.weight[:, 0, 1, 1] = 1e6   # Inf once cast to float16: every sample's convolution
    return model


@functools.lru_cache(maxsize=None)
def batchnorm_inf_weight_run(running_stats: bool = True) -> Path:
    """The convolution's weight overflows float16 at every step (every
    sample fails, none passes to pair with); bundle of step 0."""
    torch.manual_seed(0)
    cls = BatchNormCNN if running_stats else BatchNormCNNWithoutRunningStats
    return record(_root() / f"batchnorm_inf_weight_{running_stats}", _inf_conv(cls()), steps=1,
                  batch_fn=cnn_batch)
