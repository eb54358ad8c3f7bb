"""The op-level remedy `fix` tries before whole modules: the culprit's
operation, at its line of the model's source, run in float32.

`find_op_fix(prepared, run, culprit)`:

1. The culprit module's op trace (`replaying.op_trace`) names the op: the first
   whose output turned NaN/Inf from finite inputs (`chosen_by` "origin"),
   else the reduced-precision op with the largest error of its own against
   float64 ("local_error"). An op called from torch code only (a leaf
   module replayed alone: no line of the model's) has no line to patch
   (`OpFixStatus.NO_LINE`).
2. The step is replayed with that line in float32 (`RunConfig.fp32_lines`:
   autocast off inside the line, its float16 inputs cast to float32, as the
   printed patch does; `replay/fp32_lines.py`) and judged by the one
   criterion of fix (`whatif.judge`), then tried on every other saved step
   of the run (`saved_steps.try_on_saved_steps`).
3. The patch is written from the line's text and the variables the replay
   cast (`line_patch.py`): an exact rewrite, or the autocast-disabled block
   when none can be written.
4. Its cost: the forward's reduced-precision work it moves to float32
   (`replaying.op_cost`), to rank it against the module-level fix.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from recorders.format import schema

from ..names import Word
from ..op_words import op_origin_text
from . import Trial, fmt_num
from .line_patch import LinePatch, NotExact, line_patch
from .saved_steps import try_on_saved_steps

__all__ = ["ChosenBy", "OpFix", "OpFixStatus", "chosen_op", "find_op_fix", "work_cost", "work_words"]

_REDUCED_DTYPES = ("float16", "bfloat16")


class OpFixStatus(enum.Enum):
    SAVED = "saved"                  # the line in float32 saves the step and every other saved step
    MOVES_FAILURE = "moves_failure"  # it saves this step, not every other saved step
    NOT_SAVED = "not_saved"          # it does not save the step
    NO_LINE = "no_line"              # the op runs in torch code only: no line of the model's to patch
    NO_OP = "no_op"                  # the op trace names no op (no culprit, or it could not be traced)


class ChosenBy(Word):
    """Why the op whose line is tried was chosen; `value` is the `--json` "chosen_by"."""
    ORIGIN = "origin"                # it made NaN/Inf from finite inputs
    LOCAL_ERROR = "local_error"      # the reduced-precision op with the largest error of its own


@dataclass
class OpFix:
    status: OpFixStatus
    module: str | None = None           # the traced culprit
    op: dict | None = None              # op_trace.OpRecord.to_dict() of the op whose line was tried
    chosen_by: ChosenBy | None = None
    trial: Trial | None = None          # the step with the line in float32: metrics and judgement
    patch: LinePatch | None = None
    saved_steps_check: list = field(default_factory=list)   # [saved_steps.StepCheck]
    fp32_flops: float | None = None     # forward work moved from float16/bfloat16 to float32
    fp32_share: float | None = None     # ... as a share of the recorded forward's reduced-precision work
    why_none: str | None = None         # NO_OP: the trace's status or error

    @property
    def saves_step(self) -> bool:
        return self.status in (OpFixStatus.SAVED, OpFixStatus.MOVES_FAILURE)

    @property
    def where(self) -> str | None:
        return f"{self.op['file']}:{self.op['line']}" if self.op and self.op.get("file") else None

    def to_dict(self) -> dict:
        return {"status": self.status.value, "module": self.module, "op": self.op,
                "chosen_by": self.chosen_by.value if self.chosen_by else None,
                "where": self.where, "saved": self.saves_step,
                "trial": self.trial.to_dict() if self.trial is not None else None,
                "patch": self.patch.to_dict() if self.patch else None,
                "saved_steps_check": [c.to_dict() for c in self.saved_steps_check],
                "saved_steps": sorted(c.step for c in self.saved_steps_check if c.saved),
                "not_saved_steps": sorted(c.step for c in self.saved_steps_check if not c.saved),
                "fp32_flops": self.fp32_flops, "fp32_share": self.fp32_share, "why_none": self.why_none}

    def lines(self) -> list[str]:
        """The op-level remedy in words (FixReport.lines prints them first)."""
        if self.status is OpFixStatus.NO_OP:
            return [f"op level: no op to patch ({self.why_none})"]
        op = op_origin_text(self.op)
        what = "first op made NaN/Inf from finite inputs" if self.chosen_by is ChosenBy.ORIGIN else \
            "op with the largest error of its own"
        if self.status is OpFixStatus.NO_LINE:
            return [f"op level: the culprit's {what}, {op}, runs in torch code only (no line of the model's "
                    "to patch): a module in float32 is the remedy"]
        if self.status is OpFixStatus.NOT_SAVED:
            return [f"op level: the line of the culprit's {what}, {op}, in float32 does not save the step "
                    f"({self.trial.why})"]
        out = [f"op-level fix: run the line of the culprit's {what} in float32: {op}",
               f"  at {self.where}, replace the line with (indented as it is):"]
        out += ["      " + line for line in self.patch.text.splitlines()]
        if self.trial.backed_off:
            out.append(f"  (finite once the scaler backs off to loss scale {self.trial.loss_scale:g}, "
                       f"{self.trial.backoffs} halving(s) below the recorded one)")
        if not self.patch.exact:
            out.append(f"  no exact rewrite ({_NOT_EXACT_WORDS[self.patch.reason]}): cast the line's float16 inputs "
                       "to float32 (.float()) inside the block; the replay ran the line that way")
        if self.status is OpFixStatus.MOVES_FAILURE:
            bad = sorted(c.step for c in self.saved_steps_check if not c.saved)
            out.append(f"  it does NOT save saved step(s) {', '.join(map(str, bad))}: it only moves the failure")
        out.append(f"  extra float32 work: {work_words(self.fp32_flops, self.fp32_share)}")
        return out


_NOT_EXACT_WORDS = {
    NotExact.NO_SOURCE: "the line's text could not be read",
    NotExact.NOT_A_STATEMENT: "the line is part of a statement over several lines, or a block's header",
    NotExact.INPUT_NOT_A_VARIABLE: "a float16 input of the line is not one of its variables (an attribute, a "
                                   "list, a call's result)",
    NotExact.NO_INPUT: "no float16 input reached the line",
}


def work_words(flops, share) -> str:
    """`1.02e+03 FLOPs per forward (8.1% of its float16/bfloat16 work)`."""
    if flops is None:
        return "not measured"
    return f"{fmt_num(flops)} FLOPs per forward" + (
        f" ({share:.1%} of its float16/bfloat16 work)" if share is not None else "")


def work_cost(p, **changes) -> tuple:
    """(FLOPs moved to float32, share of the recorded forward's reduced
    work, what the float32 lines were handed) of the configuration `changes`."""
    base, _ = p.session.reduced_work(p.config)
    now, seen = p.session.reduced_work(p.config.replace(**changes))
    moved = max(0.0, base - now)
    return moved, (moved / base if base > 0 else None), seen


def chosen_op(trace):
    """(the op whose line to try, why): the trace's origin, else its
    reduced-precision op with the largest error of its own; (None, None)."""
    if trace.origin is not None:
        return trace.origin, ChosenBy.ORIGIN
    reduced = [o for o in trace.ops if o.dtype in _REDUCED_DTYPES and o.local_rel_err is not None]
    if not reduced:
        return None, None
    return max(reduced, key=lambda o: o.local_rel_err), ChosenBy.LOCAL_ERROR


def find_op_fix(p, run, culprit, progress=None) -> OpFix:
    """The culprit's op at its line in float32: tried, verified, costed (see
    the module's doc). `run`: the recorded precision's captured replay the
    candidates were ranked on; `culprit`: `attribution.find_culprit`'s."""
    from ..replaying import attribution, op_trace
    if culprit is None or culprit["name"] == schema.LOSS_NAME:
        return OpFix(OpFixStatus.NO_OP, why_none="no module's own arithmetic is broken: no culprit to trace"
                     if culprit is None else "the loss function is the culprit, not a module")
    reference = p.reference_for(None, keep_inputs=True)
    trace = op_trace.trace_module(p.session, reference, run, culprit["name"])
    op, chosen = chosen_op(trace)
    if op is None:
        return OpFix(OpFixStatus.NO_OP, module=culprit["name"],
                     why_none=trace.error or f"no op of {culprit['name'] or 'the model'} made NaN/Inf or ran in a "
                                             "reduced precision")
    fix = OpFix(OpFixStatus.NO_LINE, module=culprit["name"], op=op.to_dict(), chosen_by=chosen)
    if op.source is None:
        return fix
    key = (os.path.abspath(op.source.file), op.source.line)
    fix.trial = p.trial(fp32_lines=(key,))
    if not fix.trial.saved:
        fix.status = OpFixStatus.NOT_SAVED
        return fix
    fix.saved_steps_check = try_on_saved_steps(p, (), progress, lines=(key,))
    fix.status = (OpFixStatus.SAVED if all(c.saved for c in fix.saved_steps_check)
                  else OpFixStatus.MOVES_FAILURE)
    fix.fp32_flops, fix.fp32_share, seen = work_cost(p, fp32_lines=(key,))
    inputs = seen.get(key)
    fix.patch = line_patch(op.source.code, inputs.variables if inputs else (), others=inputs.others if inputs else 0,
                           device_type=p.policy_dict().get("device_type") or "cuda")
    return fix
