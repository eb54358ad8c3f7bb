"""Analyses: one pure function per module, from a loaded `Run` to plain data.

No printing, no click: each returns a report object with `to_dict()` (the
JSON contract), `table()` (a DataFrame, the rows a person scans) and
`lines()` (the few sentences shown above that table).

    nans.find_nans(run)            first non-finite appearance per layer, origins
    scale.scale_dynamics(run)      loss-scale status, onset, rate, drivers
    ranges.layer_ranges(run)       float16 headroom, trend, forecast, underflow
    summary.summarize(run)         findings of the three, by severity
"""
from .nans import find_nans
from .ranges import layer_ranges
from .scale import scale_dynamics
from .summary import summarize

__all__ = ["find_nans", "layer_ranges", "scale_dynamics", "summarize"]
