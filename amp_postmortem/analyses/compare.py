"""Two recorded runs of the same model and data (e.g. a float32 baseline and
its AMP twin): where do they part? (The playbook's step 1 made a tool.)

- Loss: per step (ranks averaged), the relative difference
  |loss_b - loss_a| / |loss_a|, run A being the reference. The divergence
  step is the first common step where it exceeds `threshold` (default 10%)
  for `persist` consecutive common steps (default `PERSIST`, 3): a single
  step over the threshold is noise, a parting lasts. A loss that is NaN/Inf
  in one run only parts at once (with the steps over the threshold just
  before it); NaN in both does not part.
- Layers: per (layer, kind) the same test on
  - `activation`: absmax (the activation range);
  - `param_grad`: the gradient norm, rms * sqrt(numel), where both runs have
    full-tier rows at that step, else the absmax;
  - `grad_output`: the absmax divided by the step's loss scale (a scaled
    run's gradients are compared unscaled).
  Ranks and repeated calls are merged (max of absmax, mean of norms). A
  non-finite gradient of a step its run skipped (a loss scaler's
  calibration; never applied) is not compared.
  Noise floor: a value pair is compared only when the larger of the two is
  significant both for the model, at least `MODEL_FLOOR` (1e-4) of the
  largest value of that kind and metric in that step, or the machine
  epsilon of the coarser run's precision (float16: 2^-10) when larger (a
  gradient that is zero up to rounding, such as the key bias of an
  attention, which softmax's shift invariance makes zero, is a rounding
  residue of the larger terms it sums and sits below that), and for the
  layer, at least `LAYER_FLOOR` (1e-3) of the layer's own median in run A;
  the relative difference is taken to max(|a|, that floor). The layers are
  ranked by the first step of their persistent parting, then forward before
  backward, then run A's execution order: the first of them is where the
  runs first differ inside the model.
- JSON carries no Infinity: a relative difference where the value is
  non-finite in one run only is null with `one_side_nonfinite` true, and
  `max_rel_diff` is the largest finite one (`nonfinite_step`: the first step
  where one run only is non-finite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..names import display_name as _display
from ..errors import OptionError
from ..reading.loader import Run
from ..display import report_html, report_repr
from .updates import param_dtype
from ..result import CommandResult
from recorders.format import plain

THRESHOLD = 0.10
PERSIST = 3            # consecutive common steps over the threshold that make a parting
MODEL_FLOOR = 1e-4     # of the step's largest value of the kind: below, a value is rounding noise...
# ...or below the rounding level (machine epsilon) of the coarser run's
# precision, when larger: a float16 sum that cancels leaves ~eps16 x its terms.
EPSILON = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}
LAYER_FLOOR = 1e-3     # of the layer's own median value in run A
KINDS = ("activation", "param_grad", "grad_output")
METRIC = {"activation": "absmax", "param_grad": "grad_norm", "grad_output": "absmax_unscaled"}
LAYER_COLUMNS = ["name", "kind", "metric", "parted_step", "rel_diff", "one_side_nonfinite", "value_a", "value_b",
                 "max_rel_diff", "nonfinite_step"]
_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "numel", "absmax", "rms", "nan_count", "inf_count"]


@dataclass
class CompareReport(CommandResult):
    run_a: dict
    run_b: dict
    threshold: float
    persist: int
    common_steps: int
    first_common_step: int | None
    last_common_step: int | None
    divergence_step: int | None
    loss: dict                      # at the divergence step: {"a", "b", "rel_diff", "one_side_nonfinite"}
    layers: pd.DataFrame            # LAYER_COLUMNS, parted layers first (ranked), then the rest
    notes: list = field(default_factory=list)
    # With one run in float32 and the other with autocast: the float32 run
    # confirms or refutes the AMP run's training instability
    # (`instability.baseline_verdict`); None otherwise.
    instability: dict | None = None

    @property
    def first_layers(self) -> list[dict]:
        """The layers that part at the earliest layer-parting step."""
        parted = self.layers[self.layers["parted_step"].notna()]
        if parted.empty:
            return []
        first = parted["parted_step"].min()
        return [{"name": r["name"], "kind": r["kind"]} for _, r in parted[parted["parted_step"] == first].iterrows()]

    def document(self) -> dict:
        rows = [{k: plain(v) for k, v in r.items()} for r in self.layers.to_dict("records")]
        return {"run_a": self.run_a, "run_b": self.run_b, "threshold": self.threshold, "persist": self.persist,
                "common_steps": self.common_steps, "first_common_step": self.first_common_step,
                "last_common_step": self.last_common_step, "divergence_step": self.divergence_step,
                "loss": {k: plain(v) for k, v in self.loss.items()},
                "first_layer": self.first_layers[0] if self.first_layers else None,
                "layers": rows, "notes": self.notes, "instability": self.instability}

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

    def table(self) -> pd.DataFrame:
        return self.layers[self.layers["parted_step"].notna()].reset_index(drop=True)

    def lines(self) -> list[str]:
        out = [f"A: {self.run_a['path']} ({self.run_a['precision']})",
               f"B: {self.run_b['path']} ({self.run_b['precision']})",
               f"{self.common_steps} common steps ({self.first_common_step}-{self.last_common_step}), "
               f"threshold {self.threshold:.0%} relative to A for {self.persist} step(s) in a row "
               "(NaN/Inf in one run only: at once)"]
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
        v = self.instability
        if v is not None and v["verdict"] is not None:
            out.append(f"training instability of the AMP run {v['verdict'].upper()} by the float32 run: {v['why']}")
        out += [f"note: {n}" for n in self.notes]
        return out


def compare_runs(run_a: Run, run_b: Run, *, threshold: float = THRESHOLD, persist: int = PERSIST) -> CompareReport:
    """Where run B parts from run A: the loss curve and the layers, ranked."""
    if not threshold > 0:
        raise OptionError(f"threshold {threshold!r} must be a positive relative difference, e.g. 0.1 for 10%")
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
    loss = {"a": None, "b": None, "rel_diff": None, "one_side_nonfinite": None}
    if div is not None:
        i = list(common).index(div)
        loss = {"a": float(la.loc[div]), "b": float(lb.loc[div]), "rel_diff": float(rel[i]),
                "one_side_nonfinite": bool(np.isinf(rel[i]))}
    layers = _layers(run_a, run_b, sorted(int(s) for s in common), threshold, persist, notes)
    return CompareReport(run_a=_facts(run_a), run_b=_facts(run_b), threshold=threshold, persist=persist,
                         common_steps=len(common), first_common_step=int(common.min()) if len(common) else None,
                         last_common_step=int(common.max()) if len(common) else None, divergence_step=div,
                         loss=loss, layers=layers, notes=notes, instability=_instability(run_a, run_b))


def _instability(run_a: Run, run_b: Run) -> dict | None:
    """The float32 run's word on the AMP run's instability, when one of the
    two ran without autocast and the other with it."""
    from .instability import baseline_verdict
    on = [bool((r.autocast or {}).get("enabled")) for r in (run_a, run_b)]
    if on[0] == on[1]:
        return None
    amp, fp32 = (run_b, run_a) if on[1] else (run_a, run_b)
    return baseline_verdict(amp, fp32)


def _loss_series(run: Run) -> pd.Series:
    s = run.steps
    return s.groupby("step")["loss"].mean() if len(s) else pd.Series(dtype=float)


def _rel_diff(a: np.ndarray, b: np.ndarray, floor=0.0) -> np.ndarray:
    """|b - a| / max(|a|, floor); 0 where both are below `floor` (noise) or
    equal, or both non-finite; inf where only one is non-finite. A zero `a`
    with no floor divides by the smallest float, not by zero."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    floor = np.broadcast_to(np.asarray(floor, float), a.shape)
    fa, fb = np.isfinite(a), np.isfinite(b)
    out = np.zeros(len(a))
    both = fa & fb
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        denom = np.maximum(np.maximum(np.abs(a), floor), np.finfo(float).tiny)
        diff = np.abs(b - a)  # NaN where both are Inf: only `both` (finite) is read
        d = np.where((diff == 0) | (np.maximum(np.abs(a), np.abs(b)) < floor), 0.0, diff / denom)
    out[both] = d[both]
    out[fa != fb] = np.inf
    return out


