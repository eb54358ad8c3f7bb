"""Every file the analyzer reads, checked before use (the load layer's gate).

`limits` states the bounds once (docs/FORMAT.md, "Limits", repeats them and
`tests/test_hostile_inputs.py` keeps the two in step); `safe` opens files
of a run or bundle (regular files only, no symlink inside the run, no FIFO
that would hang a read, names that are canonical ASCII) and reads JSON
whose size and nesting are bounded before it is parsed; `models` declares
one pydantic model per file kind (manifest, shard index, bundle.json,
argument trees), so a wrong type is one line naming the file and the field.
A violation raises the caller's `PostmortemError` subclass (the CLI: exit 2).
"""
