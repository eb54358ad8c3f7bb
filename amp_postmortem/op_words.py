"""The words of an op trace (`op_trace.py`), said once for every command
that shows one: `replay`, `nans`, `summary` (`run_origin.py`), `fix` and `report`. They read the
plain data of `replay --json` (`ModuleOpTrace.to_dict()`), so a report made from a
saved `replay --json` says the same as the replay did. No torch: `report` runs
without it."""
from __future__ import annotations

from .names import ROOT_DISPLAY

# The op trace's status, in words (keys: `op_trace.TraceStatus` values).
_STATUS_WORDS = {
    "origin": "an op made NaN/Inf from finite inputs",
    "inputs_nonfinite": "NaN/Inf only carried in from its inputs",
    "finite": "every op's output is finite",
    "not_traced": "not traced",
}


def _module(name) -> str:
    return ROOT_DISPLAY if name == "" else str(name)


def op_origin_text(op: dict) -> str:
    """`aten::bmm at models.py:77 (logits = q @ k.transpose(-1, -2)) in
    blocks.1.attn.forward, float16`."""
    if op.get("file"):
        where = f" at {op['file']}:{op['line']}" + (f" ({op['code']})" if op.get("code") else "")
    else:
        where = " (called from torch code only: no line of the model's)"
    frame_module = op.get("frame_module")
    if frame_module is not None:
        inside = f"{_module(frame_module)}.{op['function']}"
        if op.get("module") not in (None, frame_module):
            inside += f" (inside {_module(op['module'])})"  # a torch module called at that line
    elif op.get("function"):
        inside = f"{op['function']} (inside {_module(op.get('module'))})"
    else:
        inside = _module(op.get("module"))
    return f"{op['op']}{where} in {inside}, {op.get('dtype') or '-'}"


def trace_line(trace: dict) -> str:
    """One line per traced module: where its first non-finite op is, or why none."""
    head = f"op trace of {_module(trace['module'])} ({trace['precision']}"
    if trace.get("micro_batch") is not None:
        head += f", micro-batch {trace['micro_batch']}, call {trace['call']}"
    head += f", {trace.get('ops_seen', 0)} ops"
    if trace.get("ops_seen", 0) > trace.get("ops_recorded", 0):
        head += f", the first {trace.get('max_ops')} recorded"
    head += ")"
    if trace.get("origin"):
        return f"{head}: first non-finite from finite inputs: {op_origin_text(trace['origin'])}"
    words = _STATUS_WORDS.get(trace.get("status"), str(trace.get("status")))
    return f"{head}: {words}" + (f" ({trace['error']})" if trace.get("error") else "")


def trace_rows(trace: dict) -> list:
    """Table rows (op, line, dtype, absmax, local error, NaN/Inf) of one trace."""
    rows = []
    for op in trace.get("ops") or []:
        line = f"{op['file']}:{op['line']}" if op.get("file") else "-"
        rows.append({"op": op["op"], "line": line, "code": op.get("code") or "", "dtype": op.get("dtype"),
                     "absmax": op.get("absmax"), "local_rel_err": op.get("local_rel_err"),
                     "nonfinite": (op.get("nan") or 0) + (op.get("inf") or 0),
                     "origin": bool(trace.get("origin")) and op.get("index") == trace["origin"].get("index")})
    return rows


def run_op_origin_line(origin: dict) -> str:
    """`nans` and `summary` given a model (`replaying/run_origin.py`): the op
    origin of the replayed step, and which step it is."""
    if origin["status"] == "no_bundle":
        return "op origin: not found: the run saved no replay bundle (see the recorder's bundle options)"
    fidelity = {True: "reproduced", False: "NOT reproduced", None: "reproduction unknown"}[origin.get("reproduced")]
    why = {"asked": "the step asked for", "origin_step": "the forward origin's step",
           "bundle_priority": "the bundle recommend would replay"}.get(origin.get("chosen_by"), "")
    head = f"op origin (replay of step {origin['step']}, rank {origin['rank']}: {why}, {fidelity})"
    if origin["status"] == "found":
        return f"{head}: {op_origin_text(origin['op'])}"
    weights = origin.get("nonfinite_weights") or []
    if weights:
        return (f"{head}: none: the step ran on weights already NaN/Inf in the bundle "
                f"({', '.join(weights[:5])}{', ...' if len(weights) > 5 else ''}), which no op of the step made")
    culprit = origin.get("culprit")
    if culprit is None:
        return f"{head}: none (no module's own arithmetic is broken in the {origin.get('precision')} replay)"
    return f"{head}: none (no op of the culprit {_module(culprit['name'])} made NaN/Inf from finite inputs)"
