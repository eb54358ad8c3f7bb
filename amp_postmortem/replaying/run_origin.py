"""The op origin of a run's failure, for `nans` and `summary` given a model:
one saved step replayed (`replay()`) in its recorded precision, and the
first operation of the culprit whose output turned NaN/Inf from finite
inputs (`op_trace.py`), with its source line.

    origin = op_origin_of_run(run, model="train.py:make_model", forward_step=79)
    origin.status            # OpOriginStatus.FOUND
    origin.to_dict()["op"]   # op_trace.OpRecord.to_dict(): op, file, line, code, dtype...

Which bundle: `step` when given (`--step`, as `replay` and `recommend`
take it); else the bundle saved at the step of the forward origin `nans`
found (the failing step, when the recorder saved it); else the bundle that
`recommend` would replay (`analyses.bundle_choice.pick_bundle`). The model
is the user's (`--model`, its rules in `model_spec.py`): nothing a run's
data names is imported, and without a model nothing here runs.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["OpOriginStatus", "RunOpOrigin", "op_origin_of_run"]


class OpOriginStatus(enum.Enum):
    FOUND = "found"          # the replay named the op
    NO_OP = "no_op"          # replayed: no culprit, or no op of it made NaN/Inf from finite inputs
    NO_BUNDLE = "no_bundle"  # the run saved no replay bundle (of the rank asked for)


@dataclass(frozen=True)
class RunOpOrigin:
    status: OpOriginStatus
    step: int | None = None
    rank: int | None = None
    chosen_by: str | None = None   # "asked" (--step) | "origin_step" | "bundle_priority"
    precision: str | None = None
    reproduced: bool | None = None
    culprit: dict | None = None    # replay's culprit
    op: dict | None = None         # op_trace.OpRecord.to_dict()
    nonfinite_weights: tuple = ()  # the bundle's parameters holding NaN/Inf: the step ran on them

    def to_dict(self) -> dict:
        return {"status": self.status.value, "step": self.step, "rank": self.rank, "chosen_by": self.chosen_by,
                "precision": self.precision, "reproduced": self.reproduced, "culprit": self.culprit,
                "op": self.op, "nonfinite_weights": list(self.nonfinite_weights)}


def op_origin_of_run(run, *, model, step: int | None = None, rank: int | None = None,
                     forward_step: int | None = None, device: str = "cpu", policy: str = "recorded",
                     loss_fn=None) -> RunOpOrigin:
    """Replay one saved step of `run` (see the module's doc) and say its op origin."""
    from ..reading import bundle as bundles
    from ..analyses.bundle_choice import pick_bundle
    from . import recorded_precision, replay
    saved = [(s, r) for s, r, _ in bundles.list_bundles(run.path) if rank is None or r == rank]
    if step is not None:
        chosen, at = "asked", (step, rank)
    elif forward_step is not None and any(s == forward_step for s, _ in saved):
        chosen, at = "origin_step", (forward_step, min(r for s, r in saved if s == forward_step))
    else:
        picked = pick_bundle(run, rank)
        if picked is None:
            return RunOpOrigin(OpOriginStatus.NO_BUNDLE)
        chosen, at = "bundle_priority", picked[:2]
    bundle = bundles.load_bundle(bundles.find_bundle(run.path, at[0], at[1]))
    precision = recorded_precision(bundle)
    result = replay(bundle, run_dir=run.path, model=model, device=device, policy=policy, loss_fn=loss_fn,
                    precisions=(precision,))
    return RunOpOrigin(OpOriginStatus.FOUND if result.op_origin else OpOriginStatus.NO_OP, step=bundle.step,
                       rank=bundle.rank, chosen_by=chosen, precision=precision, reproduced=result.reproduced,
                       culprit=result.culprit, op=result.op_origin,
                       nonfinite_weights=tuple(bundle.nonfinite_params()))
