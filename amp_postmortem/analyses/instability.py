"""Precision or instability: would float32 have failed too?

A float16 overflow is a precision problem when the values were sane and
float16's range was too narrow for them; it is training instability when the
values themselves ran away (a learning rate too high, no warm-up, no
clipping) and float16 only failed first. Keeping a module in float32 or
lowering the loss scale then postpones the failure by a few steps. The
recorded evidence, over the steps before the failure (the first step whose
forward or loss was non-finite; the whole run when none was):

- `loss_rise`: the loss rose before it went non-finite: the mean of the
  last finite losses (up to 3) is at least `LOSS_RISE` times the lowest
  loss before them (over the last `WINDOW` recorded steps before the
  failure);
- `growth`: activations or weights grew: a layer's largest value (`absmax`
  of its `activation` rows, of its parameters' `param` rows) rose by at
  least `GROWTH_BITS` bits (a factor 8) from the first of those steps to
  the last, and still stood at its peak (within a factor 2) at the end;
  where fewer than `MIN_GROWTH_STEPS` of those steps have module rows (a
  sentinel run samples one step in `cheap_every`), from the first of the
  last `MIN_GROWTH_STEPS` that have.
  The weight that grew most names the layer whose updates grew.

`find_instability` reports instability when the run failed and both hold
(one alone is ordinary: losses rise after a data shift, activations grow
from a small initialisation). A run that never went non-finite is not
called unstable: float16 has not failed, and growth alone (a planted gain,
a warming-up model) is what `ranges` forecasts; its evidence is still
reported (`baseline_verdict` reads an fp32 baseline's loss that way). A replay adds a third piece (`replay_evidence`,
used by `recommend`): the float64 replay of the failing step, exact
arithmetic, itself exceeds float16's range, with values larger than the
recorded ones of the steps before. That is also what a float16 *range*
problem looks like, so it only suggests that float32 would fail too: a
float32 re-run of a saved window decides it (`precision_verdict.py`). An fp32 baseline (`baseline_verdict`, used by `compare`)
confirms the finding when the baseline's loss also went non-finite or rose
by `LOSS_RISE` over the same steps, and refutes it otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from recorders.format import plain, schema

from ..reading.loader import Run
from ..reading.step_series import recorded_steps
from ..names import display_name as _display

LOSS_RISE = 2.0              # the late loss at least twice the lowest before it
GROWTH_BITS = 3.0            # a factor 8 from the first step looked at to the last
PEAK_SLACK_BITS = 1.0        # still within a factor 2 of its peak at the end
LATE_LOSSES = 3
WINDOW = 1000                # the recorded steps before the failure looked at
# Growth is read over at least this many steps with module rows, from before
# the window when it holds fewer: a sentinel run samples one step in
# `cheap_every` (1000), so its last WINDOW steps hold one sampled step or none.
MIN_GROWTH_STEPS = 4


@dataclass
class InstabilityReport:
    unstable: bool
    failure_step: int | None          # first step with a non-finite forward or loss
    from_step: int | None             # the steps looked at: from_step..to_step
    to_step: int | None
    loss_rise: dict | None            # {"from_loss", "from_step", "to_loss", "to_step", "ratio"}
    growth: list = field(default_factory=list)  # [{"name", "kind", "from_step", "from", "to_step", "to", "bits"}]
    grown_layer: str | None = None    # the module whose weights grew most
    evidence: list = field(default_factory=list)  # sentences

    def to_dict(self) -> dict:
        return plain({"unstable": self.unstable, "failure_step": self.failure_step, "from_step": self.from_step,
                      "to_step": self.to_step, "loss_rise": self.loss_rise, "growth": self.growth,
                      "grown_layer": self.grown_layer, "evidence": self.evidence})

    def remedies(self) -> list[str]:
        layer = f"; watch {self.grown_layer}, whose weights grew most" if self.grown_layer else ""
        return ["lower the learning rate (or add warm-up)", "clip the gradient norm (or clip lower)"
                + layer]


def failure_step(run: Run) -> int | None:
    """The first step whose loss or forward activations were non-finite."""
    s = run.step_series().steps
    bad = s.loc[s["loss_nonfinite_any"], "step"]
    first = int(bad.min()) if len(bad) else None
    acts = run.scan_tensors(["step", "kind", "phase", "nan_count", "inf_count"], nonfinite_only=True,
                            kinds=["input", "activation"], label="reading non-finite forwards")
    if len(acts):
        fwd = int(acts["step"].min())
        first = fwd if first is None else min(first, fwd)
    return first


def find_instability(run: Run) -> InstabilityReport:
    """The recorded evidence for training instability (module docstring)."""
    fail = failure_step(run)
    s = run.step_series().steps  # the lowest rank's row of each step
    before = s[s["step"] < fail] if fail is not None else s
    before = before.iloc[-WINDOW:]
    if before.empty:
        return InstabilityReport(False, fail, None, None, None)
    lo, hi = int(before["step"].min()), int(before["step"].max())
    rise = _loss_rise(before)
    if fail is None or rise is None or rise["ratio"] < LOSS_RISE:
        # Not unstable whatever grew: skip the scan of every layer's rows.
        return InstabilityReport(False, fail, lo, hi, rise)
    growth = _growth(run, _growth_start(s, lo, hi), hi)
    rose = rise is not None and rise["ratio"] >= LOSS_RISE
    grew = [g for g in growth if g["bits"] >= GROWTH_BITS]
    weights = [g for g in grew if g["kind"] == "param"]
    grown = weights[0]["name"].rpartition(".")[0] if weights else None
    report = InstabilityReport(fail is not None and rose and bool(grew), fail, lo, hi, rise, grew[:6], grown)
    if rose:
        report.evidence.append(
            f"the loss rose from {rise['from_loss']:.4g} (step {rise['from_step']}) to {rise['to_loss']:.4g} "
            f"(step {rise['to_step']}), x{rise['ratio']:.3g}"
            + (f", before it went non-finite at step {fail}" if fail is not None else ""))
    for kind, what in (("activation", "activations"), ("param", "weights")):
        top = next((g for g in grew if g["kind"] == kind), None)
        if top is not None:
            report.evidence.append(
                f"{what} grew: {_display(top['name'])} {top['from']:.3g} at step {top['from_step']} -> "
                f"{top['to']:.3g} at step {top['to_step']} ({top['bits']:.1f} bits, x{2 ** top['bits']:.3g})")
    return report


def _loss_rise(before: pd.DataFrame) -> dict | None:
    loss = before[np.isfinite(before["loss"].astype(float))]
    if len(loss) < 2:
        return None
    late = loss.iloc[-min(LATE_LOSSES, len(loss) - 1):]
    early = loss.iloc[:len(loss) - len(late)]
    low = early.loc[early["loss"].idxmin()]
    if not low["loss"] > 0:
        return None
    to = float(late["loss"].mean())
    return {"from_loss": float(low["loss"]), "from_step": int(low["step"]), "to_loss": to,
            "to_step": int(late["step"].iloc[-1]), "ratio": to / float(low["loss"])}


def _growth_start(series: pd.DataFrame, lo: int, hi: int) -> int:
    """Where growth is read from: `lo`, or the first of the last
    `MIN_GROWTH_STEPS` steps with module rows up to `hi` when that lies
    before it (the step series' `recorded_any`)."""
    recorded = recorded_steps(series)
    recorded = recorded[recorded <= hi]
    k = min(MIN_GROWTH_STEPS, len(recorded))
    return min(lo, int(recorded.iloc[-k])) if k else lo


def _recorded_window_start(run: Run, step: int) -> int:
    """The first of the last `WINDOW` steps with module rows before `step`
    (`step - WINDOW` when none: the range is then empty anyway): a sentinel
    run's last WINDOW step numbers hold one sampled step or none, too few
    to see a value grow."""
    recorded = recorded_steps(run.step_series().steps)
    recorded = recorded[recorded < step]
    return int(recorded.iloc[-WINDOW]) if len(recorded) >= WINDOW else (
        int(recorded.iloc[0]) if len(recorded) else step - WINDOW)


def _growth(run: Run, lo: int, hi: int) -> list:
    """Per (layer, activation | param): growth in bits from `lo` to `hi`,
    largest first; only layers still near their peak at the end."""
    if len(run.ranks) > 1 and run.sharded_params:
        # FSDP: the ranks' shards of a parameter are merged into one row
        # before the finite filter (scan_tensors), so every row is needed.
        df = run.scan_tensors(["step", "rank", "name", "kind", "absmax", "nan_count", "inf_count"],
                              kinds=["activation", "param"], step_range=(lo, hi), label="reading growth")
        if df.empty:
            return []
        df = df[((df["nan_count"] + df["inf_count"]) == 0) & (df["absmax"] > 0)]
        per = df.groupby(["name", "kind", "step"], sort=False)["absmax"].max().reset_index().sort_values("step")
        keys = ["name", "kind"]
        layer = lambda key: key  # noqa: E731
    else:
        per, layers = _per_step_peaks(run, lo, hi)
        if per is None:
            return []
        per = per.sort_values("step")
        keys = "lid"
        layer = layers.__getitem__
    out = []
    for key, g in per.groupby(keys, sort=False):
        name, kind = layer(key)
        if len(g) < 2:
            continue
        first, last, peak = (float(g["absmax"].iloc[0]), float(g["absmax"].iloc[-1]),
                             float(g["absmax"].max()))
        bits = math.log2(last / first)
        if bits <= 0 or math.log2(peak / last) > PEAK_SLACK_BITS:
            continue
        out.append({"name": name, "kind": kind, "from_step": int(g["step"].iloc[0]), "from": first,
                    "to_step": int(g["step"].iloc[-1]), "to": last, "bits": bits})
    out.sort(key=lambda g: -g["bits"])
    return out


def _per_step_peaks(run: Run, lo: int, hi: int) -> tuple[pd.DataFrame | None, list]:
    """The finite, non-zero absmax of each (layer, step) of activations and
    weights from `lo` to `hi`, merged over ranks and calls: (lid, step,
    absmax) rows in order of their first row read, as a groupby over every
    row gives them, and the (name, kind) of each lid. Shard by shard: only
    a shard's rows and the window's layers x steps of numbers are held."""
    layers: dict = {}
    parts = []
    for part_layers, peaks in run.map_tensor_shards(
            _growth_shard, ["step", "name", "kind", "absmax", "nan_count", "inf_count"],
            kinds=["activation", "param"], step_range=(lo, hi), label="reading growth"):
        if not len(peaks["lid"]):
            continue
        ids = np.array([layers.setdefault(k, len(layers)) for k in part_layers], dtype=np.int32)
        parts.append({**peaks, "lid": ids[peaks["lid"]]})
    if not parts:
        return None, []
    merged = _peaks(*(np.concatenate([p[c] for p in parts]) for c in ("lid", "step", "absmax")))
    return pd.DataFrame(merged), list(layers)


def _growth_shard(rows) -> tuple[list, dict]:
    """The per-shard map of `_growth`: the finite, non-zero rows merged per
    (layer, step) by their maximum, groups in order of their first row, a
    layer as an id into the (name, kind) list returned."""
    rows = rows.filter(pc.and_(pc.equal(pc.add(rows["nan_count"], rows["inf_count"]), 0),
                               pc.greater(rows["absmax"], 0)))
    n = pc.dictionary_encode(rows["name"].combine_chunks())
    k = pc.dictionary_encode(rows["kind"].combine_chunks())
    key = n.indices.to_numpy().astype(np.int64) * max(1, len(k.dictionary)) + k.indices.to_numpy()
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")  # ids in order of first row
    ids = np.empty(len(uniq), dtype=np.int32)
    ids[by_first] = np.arange(len(uniq), dtype=np.int32)
    names, kinds = n.dictionary.to_pylist(), k.dictionary.to_pylist()
    nk = max(1, len(kinds))
    layers = [(names[uniq[i] // nk], kinds[uniq[i] % nk]) for i in by_first]
    return layers, _peaks(ids[inverse.ravel()], rows["step"].to_numpy(), rows["absmax"].to_numpy())


def _peaks(lid: np.ndarray, step: np.ndarray, absmax: np.ndarray) -> dict:
    """Rows of equal (lid, step) merged by their maximum absmax, groups in
    order of their first row (as pandas' groupby(sort=False) gives them):
    a stable sort, then the groups put back in order of first row."""
    if not len(lid):
        return {"lid": lid.astype(np.int32), "step": step.astype(np.int64), "absmax": absmax.astype(float)}
    srt = np.lexsort((step, lid))
    l, st = lid[srt], step[srt]
    new = np.ones(len(l), dtype=bool)
    new[1:] = (l[1:] != l[:-1]) | (st[1:] != st[:-1])
    starts = np.flatnonzero(new)
    back = np.argsort(srt[starts], kind="stable")
    return {"lid": l[starts][back], "step": st[starts][back],
            "absmax": np.maximum.reduceat(absmax[srt], starts)[back]}


def replay_evidence(run: Run, reference, step: int) -> str | None:
    """A sentence when the float64 replay of `step` exceeds float16's range
    in a module whose recorded values before `step` were smaller (growing),
    else None. `reference` is the float64 `StepCapture`."""
    import torch
    worst, worst_name = 0.0, None
    for call in reference.calls.values():
        for t in call.outputs:
            if t.dtype.is_floating_point and t.numel():
                finite = t[torch.isfinite(t)]
                v = float(finite.abs().max()) if finite.numel() else 0.0
                if v > worst and call.name != "":
                    worst, worst_name = v, call.name
    if worst <= schema.FP16_MAX or worst_name is None:
        return None
    rows = run.scan_tensors(["step", "name", "kind", "absmax"], kinds=["activation"],
                            step_range=(_recorded_window_start(run, step), step - 1), label="reading recorded ranges")
    rows = rows[(rows["name"] == worst_name) & (rows["absmax"] > 0)].sort_values("step")
    if rows.empty or float(rows["absmax"].iloc[-1]) >= worst:
        return None
    first = rows.iloc[0]
    return (f"the float64 replay of step {step} (exact arithmetic) is itself beyond float16's range: "
            f"{_display(worst_name)} reaches {worst:.3g} > 65504, up from {float(first['absmax']):.3g} at step "
            f"{int(first['step'])} (growing values; whether float32 fails too only a float32 re-run of a saved "
            f"window can say)")


def baseline_verdict(amp: Run, baseline: Run, report: InstabilityReport | None = None) -> dict:
    """Whether an fp32 `baseline` of the same job confirms or refutes the
    instability of the `amp` run: {"verdict": "confirmed" | "refuted" | None,
    "why", "amp_unstable"}. None when the AMP run shows no instability."""
    report = report or find_instability(amp)
    out = {"verdict": None, "amp_unstable": report.unstable, "why": None}
    if not report.unstable:
        out["why"] = "the AMP run shows no training instability"
        return out
    s = baseline.steps.drop_duplicates("step").sort_values("step")
    to = report.failure_step if report.failure_step is not None else report.to_step
    upto = s[s["step"] <= to] if to is not None else s
    bad = upto[~np.isfinite(upto["loss"].astype(float))]
    if len(bad):
        out.update(verdict="confirmed", why=f"the float32 baseline's loss went non-finite too, at step "
                                             f"{int(bad['step'].iloc[0])}")
        return out
    rise = _loss_rise(upto)
    if rise is not None and rise["ratio"] >= LOSS_RISE:
        out.update(verdict="confirmed", why=f"the float32 baseline diverges too: its loss rose from "
                                             f"{rise['from_loss']:.4g} (step {rise['from_step']}) to "
                                             f"{rise['to_loss']:.4g} (step {rise['to_step']}), x{rise['ratio']:.3g}")
        return out
    last = upto[np.isfinite(upto["loss"].astype(float))]
    out.update(verdict="refuted", why="the float32 baseline trains normally over the same steps"
               + (f" (loss {float(last['loss'].iloc[0]):.4g} -> {float(last['loss'].iloc[-1]):.4g})"
                  if len(last) else "") + ": the failure is float16's, a precision problem")
    return out

