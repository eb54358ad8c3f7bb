"""Runs for the advice tests (instability, verified remedies, tied weights),
recorded once per test session by the real recorder on the CPU, trained
through `tiny_models.train` (float16 CPU autocast,
`torch.amp.GradScaler("cpu")`), each named after its fault:

- `diverging_gpt_run`: a tiny GPT with tied token embedding and output
  projection, AdamW, gradient clipping and a far too high learning rate: it
  diverges, in float16 and in float32 alike (`diverging_gpt_fp32_run`, its
  twin without autocast);
- `fp32_module_run`: a model whose one module overflows float16 in the
  forward: keeping that module in float32 saves every step;
- `lower_scale_run`: a model whose weight gradients overflow float16 at the
  recorded loss scale: a lower scale saves every step.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

VOCAB, BLOCK, D = 32, 8, 16
GPT_STEPS = 16
GPT_LR = 3.0


class TiedGPT(nn.Module):
    """Embedding, one pre-norm MLP block, and an output projection whose
    weight IS the embedding's (tied, as GPT-2 does)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(BLOCK, D)
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        h = h + self.proj(torch.relu(self.fc(self.ln(h))))
        return self.lm_head(self.ln_f(h))


def tied_gpt():
    torch.manual_seed(0)
    return TiedGPT()


def gpt_batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (8, BLOCK), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def record_gpt(path, *, amp: bool, steps: int = GPT_STEPS, lr: float = GPT_LR, recorder_options=None):
    from tiny_models import recorder_at, train
    model = tied_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)

    def cross_entropy(model, idx, target, step, accumulate):
        logits = model(idx)
        with torch.autocast("cpu", enabled=False):  # the loss outside autocast, as the job wrote it
            return nn.functional.cross_entropy(logits.float().view(-1, VOCAB), target.view(-1))

    def clip(step, model):
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    options = recorder_options or {"full_every": 1}
    rec = train(model, [gpt_batch(step) for step in range(steps)], recorder=recorder_at(path, **options),
                optimizer=opt, scaler=scaler if amp else None, dtype=torch.float16 if amp else None,
                loss_fn=cross_entropy, before_update=clip, close=False).rec
    rec.flush()
    assert rec.enabled, f"the recorder failed: {rec.failure!r}"
    rec.close()
    return Path(path)


_ROOT = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="advice-runs-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


@functools.lru_cache(maxsize=None)
def diverging_gpt_run() -> Path:
    return record_gpt(_root() / "diverging_tied_gpt_fp16", amp=True)


@functools.lru_cache(maxsize=None)
def diverging_gpt_fp32_run() -> Path:
    return record_gpt(_root() / "diverging_tied_gpt_fp32", amp=False)


# ------------------------------------------------- one-module and scale jobs
D_IN, D_HID = 4, 8
BRANCH_BATCH = 16
SPIKE_GAIN = 4000.0      # x * 4000 overflows float16 (65504) for |x| > 16
HOT = 100.0              # a hot half of the batch drives its branch's |x| far above 16


class Spike(nn.Module):
    """(4000 x) / 4000: the identity, except that the product overflows
    float16 for |x| > 16 (its gradient passes unchanged, so nothing else in
    the model underflows)."""

    def forward(self, x):
        return (x * SPIKE_GAIN) / SPIKE_GAIN


class BranchNet(nn.Module):
    """Two branches, each on half the features: a hot first half overflows
    `spike_a`, a hot second half `spike_b`."""

    def __init__(self):
        super().__init__()
        self.lin_a = nn.Linear(D_IN, D_HID)
        self.lin_b = nn.Linear(D_IN, D_HID)
        self.spike_a = Spike()
        self.spike_b = Spike()
        self.head = nn.Linear(2 * D_HID, 1)

    def forward(self, x):
        a = self.spike_a(self.lin_a(x[:, :D_IN]))
        b = self.spike_b(self.lin_b(x[:, D_IN:]))
        return self.head(torch.cat([a, b], dim=-1))


def branch_net():
    torch.manual_seed(0)
    return BranchNet()


