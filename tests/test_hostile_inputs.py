"""Hostile files: every file the analyzer reads is checked before use
(amp_postmortem/reading/files/). Each case damages a copy of a real run recorded by
the real recorder (sample_runs/fp16_layernorm, with two replay bundles) and
runs the CLI on it: exit code 2, one line `Error: <file>: ...` naming the
file (and the field), never a traceback, never a hang."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.reading.files import limits
from recorders.format import schema
from recorders.format.plain import file_sha256, json_checksum

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_runs" / "fp16_layernorm"
MODEL = "sample_runs/models.py:fp16_layernorm_model"
STEP = 19
DEEP = 200_000


@pytest.fixture
def run(tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(SAMPLE, dst)
    return dst


def _cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _error(result, *names) -> str:
    """The one `Error:` line of an exit-2 result; it names each of `names`."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def _edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    doc = change(doc) or doc
    path.write_text(json.dumps(doc))


def _reseal(bundle: Path) -> None:
    """Recompute the checksums of an edited bundle, as a forger would: only
    the validation can tell what is wrong."""
    meta = json.loads((bundle / "bundle.json").read_text())
    f = bundle / schema.BUNDLE_TENSORS_FILE
    meta["files"][schema.BUNDLE_TENSORS_FILE].update(bytes=f.stat().st_size, sha256=file_sha256(f))
    meta["checksum"] = json_checksum(meta)
    (bundle / "bundle.json").write_text(json.dumps(meta))


