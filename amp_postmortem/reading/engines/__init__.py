"""Where the per-shard work of an analysis runs.

An analysis reads tensor rows shard by shard: the map step
(`scan.scan_shard`: one shard in, one partial out: the shard's rows that
pass the filter, projected) is a plain function of a small picklable task,
and the merge (in `Run.iter_tensor_batches` and the analyses) consumes the
partials in shard order. An engine only runs the map: `LocalEngine` in this
process, `DaskEngine` as tasks on a `dask.distributed` cluster, next to the
data. Because partials are merged in the same order whatever ran them,
every engine gives the same answer. Another engine (Ray, Spark) is one more
class with `map(fn, tasks)` that yields results in task order.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol

from ...errors import EngineError

ENGINES = ("local", "dask")


class Engine(Protocol):
    name: str

    def map(self, fn: Callable, tasks: Iterable) -> Iterator:
        """`fn(task)` for each task, yielded in task order."""

    def close(self) -> None:
        """Release what the engine connected to."""


def get_engine(name: str | None = "local", scheduler: str | None = None) -> Engine:
    """The engine called `name`: `local` (default) or `dask` (at
    `scheduler`, else the cluster found from the environment)."""
    name = (name or "local").lower()
    if name == "local":
        if scheduler:
            raise EngineError("--scheduler needs --engine dask")
        from .local import LocalEngine
        return LocalEngine()
    if name == "dask":
        from .dask import DaskEngine
        return DaskEngine.connect(scheduler)
    raise EngineError(f"unknown engine {name!r}; valid: {', '.join(ENGINES)}")
