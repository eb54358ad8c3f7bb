"""The tests' tiny CPU models and their one training loop (`train`).

Every test that records a run trains through `train` (CPU autocast, an
optional `torch.amp.GradScaler("cpu")`, SGD or the test's optimizer),
changing only the model, the data, the loss and what its callbacks plant.
A test about the loop itself (one that skips the update, drops a batch,
runs in a worker or a script of its own) keeps its loop and says why."""
from __future__ import annotations

import dataclasses
import math
import typing

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
    """Multiplies its input by `gain`: 1 is harmless; a test plants more
    (float16 turns 1e6 x into Inf) or NaN at the steps it chooses."""

    def __init__(self, gain: float = 1.0):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


class _AmpGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gain):
        ctx.gain = gain
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.gain, None


class GradAmp(nn.Module):
    """Identity forward; multiplies the gradient passing back by `gain`."""

    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, x):
        return _AmpGrad.apply(x, self.gain)


class BoomBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.boom = Boom()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.boom(self.fc(x)))


class BoomNet(nn.Module):
    """The analyzer fixtures' model (conftest): `block.boom` and `amp` are
    where faults are planted, in the forward and in the backward."""

    def __init__(self, d_in=4, d=8):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.block = BoomBlock(d)
        self.amp = GradAmp()
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.amp(self.block(self.inp(x))))


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


# Models of the replay tests (test_replay.py): bundles built from them by hand.
class Blowup(nn.Module):
    """A hand-written op whose float16 result passes 65504 (fine in fp32/bf16)."""

    def forward(self, x):
        return x * 4000.0


class BlowupNet(nn.Module):
    """`block.blowup` overflows float16 once `block.fc` is scaled up."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.Sequential()
        self.block.add_module("fc", nn.Linear(16, 16))
        self.block.add_module("blowup", Blowup())
        self.block.add_module("norm", nn.LayerNorm(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.block(self.embed(x))))


class SquaredScores(nn.Module):
    """pow is float32 under CUDA autocast but stays float16 under CPU
    autocast: 300**2 = 90000 overflows float16, then softmax turns it to NaN."""

    def forward(self, x):
        return torch.softmax(x.pow(2) / 1e4, dim=-1)


class ScoreNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.scores = SquaredScores()
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.scores(self.proj(x)))


class HalfNorm(nn.Module):
    """A LayerNorm written out by hand, in its input's dtype (float16 under
    CPU autocast): its variance `xc * xc` is where float16 overflows, while
    the normalised output stays near 1 (the op probe's planted fault)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xc = x - x.mean(-1, keepdim=True)
        var = (xc * xc).mean(-1, keepdim=True)  # PLANTED: the op nearest to 65504
        return xc / torch.sqrt(var + 1e-5) * self.weight


class RawAttention(nn.Module):
    """Attention logits without 1/sqrt(d), and a causal mask of -Inf: the
    logits are finite, the mask's -Inf is meant, the output is finite."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        logits = q @ k.transpose(-1, -2)
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).triu(1)
        return logits.masked_fill(mask, float("-inf")).softmax(-1) @ v


# embed's bias: after the mean is taken off, xc = +-250 and +-50, so
# xc * xc = 62,500 (62,496 in float16): 0.07 bits below 65504.
PLANTED_BIAS = (250.0, -250.0, 50.0, -50.0) * 4


class ProbeNet(nn.Module):
    """`norm` (a HalfNorm) gets values of +-250 from `embed`: its variance
    op nears float16's overflow inside the module, its output does not;
    `block` holds `norm` and `attn` (nested probes)."""

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.block = nn.Sequential()
        self.block.add_module("norm", HalfNorm(d))
        self.block.add_module("attn", RawAttention(d))
        self.head = nn.Linear(d, d_out)
        with torch.no_grad():
            self.embed.weight.mul_(0.01)
            self.embed.bias.copy_(torch.tensor(PLANTED_BIAS))

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x))


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(64)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(self.act(self.fc1(x)))))


class BackwardBlowup(nn.Module):
    """Finite forward; the weight gradient of `fc` sums 64 positive
    products of ~1e5 in float16 at loss scale 2**10: an Inf, never a NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def batches(n: int, d_in: int = 8, d_out: int = 4, seed: int = 1, shape=(4, 5)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, d_in, generator=g), torch.randn(*shape, d_out, generator=g)) for _ in range(n)]


