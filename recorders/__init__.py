"""amp-postmortem recorders: ride along with a training job and write a run.

Imports only torch, numpy, pyarrow and the standard library, so a training
job never pays for the analyzer's dependencies.
"""
from .recorder import AmpRecorder
from .schema import SCHEMA_VERSION

__all__ = ["AmpRecorder", "SCHEMA_VERSION"]
