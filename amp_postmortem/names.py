"""The analyzer's vocabulary, defined once and torch-free: how the root
module is shown, and the precisions, autocast policies and devices that the
API accepts and the CLI offers as choices."""
from __future__ import annotations

import enum

# The recorder names the root module "" (its name in `named_modules()`);
# people read it as this.
ROOT_DISPLAY = "(model)"

# Replay precisions, float64 (the reference) first.
PRECISIONS = ("fp64", "fp32", "fp16", "bf16")
# The precisions autocast runs in: what the what-ifs replay.
REDUCED_PRECISIONS = ("fp16", "bf16")
# `rerun --precision`: a saved window re-run as recorded or in one of these.
RERUN_PRECISIONS = ("recorded", "fp64", "fp32", "bf16", "fp16")
# `rerun --param-dtype` (the window's dtypes, or float32 master weights) and
# `--update-rounding` (of bfloat16/float16 parameters' updates).
PARAM_DTYPES = ("recorded", "float32")
UPDATE_ROUNDINGS = ("nearest", "stochastic")
# Whose autocast rules a float16/bfloat16 replay follows: the recording
# device type's, or CUDA's / the CPU's.
POLICIES = ("recorded", "cuda", "cpu")
DEVICES = ("cpu", "cuda")

# What `summary` can find, in the order it ranks findings of equal severity
# (a cause before its consequences); `--fail-on` takes these.
FINDING_KINDS = ("nonfinite", "training_instability", "scale_collapse", "stuck_low_scale", "unscaled_fp16_backward",
                 "loss_scaling_mistake", "fp16_reduction_overflow", "fp16_reduction_risk", "grad_underflow", "zero_gradients", "dtype_policy_mismatch", "lost_updates", "overflow_risk", "underflow_lapsed", "grad_subnormal", "reexecution_differs", "recording_disabled", "recording_not_closed", "healthy")


class Word(str, enum.Enum):
    """An outcome whose value is its `--json` string. A member equals that
    string and prints as it (`str()`, f-strings), so a user's code that
    compared a result's field with the string it held before these were
    enums (`scale(run).status == "collapse"`) keeps working; our own
    decisions compare members (tests/test_typed_decisions.py)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class BackwardStart(Word):
    """Where a replay's backward starts (`engine.ReplaySession`); `value`
    is the `--json` "backward_start"."""
    SAVED = "saved"                        # the step's saved output gradient
    SUBSTITUTE_MEAN = "substitute_mean"    # it was NaN/Inf: the gradient of the outputs' mean instead
    LOSS_FN = "loss_fn"                    # the gradient of `loss_fn` at the float64 outputs


class BackwardFrom(Word):
    """What a replayed run's backward was seeded at (`StepCapture`); `value`
    is the `--json` "backward_from" of a replayed loss-scale window."""
    LOSS = "loss"                          # the model's loss output, the scale in the loss's own dtype
    LOSS_FN = "loss_fn"                    # loss_fn's loss, scaled as GradScaler does
    OUTPUT_GRADIENT = "output_gradient"    # the saved gradient of the outputs, times the scale


def display_name(name) -> str:
    """A module name as people read it: the root module as `(model)`."""
    return ROOT_DISPLAY if name == "" else str(name)
