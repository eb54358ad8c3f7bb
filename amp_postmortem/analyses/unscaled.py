"""Float16 gradients that travel unscaled, and how much signal each layer
loses to float16's small end.

A float16 backward needs a loss scale: without one the gradients keep the
loss's own magnitudes, and the small ones (below 2^-14, float16's smallest
normal) lose precision as subnormals or are flushed to zero (below 2^-25).
No NaN, no skipped step: the loss just stops improving. `find_unscaled`
says when a run's float16 gradients travelled with no scale
(`ScaleAbsence`: no scaler, a disabled one, a scale of 1) and underflow,
and ranks the layers by the signal they lose (`lost_signal`), not by their
zeros: a layer whose zeros are structural (zero in any precision) loses
nothing to them.

The signal a layer loses is read from its `ranges` row, one number per
layer and typed: `flush_headroom_bits`, how far its largest gradient value
sits above float16's flush edge (2^-24, the smallest subnormal). A
gradient spreads over several binades below its largest value; when that
largest value is a few binades above the edge, nearly all of it is flushed
or subnormal whatever its zeros are, so the fewest bits lose the most.
Zeros are no evidence by themselves (`ranges.zero_split` cannot tell a
structural zero from a flushed one when every value sits near the edge, as
in an unscaled backward: the row's `zeros_told` is then false); a replay of
a saved step can (`whatif/flush.py`): the step in float32 and in the
recorded precision, and per layer the gradient values zero in the
recorded precision but not in float32 (flushed) against those zero in
both (structural) (`ReplayedZeros`). Each layer says where its zeros were
read (`ZerosBasis`): the recorded rows where they tell, the replay where
they do not, else `undetermined`; a replayed layer is ranked by the share
of its float32 non-zero values the recorded precision flushed, which is
the signal it lost, ahead of the headroom order.

Subnormal values are not flushed ones: `Underflow.SUBNORMAL` (values kept,
with fewer bits) is told from `Underflow.FLUSHED` (values made zero) on the
recorded flushed-zero share, so that `summary` warns of flushing and only
says what subnormals cost.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import pandas as pd

from ..reading.loader import Run
from ..names import Word

LOG2_SMALLEST_SUBNORMAL = -24   # float16's smallest subnormal, 2^-24 = 5.96e-8
FLUSHED_SHARE = 0.01            # a layer flushes when at least 1% of its values were made zero by float16
TOP_LAYERS = 5                  # the layers a finding names


class ScaleAbsence(Word):
    """Why the float16 gradients travelled unscaled; `value` is the
    `--json` "cause"."""
    NO_SCALER = "no_scaler"              # no GradScaler given to the recorder
    SCALER_DISABLED = "scaler_disabled"  # GradScaler(enabled=False)
    SCALE_ONE = "scale_one"              # a scaler whose scale stayed at 1


class Underflow(Word):
    """What a layer's underflow is, from its recorded shares."""
    FLUSHED = "flushed"          # values made zero by float16 (signal lost)
    SUBNORMAL = "subnormal"      # values kept as subnormals: fewer bits, none lost


class ZerosBasis(Word):
    """Where a layer's zeros were told apart; `value` is the `--json`
    "zeros_basis"."""
    RECORDED = "recorded"          # the recorded distribution split them (`underflow.row_shares`)
    REPLAY = "replay"              # a saved step replayed in float32 and in the recorded precision
    UNDETERMINED = "undetermined"  # neither: the rows cannot tell, and no bundle (or no --model) to replay


@dataclass(frozen=True)
class LayerZeros:
    """One layer's gradient values in a replayed step: its output
    gradients' and its own parameters'."""
    name: str
    values: int        # counted
    live: int          # non-zero in float32
    flushed: int       # of the live ones, exactly zero in the recorded precision
    subnormal: int     # of the live ones, non-zero but below float16's smallest normal (float16 only)
    structural: int    # zero in float32 and in the recorded precision

    @property
    def flushed_share(self) -> float | None:
        return self.flushed / self.live if self.live else None

    @property
    def structural_share(self) -> float | None:
        return self.structural / self.values if self.values else None

    def to_dict(self) -> dict:
        return {"name": self.name, "values": self.values, "live": self.live, "flushed": self.flushed,
                "subnormal": self.subnormal, "structural": self.structural, "flushed_share": self.flushed_share,
                "structural_share": self.structural_share}


@dataclass
class ReplayedZeros:
    """A saved step's gradients in float32 and in the recorded precision
    (`whatif/flush.py`), per layer."""
    step: int
    rank: int
    precision: str
    loss_scale: float
    layers: dict = field(default_factory=dict)   # name -> LayerZeros

    @property
    def flushed_share(self) -> float | None:
        live = sum(z.live for z in self.layers.values())
        return sum(z.flushed for z in self.layers.values()) / live if live else None

    def to_dict(self) -> dict:
        order = sorted(self.layers.values(), key=lambda z: (-(z.flushed_share or 0.0), z.name))
        return {"step": self.step, "rank": self.rank, "precision": self.precision, "loss_scale": self.loss_scale,
                "flushed_share": self.flushed_share, "layers": [z.to_dict() for z in order]}


@dataclass(frozen=True)
class LayerLoss:
    """One gradient's loss of signal (a `ranges` grad_output row)."""
    name: str
    flush_headroom_bits: float | None   # log2(absmax / 2^-24); None: no finite non-zero value
    underflow_share: float | None       # subnormal or flushed (structural zeros left out)
    flushed_zero_share: float | None
    structural_zero_share: float | None
    zero_share: float | None
    underflow: Underflow
    zeros_basis: ZerosBasis = ZerosBasis.RECORDED
    replayed: LayerZeros | None = None  # the replay's count, where one ran and saw the layer

    def to_dict(self) -> dict:
        return {"name": self.name, "flush_headroom_bits": self.flush_headroom_bits,
                "underflow_share": self.underflow_share, "flushed_zero_share": self.flushed_zero_share,
                "structural_zero_share": self.structural_zero_share, "zero_share": self.zero_share,
                "underflow": self.underflow.value, "zeros_basis": self.zeros_basis.value,
                "replayed": None if self.replayed is None else self.replayed.to_dict()}


