"""A remedy tried on every saved step of the run, not only the one it was
found on: a remedy that saves one step and leaves another non-finite only
moves the failure. Shared by the module-level fix (`fix.py`) and the
op-level one (`op_fix.py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import other_bundles, prepare_like, report_progress


def try_on_saved_steps(p, modules, progress=None, *, lines=()) -> list:
    """The fix tried on every saved step of the run (the replayed one
    first): a fix found on one step that leaves another non-finite only
    moves the failure. Each step is judged as the fix search judges
    (`whatif.judge`), as recorded and with `modules` (and the source
    `lines`, (file, line) pairs) in float32."""
    out = [StepCheck(p.step, saved=True, saved_as_recorded=False)]
    others = other_bundles(p)
    for i, (step, path) in enumerate(others):
        q = prepare_like(p, path, keep_inputs=True)
        as_recorded = q.trial()
        t = (q.trial(fp32_modules=tuple(modules), fp32_lines=tuple(lines)) if not as_recorded.saved
             else as_recorded)
        why = None
        if not t.saved:
            what = ", ".join([*modules, *(f"line {os.path.basename(f)}:{n}" for f, n in lines)])
            why = ("the float64 replay is non-finite too: no precision setting saves it"
                   if not q.reference_finite else f"with {what} in float32: {t.why}")
        out.append(StepCheck(step, saved=t.saved, saved_as_recorded=as_recorded.saved, why=why))
        report_progress(progress, "trying the fix on the saved steps", i + 1, len(others))
    return out


@dataclass(frozen=True)
class StepCheck:
    """A remedy tried on one saved step (`try_on_saved_steps`): whether it
    saves it, whether the step was saved as recorded already, and why not
    in one sentence (None when saved)."""
    step: int
    saved: bool
    saved_as_recorded: bool
    why: str | None = None

    def to_dict(self) -> dict:
        return {"step": self.step, "saved": self.saved, "saved_as_recorded": self.saved_as_recorded,
                "why": self.why}


def saved_steps(checks) -> list:
    return sorted(c.step for c in checks if c.saved)


def not_saved_steps(checks) -> list:
    return sorted(c.step for c in checks if not c.saved)
