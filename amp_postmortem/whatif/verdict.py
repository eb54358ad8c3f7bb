"""Precision or instability, decided by re-running the saved window in
float32 (`analyses/precision_verdict.py` holds the verdict and its words;
`rerun.py` the re-run). Used by `summary` and `recommend` given a model.
"""
from __future__ import annotations

from ..analyses.precision_verdict import Basis, from_rerun, pick_window, undetermined
from ..errors import PostmortemError
from ..reading.window import load_window, window_spans
from .rerun import LossNeededError, loss_kept, loss_needed, rerun_command, rerun_window


def decide(run, failure_step: int | None, *, model, rank: int | None = None, device: str = "cpu",
           policy: str = "recorded", loss_fn=None, optimizer=None, loss=None, command: str = "summary"):
    """The `PrecisionVerdict` of a failed run: the float32 re-run of the
    window holding `failure_step` from its first step to its last;
    undetermined when no such window was saved or no model is given.
    `command`: the one deciding it (`summary`, `recommend`), named where
    the verdict says how to add `--loss`."""
    loss_spec = loss if isinstance(loss, str) else None
    if model is None or failure_step is None:
        return undetermined(run, failure_step, rank=rank, loss=loss_spec)
    span = pick_window(window_spans(run.path, rank), failure_step)
    if span is None:
        return undetermined(run, failure_step, rank=rank, loss=loss_spec)
    w = load_window(span["path"])
    try:
        result = rerun_window(run.path, model=model, precision="fp32", device=device, policy=policy,
                              loss_fn=loss_fn, optimizer=optimizer, window=w, loss=loss)
    except PostmortemError as exc:  # e.g. a model that returns no loss: said, and the rest of the answer stands
        v = undetermined(run, failure_step, rank=rank, model=model if isinstance(model, str) else None,
                         loss=loss_spec)
        v.basis = Basis.RERUN_FAILED
        v.why = loss_needed(exc.kept, command) if isinstance(exc, LossNeededError) else str(exc)
        return v
    return from_rerun(failure_step, result, rerun_command(
        run.path, w, precision="fp32", model=model if isinstance(model, str) else None,
        loss=loss_spec or ("FILE.py:NAME" if loss_kept(w) and loss is None else None)))
