"""Tiny CPU models shared by the recorder tests."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn


class Attention(nn.Module):
    """Self-attention whose q·kᵀ and softmax are plain tensor code inside the
    block: a NaN made there is first *seen* in `out`, its child."""

    def __init__(self, d: int, logit_gain: float = 1.0):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.logit_gain = logit_gain

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        logits = (q @ k.transpose(-1, -2)) * self.logit_gain
        return self.out(logits.softmax(-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.norm(x)  # h feeds attn and mlp: one tensor, several modules
        return x + self.attn(h) + self.mlp(h)


class TinyNet(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4, blocks: int = 2):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


class Boom(nn.Module):
    """Multiplies by `gain` from step `at` on: an overflow planted in a
    known module (fp16 turns 1e6 x into Inf)."""

    def __init__(self, gain: float = 1e6):
        super().__init__()
        self.gain = gain
        self.armed = False

    def forward(self, x):
        return x * self.gain if self.armed else x


class PlantedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.boom = Boom()
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.boom(self.embed(x)))))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class FancyOutputs(nn.Module):
    """Tuple/dict/dataclass outputs, a module called twice, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.split = SplitHead()

    def forward(self, x):
        h = self.shared(self.shared(x))  # called twice per forward
        h = self.frozen(h)
        d = self.split(h)
        return Out(logits=d["a"], aux=d["b"][0])


class SplitHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, h):
        return {"a": self.a(h), "b": (self.b(h), 3)}


def batches(n: int, d_in: int = 8, d_out: int = 4, seed: int = 1, shape=(4, 5)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, d_in, generator=g), torch.randn(*shape, d_out, generator=g)) for _ in range(n)]


def train(model, data, *, recorder_factory=None, dtype=torch.float16, scaler=True,
          accumulate: int = 1, lr: float = 0.05, on_step=None):
    """A plain AMP loop on the CPU. Returns (losses, scales, final params, rec)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler is True else (scaler or None)
    rec = recorder_factory(model, opt, sc) if recorder_factory else None
    losses, scales = [], []
    for i in range(0, len(data), accumulate):
        if on_step:
            on_step(i // accumulate, model)
        for x, y in data[i:i + accumulate]:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = model(x)
                logits = out.logits if isinstance(out, Out) else out
                loss = ((logits.float() - y) ** 2).mean() / accumulate
            (sc.scale(loss) if sc else loss).backward()
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        opt.zero_grad()
        if rec:
            rec.step(loss)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else None)
    if rec:
        rec.close()
    return losses, scales, [p.detach().clone() for p in model.parameters()], rec
