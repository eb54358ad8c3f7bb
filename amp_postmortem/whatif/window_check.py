"""A remedy checked over the steps that follow, not only the saved step.

A remedy found by replaying one saved step (`fix`'s modules or line in
float32, `scale-window`'s scale) says nothing of what the next steps do
with the weights it produces. `check_over_window` re-runs the saved window
holding the step (`rerun.py`) with the remedy in place from the window's
first step: the remedy is `VERIFIED` only when every step of the window
stays finite; otherwise it `FAILS` at a named step. Without a window the
check says `NO_WINDOW`: "verified on the saved step only", never more.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from recorders.format import schema

from ..analyses.precision_verdict import DEFAULT_WINDOW_STEPS, pick_window
from ..reading.window import load_window, window_spans, windows_off


class WindowStatus(enum.Enum):
    VERIFIED = "verified"      # the re-run with the remedy stays finite over the window
    FAILS = "fails"            # it goes non-finite at `failed_at`
    NO_WINDOW = "no_window"    # no saved window holds the step: checked on the saved step only
    NOT_RUN = "not_run"        # a window exists but could not be re-run (`why`)


@dataclass
class WindowCheck:
    status: WindowStatus
    remedy: str                     # the remedy in words
    window: list | None = None      # [first, last]
    failed_at: int | None = None
    skipped_steps: list | None = None
    recorded_failure: int | None = None   # the recorded run's first non-finite loss in the window
    why: str | None = None          # NOT_RUN: the re-run's error; NO_WINDOW: why the recorder kept none
                                    # (a sharded job's), or None

    @property
    def verified(self) -> bool:
        return self.status is WindowStatus.VERIFIED

    def to_dict(self) -> dict:
        return {"status": self.status.value, "verified": self.verified, "remedy": self.remedy,
                "window": self.window, "failed_at": self.failed_at, "skipped_steps": self.skipped_steps,
                "recorded_failure": self.recorded_failure, "why": self.why}

    def line(self) -> str:
        """The check in words (the one place they are made)."""
        if self.status is WindowStatus.VERIFIED:
            return (f"verified over the saved window: with {self.remedy} the re-run of steps {self.window[0]}-"
                    f"{self.window[1]} stays finite" + (f" (the scaler skipped step(s) "
                                                        f"{', '.join(map(str, self.skipped_steps))})"
                                                        if self.skipped_steps else ""))
        if self.status is WindowStatus.FAILS:
            return (f"NOT verified: with {self.remedy} the re-run of the saved window (steps {self.window[0]}-"
                    f"{self.window[1]}) goes non-finite at step {self.failed_at}: it saves the replayed step, "
                    "not the steps that follow")
        if self.status is WindowStatus.NOT_RUN:
            return ("verified on the saved step only, not over the following steps (the saved window of steps "
                    f"{self.window[0]}-{self.window[1]} could not be re-run: {self.why})")
        if self.why:
            return f"verified on the saved step only, not over the following steps (no window: {self.why})"
        return ("verified on the saved step only, not over the following steps (no window saved: record with "
                f"BundlePolicy(window_steps={DEFAULT_WINDOW_STEPS}) to check a remedy over the steps that follow)")


def run_of_bundle(bundle) -> Path | None:
    """The run directory holding a bundle at `bundles/step=N/rank=R`."""
    path = Path(getattr(bundle, "path", "") or "")
    if path.parent.parent.name == schema.BUNDLES_DIR:
        return path.parent.parent.parent
    return None


def check_over_window(run_dir, step: int, remedy: str, *, model, rank: int | None = None, fp32_modules=(),
                      fp32_lines=(), init_scale: float | None = None, precision: str = "recorded",
                      device: str = "cpu", policy: str = "recorded", loss_fn=None,
                      use_scaler: bool = True, loss=None, command: str = "rerun") -> WindowCheck:
    """Re-run the window holding `step` with the remedy from its first step.
    `loss`: the loop's loss (a callable or a `--loss` spec, as for `rerun`);
    `command`: the command the check is made for, named where it says how
    to add `--loss`."""
    from ..errors import PostmortemError
    from .rerun import LossNeededError, loss_needed, rerun_window
    span = pick_window(window_spans(run_dir, rank), step) if run_dir is not None else None
    if span is None:
        return WindowCheck(WindowStatus.NO_WINDOW, remedy, why=windows_off(run_dir))
    w = load_window(span["path"])
    lines = tuple((os.path.abspath(f), int(n)) for f, n in fp32_lines)
    try:
        r = rerun_window(run_dir, model=model, precision=precision, keep_fp32=tuple(fp32_modules), fp32_lines=lines,
                         init_scale=init_scale, device=device, policy=policy, loss_fn=loss_fn, window=w,
                         use_scaler=use_scaler, loss=loss)
    except LossNeededError as exc:  # the window kept the loop's loss and none was named: how to name it
        return WindowCheck(WindowStatus.NOT_RUN, remedy, [w.first_step, w.last_step],
                           why=loss_needed(exc.kept, command))
    except PostmortemError as exc:  # e.g. no loss to train on: the check is not made, and says so
        return WindowCheck(WindowStatus.NOT_RUN, remedy, [w.first_step, w.last_step], why=str(exc))
    status = WindowStatus.VERIFIED if r.carries else WindowStatus.FAILS
    return WindowCheck(status, remedy, [w.first_step, w.last_step], r.first_nonfinite_step, r.skipped_steps,
                       r.recorded_first_nonfinite_step)
