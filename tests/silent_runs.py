"""Runs for the tests of silent AMP failures (issue 42), recorded once per
test session by the real recorder on small transformers trained as users
write them, each fault planted by its real cause:

- `unscaled_run`: a 2-layer BERT classifier (transformers, built from a
  small config, random init) under float16 autocast with a bare
  `loss.backward()`: no GradScaler. `scaled_run`: the same job with the
  default `torch.amp.GradScaler("cpu")`. `fp32_run`: without autocast.
- `bf16_weights_run`: a small GPT-style language model (torch.nn) cast with
  `model.to(torch.bfloat16)` and trained by AdamW at lr 1e-5, no float32
  master weights. `bf16_weights_window_run`: the same job keeping a window
  of steps from its first, frozen there by its lost updates (and a bundle
  at step BUNDLE_STEP); `bf16_weights_unasked_window_run`: the same with
  no `save_bundle()`. `bf16_autocast_run`: the same model in float32 under
  bfloat16 autocast, at a learning rate that trains it;
  `quiet_window_runs`: it and the float32 job, keeping windows.
- `unscaled_bundle_run`, `scaled_bundle_run`: the classifier jobs keeping
  step BUNDLE_STEP as a replay bundle.
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

_ROOT = Path(tempfile.mkdtemp(prefix="amp-postmortem-silent-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)

VOCAB, SEQ, BATCH, HIDDEN = 64, 16, 32, 32
CLS_STEPS, LM_STEPS = 12, 12
BUNDLE_STEP = 6      # the step a job keeps (rec.save_bundle()): a bundle, and a window where one is kept
WINDOW_STEPS = 8
QUIET_STEPS = 6      # a healthy job keeping windows: any event would come at its first steps


def bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=2, attn_implementation="eager")
    return BertForSequenceClassification(cfg)


def cls_batches(steps: int):
    """Does token 7 occur in the sequence? The [CLS] position (0) answers."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
        label = tokens[:, 1:].eq(7).any(1).long()
        tokens[:, 0] = 0
        out.append((tokens, label))
    return out


def _record_classifier(path: Path, mode: str, *, bundle_step: int | None = None) -> Path:
    """`bundle_step`: the step whose replay bundle the job asks for
    (`rec.save_bundle()`, as a user does to keep one step for later)."""
    from tiny_models import recorder_at, train

    def ask(step, model, x):
        if step == bundle_step:
            recorder.save_bundle()

    def make(model, opt, sc):
        nonlocal recorder
        recorder = recorder_at(path, mode="every_step", full_every=3)(model, opt, sc)
        return recorder

    recorder = None
    model = bert_classifier()
    train(model, cls_batches(CLS_STEPS), recorder=make,
          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=mode == "scaled",
          dtype=None if mode == "fp32" else torch.float16, on_step=ask if bundle_step is not None else None,
          loss_fn=lambda model, tokens, label, step, accumulate: model(input_ids=tokens, labels=label).loss)
    return path


@functools.lru_cache(maxsize=None)
def unscaled_run() -> Path:
    return _record_classifier(_ROOT / "unscaled", "unscaled")


@functools.lru_cache(maxsize=None)
def unscaled_bundle_run() -> Path:
    """The unscaled job, its step BUNDLE_STEP kept as a replay bundle."""
    return _record_classifier(_ROOT / "unscaled_bundle", "unscaled", bundle_step=BUNDLE_STEP)


@functools.lru_cache(maxsize=None)
def scaled_bundle_run() -> Path:
    """The GradScaler job, its step BUNDLE_STEP kept as a replay bundle."""
    return _record_classifier(_ROOT / "scaled_bundle", "scaled", bundle_step=BUNDLE_STEP)


@functools.lru_cache(maxsize=None)
def scaled_run() -> Path:
    return _record_classifier(_ROOT / "scaled", "scaled")


