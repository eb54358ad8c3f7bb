"""Where a run is, as a reader asks (`recorders/storage.py`): whether a
location is a URI (`is_uri`), a local one as a path (`local_path`), the
filesystem of a URI (`open_filesystem`: pyarrow's, else fsspec's), and
whether a directory is a recorder's local spool (`is_spool`), which holds
no complete run."""
from ..storage import is_spool, is_uri, local_path, open_filesystem

__all__ = ["is_uri", "local_path", "open_filesystem", "is_spool"]