def mse(model, x, y, step: int, accumulate: int):
    """The default loss: mean squared error of the logits, shared over the
    step's micro-batches."""
    out = model(x)
    logits = out.logits if isinstance(out, Out) else out
    return ((logits.float() - y) ** 2).mean() / accumulate


def recorder_at(run, **options):
    """A `recorder` for `train`: the real AmpRecorder writing to `run`."""
    from recorders import AmpRecorder
    return lambda model, opt, sc: AmpRecorder(run, model, optimizer=opt, scaler=sc, **options)


class Trained(typing.NamedTuple):
    losses: list
    scales: list
    params: list
    rec: typing.Any


def train(model, data, *, recorder=None, dtype=torch.float16, scaler=True, accumulate: int = 1,
          lr: float = 0.05, loss_fn=mse, on_step=None, after_backward=None, before_update=None,
          close: bool = True, stop_when=None, optimizer=None, pass_loss: bool = True,
          after_update=None, after_step=None) -> Trained:
    """The one AMP training loop of the tests, on the CPU.

    data: the micro-batches, `accumulate` per optimizer step ((x, y) pairs);
    recorder(model, opt, scaler): builds the recorder (see `recorder_at`);
    dtype: the autocast dtype (None or float32: autocast off);
    scaler: True (a default GradScaler("cpu")), a dict of its options, a
    GradScaler, or None/False;
    loss_fn(model, x, y, step, accumulate): the loss to backpropagate;
    on_step(step, model, x): before the step (plant a fault, change x);
    after_backward(step, micro_batch, rec): after each micro-batch's backward;
    before_update(step, model): after the backward passes, before the update;
    close: close the recorder at the end (False: leave it open);
    stop_when(rec): after each rec.step(), end the loop when true (a stop an
    on_event callback asked for);
    optimizer: the optimizer to step (None: SGD over the model's parameters at `lr`);
    pass_loss: hand the loss to rec.step() (False: rec.step() with none);
    after_update(step, model): after the update, before rec.step() (an eval pass);
    after_step(step, rec): after rec.step() (a flush: the writer keeps up).
    Returns the losses (as passed to rec.step), the scales after each step,
    the final parameters and the recorder."""
    opt = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    if scaler is True or isinstance(scaler, dict):
        sc = torch.amp.GradScaler("cpu", **(scaler if isinstance(scaler, dict) else {}))
    else:
        sc = scaler or None
    rec = recorder(model, opt, sc) if recorder else None
    autocast = dtype not in (None, torch.float32)
    losses, scales = [], []
    for step in range(len(data) // accumulate):
        micro = data[step * accumulate:(step + 1) * accumulate]
        if on_step:
            on_step(step, model, micro[0][0])
        for k, (x, y) in enumerate(micro):
            with torch.autocast("cpu", dtype=dtype if autocast else torch.float16, enabled=autocast):
                loss = loss_fn(model, x, y, step, accumulate)
            (sc.scale(loss) if sc else loss).backward()
            if after_backward:
                after_backward(step, k, rec)
        if before_update:
            before_update(step, model)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        opt.zero_grad()
        if after_update:
            after_update(step, model)
        if rec:
            rec.step(loss) if pass_loss else rec.step()
        if after_step:
            after_step(step, rec)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else None)
        if stop_when is not None and stop_when(rec):
            break
    if rec and close:
        rec.close()
    return Trained(losses, scales, [p.detach().clone() for p in model.parameters()], rec)


def planted_job(model, plant: str | None):
    """(data, on_step) for `train`: `model` (TinyNet or BoomNet) with a
    float16 overflow planted in the forward at step 2 (`plant="forward"`,
    BoomNet) or a NaN in the backward at step 1 (`"backward"`), or none."""
    d_in = 4 if model is BoomNet else 8
    d_out = 1 if model is BoomNet else 4

    def on_step(step, m, _x):
        if plant == "forward":
            m.block.boom.gain = 1e6 if step == 2 else 1.0
        elif plant == "backward":
            m.amp.gain = math.nan if step == 1 else 1.0
    return batches(8, d_in=d_in, d_out=d_out), on_step


def same_rows(a, b) -> None:
    """Two runs' row frames equal, value for value (NaN equal to NaN)."""
    assert len(a) == len(b) > 0
    for col in a.columns:
        same = (a[col] == b[col]) | (a[col].isna() & b[col].isna())
        assert same.all(), (col, a[~same].head(), b[~same].head())
