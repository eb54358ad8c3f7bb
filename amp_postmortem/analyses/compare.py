"""Two recorded runs of the same model and data (e.g. a float32 baseline and
its AMP twin): where do they part? (The playbook's step 1 made a tool.)

- Loss: per step (ranks averaged), the relative difference
  |loss_b - loss_a| / |loss_a|, run A being the reference. The divergence
  step is the first common step where it exceeds `threshold` (default 10%)
  for `persist` consecutive common steps (default 1). A loss that is NaN/Inf
  in one run only parts at once; NaN in both does not part.
- Layers: per (layer, kind) the same test on
  - `activation`: absmax (the activation range);
  - `param_grad`: the gradient norm, rms * sqrt(numel), where both runs have
    full-tier rows at that step, else the absmax;
  - `grad_output`: the absmax divided by the step's loss scale (a scaled
    run's gradients are compared unscaled).
  Ranks and repeated calls are merged (max of absmax, mean of norms). The
  layers are ranked by the step where they part, then forward before
  backward, then run A's execution order: the first of them is where the
  runs first differ inside the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..loader import Run

THRESHOLD = 0.10
KINDS = ("activation", "param_grad", "grad_output")
METRIC = {"activation": "absmax", "param_grad": "grad_norm", "grad_output": "absmax_unscaled"}
LAYER_COLUMNS = ["name", "kind", "metric", "parted_step", "rel_diff", "value_a", "value_b", "max_rel_diff"]
_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "numel", "absmax", "rms", "nan_count", "inf_count"]


@dataclass
class CompareReport:
    run_a: dict
    run_b: dict
    threshold: float
    persist: int
    common_steps: int
    first_common_step: int | None
    last_common_step: int | None
    divergence_step: int | None
    loss: dict                      # at the divergence step: {"a", "b", "rel_diff"}
    layers: pd.DataFrame            # LAYER_COLUMNS, parted layers first (ranked), then the rest
    notes: list = field(default_factory=list)

    @property
    def first_layers(self) -> list[dict]:
        """The layers that part at the earliest layer-parting step."""
        parted = self.layers[self.layers["parted_step"].notna()]
        if parted.empty:
            return []
        first = parted["parted_step"].min()
        return [{"name": r["name"], "kind": r["kind"]} for _, r in parted[parted["parted_step"] == first].iterrows()]

    def to_dict(self) -> dict:
        rows = [{k: _plain(v) for k, v in r.items()} for r in self.layers.to_dict("records")]
        return {"run_a": self.run_a, "run_b": self.run_b, "threshold": self.threshold, "persist": self.persist,
                "common_steps": self.common_steps, "first_common_step": self.first_common_step,
                "last_common_step": self.last_common_step, "divergence_step": self.divergence_step,
                "loss": {k: _plain(v) for k, v in self.loss.items()},
                "first_layer": self.first_layers[0] if self.first_layers else None,
                "layers": rows, "notes": self.notes}

    def table(self) -> pd.DataFrame:
        return self.layers[self.layers["parted_step"].notna()].reset_index(drop=True)

    def lines(self) -> list[str]:
        out = [f"A: {self.run_a['path']} ({self.run_a['precision']})",
               f"B: {self.run_b['path']} ({self.run_b['precision']})",
               f"{self.common_steps} common steps ({self.first_common_step}-{self.last_common_step}), "
               f"threshold {self.threshold:.0%} relative to A"]
        if self.divergence_step is None:
            out.append("the loss curves never part by more than the threshold")
        else:
            lo = self.loss
            out.append(f"loss curves part at step {self.divergence_step}: A {_num(lo['a'])}, B {_num(lo['b'])} "
                       f"({_pct(lo['rel_diff'])} apart)")
        first = self.first_layers
        if first:
            step = int(self.layers["parted_step"].dropna().min())
            names = ", ".join(f"{_display(f['name'])} ({f['kind']})" for f in first[:5])
            out.append(f"first to part, at step {step}: {names}")
        else:
            out.append("no layer statistic parts by more than the threshold")
        out += [f"note: {n}" for n in self.notes]
        return out


def compare_runs(run_a: Run, run_b: Run, *, threshold: float = THRESHOLD, persist: int = 1) -> CompareReport:
    """Where run B parts from run A: the loss curve and the layers, ranked."""
    if not threshold > 0:
        raise ValueError(f"threshold {threshold!r} must be a positive relative difference, e.g. 0.1 for 10%")
    persist = max(1, int(persist))
    notes = []
    la, lb = _loss_series(run_a), _loss_series(run_b)
    common = la.index.intersection(lb.index)
    if not len(common):
        notes.append("the runs share no step number: nothing to compare")
    if run_a.manifest.get("model_class") != run_b.manifest.get("model_class"):
        notes.append(f"the runs recorded different model classes ({run_a.manifest.get('model_class')} vs "
                     f"{run_b.manifest.get('model_class')})")
    rel = _rel_diff(la.loc[common].to_numpy(float), lb.loc[common].to_numpy(float))
    div = _first_parting(np.asarray(common), rel, threshold, persist)
    loss = {"a": None, "b": None, "rel_diff": None}
    if div is not None:
        i = list(common).index(div)
        loss = {"a": float(la.loc[div]), "b": float(lb.loc[div]), "rel_diff": float(rel[i])}
    layers = _layers(run_a, run_b, sorted(int(s) for s in common), threshold, persist, notes)
    return CompareReport(run_a=_facts(run_a), run_b=_facts(run_b), threshold=threshold, persist=persist,
                         common_steps=len(common), first_common_step=int(common.min()) if len(common) else None,
                         last_common_step=int(common.max()) if len(common) else None, divergence_step=div,
                         loss=loss, layers=layers, notes=notes)


def _loss_series(run: Run) -> pd.Series:
    s = run.steps
    return s.groupby("step")["loss"].mean() if len(s) else pd.Series(dtype=float)


def _rel_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|b - a| / |a|; inf where only one is non-finite, 0 where both are
    non-finite or both zero."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    fa, fb = np.isfinite(a), np.isfinite(b)
    out = np.zeros(len(a))
    both = fa & fb
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.abs(b - a) / np.abs(a)
    d = np.where((np.abs(b - a) == 0), 0.0, d)
    out[both] = d[both]
    out[fa != fb] = np.inf
    return out


def _first_parting(steps: np.ndarray, rel: np.ndarray, threshold: float, persist: int) -> int | None:
    over = rel > threshold
    run = 0
    for i, o in enumerate(over):
        run = run + 1 if o else 0
        if run >= persist:
            return int(steps[i - persist + 1])
    return None


def _layer_values(run: Run, steps: list[int]) -> pd.DataFrame:
    df = run.scan_tensors(_COLUMNS, steps=steps, kinds=KINDS, label="reading layer statistics")
    if df.empty:
        return pd.DataFrame(columns=["name", "kind", "step", "absmax", "norm", "phase", "order"])
    scale = run.steps.groupby("step")["loss_scale_before"].first()
    df["scale"] = df["step"].map(scale).astype(float).fillna(1.0)
    grad_out = df["kind"] == "grad_output"
    df.loc[grad_out, "absmax"] = df.loc[grad_out, "absmax"] / df.loc[grad_out, "scale"]
    df["norm"] = df["rms"] * np.sqrt(df["numel"].astype(float))
    bad = (df["nan_count"] + df["inf_count"]) > 0
    df.loc[bad, ["absmax", "norm"]] = np.inf  # a non-finite tensor parts from a finite one
    return df.groupby(["name", "kind", "step"], sort=False).agg(
        absmax=("absmax", "max"), norm=("norm", "mean"), phase=("phase", "first"), order=("order", "min"),
    ).reset_index()


def _layers(run_a, run_b, steps, threshold, persist, notes) -> pd.DataFrame:
    if not steps:
        return pd.DataFrame(columns=LAYER_COLUMNS)
    a, b = _layer_values(run_a, steps), _layer_values(run_b, steps)
    m = a.merge(b, on=["name", "kind", "step"], suffixes=("_a", "_b"))
    only = (set(zip(a["name"], a["kind"])) ^ set(zip(b["name"], b["kind"])))
    if only:
        notes.append(f"{len(only)} layer statistics are recorded in one run only (not compared)")
    rows = []
    for (name, kind), g in m.groupby(["name", "kind"], sort=False):
        g = g.sort_values("step")
        va, vb = g["absmax_a"].to_numpy(float), g["absmax_b"].to_numpy(float)
        metric = np.full(len(g), "absmax" if kind != "grad_output" else "absmax_unscaled", dtype=object)
        if kind == "param_grad":
            have = g["norm_a"].notna().to_numpy() & g["norm_b"].notna().to_numpy()
            va = np.where(have, g["norm_a"].to_numpy(float), va)
            vb = np.where(have, g["norm_b"].to_numpy(float), vb)
            metric = np.where(have, "grad_norm", "grad_absmax")
        rel = _rel_diff(va, vb)
        step = _first_parting(g["step"].to_numpy(), rel, threshold, persist)
        i = int(np.flatnonzero(g["step"].to_numpy() == step)[0]) if step is not None else None
        rows.append({"name": name, "kind": kind,
                     "metric": metric[i] if i is not None else METRIC[kind],
                     "parted_step": step, "rel_diff": float(rel[i]) if i is not None else None,
                     "value_a": float(va[i]) if i is not None else None,
                     "value_b": float(vb[i]) if i is not None else None,
                     "max_rel_diff": float(np.nanmax(rel)) if len(rel) else None,
                     "_phase": 0 if g["phase_a"].iloc[0] == "forward" else 1,
                     "_order": int(g["order_a"].min())})
    if not rows:
        return pd.DataFrame(columns=LAYER_COLUMNS)
    out = pd.DataFrame(rows)
    out["_never"] = out["parted_step"].isna()
    out = out.sort_values(["_never", "parted_step", "_phase", "_order"], kind="stable")
    out = out[LAYER_COLUMNS].reset_index(drop=True)
    out["parted_step"] = out["parted_step"].astype("Int64")
    return out


def _facts(run: Run) -> dict:
    ac = run.autocast
    return {"path": str(run.path), "run_id": run.run_id,
            "precision": ac.get("dtype") if ac.get("enabled") else "float32 (no autocast)",
            "steps": int(run.steps["step"].nunique()) if len(run.steps) else 0}


def _plain(v):
    if v is pd.NA or v is None:
        return None
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return v if math.isfinite(v) else None
    return v


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v) -> str:
    return "-" if v is None else ("inf" if not math.isfinite(v) else f"{v:.1%}")


def _display(name: str) -> str:
    return "(model)" if name == "" else name
