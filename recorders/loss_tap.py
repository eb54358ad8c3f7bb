"""Every micro-batch's loss, captured where the job scales or returns it.

A job with gradient accumulation backpropagates several losses per optimizer
step; the loss a user hands to `rec.step(loss)` is at best the last one, and a
framework callback gets none. `MicroBatchLosses` collects each micro-batch's
loss as a device tensor (a detached reference: no copy, no sync); at
`rec.step()` `step_loss()` combines them on the device, so one NaN
micro-batch makes the step's loss NaN. Two taps feed it:

- `ScaleTap` wraps `scaler.scale` on the scaler *instance* (removed on close):
  every loop that uses a GradScaler (plain, Accelerate, Trainer, Lightning
  16-mixed) passes its loss through it, after any accumulation division. A
  disabled scaler still passes it through (nanoGPT's bf16 path).
- `OutputLossTap`: takes the loss a model returns (Hugging Face models
  called with `labels=`; a `(logits, loss)` tuple) after the root's
  forward, for jobs without a scaler (the recorder's root forward hook
  carries it). Which output is the loss is
  `find_loss`, the rule the replay uses too.

Frameworks that hand the loss to a hook (Lightning's `on_before_backward`)
call `AmpRecorder.add_loss`.
"""
from __future__ import annotations

import math

import torch

from .format.tensors import find_loss


class MicroBatchLosses:
    """The losses of the current optimizer step's micro-batches, as
    backpropagated (`add`: through the scaler, or handed over by a
    framework, after any accumulation division) or as the model returned
    them (`add_returned`: before the loop divides them)."""

    def __init__(self):
        self._backpropagated: list[torch.Tensor] = []
        self._returned: list[torch.Tensor] = []

    def add(self, loss) -> None:
        if _usable(loss):
            self._backpropagated.append(loss.detach())

    def add_returned(self, loss) -> None:
        if _usable(loss):
            self._returned.append(loss.detach())

    @property
    def captured(self) -> bool:
        """A loss of the current step was captured (`close_step` combines them)."""
        return bool(self._backpropagated or self._returned)

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        taken = self._backpropagated, self._returned
        self._backpropagated, self._returned = [], []
        return taken

    def close_step(self, explicit=None) -> tuple:
        """(`step_loss`, `loss_dtype`) of the losses taken, emptied: the
        step's loss and its dtype name. The usual loop (one micro-batch
        through the scaler, its loss passed to `rec.step()`) in a few lines:
        this runs every step."""
        back = self._backpropagated
        if not back and not self._returned:  # nothing captured (a loss the model did not return, no scaler)
            return explicit, (_DTYPE_NAMES.get(explicit.dtype) or str(explicit.dtype).removeprefix("torch.")
                              if isinstance(explicit, torch.Tensor) else None)
        if len(back) == 1 and not self._returned and type(explicit) is torch.Tensor:
            t = back[0]
            self._backpropagated = []
            dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
            if _same_value(t, explicit):
                return explicit.detach() if explicit.dim() == 0 else explicit.detach().reshape(()), dtype
            return step_loss(([t], []), explicit), dtype
        taken = self.take()
        return step_loss(taken, explicit), loss_dtype(taken, explicit)


_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _usable(loss) -> bool:
    return isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() > 0


def step_loss(taken, explicit=None):
    """The loss to record for a step (`taken`: `MicroBatchLosses.take()`),
    on the device, never read here.

    The sum of the losses as backpropagated (the objective whose gradient
    the step took: with `loss / accum` per micro-batch, the mean loss), else
    the mean of the losses the model returned (one micro-batch's loss
    each, as a replay of the step computes them); float64 accumulation.
    A loss the user passes wins while every captured loss is finite; when one
    is not, the captured non-finite value is recorded instead, so the step
    counts as a non-finite-loss step whichever micro-batch it was."""
    backpropagated, returned = taken
    losses = backpropagated or returned
    if not losses:
        return explicit
    if len(losses) == 1 and isinstance(explicit, torch.Tensor) and _same_value(losses[0], explicit):
        # The usual loop: the loss it scaled is the one it passes (one
        # micro-batch): the value is the same, finite or not.
        return explicit.detach() if explicit.dim() == 0 else explicit.detach().reshape(())
    if isinstance(explicit, torch.Tensor) and explicit.numel() == 1 and all(
            t.is_cpu and t.numel() == 1 for t in losses) and all(
            math.isfinite(float(t)) for t in losses):
        # Host values (the CPU): every captured loss is finite, so the one
        # passed wins, with no operation on the training path.
        return explicit.detach().reshape(())
    device = losses[0].device
    total = torch.stack([t.to(device=device, dtype=torch.float64).sum() for t in losses]).sum()
    if not backpropagated:
        total = total / len(losses)
    if isinstance(explicit, torch.Tensor) and explicit.numel() == 1:
        explicit = explicit.detach().reshape(())
        return torch.where(torch.isfinite(total.to(explicit.device)), explicit,
                           total.to(device=explicit.device, dtype=explicit.dtype))
    if isinstance(explicit, (int, float)):
        # A fill on the device: no host-to-device copy on the training path.
        return torch.where(torch.isfinite(total), torch.full_like(total, float(explicit)), total)
    # float32 at least: a sum of float16 losses may overflow where none did.
    dtype = torch.promote_types(losses[0].dtype, torch.float32)
    return total.to(dtype)