@dataclass
class Unscaled:
    """A float16 backward without a loss scale (`cause`), or None-like
    (`cause` None) when the run had a scale or no float16 gradient."""
    cause: ScaleAbsence | None
    device_type: str | None
    layers: list = field(default_factory=list)   # LayerLoss of the underflowing layers, most signal lost first

    @property
    def underflows(self) -> bool:
        return self.cause is not None and bool(self.layers)

    def to_dict(self) -> dict:
        return {"cause": None if self.cause is None else self.cause.value, "device_type": self.device_type,
                "layers": [lay.to_dict() for lay in self.layers]}


def scale_absence(run: Run) -> ScaleAbsence | None:
    """Why a float16-autocast run's gradients had no loss scale; None when
    autocast was not float16, or a scale above 1 was applied."""
    ac = run.autocast or {}
    if not ac.get("enabled") or ac.get("dtype") != "float16":
        return None
    recorded = run.manifest.get("scaler")
    if not recorded:
        return ScaleAbsence.NO_SCALER
    if recorded.get("enabled") is False:
        return ScaleAbsence.SCALER_DISABLED
    scales = run.step_series().steps.get("loss_scale_before")
    known = scales.dropna() if scales is not None else pd.Series(dtype=float)
    # A scale of exactly 1 applies none; one below 1 is a scale stuck low (`scale`'s finding).
    if len(known) and bool((known == 1.0).all()):
        return ScaleAbsence.SCALE_ONE
    if not len(known):
        return ScaleAbsence.SCALER_DISABLED
    return None


def layer_losses(ranges, flag: str = "underflow", replayed: ReplayedZeros | None = None) -> list[LayerLoss]:
    """The float16 gradient rows `ranges` flags with `flag`, most signal
    lost first (`lost_signal_order`). A layer's zeros are read from its
    row where the row tells them apart, else from `replayed` (a replay of
    a saved step) where it saw the layer, else undetermined (and counted
    as the row counts them)."""
    rows = ranges.flagged(flag)
    rows = rows[(rows["kind"] == "grad_output") & (rows["range_dtype"] == "float16")]
    out = []
    for r in rows.to_dict("records"):
        name = str(r["name"])
        flushed = _num(r.get("flushed_zero_share"))
        told = r.get("zeros_told")
        seen = replayed.layers.get(name) if replayed is not None else None
        if told is not False and told is not None:
            basis = ZerosBasis.RECORDED
        else:
            basis = ZerosBasis.REPLAY if seen is not None else ZerosBasis.UNDETERMINED
        share = seen.flushed_share if basis is ZerosBasis.REPLAY else flushed
        out.append(LayerLoss(
            name=name, flush_headroom_bits=_bits(r.get("absmax")),
            underflow_share=_num(r.get("recent_underflow_share")), flushed_zero_share=flushed,
            structural_zero_share=_num(r.get("structural_zero_share")), zero_share=_num(r.get("zero_share")),
            underflow=Underflow.FLUSHED if (share or 0.0) >= FLUSHED_SHARE else Underflow.SUBNORMAL,
            zeros_basis=basis, replayed=seen))
    return sorted(out, key=lost_signal_order)


def lost_signal_order(lay: LayerLoss) -> tuple:
    """Replayed layers first, by the share of their float32 signal the
    recorded precision flushed; then by the fewest bits above the flush
    edge, then the larger share."""
    if lay.zeros_basis is ZerosBasis.REPLAY and lay.replayed is not None:
        return (0, -(lay.replayed.flushed_share or 0.0), 0.0, lay.name)
    bits = lay.flush_headroom_bits
    return (1, math.inf if bits is None else bits, -(lay.underflow_share or 0.0), lay.name)


def zeros_basis(layers: list) -> ZerosBasis | None:
    """Where the layers' zeros were read, as one word: `undetermined` when
    any layer's could not be, else `replay` when any came from a replay,
    else `recorded`; None without layers."""
    if not layers:
        return None
    found = {lay.zeros_basis for lay in layers}
    for basis in (ZerosBasis.UNDETERMINED, ZerosBasis.REPLAY):
        if basis in found:
            return basis
    return ZerosBasis.RECORDED


def find_unscaled(run: Run, ranges, replayed: ReplayedZeros | None = None) -> Unscaled:
    """The unscaled float16 backward of `run` (see the module's doc);
    `ranges`: its `layer_ranges` report; `replayed`: a saved step's
    replayed zeros, where the rows cannot tell them."""
    cause = scale_absence(run)
    device = (run.autocast or {}).get("device_type") or run.manifest.get("device_type")
    if cause is None:
        return Unscaled(None, device)
    return Unscaled(cause, device, layer_losses(ranges, replayed=replayed))


def only_subnormal(layers: list) -> bool:
    """Every underflowing layer keeps its values (subnormals, nothing flushed)."""
    return bool(layers) and all(lay.underflow is Underflow.SUBNORMAL for lay in layers)


def _bits(absmax) -> float | None:
    v = _num(absmax)
    if v is None or v <= 0:
        return None
    return max(0.0, math.log2(v) - LOG2_SMALLEST_SUBNORMAL)


def _num(v) -> float | None:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
