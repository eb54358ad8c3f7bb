"""`AmpPostmortemCallback` for the Hugging Face `Trainer`.

>>> trainer = Trainer(model=model, args=args, train_dataset=ds,
...                   callbacks=[AmpPostmortemCallback("runs/hf")])

The Trainer hands callbacks its model and its `AcceleratedOptimizer`, whose
`.scaler` is the GradScaler Accelerate really uses (None for bf16): the
recorder hooks those. `on_optimizer_step` is the one event after the
optimizer ran and before the scheduler and `zero_grad` (gradients present,
the learning rate as used, `state.global_step` not yet incremented), so each
optimizer step is closed there with `step=state.global_step`. A callback gets
no loss: the recorder captures every micro-batch's loss itself (through the
scaler, or from the model's outputs when the model computes it, as
`transformers` models called with `labels=` do).

With `stop_on_event=True`, a stop that an `on_event` callback requested
(`event.request_stop()`, `rec.should_stop`) sets the Trainer's
`control.should_training_stop` at the next optimizer step: the Trainer ends
training after that step, as at `max_steps` (`on_train_end` runs, the
recorder closes).
"""
from __future__ import annotations

from transformers import TrainerCallback

from ..recorder import AmpRecorder


class AmpPostmortemCallback(TrainerCallback):
    """Records a `Trainer` run into `run_dir`; `recorder_options` are
    `AmpRecorder`'s keywords (`include`, `full_every`, `bundles`,
    `on_event`, ...). `stop_on_event`: a stop an `on_event` callback asked
    for ends the training (`control.should_training_stop`)."""

    def __init__(self, run_dir, *, stop_on_event: bool = False, **recorder_options):
        self.run_dir = run_dir
        self.stop_on_event = bool(stop_on_event)
        self.recorder_options = recorder_options
        self.recorder: AmpRecorder | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is not None:  # a second train(): the run goes on in the same directory
            self.recorder.close()
        self.recorder = AmpRecorder(self.run_dir, model, optimizer=optimizer,
                                    scaler=getattr(optimizer, "scaler", None),
                                    **self.recorder_options)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.step(step=state.global_step)
            if self.stop_on_event and self.recorder.should_stop:
                control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.close()
