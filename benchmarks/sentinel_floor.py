"""The floor of the sentinel's design on this machine: a minimal recorder
that takes the same step facts and holds the same state for a
re-execution as `AmpRecorder`'s default, and nothing else.

`sentinel_cost.py` trains it as the `floor` variant beside the product, so
that every run shows how far the default is from what its design can cost
on the machine it ran on. Where the floor itself misses a target, no
bookkeeping cut reaches it there; where the floor meets it and the default
does not, the difference is the product's own work (the decision rules,
the held steps' bookkeeping, the step row, the guards).

What it does a step, as the default's hooks do on a step not sampled:
- the root's forward pre-hook holds the inputs (references) and the CPU
  RNG state;
- its forward hook puts a pre-hook on the output's autograd node, which
  holds the gradient reaching the output and queues a callback for the
  end of the backward pass;
- that callback takes the gradients' square sum in the product's way
  (`NormPlan.facts` on the CPU: small gradients of one shape concatenated,
  one norm a group, each gradient's norm only when the sum is not finite;
  one `_foreach_norm` and one read otherwise), then the sum of the
  parameters' version counters where the product reads it (a scaler's
  job, or gradients not finite: on a clean step without a scaler the
  optimizer's step changes the weights anyway);
- the optimizer's pre-step hook notes that the step stepped;
- `step(loss)` reads the loss and the scaler's scale (host values on the
  CPU) and keeps one tuple.
No spike rule, no held-step bookkeeping, no writer thread, no file, no
guard: none of it is optional in the product, which is why this is a floor
and not a variant anyone should run.
"""
from __future__ import annotations

import math
import operator
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recorders.collectors.grad_norms import GRAD, NormPlan, cpu_norms, settle  # noqa: E402

_VERSION = operator.attrgetter("_version")


class FloorSentinel:
    """Attach to `model` (and `optimizer`, `scaler`); call `step(loss)`
    once per optimizer step, as `AmpRecorder.step`."""

    def __init__(self, model, optimizer, scaler=None):
        self.scaler = scaler
        self._scale = scaler.get_scale() if scaler is not None else 1.0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._plan = NormPlan(self.params)
        self._engine = torch.autograd.Variable._execution_engine
        self._held = None  # [args, kwargs, rng, version sum, output grad, (norms, square sum), stepped]
        self.facts: list[tuple] = []
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True),
                         optimizer.register_step_pre_hook(self._opt_pre)]

    def _pre(self, module, args, kwargs):
        if torch.is_grad_enabled():
            self._held = [args, kwargs, torch.get_rng_state(), None, None, None, False]

    def _post(self, module, args, kwargs, out):
        if self._held is not None and type(out) is torch.Tensor and out.grad_fn is not None:
            out.grad_fn.register_prehook(self._output_grad)

    def _output_grad(self, grad_outputs):
        self._held[4] = grad_outputs[0]
        self._engine.queue_callback(self._backward_end)

    def _backward_end(self):
        plan = self._plan
        if plan.useful:
            self._held[5] = plan.facts()  # (None, the square sum) of finite gradients, as the product
        else:
            self._held[5] = cpu_norms(list(map(GRAD, self.params)), plan.work, plan.uniform, plan.big)
        # The version sum where the product needs it (`BundleCapture._take_versions`):
        # a scaler's job (a skip keeps the weights) or gradients not finite.
        if self._held[3] is None and (self.scaler is not None or not math.isfinite(self._held[5][1])):
            self._held[3] = sum(map(_VERSION, self.params))

    def _opt_pre(self, optimizer, args, kwargs):
        if self._held is not None:
            self._held[6] = True

    def _close(self):
        """(what was held of the step, the loss scale its backward used, the
        gradients' square sum, the unscaled gradient norm)."""
        held, self._held = self._held, None
        # The scale this step's backward used: the one read at the last step
        # (the scaler's update has changed it since).
        scale, self._scale = self._scale, self.scaler.get_scale() if self.scaler is not None else 1.0
        sq = held[5][1] if held is not None and held[5] is not None else math.nan
        norm = math.sqrt(sq) / scale if scale else math.nan  # a diverging job drives its scale to 0
        return held, scale, sq, norm

    def step(self, loss) -> None:
        held, scale, _, norm = self._close()
        self.facts.append((loss.item(), scale, held is not None and held[6], norm))
        if len(self.facts) >= 1000:  # the product hands its rows to a writer: none kept here
            self.facts.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class FactsFloor(FloorSentinel):
    """The floor plus the rest of the default's work on a facts-only step,
    written as compactly as it goes: the loss taken from the model's
    output when it returns one (`find_loss`, the no-scaler job's tap), the
    event rules (a non-finite loss or gradient norm, a loss or norm spike
    against running means; a copy of the weights before the update when
    the gradients already show one), the learning rate, and one row per
    step handed to a writer thread in blocks of 64, which makes an Arrow
    table of them. What it lacks against the product: micro-batch and
    wrapper cases, the held steps' bookkeeping for late decisions, the
    journal, the guards. `sentinel_parts.py` times it beside the default:
    the distance between them is what the product's way of doing the same
    work costs (2026-12-06: all of the default's distance to the floor)."""

    BLOCK = 64

    def __init__(self, model, optimizer, scaler=None):
        import queue
        import threading

        from recorders.format.tensors import find_loss
        super().__init__(model, optimizer, scaler)
        self.optimizer, self._find_loss = optimizer, find_loss
        self._handles.append(model.register_forward_hook(self._tap))
        self.tapped = None
        self.rows: list[tuple] = []
        self.events = self.step_id = 0
        self._loss_mean = self._sq_mean = None
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, daemon=True, name="facts-floor-writer")
        self._thread.start()

    def _tap(self, module, args, out):
        if torch.is_grad_enabled():
            loss = self._find_loss(out)
            if loss is not None and loss.requires_grad:
                self.tapped = loss

    def _opt_pre(self, optimizer, args, kwargs):
        held = self._held
        if held is not None:
            held[6] = True
            sq = held[5][1] if held[5] is not None else math.nan
            if not math.isfinite(sq) or (self._sq_mean is not None and sq > 100 * self._sq_mean):
                held.append([p.detach().clone() for p in self.params])  # the weights of the event's forward

    def step(self, loss) -> None:
        held, scale, sq, norm = self._close()
        value = loss.item()
        event = not (math.isfinite(value) and math.isfinite(norm))
        mean = self._loss_mean
        if mean is not None and math.isfinite(value) and value > 4 * mean:
            event = True
        if math.isfinite(value):
            self._loss_mean = value if mean is None else 0.9 * mean + 0.1 * value
        if math.isfinite(sq):
            self._sq_mean = sq if self._sq_mean is None else 0.9 * self._sq_mean + 0.1 * sq
        self.events += event
        self.rows.append((self.step_id, value, scale, norm, held is not None and held[6],
                          self.optimizer.param_groups[0]["lr"], 1, event))
        self.step_id += 1
        self.tapped = None
        if len(self.rows) >= self.BLOCK:
            self._queue.put(self.rows)
            self.rows = []

    def _write(self) -> None:
        import pyarrow as pa
        names = ("step", "loss", "loss_scale", "grad_norm", "stepped", "lr", "micro_batches", "event")
        while True:
            rows = self._queue.get()
            if rows is None:
                return
            pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})

    def close(self) -> None:
        super().close()
        self._queue.put(None)
        self._thread.join()
