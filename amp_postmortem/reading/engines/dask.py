"""The Dask engine: each shard's map is a task on a `dask.distributed`
cluster (optional extra: `pip install 'amp-postmortem[dask]'`).

The workers open the shards themselves (a local path they can see, or the
run's URI with their own credentials from their environment), so the data
never passes through the client; only the partials come back, in task
order. The cluster is the one at `--scheduler ADDRESS`, else at
`DASK_SCHEDULER_ADDRESS` (dask's `scheduler-address` setting), else the
client this process already holds.
"""
from __future__ import annotations

import os

# Tasks in flight at a time per worker thread: enough to keep every worker
# busy, few enough that the client holds a bounded number of partials.
_IN_FLIGHT_PER_THREAD = 4


class DaskEngine:
    name = "dask"

    def __init__(self, client, *, owned: bool = False):
        self.client = client
        self._owned = owned  # a client we connected (closed with the engine), not the caller's

    def close(self) -> None:
        if self._owned:
            self.client.close()

    @classmethod
    def connect(cls, scheduler: str | None = None) -> "DaskEngine":
        from ...errors import EngineError
        try:
            import dask
            from distributed import Client, get_client
        except ImportError:
            raise EngineError("the dask engine needs dask.distributed: "
                              "pip install 'amp-postmortem[dask]'") from None
        address = (scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
                   or dask.config.get("scheduler-address", None))
        if address:
            from distributed.comm import resolve_address
            if address.startswith("inproc://") and address.split("/")[3:4] != [str(os.getpid())]:
                # Checked here: a Client given it fails half-built, and its
                # clean-up then hangs for 20 s.
                raise EngineError(f"invalid Dask scheduler address {address!r}: an inproc:// address works only "
                                  f"in the process that started the cluster; pass its tcp:// address")
            try:
                resolve_address(address)  # a malformed address is the user's to fix, not a bug
                return cls(Client(address, timeout="10s", set_as_default=False), owned=True)
            except ValueError as exc:  # e.g. an unknown scheme, a port that is not a number
                raise EngineError(f"invalid Dask scheduler address {address!r}: {exc}") from None
            except (OSError, TimeoutError) as exc:
                raise EngineError(f"cannot reach the Dask scheduler at {address}: "
                                  f"{type(exc).__name__}: {exc}") from None
        try:
            return cls(get_client())
        except ValueError:
            raise EngineError("no Dask cluster: pass --scheduler ADDRESS (e.g. tcp://10.0.0.5:8786) "
                              "or set DASK_SCHEDULER_ADDRESS") from None

    def map(self, fn, tasks):
        tasks = list(tasks)
        if not tasks:
            return
        threads = sum(self.client.nthreads().values()) or 1
        window = max(1, threads * _IN_FLIGHT_PER_THREAD)
        futures = []
        nxt = 0
        for i in range(len(tasks)):
            while nxt < len(tasks) and nxt < i + window:
                futures.append(self.client.submit(fn, tasks[nxt], pure=False))
                nxt += 1
            fut = futures[i]
            futures[i] = None  # the client drops its reference once read
            yield fut.result()
