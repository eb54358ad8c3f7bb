"""Runs for the advice tests (instability, verified remedies, tied weights),
recorded once per test session by the real recorder on the CPU (float16 CPU
autocast, `torch.amp.GradScaler("cpu")`), each named after its fault:

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


def record_gpt(path, *, amp: bool, steps: int = GPT_STEPS, lr: float = GPT_LR):
    from recorders import AmpRecorder
    model = tied_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    with AmpRecorder(path, model, optimizer=opt, scaler=scaler if amp else None, full_every=1) as rec:
        for step in range(steps):
            idx, target = gpt_batch(step)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                logits = model(idx)
            loss = nn.functional.cross_entropy(logits.float().view(-1, VOCAB), target.view(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.step(loss)
        rec.flush()
        assert rec.enabled, f"the recorder failed: {rec._failure!r}"
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
