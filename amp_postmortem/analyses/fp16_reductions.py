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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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


@dataclass
class Fp16Reductions:
    reductions: list = field(default_factory=list)   # Fp16Reduction, earliest first
    steps_read: int = 0

    def to_dict(self) -> dict:
        return {"reductions": [r.to_dict() for r in self.reductions], "steps_read": self.steps_read,
                "float16_max": FLOAT16_MAX}


def find_fp16_reductions(run: Run) -> Fp16Reductions:
    """The modules of a Flax run whose float16 reductions overflowed while
    their inputs were finite and float32 would have held the sum."""
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
