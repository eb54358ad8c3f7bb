"""Replay bundles: saving the failing step (placeholder interface).

The recorder calls these methods at fixed points of the step; this default
implementation saves nothing. See docs/FORMAT.md for the bundle layout.
"""
from __future__ import annotations


class BundleCapture:
    """Decides when to save a replay bundle and writes it.

    Call sites (all guarded by the recorder: an exception here disables
    recording, never the training):
    - training thread: `on_micro_batch_start`, `on_model_output_grad`,
      `on_optimizer_pre_step`, `on_step_end`, `request`;
    - writer thread: `on_step_summary` (statistics of a finished step).
    """

    def __init__(self, recorder, **config):
        self.recorder = recorder
        self.config = config
        self.saved: list[dict] = []

    def on_micro_batch_start(self, step: int, micro_batch: int, args, kwargs) -> None:
        pass

    def on_model_output_grad(self, micro_batch: int, index: int, grad) -> None:
        pass

    def on_optimizer_pre_step(self) -> None:
        pass

    def on_step_end(self, step: int, *, loss, stepped: bool | None) -> None:
        pass

    def on_step_summary(self, summary: dict) -> None:
        pass

    def request(self) -> None:
        pass

    def close(self) -> None:
        pass
