"""amp-postmortem recorders: ride along with a training job and write a run.

Imports only torch, numpy, pyarrow and the standard library, so a training
job never pays for the analyzer's dependencies. `AmpRecorder` and the parts
it takes (`RecordSchedule`, `BundlePolicy`, `StorageOptions`,
`WriterOptions`, `EventPolicy`, `ProbeOptions`) and the events an `on_event` callback gets
(`Event`, `EventKind`) are imported lazily so that the analyzer can read
the run format (`recorders.format`, the format's one definition, which
the recorder's own modules import too) without importing torch.
"""
from .format.schema import SCHEMA_VERSION

# name -> the module that defines it
_LAZY = {"AmpRecorder": "recorder", "RecordSchedule": "schedule", "BundlePolicy": "bundles.policy",
         "StorageOptions": "options", "WriterOptions": "options", "ProbeOptions": "options", "OptionError": "errors",
         "Event": "events", "EventKind": "events", "EventPolicy": "events"}

__all__ = [*_LAZY, "SCHEMA_VERSION"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'recorders' has no attribute {name!r}")
