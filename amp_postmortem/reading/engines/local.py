"""The default engine: the map runs in this process, lazily, shard after
shard, so only one shard's partial is in memory at a time."""
from __future__ import annotations


class LocalEngine:
    name = "local"

    def map(self, fn, tasks):
        for task in tasks:
            yield fn(task)

    def close(self) -> None:
        pass
