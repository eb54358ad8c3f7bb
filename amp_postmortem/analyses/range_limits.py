"""The limits and thresholds `ranges` decides on, in one place: each dtype's
largest finite value and smallest normal (`DTYPE_LIMITS`, and which apply
to a row: `range_dtype`), the headroom and forecast thresholds of
`overflow_risk`, and the underflow rules' (`underflow.py`). `--json` prints
them all (`RangesReport`'s "thresholds")."""
from __future__ import annotations

from recorders.format import schema

OVERFLOW_RISK_BITS = 2.0      # < 2 bits: absmax above 16376, a factor 4 from Inf
FORECAST_HORIZON = 1000       # steps after the latest one
FORECAST_RISK_BITS = 6.0      # a forecast alarms within a factor 64 of the limit...
FORECAST_IMMINENT = 100       # ...or, whatever the headroom, when it is this few steps away
UNDERFLOW_SHARE = 0.25        # a quarter of a gradient's values subnormal or flushed
FLUSH_MARGIN_BITS = 2.0       # no longer used (zeros are judged by `zero_split`); kept in --json's thresholds
LOG2_MIN_NORMAL = -14         # float16's smallest normal, 2^-14 = 6.1e-5
LOG2_FLUSH_EDGE = -25         # float16 rounds |x| < 2^-25 to zero (2^-24 is its smallest subnormal)
MIN_FIT_SPREAD = 1.0          # the fit's two quantiles at least this many sigmas apart, else the values sit at the edge
MIN_GAP_VALUES = 32           # non-zero values needed before an empty subnormal band proves the zeros structural
RECENT_PART = 0.25            # the recent evidence: full-tier steps of the window's last quarter...
STALE_PART = 0.5              # ...or the latest one, unless it lies in the window's first half (stale)

# (largest finite value, smallest normal) per dtype; float16's when the dtype is unknown.
DTYPE_LIMITS = {
    "float16": (schema.FP16_MAX, schema.FP16_MIN_NORMAL),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38),
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38),
    "float64": (1.7976931348623157e308, 2.2250738585072014e-308),
}
FALLBACK_DTYPE = "float16"


def range_dtype(dtype) -> str:
    """The dtype whose limits apply to a row of recorded `dtype`."""
    return dtype if isinstance(dtype, str) and dtype in DTYPE_LIMITS else FALLBACK_DTYPE
