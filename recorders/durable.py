"""A directory made durable: after a file is created or renamed in it, the
directory's own fsync makes the new name survive a node failure (the
file's fsync covers its bytes, not its name). Used by the writer's atomic
files and by the journal's new streams.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