def _bundle(run: Path, step: int = STEP) -> Path:
    return run / "bundles" / f"step={step}" / "rank=0"


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _cli_in_subprocess(*argv, timeout=60):
    """The CLI in its own process, for files that could hang a read."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", "from amp_postmortem.cli import main; main()", *map(str, argv)],
                          capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


# ------------------------------------------------------------ manifests
@pytest.mark.parametrize("command", ["summary", "nans", "scale", "ranges"])
def test_world_size_two_is_one_line_naming_the_manifest_and_the_field(run, command):
    _edit_json(run / "manifest.json", lambda m: m.update(world_size="two"))
    line = _error(_cli(command, run), "manifest.json", "world_size", "'two'")
    assert "valid integer" in line


def test_world_size_of_a_trillion_is_refused_before_anything_is_counted(run):
    _edit_json(run / "manifest.json", lambda m: m.update(world_size=10 ** 12))
    _error(_cli("summary", run), "manifest.json", "world_size", str(limits.MAX_WORLD_SIZE))


def test_world_size_of_a_million_warns_in_one_short_line_of_spans(run):
    _edit_json(run / "manifest.json", lambda m: m.update(world_size=10 ** 6))
    result = _cli("nans", run, "--json")
    assert result.exit_code == 0, result.output
    warning, = [w for w in json.loads(result.stdout)["warnings"] if "missing" in w]
    assert "rank(s) 1-999999 of world_size 1000000 are missing" in warning and len(warning) < 200


def test_a_rank_manifest_of_the_wrong_shape_names_its_field(run):
    _edit_json(run / "rank=0" / "manifest.json", lambda m: m.update(params=[{"name": 3}]))
    _error(_cli("summary", run), "rank=0/manifest.json", "params.0.name")


def test_a_manifest_nested_200000_deep_is_refused_before_it_is_parsed(run):
    (run / "manifest.json").write_text('{"format": ' + _deep(DEEP) + "}")
    _error(_cli("summary", run), "manifest.json", "nested")


def test_a_manifest_that_is_not_utf8_is_one_line(run):
    (run / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}')
    _error(_cli("summary", run), "manifest.json", "UTF-8")


# -------------------------------------------------------------- indexes
def _index(run: Path) -> Path:
    return run / "rank=0" / "index" / "part-000000.json"


# An index is never needed (docs/FORMAT.md, "Table: shard index"): one that
# cannot be used is named in a warning, and its pair is read from the
# footers, with the answers of a run without indexes.
FALLBACK = "the index is ignored and its shard pair read from the footers"


def _without_index(run: Path, tmp_path: Path, command: str) -> dict:
    plain = tmp_path / "plain"
    shutil.copytree(run, plain)
    _index(plain).unlink()
    return json.loads(_cli(command, plain, "--json").stdout.replace(str(plain), str(run)))


@pytest.mark.parametrize("damage, says", [
    (lambda p: p.write_text(_deep(DEEP)), "nested"),
    (lambda p: _edit_json(p, lambda d: d.update(first_step="zero")), "first_step"),
    (lambda p: _edit_json(p, lambda d: d.update(schema_version="x.y")), "unreadable schema_version 'x.y'"),
    (lambda p: _edit_json(p, lambda d: d.update(schema_version="99.0")), "uses run format version 99.0"),
    (lambda p: p.write_bytes(b'{"format": "amp-postmortem-shard-index", '), "not JSON"),
    (lambda p: p.write_bytes(b'{"format": "\xff"}'), "not UTF-8"),
], ids=["nested", "wrong_type", "bad_version", "newer_version", "truncated", "not_utf8"])
@pytest.mark.parametrize("command", ["nans", "summary"])
def test_an_unusable_index_falls_back_to_the_footers_with_a_warning(run, tmp_path, damage, says, command):
    expected = _without_index(run, tmp_path, command)
    damage(_index(run))
    result = _cli(command, run, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    warning, = [w for w in doc.pop("warnings") if FALLBACK in w]
    assert "index/part-000000.json" in warning and says in warning, warning
    expected.pop("warnings")
    if command == "summary":  # the run facts repeat the warnings
        doc["run"].pop("warnings"), expected["run"].pop("warnings")
    assert doc == expected
    assert "Warning: " in _cli(command, run).stderr  # said to a person too


# ------------------------------------------------- special files, names
def test_a_fifo_in_place_of_an_index_never_hangs_and_is_left_for_the_footers(run):
    os.unlink(_index(run))
    os.mkfifo(_index(run))
    result = _cli_in_subprocess("summary", run, timeout=60)  # a hang fails here
    assert result.returncode == 0, result.stderr
    assert "index/part-000000.json: is a FIFO" in result.stderr and FALLBACK in result.stderr


@pytest.mark.parametrize("where", ["manifest.json", "rank=0/manifest.json",
                                   "rank=0/steps/part-000000.parquet", "rank=0/tensors/part-000000.parquet"])
def test_a_fifo_in_place_of_a_file_never_hangs(run, where):
    path = run / where
    path.unlink()
    os.mkfifo(path)
    result = _cli_in_subprocess("summary", run, timeout=60)  # a hang fails here
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "FIFO" in lines[0], result.stderr
    assert where.split("/")[-1] in lines[0]


def test_a_symlinked_shard_is_refused_even_to_a_real_shard(run, tmp_path):
    shard = run / "rank=0" / "steps" / "part-000000.parquet"
    outside = tmp_path / "outside.parquet"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    _error(_cli("summary", run), "steps/part-000000.parquet", "symbolic link")


@pytest.mark.parametrize("name", ["rank=00", "rank=\u0660", "rank=+1", "rank=0\n"])
def test_a_rank_directory_that_would_alias_rank_0_is_refused(run, name):
    shutil.copytree(run / "rank=0", run / name)
    line = _error(_cli("summary", run), "not canonical", "rank=0, rank=12")
    assert repr(name) in line


def test_a_file_name_that_is_not_utf8_is_ignored_with_a_warning(run):
    steps = os.fsencode(run / "rank=0" / "steps")
    with open(os.path.join(steps, b"part-\xff.parquet"), "wb") as f:
        f.write(b"not parquet")
    result = _cli("nans", run, "--json")
    assert result.exit_code == 0, result.output
    warnings = json.loads(result.stdout)["warnings"]
    assert any("part-\\xff.parquet" in w and "not UTF-8" in w for w in warnings), warnings


def test_a_shard_pair_of_nulls_is_skipped_and_named(run):
    for table, sch in (("steps", schema.STEP_SCHEMA), ("tensors", schema.TENSOR_SCHEMA)):
        nullable = pa.schema([pa.field(f.name, f.type) for f in sch])
        pq.write_table(pa.Table.from_arrays([pa.nulls(3, f.type) for f in sch], schema=nullable),
                       run / "rank=0" / table / "part-000099.parquet")
    for command in ("summary", "nans", "scale", "ranges"):
        result = _cli(command, run)
        assert result.exit_code == 0, result.output
        assert "skipped rank=0/steps/part-000099.parquet: column 'step' holds nulls" in result.output
    for table in ("steps", "tensors"):  # nothing else: no step on disk
        (run / "rank=0" / table / "part-000000.parquet").unlink()
    shutil.rmtree(run / "rank=0" / "index")
    _error(_cli("summary", run), "holds no readable step")


# -------------------------------------------------------------- bundles
def _replay(run, step=STEP):
    return _cli("replay", run, "--step", step, "--model", MODEL)


def test_bundle_json_that_is_a_string_is_one_line(run):
    (_bundle(run) / "bundle.json").write_text('"just a string"')
    _error(_replay(run), "bundle.json", "format")


def test_bundle_json_nested_200000_deep_is_refused_before_it_is_parsed(run):
    (_bundle(run) / "bundle.json").write_text('{"format": ' + _deep(DEEP) + "}")
    _error(_replay(run), "bundle.json", "nested")


@pytest.mark.parametrize("device", ["cuda:banana", "xla:0", "cuda:-1"])
def test_an_unknown_device_in_an_argument_tree_is_one_line(run, device):
    b = _bundle(run)

    def plant(meta):
        mb = meta["micro_batches"][0]
        mb["kwargs"] = {"kind": "dict", "items": [["device", {"kind": "device", "value": device}]]}
    _edit_json(b / "bundle.json", plant)
    _reseal(b)
    _error(_replay(run), "bundle.json", "micro_batches.0.kwargs", repr(device))


@pytest.mark.parametrize("key, value", [("step", 18), ("rank", 1), ("run_id", "someone-else")])
def test_a_bundle_that_disagrees_with_its_place_or_run_is_refused(run, key, value):
    b = _bundle(run)
    _edit_json(b / "bundle.json", lambda m: m.update({key: value}))
    _reseal(b)
    _error(_replay(run), "bundle.json", f"{key}: {value!r}")


@pytest.mark.parametrize("field, change", [
    ("params.exact", lambda m: m["params"].update(exact="yes")),
    # what the replay runs the step under: each would replay another step
    ("autocast.device_type", lambda m: m["autocast"].update(device_type="banana")),
    ("autocast.dtype", lambda m: m["autocast"].update(dtype="float99")),
    ("loss_scale", lambda m: m.update(loss_scale=-1.0)),
    ("scaler.scale", lambda m: m["scaler"].update(scale="x")),
    ("micro_batches", lambda m: m.update(micro_batches=[])),
    ("files.tensors.parquet.bytes", lambda m: m["files"]["tensors.parquet"].update(bytes=True)),
])
def test_a_bundle_field_of_the_wrong_type_names_the_field(run, field, change):
    b = _bundle(run)
    _edit_json(b / "bundle.json", change)
    _reseal(b) if field != "files.tensors.parquet.bytes" else _edit_json(
        b / "bundle.json", lambda m: m.update(checksum=json_checksum(m)))
    _error(_replay(run), "bundle.json", field + ":")


def _rewrite_tensors(bundle: Path, change) -> None:
    """tensors.parquet with its rows changed by `change(rows)`, written as
    the recorder writes it (zstd), the bundle resealed."""
    f = bundle / schema.BUNDLE_TENSORS_FILE
    rows = pq.read_table(f).to_pylist()
    rows = change(rows) or rows
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.BUNDLE_TENSOR_SCHEMA), f, compression="zstd")
    _reseal(bundle)


def test_a_shape_whose_product_overflows_int64_is_refused(run):
    def plant(rows):
        rows[0]["shape"] = [2 ** 32, 2 ** 32]  # the int64 product wraps round to 0
        rows[0]["data"] = b""
    _rewrite_tensors(_bundle(run), plant)
    line = _error(_replay(run), "tensors.parquet", "shape", str(2 ** 64))
    assert str(limits.MAX_TENSOR_ELEMENTS) in line


def test_a_compressed_bomb_is_refused_before_it_is_decompressed(run, monkeypatch):
    def plant(rows):
        rows[0]["data"] = bytes(32 << 20)  # 32 MiB of zeros: zstd keeps ~1 KB
    b = _bundle(run)
    _rewrite_tensors(b, plant)
    assert (b / schema.BUNDLE_TENSORS_FILE).stat().st_size < 200_000
    read = pq.ParquetFile.read
    columns_read = []

    def spy(self, columns=None, **kw):
        columns_read.append(columns)
        return read(self, columns=columns, **kw)
    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    _error(_replay(run), "tensors.parquet", "decompresses to")
    assert all(c is not None and "data" not in c for c in columns_read), columns_read


def test_a_huge_declared_shape_is_refused(run):
    def plant(rows):
        rows[0]["shape"] = [1 << 20, 1 << 20]
    _rewrite_tensors(_bundle(run), plant)
    _error(_replay(run), "tensors.parquet", "shape", "elements")


def test_a_symlink_in_a_bundle_is_not_followed_out_of_it(run, tmp_path):
    b = _bundle(run)
    outside = tmp_path / "elsewhere.parquet"
    shutil.move(b / schema.BUNDLE_TENSORS_FILE, outside)  # the same bytes: its sha256 still fits
    (b / schema.BUNDLE_TENSORS_FILE).symlink_to(outside)
    _error(_replay(run), "tensors.parquet", "symbolic link")


def test_a_symlinked_bundle_directory_is_refused(run, tmp_path):
    b = _bundle(run)
    outside = tmp_path / "bundle"
    shutil.move(b, outside)
    b.symlink_to(outside, target_is_directory=True)
    _error(_replay(run), "rank=0", "symbolic link")


@pytest.mark.parametrize("name", ["step=019", "step=\u0661\u0669", "step=+19"])
def test_a_step_directory_that_would_alias_a_step_is_refused(run, name):
    shutil.copytree(run / "bundles" / f"step={STEP}", run / "bundles" / name)
    _error(_replay(run), "not canonical", repr(name))


@pytest.mark.parametrize("where", [f"bundles/step={STEP}/rank=0/{schema.BUNDLE_TENSORS_FILE}",
                                   f"bundles/step={STEP}/rank=0/bundle.json",
                                   "rank=0/tensors/part-000001.parquet"])  # read by the replay's fidelity check
def test_a_fifo_never_hangs_a_replay(run, where):
    f = run / where
    if f.exists():
        f.unlink()
    os.mkfifo(f)
    result = _cli_in_subprocess("replay", run, "--step", STEP, "--model", MODEL)
    assert result.returncode == 2, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("Error: ") and f.name in line and "FIFO" in line


# ------------------------------------------------- the valid run still
def test_the_undamaged_run_and_bundle_still_load(run):
    from amp_postmortem import load_bundle, load_run
    loaded = load_run(run)
    assert loaded.ranks == [0] and not loaded.warnings
    b = load_bundle(run, step=STEP)
    assert b.step == STEP and b.rank == 0 and b.params


# ------------------------------------------------------------ the limits
def test_format_md_states_every_limit_of_the_code():
    text = (REPO / "docs" / "FORMAT.md").read_text()
    section = text.split("## Limits", 1)[1].split("\n## ", 1)[0]
    for name, value in limits.LIMITS.items():
        row = re.search(rf"^\| `{name}` \| ([0-9,]+) \|", section, re.M)
        assert row, f"docs/FORMAT.md, Limits, has no row for {name}"
        assert int(row.group(1).replace(",", "")) == value, name


# ------------------------------------------- journals and the status slot
def _journal_of(run: Path, table: str = "steps") -> Path:
    d = run / "rank=0" / schema.JOURNAL_DIR / table
    d.mkdir(parents=True, exist_ok=True)
    return d / f"part-000099{schema.JOURNAL_SUFFIX}"


@pytest.mark.parametrize("where", [f"rank=0/{schema.STATUS_FILE}", "journal"])
def test_a_fifo_as_a_journal_or_status_slot_never_hangs(run, where):
    path = _journal_of(run) if where == "journal" else run / where
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    result = _cli_in_subprocess("summary", run, timeout=60)  # a hang fails here
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "FIFO" in lines[0] and path.name in lines[0]


def test_a_symlinked_journal_or_status_slot_is_refused(run, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"format": schema.STATUS_FORMAT, "status": "closed"}))
    slot = run / "rank=0" / schema.STATUS_FILE
    slot.unlink(missing_ok=True)
    slot.symlink_to(outside)
    _error(_cli("summary", run), schema.STATUS_FILE, "symbolic link")
    slot.unlink()
    journal = _journal_of(run)
    journal.symlink_to(outside)
    _error(_cli("summary", run), journal.name, "symbolic link")


def test_a_status_slot_nested_deep_is_refused_before_it_is_parsed(run):
    (run / "rank=0" / schema.STATUS_FILE).write_text(_deep(limits.MAX_STATUS_BYTES // 2 - 1))
    _error(_cli("summary", run), schema.STATUS_FILE, "levels")


def test_a_status_slot_larger_than_its_limit_is_refused(run):
    (run / "rank=0" / schema.STATUS_FILE).write_text(" " * (limits.MAX_STATUS_BYTES + 1))
    _error(_cli("summary", run), schema.STATUS_FILE, "bytes")


def test_a_shard_row_group_past_its_limit_is_skipped_before_it_is_read(run, monkeypatch):
    # The footer's decompressed size says too much: the shard is never read.
    from amp_postmortem.reading.files import limits as lim
    monkeypatch.setattr(lim, "MAX_ROW_GROUP_BYTES", 1024)
    result = _cli("ranges", run, "--json")
    assert "skipped unreadable shard" in result.output and "MAX_ROW_GROUP_BYTES" in result.output, result.output
    assert "Traceback" not in result.output


def test_a_compressed_journal_bomb_is_refused_before_it_is_decoded(run, monkeypatch):
    # 40 KB of lz4 that would decode to 80 MB: its message metadata says
    # so, and the reader refuses it without decoding (files/ipc.py).
    import numpy as np
    import amp_postmortem.reading.journal as journal
    monkeypatch.setattr(journal, "MAX_JOURNAL_BYTES", 1 << 20)
    zeros = pa.schema([("step", pa.int64())])
    with pa.ipc.new_stream(str(_journal_of(run)), zeros,
                           options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
        w.write_batch(pa.record_batch([pa.array(np.zeros(10_000_000, dtype=np.int64))], schema=zeros))
    assert _journal_of(run).stat().st_size < 1 << 20
    _error(_cli("summary", run), _journal_of(run).name, "MAX_JOURNAL_BYTES")
