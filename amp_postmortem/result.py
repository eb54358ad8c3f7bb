"""What every command's result has: the warnings of the runs it read, and
`to_dict()`, the document the command prints with `--json`.

Each result class (`Summary`, `NanReport`, `FixReport`, ...) derives from
`CommandResult` and gives its own fields in `document()`. The API
(`amp_postmortem/__init__.py`) sets `warnings` to the loaders' warnings of
the runs it read; a result made outside the API (`find_nans(run)`) has none
set, and its `to_dict()` is its document alone."""
from __future__ import annotations

from recorders.format import plain


class CommandResult:
    # None: not returned by the API; [] or more: the runs' warnings, in `to_dict()`
    warnings: list[str] | None = None

    def document(self) -> dict:
        """The result's own fields as plain data, without the warnings."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """`document()`, and, for a result of the API, its `warnings`: what
        `--json` prints."""
        doc = self.document()
        if self.warnings is None:
            return doc
        return plain(doc if "warnings" in doc else {**doc, "warnings": self.warnings})
