"""Named errors of the analyzer. Each carries a one-line message naming the
bad value and what would be valid; the CLI prints `Error: <message>` and exits
with code 2."""


class PostmortemError(Exception):
    """Base class: an input the analyzer cannot use."""


class RunNotFoundError(PostmortemError):
    pass


class UnsupportedVersionError(PostmortemError):
    pass


class CorruptRunError(PostmortemError):
    pass


class BundleError(PostmortemError):
    """A replay bundle is missing, truncated, tampered with or unreadable."""


class ModelSpecError(PostmortemError):
    """--model could not be resolved or the weights do not fit the model."""


class MixedRunsError(CorruptRunError):
    """Files of different recordings (run ids) share one run directory."""


class RankNotFoundError(PostmortemError):
    """--rank names a rank the run has no data for."""


class EngineError(PostmortemError):
    """--engine / --scheduler name no usable engine (unknown name, missing
    extra, unreachable scheduler)."""
