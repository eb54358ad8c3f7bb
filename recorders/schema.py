"""Moved to `recorders/format/schema.py` (the run format's tables, names and versions).
This old path stays importable, as the same module object, for code outside
the package (tests, benchmarks, users' scripts); the recorder and the
analyzer import `recorders.format`."""
import importlib
import sys

# The module itself, by its full name.
sys.modules[__name__] = importlib.import_module(".format.schema", __package__)
