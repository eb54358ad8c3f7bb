"""`AmpPostmortemCallback` for the Lightning `Trainer`.

>>> trainer = L.Trainer(precision="bf16-mixed",
...                     callbacks=[AmpPostmortemCallback("runs/lightning")])

Works with `lightning.pytorch` or, when only that is installed,
`pytorch_lightning`. The recorder watches the whole `LightningModule`: its
own `forward` never runs (`training_step` calls the submodules), and the
recorder opens each micro-batch at the first submodule called. The scaler is
the precision plugin's (`"16-mixed"`; None for `"bf16-mixed"`), whose
`scale()` the recorder taps for every micro-batch's loss; without one the
loss comes from `on_before_backward` (divided by `accumulate_grad_batches`,
as backpropagated). Lightning has no event after the optimizer step:
`on_train_batch_end` closes a step when `trainer.global_step` moved (an
AMP-skipped step moves it too), with the step number it had before.

With `stop_on_event=True`, a stop that an `on_event` callback requested
(`event.request_stop()`, `rec.should_stop`) sets `trainer.should_stop` when
that step closes: Lightning ends the fit there (`on_train_end` runs, the
recorder closes).
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from ..recorder import AmpRecorder


class AmpPostmortemCallback(Callback):
    """Records a Lightning training into `run_dir`; `recorder_options` are
    `AmpRecorder`'s keywords (`include`, `full_every`, `bundles`,
    `on_event`, ...). `stop_on_event`: a stop an `on_event` callback asked
    for ends the fit (`trainer.should_stop`)."""

    def __init__(self, run_dir, *, stop_on_event: bool = False, **recorder_options):
        self.run_dir = run_dir
        self.stop_on_event = bool(stop_on_event)
        self.recorder_options = recorder_options
        self.recorder: AmpRecorder | None = None
        self._global_step = 0
        self._loss_from_hook = False

    def on_train_start(self, trainer, pl_module):
        if self.recorder is not None:
            self.recorder.close()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizers = trainer.optimizers
        self.recorder = AmpRecorder(self.run_dir, pl_module,
                                    optimizer=optimizers[0] if optimizers else None,
                                    scaler=scaler, **self.recorder_options)
        # With a scaler the recorder's scale tap sees every loss, already
        # divided for accumulation and not yet scaled; the hook's loss is
        # scaled then, so it is used only without one.
        self._loss_from_hook = scaler is None
        self._global_step = trainer.global_step

    def on_before_backward(self, trainer, pl_module, loss):
        if self._loss_from_hook and self.recorder is not None:
            self.recorder.add_loss(loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.recorder is not None and trainer.global_step != self._global_step:
            self.recorder.step(step=self._global_step)
            self._global_step = trainer.global_step
            if self.stop_on_event and self.recorder.should_stop:
                trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()

    def _close(self):
        if self.recorder is not None:
            self.recorder.close()
