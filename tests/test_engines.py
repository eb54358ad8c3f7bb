"""The per-shard map on a real Dask cluster gives the local engine's answer."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.reading.engines import get_engine
from amp_postmortem.reading.engines.scan import ShardScan, scan_shard
from amp_postmortem.errors import EngineError
from amp_postmortem.reading.loader import load_run

COMMANDS = ("nans", "scale", "ranges", "summary")


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster
    # Thread workers: process workers would re-import torch (seconds each)
    # on this 2-core CI machine; the tasks are the same either way.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c, \
            Client(c, set_as_default=False) as client:
        yield c.scheduler_address, client


def _json(args):
    res = CliRunner().invoke(main, args + ["--json"])
    assert res.exit_code == 0, (args, res.output)
    return json.loads(res.stdout)


@pytest.mark.parametrize("fixture", ["overflow_run", "collapse_run", "two_rank_run", "underflow_run",
                                     "uneven_ranks_run"])
def test_every_scan_command_gives_identical_json_on_dask_and_locally(cluster, fixture, request):
    address, client = cluster
    run = str(request.getfixturevalue(fixture))
    for command in COMMANDS:
        local = _json([command, run])
        dask = _json([command, run, "--engine", "dask", "--scheduler", address])
        assert dask == local, command
    # The shards were really read by the cluster's workers.
    assert client.run_on_scheduler(_scans_done) > 0


def _scans_done(dask_scheduler) -> int:
    prefix = dask_scheduler.task_prefixes.get("scan_shard")
    return 0 if prefix is None else sum(prefix.state_counts.values())


def test_the_cluster_is_found_from_the_environment(cluster, overflow_run, monkeypatch):
    address, _ = cluster
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    assert _json(["nans", str(overflow_run), "--engine", "dask"]) == _json(["nans", str(overflow_run)])


def test_no_cluster_is_one_error_line(overflow_run, monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    res = CliRunner().invoke(main, ["nans", str(overflow_run), "--engine", "dask"])
    assert res.exit_code == 2
    assert res.output.splitlines() == ["Error: no Dask cluster: pass --scheduler ADDRESS (e.g. "
                                       "tcp://10.0.0.5:8786) or set DASK_SCHEDULER_ADDRESS"]
    res = CliRunner().invoke(main, ["nans", str(overflow_run), "--scheduler", "tcp://127.0.0.1:1"])
    assert res.exit_code == 2 and res.output.splitlines() == ["Error: --scheduler needs --engine dask"]


@pytest.mark.parametrize("address, why", [("foo://10.0.0.5:8786", "unknown address scheme 'foo'"),
                                          ("tcp://10.0.0.5:port", "invalid literal for int()"),
                                          ("inproc://10.0.0.5/1/1", "an inproc:// address works only in")])
def test_a_malformed_scheduler_address_is_one_error_line(overflow_run, address, why):
    res = CliRunner().invoke(main, ["nans", str(overflow_run), "--engine", "dask", "--scheduler", address])
    assert res.exit_code == 2
    lines = res.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: invalid Dask scheduler address {address!r}: {why}")


def test_unknown_engine_is_a_named_error():
    with pytest.raises(EngineError, match="unknown engine 'ray'; valid: local, dask"):
        get_engine("ray")


def test_the_map_is_one_shard_in_one_partial_out(overflow_run):
    """The engine-neutral map: a plain task that Dask can ship to a worker
    (its own serialization) and an Arrow partial."""
    from distributed.protocol import deserialize, serialize
    run = load_run(overflow_run)
    shard = run.select_shards(nonfinite_only=True)[0]
    task = ShardScan(path=str(shard.path), columns=("step", "name", "nan_count", "inf_count"),
                     nonfinite_only=True)
    part = scan_shard(deserialize(*serialize(task)))
    assert part.error is None and part.table.num_rows == shard.nonfinite_rows
    assert part.table.column_names == ["step", "name", "nan_count", "inf_count"]
    clean = [s for s in run.tensor_shards if s.nonfinite_rows == 0][0]
    assert scan_shard(ShardScan(path=str(clean.path), nonfinite_only=True)).table is None  # pruned unread


def test_the_python_api_takes_the_engine_and_scheduler(cluster, uneven_ranks_run):
    import amp_postmortem
    address, _ = cluster
    for command in (amp_postmortem.scale, amp_postmortem.summary):
        on_dask = command(str(uneven_ranks_run), engine="dask", scheduler=address).to_dict()
        assert on_dask == command(str(uneven_ranks_run)).to_dict()


def test_a_steps_shard_is_reduced_where_it_is_read(uneven_ranks_run):
    """The steps map ships like the tensors map: a plain task, a small partial."""
    from distributed.protocol import deserialize, serialize
    from amp_postmortem.reading import step_series
    from recorders.format import schema
    shard = load_run(uneven_ranks_run).step_shards[0]
    task = ShardScan(path=str(shard.path), columns=tuple(step_series.READ_COLUMNS),
                     reduce=step_series.shard_partial, table=schema.STEPS_DIR)
    part = scan_shard(deserialize(*serialize(task)))
    assert part.error is None and part.table is None
    assert part.result.table.column("step").to_pylist() == [0, 1, 2] and part.result.rank_last_steps == {0: 2}
