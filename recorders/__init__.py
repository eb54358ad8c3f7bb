"""amp-postmortem recorders: ride along with a training job and write a run.

Imports only torch, numpy, pyarrow and the standard library, so a training
job never pays for the analyzer's dependencies. `AmpRecorder` is imported
lazily so that the analyzer can read `recorders.schema` (the format's one
definition) without importing torch.
"""
from .schema import SCHEMA_VERSION

__all__ = ["AmpRecorder", "SCHEMA_VERSION"]


def __getattr__(name):
    if name == "AmpRecorder":
        from .recorder import AmpRecorder
        return AmpRecorder
    raise AttributeError(f"module 'recorders' has no attribute {name!r}")
