"""One run id for every rank of a job, with no user action.

The id is resolved on rank 0 (in order: the `run_id` argument,
`$AMP_POSTMORTEM_RUN_ID`, `$TORCHELASTIC_RUN_ID`, the id of a run already in
the run directory, a new random one) and, when a default process group is
initialised, handed to every other rank through the group's key-value store
at construction: rank 0 writes it, the others wait for it. The store is used
rather than a collective so that it works with every backend (NCCL needs
device tensors) and without pickle (`broadcast_object_list` pickles).
"""
from __future__ import annotations

import datetime
import itertools
import os
import uuid
from pathlib import Path

from .manifest import existing_run_id

# Every rank builds its recorders in the same order: the n-th recorder of
# each rank exchanges its id under the same key.
_CONSTRUCTED = itertools.count()
STORE_TIMEOUT_S = 300


def local_run_id(run_dir: Path, rank: int, run_id: str | None) -> str:
    """The id this rank would choose on its own."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic in ("", "none"):  # torchrun's default when no rendezvous id is given
        elastic = None
    return (run_id or os.environ.get("AMP_POSTMORTEM_RUN_ID") or elastic
            or existing_run_id(run_dir, rank) or uuid.uuid4().hex)


def shared_run_id(run_dir: Path, rank: int, run_id: str | None) -> str:
    """Rank 0's id on every rank of an initialised default process group;
    this rank's own choice without one."""
    mine = local_run_id(run_dir, rank, run_id)
    store, group_rank = _default_store()
    if store is None:
        return mine
    key = f"amp_postmortem/run_id/{next(_CONSTRUCTED)}"
    if group_rank == 0:
        store.set(key, mine)
        return mine
    store.wait([key], datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return store.get(key).decode()


def _default_store():
    """(the default process group's store, this process's rank in it) when
    the group spans several ranks, else (None, 0)."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None, 0
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no usable group: each rank keeps its own id
        return None, 0
