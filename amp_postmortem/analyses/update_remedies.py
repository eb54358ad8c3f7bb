"""Whether the remedies of lost updates work: the verdict of re-running a
saved window with each (`whatif/update_trials.py` runs them), and its
words, made here once.

Each remedy of `updates.UpdateRemedy` is a trial of the window's steps,
compared with the same steps re-run as recorded. Every trial says the
share of its optimizer updates that left the weights unchanged
(`lost_share`) and how far its training moved the loss: the mean float32
loss of the window's batches with the weights before the window minus
after it (`loss_drop`, the same yardstick for every trial whatever
precision it trained in, so that a forward's rounding is not read as
learning). `judge` decides, on those numbers alone:

- the as-recorded re-run must lose updates as the run did (at least
  `LOST_SHARE`), else it does not reproduce the failure and no comparison
  with it proves anything (`NOT_REPRODUCED`);
- a remedy is `VERIFIED` when its re-run stays finite, keeps the updates
  (lost share below `LOST_SHARE`; stochastic rounding keeps them in
  expectation, not at each step, so it is judged on the loss alone) and
  its loss falls by more than the as-recorded re-run's by at least
  `GAIN` of that fall (and more than float32's evaluation noise,
  `NOISE` of the loss);
- otherwise it says why not: `NONFINITE`, `UPDATES_STILL_LOST`,
  `NO_GAIN`; and `NO_WINDOW`, `NO_MODEL`, `NOT_RUN` when no trial ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..names import Word
from .updates import LOST_SHARE, UpdateRemedy

GAIN = 0.5        # the remedy's loss falls at least 1.5x as far as the as-recorded re-run's
NOISE = 1e-5      # relative: float32 sums of the same batches in another order differ by far less
KEEP_SHARE = 0.9  # the larger learning rate is the one at which 90% of the float32 trial's updates would land


class Verification(Word):
    """What the re-run of the window says of a remedy; `value` is the
    `--json` "status"."""
    VERIFIED = "verified"                      # kept the updates and the loss fell further than as recorded
    UPDATES_STILL_LOST = "updates_still_lost"  # its re-run still loses a quarter of the updates or more
    NO_GAIN = "no_gain"                        # the updates landed but the loss fell no further
    NONFINITE = "nonfinite"                    # its re-run went NaN/Inf
    NOT_REPRODUCED = "not_reproduced"          # the as-recorded re-run kept its updates: nothing to compare
    NO_WINDOW = "no_window"                    # the run saved no window of steps
    NO_MODEL = "no_model"                      # a window is saved; re-running it needs --model
    NOT_RUN = "not_run"                        # the re-run failed (`why`)


@dataclass(frozen=True)
class UpdateTrial:
    """One re-run of the window (`remedy` None: as recorded)."""
    remedy: UpdateRemedy | None
    precision: str                 # the re-run's autocast: fp32 (none), bf16, fp16
    param_dtype: str               # the parameters' dtype in it
    lr_scale: float
    update_rounding: str           # nearest, stochastic
    finite: bool
    first_nonfinite_step: int | None
    lost_share: float | None
    loss_before: float | None      # mean float32 loss of the window's batches, weights before
    loss_after: float | None       # ... and after the re-run
    command: str                   # the `rerun` command that repeats it

    @property
    def loss_drop(self) -> float | None:
        if self.loss_before is None or self.loss_after is None:
            return None
        return self.loss_before - self.loss_after

    def to_dict(self) -> dict:
        return {"remedy": None if self.remedy is None else self.remedy.value, "precision": self.precision,
                "param_dtype": self.param_dtype, "lr_scale": self.lr_scale, "update_rounding": self.update_rounding,
                "finite": self.finite, "first_nonfinite_step": self.first_nonfinite_step,
                "lost_share": self.lost_share, "loss_before": self.loss_before, "loss_after": self.loss_after,
                "loss_drop": self.loss_drop, "command": self.command}


@dataclass
class RemedyCheck:
    remedy: UpdateRemedy
    status: Verification
    trial: UpdateTrial | None = None
    why: str | None = None         # NOT_RUN: the re-run's error

    @property
    def verified(self) -> bool:
        return self.status is Verification.VERIFIED

    def to_dict(self) -> dict:
        return {"remedy": self.remedy.value, "status": self.status.value, "verified": self.verified,
                "trial": None if self.trial is None else self.trial.to_dict(), "why": self.why}


@dataclass
class RemedyChecks:
    """The remedies of a run's lost updates, each checked (or why not)."""
    window: list | None = None                 # [first, last] of the window re-run
    as_recorded: UpdateTrial | None = None
    checks: list = field(default_factory=list)  # RemedyCheck, in `UpdateRemedy` order
    lr_scale_basis: float | None = None        # the factor at which KEEP_SHARE of the float32 updates land

    def get(self, remedy: UpdateRemedy) -> RemedyCheck | None:
        return next((c for c in self.checks if c.remedy is remedy), None)

    def to_dict(self) -> dict:
        return {"window": self.window, "as_recorded": None if self.as_recorded is None else self.as_recorded.to_dict(),
                "remedies": [c.to_dict() for c in self.checks], "lr_scale_basis": self.lr_scale_basis}


