"""Moved to `recorders/format/plain.py` (JSON-plain values and the checksum rule).
This old path stays importable, as the same module object, for code outside
the package (tests, benchmarks, users' scripts); the recorder and the
analyzer import `recorders.format`."""
import importlib
import sys

# The module, by its full name (the package `recorders.format` binds `plain` to the function).
sys.modules[__name__] = importlib.import_module(".format.plain", __package__)
