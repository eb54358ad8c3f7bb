"""Analyses: one pure function per module, from a loaded `Run` to plain data.

No printing, no click: each returns a report object with `to_dict()` (the
JSON contract), `table()` (a DataFrame, the rows a person scans) and
`lines()` (the few sentences shown above that table).

    nans.find_nans(run)              first non-finite appearance per layer, origins
    scale.scale_dynamics(run)        loss-scale status, onset, rate, drivers
    ranges.layer_ranges(run)         float16 headroom, trend, forecast, underflow
    summary.summarize(run)           findings of the three, by severity
    compare.compare_runs(a, b)       where two runs part
    bundle_choice.pick_bundle(run)   which saved bundle a what-if replays by default
    watch.RunWatcher(path).poll()    a running job's new findings, once each, and how the watch ends

The names below are imported on first use, so that reading one small module
(e.g. `bundle_choice` for the CLI's help) does not load pandas and scipy.
"""
import importlib

_EXPORTS = {"find_nans": "nans", "layer_ranges": "ranges", "scale_dynamics": "scale", "summarize": "summary"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
