"""Re-executions that did not reproduce their step.

The sentinel re-executes a step whose facts showed an event and compares
what the re-execution measured with what the step recorded (the recorder's
`step_rows.ReexecutionCheck`): the gradients' square sum, which parameters'
gradients were NaN/Inf, the loss. `differs` means the rows written for that
step are not those of the step as it ran: the step depends on something the
held state does not carry (a module whose behaviour changes from call to
call, state the loop changes between micro-batches, a data race), kernels
that are nondeterministic beyond rounding, or a faulty device. Such rows
are no evidence of the failing step, and the mismatch is a finding of its
own. Read from every rank's manifest (`reexecutions`): no shard is opened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..reading.loader import Run

DIFFERS = "differs"  # `ReexecutionCheck.DIFFERS`'s value in the manifest


@dataclass(frozen=True)
class Mismatch:
    """One re-execution that did not reproduce its step (`to_dict`: the
    summary finding's `evidence.mismatches`)."""
    step: int
    rank: int
    kind: str                     # the event that asked for it (`reexecute.KINDS`)
    recorded_nonfinite: int | None    # NaN/Inf parameter gradients the step recorded
    reexecuted_nonfinite: int | None  # ... and its re-execution measured
    recorded_loss: float | None
    reexecuted_loss: float | None

    def to_dict(self) -> dict:
        return {"step": self.step, "rank": self.rank, "kind": self.kind,
                "recorded_nonfinite_grads": self.recorded_nonfinite,
                "reexecuted_nonfinite_grads": self.reexecuted_nonfinite,
                "recorded_loss": _finite_or_none(self.recorded_loss),
                "reexecuted_loss": _finite_or_none(self.reexecuted_loss)}


def reexecution_mismatches(run: Run) -> list[Mismatch]:
    """Every re-execution the run's manifests record as `differs`, by step
    then rank (a hand-edited entry of the wrong shape is skipped)."""
    out: dict[tuple, Mismatch] = {}
    ranks = {min(run.ranks, default=0): run.manifest, **run.rank_manifests}
    for rank, manifest in ranks.items():
        entries = manifest.get("reexecutions") if isinstance(manifest, dict) else None
        for e in entries if isinstance(entries, list) else ():
            if not isinstance(e, dict) or e.get("check") != DIFFERS or not isinstance(e.get("step"), int):
                continue
            recorded = e.get("recorded") if isinstance(e.get("recorded"), dict) else {}
            again = e.get("reexecuted") if isinstance(e.get("reexecuted"), dict) else {}
            out[(e["step"], int(rank))] = Mismatch(
                e["step"], int(rank), str(e.get("kind")), _count(recorded.get("nonfinite_grads")),
                _count(again.get("nonfinite_grads")), _number(recorded.get("loss")), _number(again.get("loss")))
    return [out[k] for k in sorted(out)]


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finite_or_none(value: float | None) -> float | str | None:
    """A loss for JSON: NaN and Inf as their names."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