def branch_batch(step: int, hot: dict):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BRANCH_BATCH, 2 * D_IN, generator=g)
    y = torch.randn(BRANCH_BATCH, 1, generator=g)
    half = hot.get(step)
    if half == "a":
        x[:, :D_IN] *= HOT
    elif half == "b":
        x[:, D_IN:] *= HOT
    return x, y


def _mse(model, x, y, step, accumulate):
    return ((model(x).float() - y) ** 2).mean()


def record_branch(path, *, hot: dict, steps: int = 5, bundle_steps=(), init_scale=2.0 ** 8):
    from tiny_models import recorder_at, train
    rec = train(branch_net(), [branch_batch(step, hot) for step in range(steps)], lr=0.01,
                recorder=recorder_at(path, full_every=1, bundle_steps=tuple(bundle_steps)),
                scaler={"init_scale": init_scale, "growth_interval": 10 ** 6}, loss_fn=_mse, close=False).rec
    rec.flush()
    assert rec.enabled, f"the recorder failed: {rec.failure!r}"
    rec.close()
    return Path(path)


FP32_MODULE_STEPS = (1, 3)   # spike_a overflows at both: keep_fp32(spike_a) saves them
MOVING_STEPS = {1: "a", 3: "b"}  # spike_a at step 1, spike_b at step 3: one fix saves one


@functools.lru_cache(maxsize=None)
def fp32_module_run() -> Path:
    return record_branch(_root() / "spike_a_overflows_forward", hot={s: "a" for s in FP32_MODULE_STEPS},
                         bundle_steps=FP32_MODULE_STEPS)


@functools.lru_cache(maxsize=None)
def moving_overflow_run() -> Path:
    return record_branch(_root() / "spike_a_then_spike_b_overflow", hot=MOVING_STEPS, bundle_steps=tuple(MOVING_STEPS))


class WideHead(nn.Module):
    """A linear model whose weight gradient is large: at a high loss scale the
    float16 weight-gradient matmul overflows while every module's output
    gradient still fits."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.inp(x))


def wide_head():
    torch.manual_seed(0)
    return WideHead()


LOWER_SCALE_BUNDLES = (0, 2)


@functools.lru_cache(maxsize=None)
def lower_scale_run() -> Path:
    """Large inputs and a batch-summed weight gradient far above the
    module gradients: at the recorded scale 2^8 `out`'s float16
    weight-gradient matmul overflows while every module's output gradient
    fits; the scaler backs off until a lower scale saves the steps."""
    from tiny_models import recorder_at, train
    path = _root() / "weight_gradient_overflow_at_high_scale"

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BRANCH_BATCH, D_IN, generator=g) * 30.0
        return x, torch.randn(BRANCH_BATCH, 1, generator=g) * 30.0

    rec = train(wide_head(), [batch(step) for step in range(8)], lr=0.0,
                recorder=recorder_at(path, full_every=1, bundle_steps=LOWER_SCALE_BUNDLES),
                scaler={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6}, loss_fn=_mse, close=False).rec
    rec.flush()
    rec.close()
    return Path(path)


class RootMatmul(nn.Module):
    """The model's own forward multiplies by its own weight (no submodule
    that keep_fp32 could wrap): with inputs this large the float16 matmul
    overflows; bfloat16's range holds it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_IN, D_HID))
        self.head = nn.Linear(D_HID, 1)

    def forward(self, x):
        return self.head((x @ self.w) * 1e-3)


def root_matmul():
    torch.manual_seed(0)
    return RootMatmul()


@functools.lru_cache(maxsize=None)
def root_matmul_run() -> Path:
    from tiny_models import recorder_at, train
    path = _root() / "root_matmul_overflows_float16"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BRANCH_BATCH, D_IN, generator=g) * 1e5
    y = torch.randn(BRANCH_BATCH, 1, generator=g)
    rec = train(root_matmul(), [(x, y)], lr=0.0, recorder=recorder_at(path, full_every=1),
                scaler={"init_scale": 2.0 ** 8}, loss_fn=_mse, close=False).rec
    rec.flush()
    rec.close()
    return Path(path)
