"""Float16 reductions that overflow where float32 would not: JAX code
written in explicit float16 (a Flax model with `dtype=jnp.float16`) whose
module sums many values into a float16 output: a sum pooling, a softmax's
normaliser or a hand-written norm over a long axis.

The Flax recorder records every module's output in execution order,
children before their parent (`activation` rows: dtype, `numel`, largest
finite magnitude, NaN/Inf counts). A module is flagged at a step when its
output is the step's first non-finite row, is float16, and the row before
it (its input, or its last child's output) is finite with more values:

- it reduces: `values_per_output` = the input's values per output value
  (at least 2);
- float16 overflowed: the largest possible sum, `bound` = the input's
  largest magnitude times `values_per_output`, reaches float16's 65504;
- float32 would not: `bound` stays below float32's 3.4e38.

The remedy is to compute the reduction in float32 and cast back only what
float16 holds (`jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)`).

Flax runs only: the PyTorch and Keras recorders' rows carry each module's
own input count (`input_nonfinite`), and their `nonfinite` origin says the
same. `find_fp16_reductions(run)`: other runs have no reductions.

A reduction inside a module's `__call__` (attention weights by hand), or
one that loses precision without overflowing, leaves no row. The JAX
recorders read the step's program once and write its float16/bfloat16
reductions into the manifest's `jax_reductions` (`recorders/jax_program.py`,
docs/FORMAT.md): `sites`, one `ReductionSite` each (pattern, dtype, values
per output, the user's source line), and `program`, whether it was read
(`Program`: a JAX run without the entry was not traced: undetermined, never
"none"). A site is a risk, not a failure: `overflowed_at` names the modules
of the site's class whose overflow the rows show, when any. Nothing the
run names is imported or run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recorders.format import schema

from ..names import Word
from ..reading.loader import Run

FLOAT16_MAX = 65504.0
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The first steps with a non-finite forward row read in full: the overflow
# of a reduction repeats at every step, and reading every failing step of a
# long run would cost a scan of the run.
STEPS_READ = 16
_COLUMNS = ["step", "rank", "name", "order", "call", "dtype", "numel", "absmax", "nan_count", "inf_count"]


@dataclass(frozen=True)
class Fp16Reduction:
    """One module whose float16 reduction overflowed (see the module's doc)."""
    module: str
    first_step: int
    steps: tuple            # the steps read where it was the first non-finite row
    input_absmax: float     # the largest magnitude of the row before it, at `first_step`
    values_per_output: int
    bound: float            # input_absmax * values_per_output

    def to_dict(self) -> dict:
        return {"module": self.module, "first_step": self.first_step, "steps": list(self.steps),
                "input_absmax": self.input_absmax, "values_per_output": self.values_per_output,
                "bound": self.bound}


class Program(Word):
    """Whether the run's step program was read for float16 reductions."""
    TRACED = "traced"
    NOT_TRACED = "not_traced"   # a JAX run without `jax_reductions`: undetermined
    FAILED = "failed"           # the recorder could not read it (`trace_error`): undetermined
    NOT_JAX = "not_jax"         # a PyTorch or TensorFlow run: no JAX program to read


@dataclass(frozen=True)
class ReductionSite:
    """One float16/bfloat16 reduction of the step's program (the manifest's
    `jax_reductions.sites`, docs/FORMAT.md)."""
    pattern: str               # schema.JAX_REDUCTION_PATTERNS
    dtype: str                 # the values' dtype
    accumulation_dtype: str    # the dtype the reduction adds in (float32: jnp's upcast)
    values_per_output: int
    shifted: bool | None       # softmax family: the max subtracted before exp
    file: str | None
    line: int | None
    function: str | None
    phase: str                 # forward, backward
    count: int = 1
    overflowed_at: tuple = ()  # modules of its class whose float16 output the rows show overflowing

    def to_dict(self) -> dict:
        return {"pattern": self.pattern, "dtype": self.dtype, "accumulation_dtype": self.accumulation_dtype,
                "values_per_output": self.values_per_output, "shifted": self.shifted, "file": self.file,
                "line": self.line, "function": self.function, "phase": self.phase, "count": self.count,
                "overflowed_at": list(self.overflowed_at)}


@dataclass
class Fp16Reductions:
    reductions: list = field(default_factory=list)   # Fp16Reduction, earliest first
    steps_read: int = 0
    program: Program = Program.NOT_JAX
    program_step: int | None = None   # the step whose program was read
    trace_error: str | None = None
    sites: list = field(default_factory=list)        # ReductionSite, forward first, in program order
    sites_dropped: int = 0

    @property
    def risks(self) -> list:
        """The forward sites whose overflow the rows do not show."""
        return [s for s in self.sites if s.phase == "forward" and not s.overflowed_at]

    def to_dict(self) -> dict:
        return {"reductions": [r.to_dict() for r in self.reductions], "steps_read": self.steps_read,
                "float16_max": FLOAT16_MAX, "program": self.program.value, "program_step": self.program_step,
                "trace_error": self.trace_error, "sites": [s.to_dict() for s in self.sites],
                "sites_dropped": self.sites_dropped}


def find_fp16_reductions(run: Run) -> Fp16Reductions:
    """The modules of a Flax run whose float16 reductions overflowed while
    their inputs were finite and float32 would have held the sum, and the
    float16/bfloat16 reductions of a JAX run's step program."""
    found = _overflowed(run)
    return _with_program(run, found)


def _overflowed(run: Run) -> Fp16Reductions:
    if (run.manifest.get("framework") or {}).get("name") != "flax":
        return Fp16Reductions()
    bad = run.scan_tensors(["step"], kinds=["activation"], nonfinite_only=True, label="reading non-finite outputs")
    steps = sorted({int(s) for s in bad["step"]})[:STEPS_READ]
    if not steps:
        return Fp16Reductions()
    rows = run.scan_tensors(_COLUMNS, steps=steps, kinds=["activation"], label="reading module outputs")
    found: dict = {}
    for (step, _rank), group in rows.groupby(["step", "rank"], sort=True):
        flagged = _reduction_at(group.sort_values(["order", "call"]))
        if flagged is None:
            continue
        module, absmax, per_output = flagged
        if module in found:
            found[module]["steps"].append(int(step))
        else:
            found[module] = {"steps": [int(step)], "absmax": absmax, "per_output": per_output}
    reductions = [Fp16Reduction(module=m, first_step=f["steps"][0], steps=tuple(f["steps"]),
                                input_absmax=f["absmax"], values_per_output=f["per_output"],
                                bound=f["absmax"] * f["per_output"]) for m, f in found.items()]
    reductions.sort(key=lambda r: r.first_step)
    return Fp16Reductions(reductions=reductions, steps_read=len(steps))


def _reduction_at(rows):
    """(module, input absmax, values per output) when the step's first
    non-finite output is a float16 reduction's that float32 would hold."""
    nonfinite = (rows["nan_count"] + rows["inf_count"]) > 0
    if not nonfinite.any():
        return None
    at = int(np.argmax(nonfinite.to_numpy()))
    if at == 0:
        return None  # the model's input is not recorded: nothing says it was finite
    out, before = rows.iloc[at], rows.iloc[at - 1]
    if out["dtype"] != "float16" or not out["numel"] or before["numel"] < 2 * out["numel"]:
        return None
    per_output = int(before["numel"] // out["numel"])
    bound = float(before["absmax"]) * per_output
    if not FLOAT16_MAX <= bound < FLOAT32_MAX:
        return None
    return str(out["name"]), float(before["absmax"]), per_output


def _with_program(run: Run, found: Fp16Reductions) -> Fp16Reductions:
    """`found` with the program's sites (the manifest's `jax_reductions`),
    each linked to the overflowed modules of its class."""
    framework = run.manifest.get("framework") or {}
    if not (framework.get("name") == "flax" or (framework.get("name") == "keras"
                                                 and framework.get("backend") == "jax")):
        return found
    entry = run.manifest.get(schema.JAX_REDUCTIONS_KEY)
    if not isinstance(entry, dict):
        found.program = Program.NOT_TRACED
        return found
    found.program_step = entry["step"] if isinstance(entry.get("step"), int) else None
    if entry.get("traced") is not True:
        found.program = Program.FAILED
        found.trace_error = str(entry.get("reason") or "no reason recorded")[:300]
        return found
    found.program = Program.TRACED
    dropped = entry.get("sites_dropped")
    found.sites_dropped = dropped if isinstance(dropped, int) and dropped >= 0 else 0
    overflowed = {r.module for r in found.reductions}
    classes = {}
    for m in run.manifest.get("modules") or ():
        if isinstance(m, dict) and isinstance(m.get("type"), str) and m.get("name") in overflowed:
            classes.setdefault(m["type"], []).append(m["name"])
    sites = entry.get("sites")
    for raw in sites if isinstance(sites, list) else ():
        site = _site(raw)
        if site is None:
            continue
        owner = (site.function or "").rpartition(".")[0]  # Attention.__call__ -> Attention
        at = tuple(name for cls, names in classes.items() if owner and cls.endswith("." + owner) for name in names)
        found.sites.append(ReductionSite(**{**site.__dict__, "overflowed_at": at}))
    return found


def _site(raw) -> ReductionSite | None:
    """One recorded site, its fields checked (a malformed one is left out)."""
    if not isinstance(raw, dict):
        return None
    text = {k: raw.get(k) for k in ("pattern", "dtype", "accumulation_dtype", "phase")}
    if not all(isinstance(v, str) for v in text.values()) or text["pattern"] not in schema.JAX_REDUCTION_PATTERNS:
        return None
    per_output, count, line = raw.get("values_per_output"), raw.get("count", 1), raw.get("line")
    if not isinstance(per_output, int) or not isinstance(count, int) or not (line is None or isinstance(line, int)):
        return None
    where = {k: raw.get(k) if isinstance(raw.get(k), str) else None for k in ("file", "function")}
    shifted = raw.get("shifted") if isinstance(raw.get("shifted"), bool) else None
    return ReductionSite(**text, values_per_output=per_output, shifted=shifted, line=line, count=count, **where)