@functools.lru_cache(maxsize=None)
def fp32_run() -> Path:
    return _record_classifier(_ROOT / "fp32", "fp32")


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A 2-block causal language model (GPT-style, pre-norm, tied head)."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens, targets=None):
        n = tokens.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.tok(tokens) + self.pos.weight[:n]
        for b in self.blocks:
            x = b(x, mask)
        logits = self.ln(x) @ self.tok.weight.t()
        if targets is None:
            return logits
        # nanoGPT's way: given the targets, the model returns the loss (a re-run finds it there).
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def lm_batches(steps: int):
    """Sequences that count up modulo the vocabulary from a random start: learnable."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        out.append((start + torch.arange(SEQ + 1)) % VOCAB)
    return out


def lm_loss(model, seq):
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def _record_lm(path: Path, *, bf16_weights: bool, lr: float, window_steps: int = 0,
               ask_step: int | None = BUNDLE_STEP, autocast: bool = True, steps: int = LM_STEPS) -> Path:
    """`window_steps`: keep a window of steps (`AmpRecorder(...,
    window_steps=K)`), the job asking for step `ask_step`
    (`rec.save_bundle()`; None: it asks for none, and only a window event
    freezes a window); its loss is then the model's own (`model(tokens,
    targets)`, as nanoGPT's), which a re-run finds. `autocast`: the float32
    model trains under bfloat16 autocast (False: in float32); `steps`: how
    many it trains."""
    from tiny_models import recorder_at, train

    def make(model, opt, sc):
        nonlocal recorder
        options = {"window_steps": window_steps} if window_steps else {}
        recorder = recorder_at(path, mode="every_step", full_every=3, **options)(model, opt, sc)
        return recorder

    def ask(step, model, x):
        if step == ask_step:
            recorder.save_bundle()

    def loss(model, seq, _, step, accumulate):
        return model(seq[:, :-1], seq[:, 1:]) if window_steps else lm_loss(model, seq)

    recorder = None
    model = lm_model(bf16_weights)
    train(model, [(seq, None) for seq in lm_batches(steps)], recorder=make,
          optimizer=torch.optim.AdamW(model.parameters(), lr=lr), scaler=None,
          dtype=None if bf16_weights or not autocast else torch.bfloat16, loss_fn=loss,
          on_step=ask if window_steps and ask_step is not None else None,
          after_step=(lambda step, rec: rec.flush()) if window_steps else None)
    return path


def lm_model(bf16_weights: bool) -> TinyLM:
    """The job's model as it starts: seeded, cast to bfloat16 where the job casts it."""
    torch.manual_seed(0)
    model = TinyLM()
    return model.to(torch.bfloat16) if bf16_weights else model


@functools.lru_cache(maxsize=None)
def bf16_weights_run() -> Path:
    return _record_lm(_ROOT / "bf16_weights", bf16_weights=True, lr=1e-5)


@functools.lru_cache(maxsize=None)
def bf16_weights_window_run() -> Path:
    """The bfloat16-weights job, keeping a window of WINDOW_STEPS steps
    from its first step: frozen there by its lost updates (the request at
    BUNDLE_STEP falls inside it, and keeps a bundle)."""
    return _record_lm(_ROOT / "bf16_weights_window", bf16_weights=True, lr=1e-5, window_steps=WINDOW_STEPS)


@functools.lru_cache(maxsize=None)
def bf16_weights_unasked_window_run() -> Path:
    """The bfloat16-weights job with windows on and no `save_bundle()`:
    only its lost updates can freeze a window."""
    return _record_lm(_ROOT / "bf16_weights_unasked", bf16_weights=True, lr=1e-5, window_steps=WINDOW_STEPS,
                      ask_step=None)


@functools.lru_cache(maxsize=None)
def quiet_window_runs() -> dict:
    """Healthy jobs with windows on and no `save_bundle()`, QUIET_STEPS
    steps: the model in float32 without autocast, and under bfloat16
    autocast; by name."""
    return {name: _record_lm(_ROOT / f"{name}_window", bf16_weights=False, lr=1e-3, window_steps=WINDOW_STEPS,
                             ask_step=None, autocast=name == "bf16_autocast", steps=QUIET_STEPS)
            for name in ("fp32", "bf16_autocast")}


@functools.lru_cache(maxsize=None)
def bf16_autocast_run() -> Path:
    return _record_lm(_ROOT / "bf16_autocast", bf16_weights=False, lr=1e-3)