def _first_parting(steps: np.ndarray, rel: np.ndarray, threshold: float, persist: int) -> int | None:
    """The first step of the first run of `persist` consecutive steps over
    `threshold`; a non-finite difference (one run only non-finite) ends the
    search at once, at the start of the run of steps over the threshold
    that it closes."""
    run = 0
    for i, r in enumerate(rel):
        run = run + 1 if r > threshold else 0
        if run and (run >= persist or np.isinf(r)):
            return int(steps[i - run + 1])
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
    # An overflowed gradient of a step the scaler skipped was never applied:
    # that is how a loss scaler calibrates, not a parting. Not compared.
    skipped = set(run.steps.loc[run.steps["skipped"].astype(bool), "step"].astype(int))
    df = df[~(bad & (df["kind"] != "activation") & df["step"].isin(skipped))].copy()
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
    if m.empty:
        return pd.DataFrame(columns=LAYER_COLUMNS)
    m = _with_metric(m)
    m["floor"] = _noise_floor(m, max(MODEL_FLOOR, _epsilon(run_a), _epsilon(run_b)))
    rows = []
    for (name, kind), g in m.groupby(["name", "kind"], sort=False):
        g = g.sort_values("step")
        va, vb, metric = g["va"].to_numpy(float), g["vb"].to_numpy(float), g["metric"].to_numpy(object)
        st = g["step"].to_numpy()
        rel = _rel_diff(va, vb, g["floor"].to_numpy(float))
        step = _first_parting(st, rel, threshold, persist)
        i = int(np.flatnonzero(st == step)[0]) if step is not None else None
        finite = rel[np.isfinite(rel)]
        one_sided = np.flatnonzero(np.isinf(rel))
        rows.append({"name": name, "kind": kind,
                     "metric": metric[i] if i is not None else METRIC[kind],
                     "parted_step": step, "rel_diff": float(rel[i]) if i is not None else None,
                     "one_side_nonfinite": bool(np.isinf(rel[i])) if i is not None else None,
                     "value_a": float(va[i]) if i is not None else None,
                     "value_b": float(vb[i]) if i is not None else None,
                     "max_rel_diff": float(finite.max()) if len(finite) else None,
                     "nonfinite_step": int(st[one_sided[0]]) if len(one_sided) else None,
                     "_phase": 0 if g["phase_a"].iloc[0] == "forward" else 1,
                     "_order": int(g["order_a"].min())})
    out = pd.DataFrame(rows)
    out["_never"] = out["parted_step"].isna()
    out = out.sort_values(["_never", "parted_step", "_phase", "_order"], kind="stable")
    out = out[LAYER_COLUMNS].reset_index(drop=True)
    for col in ("parted_step", "nonfinite_step"):
        out[col] = out[col].astype("Int64")
    return out


