"""The Hugging Face and Lightning Trainers of a script run by
`amp-postmortem record` (`recorders/attach.py`): each Trainer the script
builds gets the framework's `AmpPostmortemCallback` (this package), which
attaches at the start of training to the model, optimizer and scaler the
Trainer really uses and closes each step at the framework's own event.

`trainer_patches(session)` maps each Trainer's module to the patch of its
constructor; `attach.PatchOnImport` applies it when the script imports the
module, so nothing here imports a framework the script does not.
A Lightning module with several optimizers is refused (one line, the fit
runs unrecorded): the recorder follows one optimizer.
"""
from __future__ import annotations

import functools

from ..attach_choice import describe

HF_TRAINER = "transformers.trainer"
LIGHTNING_TRAINERS = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")


def trainer_patches(session) -> dict:
    """{module name: patch(module)} for every Trainer `record` attaches to."""
    patches = {HF_TRAINER: functools.partial(patch_hf_trainer, session=session)}
    patches.update({name: functools.partial(patch_lightning_trainer, session=session) for name in LIGHTNING_TRAINERS})
    return patches


def patch_hf_trainer(module, *, session) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__

    @functools.wraps(original)
    def init(trainer, *args, **kwargs):
        original(trainer, *args, **kwargs)
        if session.claim_framework("the Hugging Face Trainer"):
            trainer.add_callback(hf_callback(session))

    trainer_class.__init__ = init


def patch_lightning_trainer(module, *, session) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__

    @functools.wraps(original)
    def init(trainer, *args, **kwargs):
        if session.claim_framework("the Lightning Trainer"):
            given = kwargs.get("callbacks")
            given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
            kwargs["callbacks"] = [*given, lightning_callback(session)]
        original(trainer, *args, **kwargs)

    trainer_class.__init__ = init


def hf_callback(session):
    """The Trainer callback, saying what it attached to (built when a
    Trainer is, after transformers finished importing)."""
    from .transformers import AmpPostmortemCallback

    class RecordCallback(AmpPostmortemCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            super().on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper: name the real one
            session.started(self.recorder, describe(model, inner, getattr(optimizer, "scaler", None)),
                            "at the Trainer's on_optimizer_step")

    return RecordCallback(session.run_dir, **session.recorder_options())


def lightning_callback(session):
    from .lightning import AmpPostmortemCallback

    class RecordCallback(AmpPostmortemCallback):
        def on_train_start(self, trainer, pl_module):
            optimizers = list(trainer.optimizers)
            if len(optimizers) != 1:
                names = ", ".join(sorted(type(o).__name__ for o in optimizers))
                session.refuse(f"the LightningModule has {len(optimizers)} optimizers ({names}): "
                               f"cannot tell which one trains")
                return
            super().on_train_start(trainer, pl_module)
            session.started(self.recorder,
                            describe(pl_module, optimizers[0], getattr(trainer.precision_plugin, "scaler", None)),
                            "at on_train_batch_end once the global step moved")

    return RecordCallback(session.run_dir, **session.recorder_options())