def _same_value(captured: torch.Tensor, explicit: torch.Tensor) -> bool:
    """`captured` (a detached reference) is `explicit`'s value: the same
    memory, shape and dtype (metadata only: no read)."""
    return (captured.data_ptr() == explicit.data_ptr() and captured.dtype == explicit.dtype
            and captured.shape == explicit.shape and explicit.numel() == 1
            and captured.device == explicit.device)


def loss_dtype(taken, explicit=None) -> str | None:
    """The dtype name of the loss the step backpropagated (`taken`:
    `MicroBatchLosses.take()`): the first one through the scaler, else the
    first the model returned, else `explicit`'s when it is a tensor. Read
    from the tensor's metadata: no sync. `step_loss` combines the losses in
    float32 at least, so its dtype is not the loss's."""
    backpropagated, returned = taken
    losses = backpropagated or returned
    t = losses[0] if losses else explicit
    if not isinstance(t, torch.Tensor):
        return None
    return str(t.dtype).removeprefix("torch.")


class ScaleTap:
    """Wraps `scaler.scale` on the instance; returns the scaler's own result,
    so the training is bit-identical. `remove()` restores the class method."""

    def __init__(self, scaler, losses: MicroBatchLosses, active):
        self._scaler = scaler
        original = scaler.scale  # bound now: a later wrap by someone else stays theirs

        def scale(outputs):
            if active():
                if type(outputs) is torch.Tensor:  # the usual loss: no walk
                    losses.add(outputs)
                else:
                    for t in _tensors(outputs):
                        losses.add(t)
            return original(outputs)

        self._wrapper = scale
        scaler.scale = scale

    def remove(self) -> None:
        if self._scaler.__dict__.get("scale") is self._wrapper:
            del self._scaler.__dict__["scale"]


class OutputLossTap:
    """Takes the loss among a model's outputs (`find_loss`) after the
    model's forward, when it carries a gradient: a loss without one trains
    nothing (a frozen model's pass, a value the model detached for logging).

    Carried by the recorder's own forward hook on the root
    (`collectors.sentinel.SentinelHooks`, which runs on every step and
    already tests what the tap tests: the root's call, grad mode, not
    paused, recording on): a forward hook of its own made torch's
    `_call_impl` walk one more hook and called three frames a step (its
    removal read -1.2 points of the launch-bound proxy's ratio in one run,
    within a run's spread: `benchmarks/RESULTS.md`, 2026-12-07). Traced by
    dynamo inside a compiled model as before (the carrier's hook calls
    `take` there)."""

    def __init__(self, carrier, losses: MicroBatchLosses):
        self._carrier = carrier
        self.losses = losses
        carrier.tap = self

    def take(self, output) -> None:
        loss = find_loss(output)
        if loss is not None and loss.requires_grad:
            self.losses.add_returned(loss)

    def remove(self) -> None:
        if self._carrier.tap is self:
            self._carrier.tap = None


def _tensors(outputs):
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (tuple, list)):
        for o in outputs:
            yield from _tensors(o)


def loss_tap_for(carrier, scaler, losses: MicroBatchLosses, active):
    """The tap a job gets: any scaler object, enabled or not, sees the loss
    as backpropagated (nanoGPT scales through a disabled one under bf16);
    without one, the model may return its loss (Hugging Face models with
    `labels=`), taken in grad mode only by `carrier`'s root forward hook
    (`OutputLossTap`). `active()`: the scaler's tap records."""
    if scaler is not None and callable(getattr(scaler, "scale", None)):
        return ScaleTap(scaler, losses, active)
    return OutputLossTap(carrier, losses)
