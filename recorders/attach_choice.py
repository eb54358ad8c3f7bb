"""Which model, optimizer and GradScaler of a script are the training ones:
the rule `amp-postmortem record` follows to attach an `AmpRecorder` to a
script it was not written into (`recorders/attach.py`).

- the optimizer: the one torch optimizer alive (two or more: refused, there
  is no telling which one trains);
- the model: the module that holds every parameter that optimizer updates
  and is no submodule of another that does (the outermost: a DDP or
  `torch.compile` wrapper rather than the model inside it, which the
  recorder unwraps); none, or two unrelated ones: refused;
- the scaler: the one enabled `torch.amp.GradScaler` alive, else none (a
  `GradScaler(enabled=False)` is none); two enabled ones: refused.

Pure: it takes the candidates and returns a `TrainingObjects` or raises
`AttachRefused` with the one-line reason; nothing here hooks anything.
"""
from __future__ import annotations

from dataclasses import dataclass


class AttachRefused(Exception):
    """The training objects cannot be told apart; the message says why."""


@dataclass(frozen=True)
class TrainingObjects:
    model: object
    optimizer: object
    scaler: object | None

    def describe(self) -> str:
        """`model Net, optimizer AdamW (4 parameter tensors), scaler GradScaler`."""
        return describe(self.model, self.optimizer, self.scaler)


def describe(model, optimizer, scaler) -> str:
    tensors = sum(len(group["params"]) for group in getattr(optimizer, "param_groups", []))
    optimizer_text = f"optimizer {type(optimizer).__name__} ({tensors} parameter tensors)" if optimizer is not None \
        else "no optimizer"
    return (f"model {type(model).__name__}, {optimizer_text}, "
            f"scaler {type(scaler).__name__ if scaler is not None else 'none'}")


def choose_training_objects(optimizers, scalers, modules) -> TrainingObjects:
    """The training model, optimizer and scaler among the live `optimizers`,
    `scalers` (GradScalers) and `modules`, by the rule above."""
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        names = ", ".join(sorted(type(o).__name__ for o in optimizers))
        raise AttachRefused(f"{len(optimizers)} optimizers ({names}): cannot tell which one trains")
    optimizer = optimizers[0]
    enabled = [s for s in scalers if _enabled(s)]
    if len(enabled) > 1:
        raise AttachRefused(f"{len(enabled)} enabled GradScalers: cannot tell which one scales the loss")
    return TrainingObjects(training_model(optimizer, modules), optimizer, enabled[0] if enabled else None)


def training_model(optimizer, modules):
    """The outermost module holding every parameter `optimizer` updates."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not wanted:
        raise AttachRefused(f"the optimizer {type(optimizer).__name__} holds no parameter")
    owners = [m for m in modules if wanted <= {id(p) for p in m.parameters()}]
    if not owners:
        raise AttachRefused(f"no one module holds all {len(wanted)} parameter tensors the optimizer "
                            f"{type(optimizer).__name__} updates (parameters of several models)")
    inside = {id(sub) for m in owners for sub in m.modules() if sub is not m}
    outermost = [m for m in owners if id(m) not in inside]
    if len(outermost) > 1:
        names = ", ".join(sorted(type(m).__name__ for m in outermost))
        raise AttachRefused(f"{len(outermost)} separate modules ({names}) each hold all the optimizer's "
                            f"parameters: cannot tell which one is the model")
    return outermost[0]


def _enabled(scaler) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
