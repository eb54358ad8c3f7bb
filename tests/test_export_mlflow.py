"""`export mlflow` and `export wandb`: a run recorded by the real recorder,
logged to MLflow's file store in tmp_path and read back with MLflow's own
client; logged to W&B in offline mode and read back from its run folder."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient  # the `mlflow` extra holds mlflow-skinny

from amp_postmortem.analyses.summary import summarize
from amp_postmortem.cli import main
from amp_postmortem.export_tracking import FINDINGS_ARTIFACT, export_mlflow
from amp_postmortem.reading.loader import load_run
from conftest import OVERFLOW_STEP


@pytest.fixture
def client_of(monkeypatch):
    """MLflow's client on a store. The file store refuses to open unless
    allowed (MLflow 3); the export allows it for itself only, so the reading
    side says so too, for this test only."""
    def client(uri):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        return MlflowClient(tracking_uri=str(uri))
    return client


def history(client, run_id, key) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_the_report_extra_installs_no_mlflow_the_mlflow_extra_does():
    import tomllib
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert not any("mlflow" in req for req in extras["report"])
    assert any(req.startswith("mlflow-skinny") for req in extras["mlflow"])
    assert any(req.startswith("sqlalchemy") for req in extras["mlflow"])  # what a sqlite:/// store needs


def test_export_to_a_sqlite_store_reads_back_with_mlflows_client(overflow_run, tmp_path, monkeypatch):
    """MLflow 3's default store, a database: no opt-out needed to read it."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = CliRunner().invoke(main, ["export", "mlflow", str(overflow_run), "--tracking-uri", uri,
                                       "--experiment", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tracking_uri"] == uri and doc["steps"] == 12
    client = MlflowClient(tracking_uri=uri)
    (run_id,) = doc["run_ids"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(history(client, run_id, "loss")) == list(range(12))
    assert history(client, run_id, "skipped")[OVERFLOW_STEP] == 1.0
    assert client.get_run(run_id).data.tags["amp_postmortem.finding_kinds"] == "nonfinite"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server over HTTP on a loopback port (a sqlite
    backend and an artifact root in a temporary folder), as a team runs it."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # it starts in ~20 s on two busy cores
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, "the MLflow server exited"
            assert time.monotonic() < deadline, "the MLflow server did not answer /health"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def test_export_to_a_tracking_server_over_http_reads_back(overflow_run, tmp_path, mlflow_server):
    """A tracking server (`mlflow server`) over HTTP: the export logs the
    steps, the findings as tags and their artifact; MLflow's client reads
    them back from the server; --json stays parseable (MLflow's own lines
    go to stderr)."""
    result = CliRunner().invoke(main, ["export", "mlflow", str(overflow_run), "--tracking-uri", mlflow_server,
                                       "--experiment", "over-http", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tracking_uri"] == mlflow_server and doc["steps"] == 12
    client = MlflowClient(tracking_uri=mlflow_server)
    (run_id,) = doc["run_ids"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "over-http"
    assert sorted(history(client, run_id, "loss")) == list(range(12))
    assert history(client, run_id, "skipped")[OVERFLOW_STEP] == 1.0
    assert run.data.tags["amp_postmortem.finding_kinds"] == "nonfinite"
    doc = json.loads(Path(client.download_artifacts(run_id, FINDINGS_ARTIFACT, str(tmp_path))).read_text())
    assert "nonfinite" in [row[doc["columns"].index("kind")] for row in doc["data"]]


def test_a_file_store_reads_back_only_with_the_opt_out_the_readme_names(overflow_run, tmp_path, monkeypatch):
    """MLflow 3 refuses to open a file store unless MLFLOW_ALLOW_FILE_STORE
    is set: the export sets it for itself; a reader must set it too (docs/COMMANDS.md)."""
    import subprocess
    import sys
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "mlruns"
    result = CliRunner().invoke(main, ["export", "mlflow", str(overflow_run), "--tracking-uri", str(store),
                                       "--json"])
    assert result.exit_code == 0, result.output
    (run_id,) = json.loads(result.stdout)["run_ids"]
    # A reader of its own (MLflow caches the stores it opened in a process).
    read = ("import sys; from mlflow.tracking import MlflowClient; "
            "print(MlflowClient(tracking_uri=sys.argv[1]).get_run(sys.argv[2]).info.status)")

    def reader(**env):
        plain = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
        return subprocess.run([sys.executable, "-c", read, str(store), run_id], capture_output=True, text=True,
                              env={**plain, **env}, timeout=120)
    refused = reader()
    assert refused.returncode != 0 and "MLFLOW_ALLOW_FILE_STORE" in refused.stderr
    allowed = reader(MLFLOW_ALLOW_FILE_STORE="true")  # the opt-out docs/COMMANDS.md names
    assert allowed.returncode == 0 and allowed.stdout.strip() == "FINISHED", allowed.stderr


def test_step_metrics_headroom_and_findings_read_back_from_the_file_store(overflow_run, tmp_path, monkeypatch,
                                                                            client_of):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "mlruns"
    result = export_mlflow(overflow_run, tracking_uri=store, experiment="tiny")
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # the caller's environment as it was
    assert result.steps == 12 and len(result.run_ids) == 1
    client = client_of(store)
    (run_id,) = result.run_ids
    mlrun = client.get_run(run_id)
    assert client.get_experiment_by_name("tiny").experiment_id == mlrun.info.experiment_id
    assert mlrun.info.status == "FINISHED"

    steps = load_run(overflow_run).steps.set_index("step")
    loss = history(client, run_id, "loss")
    assert sorted(loss) == list(range(12))
    for step, value in loss.items():  # MLflow keeps float64: the recorded values exactly, NaN included
        recorded = float(steps.loc[step, "loss"])
        assert (math.isnan(value) and math.isnan(recorded)) or value == recorded, step
    assert history(client, run_id, "loss_scale") == {s: float(v) for s, v in steps["loss_scale"].items()}
    skipped = history(client, run_id, "skipped")
    assert skipped == {s: float(v) for s, v in steps["skipped"].items()}
    assert skipped[OVERFLOW_STEP] == 1.0
    gn = history(client, run_id, "grad_norm")
    assert all(gn[s] == v for s, v in steps["grad_norm"].items() if np.isfinite(v))

    headroom = history(client, run_id, "headroom/activation/block.boom")
    assert headroom[OVERFLOW_STEP] == 0.0  # Inf in the tensor: no headroom left
    rows = load_run(overflow_run).scan_tensors(["step", "name", "kind", "absmax"], kinds=["activation"])
    boom = rows[rows["name"] == "block.boom"].groupby("step")["absmax"].max()
    assert headroom[0] == math.log2(65504.0 / boom[0])
    assert "headroom/input/_input_" in mlrun.data.metrics  # `<input>`: MLflow allows no angle brackets

    findings = summarize(load_run(overflow_run)).findings
    tags = mlrun.data.tags
    assert result.findings == len(findings) > 0
    assert tags["amp_postmortem.findings"] == str(len(findings))
    assert tags["amp_postmortem.finding_kinds"] == ",".join(f.kind for f in findings)
    first = findings[0]
    assert tags[f"amp_postmortem.finding.{first.kind}"].startswith(f"{first.severity} step {first.step}")
    local = client.download_artifacts(run_id, FINDINGS_ARTIFACT, str(tmp_path))
    doc = json.loads(Path(local).read_text())
    assert [row[doc["columns"].index("kind")] for row in doc["data"]] == [f.kind for f in findings]


def test_export_command_json_into_an_existing_experiment(overflow_run, tmp_path, client_of):
    runner = CliRunner()
    uri = (tmp_path / "store").as_uri()  # a file: URI works as well as a plain path
    argv = ["export", "mlflow", str(overflow_run), "--tracking-uri", uri, "--experiment", "again", "--json"]
    first = runner.invoke(main, argv)
    assert first.exit_code == 0, first.output
    second = runner.invoke(main, argv)
    assert second.exit_code == 0, second.output
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["experiment_id"] == b["experiment_id"] and a["run_ids"] != b["run_ids"]
    assert a["steps"] == 12 and a["tracking_uri"] == uri
    runs = client_of(uri).search_runs([a["experiment_id"]])
    assert sorted(r.info.run_id for r in runs) == sorted(a["run_ids"] + b["run_ids"])


def test_each_rank_gets_its_own_mlflow_run(two_rank_run, tmp_path, client_of):
    result = export_mlflow(two_rank_run, tracking_uri=tmp_path)
    client = client_of(tmp_path)
    steps = load_run(two_rank_run).steps
    assert len(result.run_ids) == 2
    for rank, run_id in enumerate(result.run_ids):
        assert client.get_run(run_id).data.tags["amp_postmortem.rank"] == str(rank)
        mine = steps[steps["rank"] == rank].set_index("step")["loss"]
        assert history(client, run_id, "loss") == {int(s): float(v) for s, v in mine.items()}


def test_without_mlflow_one_line_error_and_exit_2(overflow_run, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    out = CliRunner().invoke(main, ["export", "mlflow", str(overflow_run), "--tracking-uri", str(tmp_path)])
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == [
        "Error: the MLflow export needs mlflow: pip install 'amp-postmortem[mlflow]'"]


# ------------------------------------------------------------ W&B offline
# wandb is its own extra (`.[wandb]`), not in `report`; the test install has it.
def wandb_records(run_dir) -> list:
    """The records of an offline run's `.wandb` file: LevelDB's log format
    (a 7-byte file header, 32 KiB blocks of checksum, length, type records;
    wandb >= 0.2x has no reader of its own in Python)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = Path(run_dir).glob("run-*.wandb")
    data, block, pos, records, part = path.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_history(records) -> dict[int, dict[str, float]]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out[int(row["_step"])] = row
    return out


def test_wandb_offline_run_holds_the_metrics_and_findings(overflow_run, tmp_path):
    from amp_postmortem.export_tracking import export_wandb
    result = export_wandb(overflow_run, directory=tmp_path, offline=True, project="tiny")
    assert result.mode == "offline" and len(result.run_dirs) == 1
    records = wandb_records(result.run_dirs[0])
    history = wandb_history(records)
    steps = load_run(overflow_run).steps.set_index("step")
    assert sorted(history) == list(range(12))
    for step in history:
        recorded, logged = float(steps.loc[step, "loss"]), history[step]["loss"]
        assert (math.isnan(recorded) and math.isnan(logged)) or logged == recorded, step  # JSON NaN
        assert history[step]["skipped"] == float(steps.loc[step, "skipped"])
    assert history[OVERFLOW_STEP]["headroom/activation/block.boom"] == 0.0

    findings = summarize(load_run(overflow_run)).findings
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert meta.project == "tiny" and set(meta.tags) == {f.kind for f in findings}
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({u.key or "/".join(u.nested_key): u.value_json for u in r.summary.update})
    assert summary["amp_postmortem.findings"] == json.dumps(str(len(findings)))
    (table,) = Path(result.run_dirs[0]).glob("files/media/table/findings_*.table.json")
    doc = json.loads(table.read_text())
    assert [row[doc["columns"].index("kind")] for row in doc["data"]] == [f.kind for f in findings]


def test_wandb_command_honours_wandb_mode_offline(overflow_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = CliRunner().invoke(main, ["export", "wandb", str(overflow_run), "--dir", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["mode"] == "offline" and doc["steps"] == 12
    assert sorted(wandb_history(wandb_records(doc["run_dirs"][0]))) == list(range(12))


def test_without_wandb_one_line_error_and_exit_2(overflow_run, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    out = CliRunner().invoke(main, ["export", "wandb", str(overflow_run), "--offline", "--dir", str(tmp_path)])
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == [
        "Error: the W&B export needs wandb: pip install 'amp-postmortem[wandb]'"]
