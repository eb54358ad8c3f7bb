"""`RangesReport`, what `ranges` returns: the layers' table, the probed
modules' operations, and how both read (`lines`, the sentences that date a
layer's underflow)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from recorders.format import plain

from ..display import report_html, report_repr
from ..names import display_name as _display
from ..result import CommandResult
from .range_limits import (DTYPE_LIMITS, FLUSH_MARGIN_BITS, FORECAST_HORIZON, FORECAST_IMMINENT, FORECAST_RISK_BITS,
                           LOG2_FLUSH_EDGE, MIN_FIT_SPREAD, MIN_GAP_VALUES, OVERFLOW_RISK_BITS, RECENT_PART,
                           STALE_PART, UNDERFLOW_SHARE)
from .underflow import Zeros


@dataclass
class RangesReport(CommandResult):
    layers: pd.DataFrame      # LAYER_COLUMNS, in execution order (forward, then backward)
    first_step: int | None    # the window analysed
    last_step: int | None
    full_tier_steps: int = 0  # steps of the window with full-tier statistics
    # INTERMEDIATE_COLUMNS, one row per probed module (empty: no op probe in the run)
    intermediates: pd.DataFrame | None = None

    def document(self) -> dict:
        rows = []
        for r in self.layers.to_dict("records"):
            rows.append({k: plain(v) for k, v in r.items()})
        inside = [] if self.intermediates is None else [
            {k: plain(v) for k, v in r.items()} for r in self.intermediates.to_dict("records")]
        return {"layers": rows, "first_step": self.first_step, "last_step": self.last_step,
                "full_tier_steps": self.full_tier_steps, "intermediates": inside,
                "thresholds": {"overflow_risk_bits": OVERFLOW_RISK_BITS, "forecast_horizon": FORECAST_HORIZON,
                               "forecast_risk_bits": FORECAST_RISK_BITS, "forecast_imminent": FORECAST_IMMINENT,
                               "underflow_share": UNDERFLOW_SHARE,
                               "flush_margin_bits": FLUSH_MARGIN_BITS,
                               "log2_flush_edge": LOG2_FLUSH_EDGE, "min_gap_values": MIN_GAP_VALUES,
                               "min_fit_spread": MIN_FIT_SPREAD,
                               "recent_part": RECENT_PART, "stale_part": STALE_PART,
                               "dtype_limits": {d: {"max": mx, "min_normal": mn}
                                                for d, (mx, mn) in DTYPE_LIMITS.items()}}}

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

    def table(self) -> pd.DataFrame:
        t = self.layers.copy()
        t["flags"] = [",".join(f) for f in t["flags"]]
        return t

    def flagged(self, flag: str) -> pd.DataFrame:
        return self.layers[[flag in f for f in self.layers["flags"]]]

    def lines(self) -> list[str]:
        if self.first_step is None:
            return ["No tensor rows recorded."]
        out = [f"steps {self.first_step}-{self.last_step} ({self.full_tier_steps} with full-tier statistics)"]
        used = self.layers["range_dtype"].value_counts()
        out.append("limits: " + ", ".join(f"{d} (max {DTYPE_LIMITS[d][0]:.6g}) for {n} row(s)"
                                          for d, n in sorted(used.items())))
        for flag in ("nonfinite", "overflow_risk", "underflow", "underflow_lapsed"):
            hit = self.flagged(flag)
            if len(hit):
                names = ", ".join(sorted({_display(n) for n in hit["name"]}))
                out.append(f"{flag}: {len(hit)} row(s): {names}")
                if flag == "underflow":
                    worst = hit.sort_values("recent_underflow_share", ascending=False, kind="stable").iloc[0]
                    out.append(f"worst underflow: {_display(worst['name'])} {worst['kind']}, "
                               f"{worst['recent_underflow_share']:.0%} of "
                               f"{sampled_values(worst['share_sample_size'])} {recent_words(worst)}")
                if flag == "underflow_lapsed":
                    worst = hit.sort_values("underflow_episode_share", ascending=False, kind="stable").iloc[0]
                    out.append(f"lapsed underflow: {_display(worst['name'])} {worst['kind']}, {lapsed_words(worst)}")
        grads = self.layers[self.layers["kind"] == "grad_output"]
        masked = grads[grads["zeros"].isin([Zeros.STRUCTURAL.value, Zeros.MIXED.value])
                       & (grads["structural_zero_share"].fillna(0) >= UNDERFLOW_SHARE)]
        if len(masked):
            out.append(f"structural zeros (zero at any scale: not underflow): {len(masked)} gradient row(s), "
                       + ", ".join(f"{_display(r['name'])} {r['structural_zero_share']:.0%}"
                                   for r in masked.head(5).to_dict("records"))
                       + (", ..." if len(masked) > 5 else ""))
        unknown = grads[grads["zeros"] == Zeros.UNDETERMINED.value]
        if len(unknown):
            out.append(f"undetermined zeros (every value zero, a zero weight's or a gradient flushed whole, or too "
                       f"few non-zero values to tell; not counted as underflow): "
                       f"{', '.join(sorted({_display(n) for n in unknown['name']}))}")
        out.extend(self._intermediate_lines())
        if self.full_tier_steps == 0:
            out.append("no full-tier step in the window: underflow shares unknown")
        return out

    def _intermediate_lines(self) -> list[str]:
        if self.intermediates is None or not len(self.intermediates):
            return []
        out = [f"probed modules: {len(self.intermediates)}"]
        for r in self.intermediates.to_dict("records"):
            if "overflow_risk" not in r["flags"]:
                continue
            where = f" at {r['source']}" if r["source"] else ""
            output = r["output_headroom_bits"]
            seen = "" if output is None or pd.isna(output) else f"; its output keeps {output:.1f} bits"
            out.append(f"overflow_risk inside {_display(r['name'])}: {r['op']}{where} reached "
                       f"{r['absmax']:,.6g} in {r['dtype']} (max {DTYPE_LIMITS[r['range_dtype']][0]:.6g}, "
                       f"{r['headroom_bits']:.2f} bits of headroom) at step {r['step']}{seen}")
        return out


def recent_words(row) -> str:
    """When a layer's current underflow share was measured, for sentences."""
    first, last = row["recent_from_step"], row["evidence_last_step"]
    return (f"at step {last}" if first == last else f"over the full-tier steps {first}-{last}") + (
        f" (the window's {row['evidence_steps']} full-tier steps since step {row['evidence_first_step']}: "
        f"median {row['underflow_share']:.0%})" if row["evidence_steps"] and row["evidence_steps"] > 1 else "")


def lapsed_words(row) -> str:
    """A lapsed underflow in words: when it was, and what the evidence since says."""
    a, b = row["underflow_first_step"], row["underflow_last_step"]
    was = (f"{row['underflow_episode_share']:.0%} at step {a}" if a == b
           else f"{row['underflow_episode_share']:.0%} during steps {a}-{b}")
    recent = row["recent_underflow_share"]
    if recent is None or pd.isna(recent):
        return (f"was {was}; no full-tier step since step {row['evidence_last_step']} "
                f"(the window's first half): its share now is unknown")
    first, last = row["recent_from_step"], row["evidence_last_step"]
    return f"was {was}; {recent:.1%} " + (f"at step {last}" if first == last else f"over steps {first}-{last}")


def sampled_values(size) -> str:
    """How many values a share was counted on, for sentences: "50,000
    sampled values", or "its values" for a run that did not record it."""
    if size is None or pd.isna(size):
        return "its values"
    return f"{int(size):,} sampled values"
