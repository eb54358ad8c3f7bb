"""Where a run's replay bundles are (`bundles/step=S/rank=R/`), listed
without reading them: torch-free, so that `summary` can say what a run
saved for replays where torch is absent. Reading a bundle is `bundle.py`'s."""
from __future__ import annotations

from pathlib import Path

from recorders.format import schema

from ..errors import BundleError
from .files.safe import check_inside, numbered_dirs, rank_of, step_of


def list_bundles(run_dir) -> list[tuple[int, int, Path]]:
    """(step, rank, path) of every complete bundle under `run_dir/bundles`
    (a directory, or a run's `StorePath` on an object store).
    A `step=`/`rank=` name that is not canonical (`rank=00` would alias
    rank 0) or a linked directory is refused (BundleError)."""
    # A run on a store is listed through its StorePath, which walks as a Path does.
    run_dir = run_dir if hasattr(run_dir, "iterdir") else Path(run_dir)
    root = run_dir / schema.BUNDLES_DIR
    check_inside(root, run_dir, BundleError)
    found = []
    if root.is_dir():
        for step, sdir in numbered_dirs(root, step_of, run_dir, BundleError):
            found += [(step, rank, rdir) for rank, rdir in numbered_dirs(sdir, rank_of, run_dir, BundleError)]
    return sorted(found)
