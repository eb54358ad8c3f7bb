"""Lost updates: optimizer steps that leave bfloat16/float16 weights
unchanged, and the parameters' own dtype.

The recorder measures, on its sampled steps, per parameter held in low
precision, how many positions the optimizer was asked to move (non-zero
gradient) and how many of those kept their exact value (the manifest's
`lost_updates`, `recorders/collectors/updates.py`). A weight changes only
when its update reaches half an ulp of the weight: in bfloat16 that is
2^-9 of its magnitude, so a learning rate times an update below it is lost
to rounding. Float32 parameters (a float32 run, autocast over float32
weights) are not measured: a float32 master weight keeps every update.

`lost_updates(run)` returns per layer (module) the lost share at the latest
measured step and its trend (Theil-Sen slope per 1000 steps), the share
over the run's recent measured steps, the cause (`LostCause`) and the
remedies (`UpdateRemedy`); `update_remedies.py` says whether each is
verified by a re-run of a saved window of steps where the run holds one.
`param_dtypes(run)` says the parameters' dtypes from the manifest, for the
run facts and `compare`.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from recorders.format import schema

from ..reading.loader import Run
from ..names import Word
from .trend import theil_sen

LOST_SHARE = 0.25       # a quarter of the asked updates lost: the training stalls
RECENT_PART = 0.25      # the recent measured steps: the last quarter (at least the latest one)
ALPHA = 0.01
MAX_TREND_POINTS = 200


class LostCause(Word):
    """Why updates are lost; `value` is the `--json` "cause"."""
    NO_MASTER_WEIGHTS = "no_master_weights"   # parameters held in bf16/fp16, no float32 copy, times the lr


class UpdateRemedy(Word):
    """What keeps the updates; `value` is the `--json` remedy."""
    FP32_MASTER_WEIGHTS = "fp32_master_weights"       # float32 parameters under autocast (or a master copy)
    LARGER_LR = "larger_learning_rate"                # updates above half an ulp
    STOCHASTIC_ROUNDING = "stochastic_rounding"       # or compensated (Kahan) summation, keeping bf16 weights


@dataclass(frozen=True)
class LayerUpdates:
    name: str                 # the module (a parameter's prefix)
    dtype: str
    params: int
    lost_share: float | None          # at the latest measured step
    recent_lost_share: float | None   # over the recent measured steps
    trend_per_kstep: float | None     # Theil-Sen slope of the share, per 1000 steps
    moved: int                        # updates asked at the latest measured step

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "params": self.params, "lost_share": self.lost_share,
                "recent_lost_share": self.recent_lost_share, "trend_per_kstep": self.trend_per_kstep,
                "moved": self.moved}


@dataclass
class LostUpdates:
    measured: bool                    # the run measured low-precision parameters
    steps: list = field(default_factory=list)
    layers: list = field(default_factory=list)   # LayerUpdates, most lost first
    recent_lost_share: float | None = None
    recent_from_step: int | None = None
    lost_share_by_step: list = field(default_factory=list)
    cause: LostCause | None = None
    param_dtype: str | None = None
    learning_rate: float | None = None
    optimizer: str | None = None
    window: bool = False              # a saved window of steps could verify the remedies

    @property
    def lost(self) -> bool:
        return self.recent_lost_share is not None and self.recent_lost_share >= LOST_SHARE

    def remedies(self) -> list:
        return list(UpdateRemedy) if self.lost else []

    def to_dict(self) -> dict:
        return {"measured": self.measured, "steps": self.steps, "layers": [lay.to_dict() for lay in self.layers],
                "recent_lost_share": self.recent_lost_share, "recent_from_step": self.recent_from_step,
                "lost_share_by_step": self.lost_share_by_step,
                "cause": None if self.cause is None else self.cause.value, "param_dtype": self.param_dtype,
                "learning_rate": self.learning_rate, "optimizer": self.optimizer,
                "remedies": [r.value for r in self.remedies()], "window": self.window}


def param_dtypes(manifest: dict) -> dict:
    """{dtype: parameter count} of the manifest's parameters."""
    return dict(Counter(str(p.get("dtype")) for p in manifest.get("params") or [] if isinstance(p, dict)))


