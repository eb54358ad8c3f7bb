"""Plain JSON data from analysis results: the one converter every report's
`to_dict()` uses, so `--json` never prints NaN, Infinity or a numpy type."""
from __future__ import annotations

import math


def plain(obj):
    """Dicts, lists and tuples recursively; numpy scalars and arrays to Python
    values; NaN/Inf floats and pandas' NA to None."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, bytes, bool, int)):
        return obj
    if type(obj).__name__ == "NAType":  # pandas.NA, without importing pandas
        return None
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        try:
            return plain(obj.tolist())
        except (ValueError, TypeError):
            return str(obj)
    if hasattr(obj, "item"):
        try:
            return plain(obj.item())
        except (ValueError, TypeError):
            return str(obj)
    return obj