def _with_metric(m: pd.DataFrame) -> pd.DataFrame:
    """`va`, `vb`, `metric`: the gradient norm of a parameter where both
    runs have it at that step, else the absmax."""
    m = m.copy()
    norm = (m["kind"] == "param_grad") & m["norm_a"].notna() & m["norm_b"].notna()
    m["va"] = np.where(norm, m["norm_a"], m["absmax_a"]).astype(float)
    m["vb"] = np.where(norm, m["norm_b"], m["absmax_b"]).astype(float)
    m["metric"] = np.where(norm, "grad_norm", np.where(m["kind"] == "param_grad", "grad_absmax",
                                                       m["kind"].map(METRIC)))
    return m


def _noise_floor(m: pd.DataFrame, model_floor: float) -> pd.Series:
    """Per row: the value below which a pair is noise, the larger of
    `model_floor` x the step's largest finite value of that kind and metric
    (either run) and LAYER_FLOOR x the layer's own median finite value in
    run A."""
    fa = m["va"].abs().where(np.isfinite(m["va"]))
    fb = m["vb"].abs().where(np.isfinite(m["vb"]))
    larger = np.fmax(fa, fb)
    step_max = larger.groupby([m["kind"], m["metric"], m["step"]]).transform("max").fillna(0.0)
    own = fa.groupby([m["name"], m["kind"], m["metric"]]).transform("median").fillna(0.0)
    return np.maximum(model_floor * step_max, LAYER_FLOOR * own)


def _epsilon(run: Run) -> float:
    ac = run.autocast
    own = param_dtype(run.manifest)  # parameters held in bf16/fp16 round like their dtype
    coarser = [d for d in (ac.get("dtype") if ac.get("enabled") else None, own) if d in EPSILON]
    return max((EPSILON[d] for d in coarser), default=EPSILON["float32"])


def _facts(run: Run) -> dict:
    ac = run.autocast
    params = param_dtype(run.manifest)
    return {"path": str(run.path), "run_id": run.run_id,
            "precision": precision_words(ac, params), "autocast_dtype": ac.get("dtype") if ac.get("enabled") else None,
            "param_dtype": params,
            "steps": int(run.steps["step"].nunique()) if len(run.steps) else 0}


def precision_words(ac: dict, params: str | None) -> str:
    """The precision of a run (`--json` "precision"): the autocast dtype, or
    `float32 (no autocast)`; parameters held in another dtype said beside it."""
    base = ac.get("dtype") if ac.get("enabled") else "float32 (no autocast)"
    if params in (None, "float32"):
        return str(base)
    return (f"{params} parameters (no autocast)" if not ac.get("enabled")
            else f"{ac.get('dtype')} autocast over {params} parameters")




def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v) -> str:
    return "-" if v is None else ("inf" if not math.isfinite(v) else f"{v:.1%}")
