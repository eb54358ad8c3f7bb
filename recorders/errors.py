"""The recorder's one user error: an option the caller must fix.

Raised at construction (of `AmpRecorder` or of one of its parts), before
anything is written; every other failure of the recorder turns recording
off with one warning and never stops the training. A `ValueError`, so code
that caught the `ValueError` a bad option raised before keeps working.
"""
from __future__ import annotations

import numbers
import operator


class OptionError(ValueError):
    """A recorder option the caller must fix (raised at construction)."""


def option_int(name: str, value) -> int:
    """`value` as a whole number for option `name` (a numpy integer or a
    float like 1e3 too), else an OptionError."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            if isinstance(value, numbers.Real) and float(value).is_integer():
                return int(value)
    raise OptionError(f"{name}={value!r} is not a whole number")


def option_float(name: str, value) -> float:
    """`value` as a number for option `name`, else an OptionError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"{name}={value!r} is not a number")
    return float(value)