def param_dtype(manifest: dict) -> str | None:
    """The parameters' dtype: one name, `mixed (a, b)`, or None when unrecorded."""
    found = param_dtypes(manifest)
    if not found:
        return None
    if len(found) == 1:
        return next(iter(found))
    return "mixed (" + ", ".join(sorted(found)) + ")"


def lost_updates(run: Run) -> LostUpdates:
    """The lost updates the recorder measured (see the module's doc)."""
    m = run.manifest
    rec = m.get(schema.LOST_UPDATES_KEY) or {}
    names, dtypes = list(rec.get("params") or []), list(rec.get("dtypes") or [])
    steps = [int(s) for s in rec.get("steps") or []]
    moved = np.asarray(rec.get("moved") or [], dtype=float).reshape(len(steps), -1) if steps else None
    kept = np.asarray(rec.get("unchanged") or [], dtype=float).reshape(len(steps), -1) if steps else None
    opt = (m.get("optimizer") or {}).get("class")
    out = LostUpdates(measured=bool(names), steps=steps, param_dtype=param_dtype(m), optimizer=opt)
    if moved is None or moved.shape[1] != len(names) or kept.shape != moved.shape:
        return out
    recent = max(1, int(math.ceil(len(steps) * RECENT_PART)))
    total_moved, total_kept = moved.sum(axis=1), kept.sum(axis=1)
    out.lost_share_by_step = [None if a == 0 else float(k / a) for a, k in zip(total_moved, total_kept)]
    a, k = total_moved[-recent:].sum(), total_kept[-recent:].sum()
    out.recent_lost_share = float(k / a) if a else None
    out.recent_from_step = steps[-recent]
    groups: dict = {}
    for i, name in enumerate(names):
        groups.setdefault(name.rpartition(".")[0] or name, []).append(i)
    layers = []
    for layer, idx in groups.items():
        a_s, k_s = moved[:, idx].sum(axis=1), kept[:, idx].sum(axis=1)
        share = [k / a if a else np.nan for a, k in zip(a_s, k_s)]
        ra, rk = a_s[-recent:].sum(), k_s[-recent:].sum()
        layers.append(LayerUpdates(
            name=layer, dtype=dtypes[idx[0]] if idx[0] < len(dtypes) else "unknown", params=len(idx),
            lost_share=None if not a_s[-1] else float(k_s[-1] / a_s[-1]),
            recent_lost_share=float(rk / ra) if ra else None, trend_per_kstep=_trend(steps, share),
            moved=int(a_s[-1])))
    out.layers = sorted(layers, key=lambda lay: (-(lay.recent_lost_share or 0.0), lay.name))
    if out.lost:
        out.cause = LostCause.NO_MASTER_WEIGHTS
        out.learning_rate, out.window = _last_lr(run), bool(_windows(run))
    return out


def _trend(steps, share) -> float | None:
    x = np.asarray(steps, dtype=float)
    y = np.asarray(share, dtype=float)
    ok = np.isfinite(y)
    if ok.sum() < 3 or len(set(x[ok])) < 2:
        return None
    slope, _, _ = theil_sen(x[ok], y[ok], alpha=ALPHA, max_points=MAX_TREND_POINTS)
    return slope * 1000.0


def _last_lr(run: Run) -> float | None:
    steps = run.steps  # read only for a run that lost updates
    if "lr" not in steps or not len(steps):
        return None
    v = steps["lr"].iloc[-1]
    try:
        v = v[0] if hasattr(v, "__len__") else v
        return float(v)
    except (TypeError, ValueError, IndexError):
        return None


def _windows(run: Run) -> list:
    from ..errors import BundleError
    from ..reading.window import window_spans
    try:
        return window_spans(run.path)
    except BundleError:
        return []
