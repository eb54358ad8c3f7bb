"""Named errors of the analyzer: everything a user can fix. Each carries a
one-line message naming the bad value and what would be valid; the CLI prints
`Error: <message>` and exits with code 2. Any other exception is a bug (exit
code 1; `--debug` shows the traceback)."""


class PostmortemError(Exception):
    """Base class: an input the analyzer cannot use."""


class RunNotFoundError(PostmortemError):
    """The run path does not exist, is not a run directory, or cannot be read."""


class UnsupportedVersionError(PostmortemError):
    pass


class CorruptRunError(PostmortemError):
    pass


class EmptyRunError(CorruptRunError):
    """A run (or the selected rank) holds no readable step: no shard yet,
    every shard unreadable, empty or of another format, or recording was
    switched off before the first step was written."""


class MixedRunsError(CorruptRunError):
    """Files of different recordings (run ids) share one run directory."""


class RankNotFoundError(PostmortemError):
    """--rank names a rank the run has no data for."""


class StepNotFoundError(PostmortemError):
    """--step names a step the run did not record."""


class BundleError(PostmortemError):
    """A replay bundle is missing, truncated, tampered with or unreadable."""


class ModelSpecError(PostmortemError):
    """--model could not be resolved or the weights do not fit the model."""


class LossFnSpecError(PostmortemError):
    """--loss-fn could not be resolved to a callable."""


class PrecisionError(PostmortemError):
    """A precision that is not one of fp64, fp32, fp16, bf16, or one the
    saved step cannot be replayed in."""


class PolicyError(PostmortemError):
    """An autocast policy that is not one of recorded, cuda, cpu."""


class DeviceError(PostmortemError):
    """A replay device that is not valid or not available here (CUDA)."""


class OptionError(PostmortemError):
    """An option value outside its valid range (e.g. --scales 4:2)."""


class MissingExtraError(PostmortemError):
    """An optional dependency (a pip extra such as `report`) is not installed."""


class ReplayFileError(PostmortemError):
    """`report --replay` names a file that is not the output of `replay --json`."""


class ExportError(PostmortemError):
    """An export cannot be written where it was asked for."""