def unchecked(remedies, status: Verification, window=None, why: str | None = None) -> RemedyChecks:
    """Every remedy with the same reason it was not re-run."""
    return RemedyChecks(window=window, checks=[RemedyCheck(r, status, why=why) for r in remedies])


def judge(trial: UpdateTrial, as_recorded: UpdateTrial) -> Verification:
    """The verdict on one remedy's trial against the as-recorded re-run
    (see the module's doc)."""
    if not reproduced(as_recorded):
        return Verification.NOT_REPRODUCED
    if not trial.finite:
        return Verification.NONFINITE
    if trial.remedy is not UpdateRemedy.STOCHASTIC_ROUNDING and (
            trial.lost_share is None or trial.lost_share >= LOST_SHARE):
        return Verification.UPDATES_STILL_LOST
    drop, base = trial.loss_drop, as_recorded.loss_drop
    if drop is None or base is None:
        return Verification.NO_GAIN
    floor = NOISE * abs(as_recorded.loss_before)
    if drop > floor and drop - base > max(floor, GAIN * abs(base)):
        return Verification.VERIFIED
    return Verification.NO_GAIN


def reproduced(as_recorded: UpdateTrial) -> bool:
    """The as-recorded re-run lost updates as the recorded run did."""
    return (as_recorded.finite and as_recorded.lost_share is not None and as_recorded.lost_share >= LOST_SHARE
            and as_recorded.loss_drop is not None)


# words
_REMEDY_NAMES = {UpdateRemedy.FP32_MASTER_WEIGHTS: "float32 master weights",
                 UpdateRemedy.LARGER_LR: "a larger learning rate",
                 UpdateRemedy.STOCHASTIC_ROUNDING: "stochastic rounding"}


def remedy_name(remedy: UpdateRemedy) -> str:
    return _REMEDY_NAMES[remedy]


def _trial_words(t: UpdateTrial) -> str:
    what = []
    if t.remedy is UpdateRemedy.LARGER_LR:
        what.append(f"learning rate x{t.lr_scale:g}")
    if t.lost_share is None:
        lost = ""
    elif t.remedy is UpdateRemedy.STOCHASTIC_ROUNDING:
        # A weight moves a whole ulp on some steps: most steps leave it, the sum of the updates lands.
        lost = f"{t.lost_share:.1%} of the steps' updates leave the weight as it was, kept in expectation, "
    else:
        lost = f"{t.lost_share:.1%} of updates lost, "
    drop = "loss not measured" if t.loss_drop is None else f"loss fell {t.loss_drop:.4g}"
    return ", ".join(what + [lost + drop])


def check_line(check: RemedyCheck, checks: RemedyChecks, *, named: bool = True) -> str:
    """One remedy's check in words (the one place they are made);
    `named=False`: without the remedy's name in front (a check that holds
    for every remedy, said once)."""
    return (remedy_name(check.remedy) + ": " if named else "") + _check_words(check, checks)


def _check_words(check: RemedyCheck, checks: RemedyChecks) -> str:
    base = checks.as_recorded
    span = f"steps {checks.window[0]}-{checks.window[1]}" if checks.window else "the saved window"
    versus = (f" vs as recorded {base.lost_share:.1%} lost, loss fell {base.loss_drop:.4g}"
              if base is not None and base.lost_share is not None and base.loss_drop is not None else "")
    s = check.status
    if s is Verification.VERIFIED:
        return f"verified by re-running {span} ({_trial_words(check.trial)}{versus})"
    if s is Verification.NO_WINDOW:
        return ("not verified, the run saved no window of steps to re-run (record with "
                "BundlePolicy(window_steps=K): the first recorded step that loses half of its updates then "
                "keeps one)")
    if s is Verification.NO_MODEL:
        return f"not verified yet, re-run {span} with --model SPEC (summary or recommend) to verify it"
    if s is Verification.NOT_RUN:
        return f"not verified, the re-run of {span} failed: {check.why}"
    if s is Verification.NOT_REPRODUCED:
        lost = "" if base is None or base.lost_share is None else f" (it lost {base.lost_share:.1%})"
        return (f"not verified, the re-run of {span} as recorded does not lose the updates the run "
                f"lost{lost}: nothing to compare with (is --model the model the run trained?)")
    if s is Verification.NONFINITE:
        return (f"NOT verified, its re-run of {span} goes non-finite at step "
                f"{check.trial.first_nonfinite_step}")
    if s is Verification.UPDATES_STILL_LOST:
        return f"NOT verified, its re-run of {span} still loses updates ({_trial_words(check.trial)})"
    return (f"NOT verified, its re-run of {span} keeps the updates but the loss falls no further than "
            f"as recorded ({_trial_words(check.trial)}{versus})")
