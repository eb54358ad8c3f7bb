"""The tiny models of the sample runs.

Every factory takes no argument and builds exactly the architecture its run
was recorded with, so that a replay can load the run's weights strictly:

    amp-postmortem replay sample_runs/attention_overflow --step N \\
        --model sample_runs/models.py:attention_overflow_gpt

The file imports only torch, so it can be loaded by path on any machine.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# The tiny GPT: a synthetic "repeat the first half" language task.
VOCAB = 64
BLOCK = 16
D_MODEL = 32
N_HEAD = 2
N_LAYER = 2

# The float-feature models (bad_batch, scale_collapse, fp16_layernorm).
FEATURES = 16
CLASSES = 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out as plain tensor code, as
    most training code does: q·kᵀ, the causal mask and the softmax happen
    inside this module, not in a child, so a NaN made here is first seen in
    `out_proj` with non-finite inputs."""

    def __init__(self, d_model: int, n_head: int, scale_logits: bool = True):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.scale_logits = scale_logits
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        # Under float16 autocast this matmul's result is float16: a logit
        # above 65504 is Inf, and softmax over a row holding Inf is NaN.
        logits = q @ k.transpose(-2, -1)
        if self.scale_logits:
            logits = logits * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(causal, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, c)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, scale_logits: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, scale_logits)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A pre-LayerNorm GPT: token and position embeddings, `N_LAYER` blocks,
    a final LayerNorm and a linear head returning logits."""

    def __init__(self, vocab: int = VOCAB, block: int = BLOCK, d_model: int = D_MODEL,
                 n_head: int = N_HEAD, n_layer: int = N_LAYER, scale_logits: bool = True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, scale_logits) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt() -> TinyGPT:
    """`healthy`: the GPT with the usual 1/sqrt(head_dim) logit scaling."""
    return TinyGPT()


def attention_overflow_gpt() -> TinyGPT:
    """`attention_overflow` and `fp32_baseline`: the GPT without the
    1/sqrt(head_dim) scaling of the attention logits."""
    return TinyGPT(scale_logits=False)


class FeatureMLP(nn.Module):
    """A classifier of float feature vectors: the inputs themselves are float
    tensors, so a NaN in the data reaches the model (token ids cannot)."""

    def __init__(self, features: int = FEATURES, hidden: int = 64, classes: int = CLASSES):
        super().__init__()
        self.in_proj = nn.Linear(features, hidden)
        self.act1 = nn.GELU()
        self.fc = nn.Linear(hidden, hidden)
        self.act2 = nn.GELU()
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc(self.act1(self.in_proj(x)))))


class MultiTaskMLP(nn.Module):
    """A shared trunk with a classification head and an auxiliary head that
    reconstructs the input features; returns both outputs as a dict."""

    def __init__(self, features: int = FEATURES, hidden: int = 64, classes: int = CLASSES):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                   nn.Linear(hidden, hidden), nn.GELU())
        self.cls_head = nn.Linear(hidden, classes)
        self.aux_head = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.trunk(x)
        return {"logits": self.cls_head(h), "reconstruction": self.aux_head(h)}


class Fp16LayerNorm(nn.Module):
    """A hand-written LayerNorm that computes its statistics in the input's
    dtype. Under float16 autocast its input is the float16 output of a
    Linear: (x - mean)**2 overflows to Inf once |x - mean| > 256, the
    variance is Inf and the whole row normalises to exactly 0 (x / Inf),
    silently. `nn.LayerNorm` accumulates in float32 and does not."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        centred = x - mean
        var = (centred * centred).mean(-1, keepdim=True)
        return centred / torch.sqrt(var + self.eps) * self.weight + self.bias


class NormMLP(nn.Module):
    """A classifier of raw float features: input projection, normalisation,
    two GELU layers and a head."""

    def __init__(self, norm: type = nn.LayerNorm, features: int = FEATURES, hidden: int = 64,
                 classes: int = CLASSES):
        super().__init__()
        self.in_proj = nn.Linear(features, hidden)
        self.norm = norm(hidden)
        self.act1 = nn.GELU()
        self.fc = nn.Linear(hidden, hidden)
        self.act2 = nn.GELU()
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc(self.act1(self.norm(self.in_proj(x))))))


def feature_mlp() -> FeatureMLP:
    """`bad_batch`."""
    return FeatureMLP()


def multitask_mlp() -> MultiTaskMLP:
    """`scale_collapse`."""
    return MultiTaskMLP()


def fp16_layernorm_model() -> NormMLP:
    """`fp16_layernorm`: the hand-written float16 LayerNorm after the input
    projection."""
    return NormMLP(norm=Fp16LayerNorm)
