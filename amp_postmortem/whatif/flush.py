"""Flushed or structural: a saved step's gradient zeros told apart by
replaying it (`analyses/unscaled.py` says when the recorded rows cannot,
and what the answer changes).

`replay_zeros` replays the bundle's step twice, forward and backward:
in float32 (autocast off: a value float16 would flush is a normal float32
number there) and in the recorded precision at the recorded loss scale (as
the step ran). Per layer it counts its gradient values, the gradients of
its outputs and of its own parameters: those non-zero in float32 but
exactly zero in the recorded precision are flushed (signal lost to its
range), those zero in both are structural (a mask, a ReLU, an unused
position: zero in any precision), and those non-zero but below float16's
smallest normal are subnormal (kept, with fewer bits).
"""
from __future__ import annotations

from recorders.format import schema

from ..analyses.unscaled import LayerZeros, ReplayedZeros


def replay_zeros(source, step: int, *, rank: int | None = None, model, device: str = "cpu",
                 policy: str = "recorded", loss_fn=None) -> ReplayedZeros:
    """The `ReplayedZeros` of the saved step `step` of `source` (a run
    directory or a bundle); `model`, `loss_fn` as for `replay`."""
    from ..replaying import RunConfig
    from . import prepare
    p = prepare(source, step, rank=rank, model=model, device=device, policy=policy, loss_fn=loss_fn)
    wide = p.session.run(RunConfig("fp32", device=p.config.device), capture=True)
    low = p.run(capture=True)
    return ReplayedZeros(step=p.step, rank=p.rank, precision=p.precision, loss_scale=p.loss_scale,
                         layers=count_zeros(wide, low))


def count_zeros(wide, low) -> dict:
    """{layer: LayerZeros} of two captures of one step (`wide` in float32,
    `low` in the reduced precision)."""
    import torch
    counts: dict = {}

    def add(name, w, g):
        if w is None or g is None or w.shape != g.shape:
            return
        live = w != 0
        zero = g == 0
        small = (g != 0) & (g.abs() < schema.FP16_MIN_NORMAL) if g.dtype == torch.float16 else None
        c = counts.setdefault(name, [0, 0, 0, 0, 0])
        c[0] += w.numel()
        c[1] += int(live.sum())
        c[2] += int((live & zero).sum())
        c[3] += int((live & small).sum()) if small is not None else 0
        c[4] += int((~live & zero).sum())

    for key, call in wide.calls.items():
        other = low.calls.get(key)
        if other is None:
            continue
        for w, g in zip(call.grad_outputs, other.grad_outputs):
            add(call.name, w, g)
    for name, w in wide.param_grads.items():
        # A parameter's gradient is its module's: the optimizer sees it (divided by the scale, never made zero).
        add(name.rpartition(".")[0] or name, w, low.param_grads.get(name))
    return {name: LayerZeros(name, *c) for name, c in counts.items()}
