"""`ranges` streams: each shard is reduced batch by batch as it is read, its
partial is bounded by its layers x steps (not its rows), and the merged
table by the window's layers x steps (not ranks x layers x steps). These
fail if a shard is read whole or the rows are kept, whatever the timing."""
import pyarrow as pa
import pyarrow.parquet as pq

from amp_postmortem.analyses import ranges, ranges_shards
from amp_postmortem.reading.engines import scan
from amp_postmortem.reading.loader import load_run
from recorders.format import schema


def _rows(path) -> pa.Table:
    """Every tensor row `ranges` reads, straight from the files."""
    files = sorted(path.rglob(f"{schema.TENSORS_DIR}/*.parquet"))
    t = pa.concat_tables([pq.read_table(f, columns=["step", "rank", "name", "kind"]) for f in files])
    return t.filter(pa.compute.is_in(t["kind"], pa.array(ranges.KINDS)))


def _layer_steps(t: pa.Table) -> int:
    return t.group_by(["name", "kind", "step"]).aggregate([]).num_rows


def test_each_shard_reaches_the_reducer_as_small_batches_and_leaves_as_layers_x_steps(
        uneven_ranks_run, monkeypatch):
    expected = ranges.layer_ranges(load_run(uneven_ranks_run)).to_dict()
    monkeypatch.setattr(scan, "BATCH_ROWS", 7)  # batch edges cut through steps
    real = ranges_shards.reduce_shard
    seen = []

    @scan.reduces_batches
    def spy(batches):
        assert not isinstance(batches, pa.Table)  # never the whole shard as one table
        sizes = []

        def counted():
            for b in batches:
                assert b.num_rows <= 7
                sizes.append(b.num_rows)
                yield b
        part = real(counted())
        seen.append((sizes, part))
        return part

    monkeypatch.setattr(ranges_shards, "reduce_shard", spy)
    run = load_run(uneven_ranks_run)
    assert ranges.layer_ranges(run).to_dict() == expected  # the same answer, batch by batch
    assert len(seen) == len(run.tensor_shards) > 3
    assert sum(len(s) for s, _ in seen) > 3 * len(seen)  # several batches per shard
    for sizes, part in seen:
        keys = {(part.layers[i], int(s)) for i, s in zip(part.merged["lid"], part.merged["step"])}
        assert part.rows == sum(sizes)
        steps = {k[1] for k in keys}
        assert len(part.merged["lid"]) == len(keys) <= len(part.layers) * len(steps)  # one row per layer and step
        assert set(part.merged) == {"lid", "step", "absmax", "bad", "dtype", "fwd", "order", "pos"}


def test_the_merged_table_holds_one_row_per_layer_and_step_not_per_rank(uneven_ranks_run):
    run = load_run(uneven_ranks_run)
    rows = _rows(uneven_ranks_run)
    per = ranges_shards.reduce_window(run, None)
    assert len(set(rows["rank"].to_pylist())) == 3
    assert len(per.cols["lid"]) == _layer_steps(rows) < rows.num_rows
    assert len(per.layers) == rows.group_by(["name", "kind"]).aggregate([]).num_rows
    # compact columns: no strings per layer and step
    assert all(v.dtype.kind in "biuf" for v in per.cols.values())


def test_repeated_calls_split_across_batches_merge_to_their_maximum(tmp_path, monkeypatch):
    import torch
    from tiny_models import FancyOutputs, batches, recorder_at, train

    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    loss = lambda model, x, y, step, accumulate: ((model(x).logits.float() - y) ** 2).mean()  # noqa: E731
    train(FancyOutputs(), batches(6), recorder=recorder_at(run_dir, steps_per_shard=2, full_every=2),
          loss_fn=loss, lr=0.01)
    rows = pq.read_table(sorted(run_dir.rglob(f"{schema.TENSORS_DIR}/*.parquet"))[-1]).to_pandas()
    twice = rows[(rows["name"] == "shared") & (rows["kind"] == "activation")]
    assert len(twice) == 2 * twice["step"].nunique()  # two calls per step: two rows to merge
    whole = ranges.layer_ranges(load_run(run_dir)).to_dict()
    monkeypatch.setattr(scan, "BATCH_ROWS", 1)  # every row its own batch
    rep = ranges.layer_ranges(load_run(run_dir))
    assert rep.to_dict() == whole
    shared = rep.layers[(rep.layers["name"] == "shared") & (rep.layers["kind"] == "activation")].iloc[0]
    last = twice[twice["step"] == twice["step"].max()]
    assert shared["absmax"] == last["absmax"].max() and shared["step"] == last["step"].iloc[0]
