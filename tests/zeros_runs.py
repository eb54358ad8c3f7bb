"""Runs for the tests of exact zeros and of dated underflow (`ranges`,
`summary`, the estimated scale window), recorded once per test session by
the real recorder on a tiny token model (float16 CPU autocast,
`torch.amp.GradScaler("cpu")` at a fixed scale), each named after what is
planted in it:

- `masked_tokens_run`: structural zeros. Only the first quarter of the
  vocabulary occurs (the embedding rows of the other tokens get exactly
  zero gradient), 5 of every 8 positions are padding that the loss ignores
  (their gradient is exactly zero in every module), and a ReLU masks more.
  The scale (2^3 on a loss multiplied by 2^-5, the head's weights scaled
  by 0.1) puts the surviving
  gradients just above float16's normal limit, where a rule that counts
  zeros beside small values as flushed took the masks for underflow.
- `flushed_run`: real underflow, planted: the same model without padding,
  its loss multiplied by 2^-18 at scale 2^8, so that the gradients sit in
  float16's subnormal range and straddle its flush edge 2^-25.
- `warmup_run`: an underflow that stops: the loss is multiplied by 2^-18
  for the first `WARMUP_STEPS` steps (a warm-up of the loss weight), then
  by 1. The full tier is recorded during the warm-up and at a few steps
  after it (as a recorder's first burst and `full_every` do); `stale_run`
  has the full tier during the warm-up only.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, BATCH, SEQ = 64, 16, 32, 8, 8
PRESENT = VOCAB // 4        # tokens 0..15 occur; 16..63 never do
VALID = 3                   # positions 0..2 of each sequence count; 3..7 are padding
PAD = -100
MASKED_SHARE = (SEQ - VALID) / SEQ   # 0.625: the padding's share of every per-position gradient
PLANT = 2.0 ** -18          # the loss factor that makes the gradients underflow at scale 2^8
SCALE = 2.0 ** 8            # the fixed loss scale of the flushed and warm-up runs
WARMUP_STEPS = 8
WARMUP_RUN_STEPS = 100
WARMUP_FULL_STEPS = tuple(range(0, 10)) + (50, 80, 99)

_ROOT = Path(tempfile.mkdtemp(prefix="amp-postmortem-zeros-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


class TokenNet(nn.Module):
    """Per-position next-token scores: embedding, ReLU MLP, head (no mixing
    between positions, so a padded position's gradient is zero everywhere)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, HIDDEN)
        self.act = nn.ReLU()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.head(self.act(self.fc(self.embed(tokens))))


def _batches(steps: int, *, padded: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, PRESENT, (BATCH, SEQ), generator=gen)
        target = torch.randint(0, PRESENT, (BATCH, SEQ), generator=gen)
        if padded:
            target[:, VALID:] = PAD
        out.append((tokens, target))
    return out


def _loss(factor):
    def loss_fn(model, tokens, target, step, accumulate):
        logits = model(tokens).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD) * factor(step)
    return loss_fn


def record(path, *, steps: int, padded: bool, init_scale: float, factor=lambda step: 1.0, head_gain=1.0,
           schedule=None, full_every: int = 1):
    from recorders import AmpRecorder
    from tiny_models import train

    torch.manual_seed(0)
    model = TokenNet()
    with torch.no_grad():
        model.head.weight.mul_(head_gain)
    options = {"schedule": schedule} if schedule is not None else {"full_every": full_every}
    train(model, _batches(steps, padded=padded), loss_fn=_loss(factor), lr=0.1,
          recorder=lambda m, opt, sc: AmpRecorder(path, m, optimizer=opt, scaler=sc, **options),
          scaler={"init_scale": init_scale, "growth_interval": 10 ** 9})
    return Path(path)


MASKED_SCALE = 2.0 ** 3
MASKED_FACTOR = 2.0 ** -5   # with the scale: the gradients of 2^-2 times the loss's


def masked_tokens(path, init_scale=MASKED_SCALE) -> Path:
    return record(path, steps=12, padded=True, init_scale=init_scale, head_gain=0.1,
                  factor=lambda step: MASKED_FACTOR)


@functools.lru_cache(maxsize=None)
def masked_tokens_run() -> Path:
    return masked_tokens(_ROOT / "masked_tokens")


@functools.lru_cache(maxsize=None)
def flushed_run() -> Path:
    return record(_ROOT / "flushed", steps=12, padded=False, init_scale=SCALE, factor=lambda step: PLANT)


def full_at(steps):
    """A schedule with the full tier at `steps` only, the cheap tier elsewhere."""
    from recorders.schedule import RecordSchedule

    class FullAt(RecordSchedule):
        def tier(self, step):
            return "full" if step in steps else "cheap"
    return FullAt(full_every=0, full_after_event=0)


def _warmup(path, full_steps) -> Path:
    return record(path, steps=WARMUP_RUN_STEPS, padded=False, init_scale=SCALE,
                  factor=lambda step: PLANT if step < WARMUP_STEPS else 1.0, schedule=full_at(full_steps))


@functools.lru_cache(maxsize=None)
def warmup_run() -> Path:
    return _warmup(_ROOT / "warmup", WARMUP_FULL_STEPS)


@functools.lru_cache(maxsize=None)
def stale_run() -> Path:
    """`warmup_run` with the full tier during the warm-up only (steps 0-9)."""
    return _warmup(_ROOT / "stale", tuple(range(10)))
