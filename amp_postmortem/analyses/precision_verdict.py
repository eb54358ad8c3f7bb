"""Precision or instability, decided by a counterfactual, or said undetermined.

A failing mixed-precision run is `training_instability` only when a float32
re-run of its saved window (`amp-postmortem rerun ... --precision fp32`,
`whatif/rerun.py`) diverges too; it is a precision problem when that re-run
stays finite over the same steps. Without a saved window, or without the
model to re-run it (`--model`), the recorded evidence (`instability.py`:
the loss rose, values grew) only makes instability *suspected*: the verdict
is `undetermined`, with the command that would decide it.

This module is torch-free: it reads which windows exist (window.json) and
words the verdict; `whatif/verdict.py` runs the re-run.
"""
from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass

from ..reading.window import window_spans, windows_off

DEFAULT_WINDOW_STEPS = 16  # what the record-again advice suggests


class Verdict(enum.Enum):
    TRAINING_INSTABILITY = "training_instability"   # the float32 re-run diverges too
    PRECISION = "precision"                         # the float32 re-run stays finite
    UNDETERMINED = "undetermined"                   # no re-run could be made


class Basis(enum.Enum):
    FP32_RERUN_DIVERGED = "fp32_rerun_diverged"
    FP32_RERUN_FINITE = "fp32_rerun_finite"
    NO_WINDOW = "no_window"                 # the run saved no window holding the failure
    NO_MODEL = "no_model"                   # a window exists; re-running it needs --model
    RERUN_FAILED = "rerun_failed"           # a window exists but could not be re-run (`why`)


@dataclass
class PrecisionVerdict:
    verdict: Verdict
    basis: Basis
    failure_step: int | None
    window: list | None = None             # [first, last] of the window used or available
    rerun_steps: list | None = None        # [from, to] re-run in float32
    diverged_at: int | None = None         # the float32 re-run's first non-finite step
    command: str | None = None             # what would decide it (undetermined), or what decided it
    why: str | None = None                 # RERUN_FAILED: the re-run's error

    @property
    def verified(self) -> bool:
        return self.verdict is not Verdict.UNDETERMINED

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "basis": self.basis.value, "verified": self.verified,
                "failure_step": self.failure_step, "window": self.window, "rerun_steps": self.rerun_steps,
                "diverged_at": self.diverged_at, "command": self.command, "why": self.why}

    def sentence(self) -> str:
        """The verdict in words (the one place they are made)."""
        b = self.basis
        if b is Basis.FP32_RERUN_DIVERGED:
            return (f"training instability, verified: a float32 re-run of steps {self.rerun_steps[0]}-"
                    f"{self.rerun_steps[1]} diverges too (non-finite at step {self.diverged_at})")
        if b is Basis.FP32_RERUN_FINITE:
            return (f"a precision problem, not training instability: a float32 re-run of steps "
                    f"{self.rerun_steps[0]}-{self.rerun_steps[1]} stays finite where the recorded run failed "
                    f"(step {self.failure_step})")
        if b is Basis.RERUN_FAILED:
            return (f"precision or instability undetermined: the saved window of steps {self.window[0]}-"
                    f"{self.window[1]} could not be re-run ({self.why}); {self.command}")
        if b is Basis.NO_MODEL:
            return (f"precision or instability undetermined: a window of steps {self.window[0]}-{self.window[1]} "
                    f"is saved; re-run it in float32 to decide: {self.command}")
        if self.why:  # windows were saved, none holding the failure
            return f"precision or instability undetermined: {self.why}; decide it by {self.command}"
        return ("precision or instability undetermined: no window of steps was saved to re-run in float32; "
                f"decide it by {self.command}")


def undetermined(run, failure_step: int | None, *, rank: int | None = None, model: str | None = None,
                 loss: str | None = None) -> PrecisionVerdict:
    """The verdict without a re-run: which window would decide it, and how
    (the exact command: `--loss` where the window kept the loop's loss;
    never advice to record what the run already holds)."""
    target = shlex.quote(str(run.path))
    spans = window_spans(run.path, rank)
    span = pick_window(spans, failure_step)
    model_words = shlex.quote(model) if model else "SPEC"
    if span is None:
        compare = f"training the job in float32 and running `amp-postmortem compare FP32_RUN {target}`"
        off = windows_off(run.path)
        why = None
        if off:
            command = f"{compare} (the recorder keeps no window here: {off})"
        elif spans:
            saved = ", ".join(f"{s['first_step']}-{s['last_step']}" for s in spans)
            why = (f"the run saved window(s) of steps {saved}, none holding the failure at step {failure_step} "
                   "(an older recorder opened its one window at the first bundle trigger, or max_window_bytes "
                   "ran out)")
            command = (f"recording again with this version (a window opens at the first non-finite loss or "
                       f"forward value, and more than one is kept within max_window_bytes) and running "
                       f"`amp-postmortem summary {target} --model {model_words}`, or by {compare}")
        else:
            command = (f"recording again with AmpRecorder(..., window_steps={DEFAULT_WINDOW_STEPS}) (a loop that "
                       f"computes its loss outside the model: AmpRecorder(..., loss_fn=criterion), or `amp-postmortem "
                       f"record --loss criterion -- python train.py`, which keep the targets too) and running `amp-postmortem summary {target} --model {model_words}`, "
                       f"or by {compare}")
        return PrecisionVerdict(Verdict.UNDETERMINED, Basis.NO_WINDOW, failure_step, command=command, why=why)
    first, last = span["first_step"], span["last_step"]
    loss_words = ""
    if loss or span.get("loss"):
        loss_words = f" --loss {shlex.quote(loss) if loss else 'FILE.py:NAME'}"
    command = (f"amp-postmortem rerun {target} --from {first} --steps {last - first + 1} --precision fp32 "
               f"--model {model_words}{loss_words} (or `amp-postmortem summary {target} --model {model_words}"
               f"{loss_words}`)")
    if span.get("loss") and not loss:
        command += (f"; FILE.py:NAME: your own file and the loss the loop calls ({span['loss'].rpartition('.')[2]} "
                    "was recorded)")
    return PrecisionVerdict(Verdict.UNDETERMINED, Basis.NO_MODEL, failure_step, window=[first, last],
                            command=command)


def pick_window(spans: list, failure_step: int | None):
    """The window holding the failure step (else the first one after it
    started; else None: a window wholly before the failure says nothing)."""
    if not spans:
        return None
    if failure_step is None:
        return spans[0]
    holding = [s for s in spans if s["first_step"] <= failure_step <= s["last_step"]]
    return holding[0] if holding else None


def from_rerun(failure_step: int | None, result, command: str) -> PrecisionVerdict:
    """The verdict of a float32 re-run (`whatif.rerun.RerunResult`)."""
    steps = [result.from_step, result.to_step]
    window = list(result.window_steps)
    if result.carries:
        return PrecisionVerdict(Verdict.PRECISION, Basis.FP32_RERUN_FINITE, failure_step, window, steps,
                                None, command)
    return PrecisionVerdict(Verdict.TRAINING_INSTABILITY, Basis.FP32_RERUN_DIVERGED, failure_step, window, steps,
                            result.first_nonfinite_step, command)
