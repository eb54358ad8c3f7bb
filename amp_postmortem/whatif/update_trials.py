"""Re-run a saved window with each remedy of lost updates
(`analyses/update_remedies.py` judges them and says them in words;
`rerun.py` re-runs). Used by `summary` and `recommend` given a model.

The window re-run is the latest one the run saved (lost updates are a
matter of the weights' dtype and the learning rate, present at every
step, not of one event), from its first step to its last, four times:
- as recorded: the parameters in the dtypes the window saved, the
  recorded learning rates;
- `fp32_master_weights`: float32 parameters under autocast in the dtype
  the run held them in (the run's own autocast where it had one; float16
  with a GradScaler at its default scale, as float16 autocast needs);
- `larger_learning_rate`: the recorded learning rate times the factor at
  which `KEEP_SHARE` of the float32 updates reach half an ulp of their
  weight, measured on the float32 trial (`weight_updates.UpdateReach`:
  every torch optimizer's update scales with its learning rate), rounded
  up to 1, 2 or 5 x 10^k and at most `MAX_LR_SCALE`;
- `stochastic_rounding`: the parameters in their dtype, each update
  rounded stochastically.
"""
from __future__ import annotations

import math

from ..analyses.update_remedies import (KEEP_SHARE, RemedyCheck, RemedyChecks, UpdateTrial, Verification, judge,
                                        unchecked)
from ..analyses.updates import UpdateRemedy
from ..errors import PostmortemError
from ..reading.window import load_window, window_spans
from .rerun import LossNeededError, loss_kept, loss_needed, rerun_command, rerun_window

MAX_LR_SCALE = 1000.0   # beyond it the "remedy" is another training recipe, not a fix of the rounding
_AUTOCAST = {"bfloat16": "bf16", "float16": "fp16"}


def verify_update_remedies(run, lost, *, model, rank: int | None = None, device: str = "cpu",
                           policy: str = "recorded", loss_fn=None, loss=None,
                           command: str = "summary") -> RemedyChecks:
    """The `RemedyChecks` of `lost` (`analyses.updates.LostUpdates`) by
    re-running the run's latest saved window; `command`: the command
    asking, named where the words say how to add `--loss`."""
    remedies = lost.remedies()
    spans = window_spans(run.path, rank)
    if not spans:
        return unchecked(remedies, Verification.NO_WINDOW)
    span = spans[-1]
    window = [span["first_step"], span["last_step"]]
    if model is None:
        return unchecked(remedies, Verification.NO_MODEL, window)
    w = load_window(span["path"])
    low = next((lay.dtype for lay in lost.layers if lay.dtype in _AUTOCAST), "bfloat16")
    ac = w.autocast or {}
    master_precision = "recorded" if ac.get("enabled") else _AUTOCAST[low]
    # Float16 autocast needs a loss scale: the run had none to carry over when it held float16 weights.
    float16 = (ac.get("dtype") if ac.get("enabled") else low) == "float16"
    master_scale = 2.0 ** 16 if float16 and not (w.scaler and w.scaler.get("enabled", True) is not False) else None
    spec = model if isinstance(model, str) else None
    loss_spec = loss if isinstance(loss, str) else ("FILE.py:NAME" if loss_kept(w) and loss is None else None)

    def trial(remedy, *, precision="recorded", param_dtype=None, lr_scale=1.0, rounding="nearest",
              init_scale=None, watchers=()):
        r = rerun_window(run.path, model=model, window=w, precision=precision, param_dtype=param_dtype,
                         lr_scale=lr_scale, update_rounding=rounding, init_scale=init_scale, device=device,
                         policy=policy, loss_fn=loss_fn, loss=loss, watchers=watchers, evaluate=True)
        before, after = r.window_loss
        return UpdateTrial(
            remedy=remedy, precision=r.precision, param_dtype=r.param_dtype if r.param_dtype != "recorded"
            else (r.recorded_param_dtype or "recorded"), lr_scale=r.lr_scale, update_rounding=r.update_rounding,
            finite=r.carries, first_nonfinite_step=r.first_nonfinite_step, lost_share=r.lost_share,
            loss_before=before, loss_after=after,
            command=rerun_command(run.path, w, precision=precision, model=spec, loss=loss_spec, lr_scale=lr_scale,
                                  param_dtype=param_dtype, update_rounding=rounding))

    from .weight_updates import UpdateReach
    checks = RemedyChecks(window=window)
    try:
        checks.as_recorded = base = trial(None)
        reach = UpdateReach({name: t.dtype for name, t in w.params.items()})
        master = trial(UpdateRemedy.FP32_MASTER_WEIGHTS, precision=master_precision, param_dtype="float32",
                       init_scale=master_scale, watchers=(reach,))
        factor = reach.factor(KEEP_SHARE)
        checks.lr_scale_basis = factor
        results = {UpdateRemedy.FP32_MASTER_WEIGHTS: master,
                   UpdateRemedy.LARGER_LR: trial(UpdateRemedy.LARGER_LR, lr_scale=lr_factor(factor)),
                   UpdateRemedy.STOCHASTIC_ROUNDING: trial(UpdateRemedy.STOCHASTIC_ROUNDING, rounding="stochastic")}
    except LossNeededError as exc:
        return unchecked(remedies, Verification.NOT_RUN, window, loss_needed(exc.kept, command))
    except PostmortemError as exc:  # e.g. the model returns no loss: said, and the finding stands
        return unchecked(remedies, Verification.NOT_RUN, window, str(exc))
    checks.checks = [RemedyCheck(r, judge(results[r], base), results[r]) for r in remedies]
    return checks


def lr_factor(reach: float | None) -> float:
    """The learning-rate factor tried: `reach` rounded up to 1, 2 or 5 x
    10^k (a number a user types), at least 2, at most `MAX_LR_SCALE`;
    10 when nothing was measured."""
    if reach is None:  # no update measured: a decade
        return 10.0
    if not math.isfinite(reach):
        return MAX_LR_SCALE
    if reach <= 2.0:
        return 2.0
    decade = 10.0 ** math.floor(math.log10(reach))
    nice = next(m * decade for m in (1, 2, 5, 10) if m * decade >= reach * (1 - 1e-9))
    return min(MAX_LR_SCALE, nice)
