"""`--fail-on`, one rule for `summary` and `watch`: which findings make the
command exit with code 1. Light (no pandas): the CLI checks the option with
it before any run is read."""
from __future__ import annotations

from typing import Callable

from ..errors import OptionError
from ..names import FINDING_KINDS

# A finding's severities, the worst first.
SEVERITIES = ("critical", "error", "warning", "info")


def fail_rule(fail_on) -> Callable:
    """A test of a finding (anything with `kind` and `severity`): a
    severity (`critical`: a finding of that severity or worse), finding
    kinds (a list or `"kind,kind"`), or None (never). A severity never
    fails on `healthy`, the finding that there is nothing to report."""
    if fail_on is None:
        return lambda f: False
    if isinstance(fail_on, str) and fail_on.strip() in SEVERITIES:
        rank = SEVERITIES.index(fail_on.strip())
        return lambda f: f.kind != "healthy" and SEVERITIES.index(f.severity) <= rank
    kinds = {k.strip() for k in (fail_on.split(",") if isinstance(fail_on, str) else fail_on) if k.strip()}
    unknown = sorted(kinds - set(FINDING_KINDS))
    if unknown or not kinds:
        bad = f"unknown finding kind(s) {', '.join(unknown)}; " if unknown else ""
        raise OptionError(f"fail_on {fail_on!r} is neither a severity ({', '.join(SEVERITIES)}) nor finding "
                          f"kinds: {bad}kinds are {', '.join(FINDING_KINDS)}")
    return lambda f: f.kind in kinds
