"""A bundle's `model_class` never chooses the code a replay runs.

Real runs made by the real recorder, their bundle.json rewritten the way an
attacker would (checksum recomputed): `replay`, `fix` and `bisect` run in a
child process, so that a `sys.exit` or `os.abort` that did run would show
as its exit code, and a planted module writes a marker file if imported.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn

import whatif_runs as W
from amp_postmortem.errors import ModelSpecError
from amp_postmortem.replaying.model_spec import RECORDED, build_model, recorded_class, resolve_model
from recorders.format.plain import json_checksum

ROOT = Path(__file__).resolve().parent.parent

PLANTED = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        pathlib.Path({marker!r}).write_text("called")
"""


def hostile_run(tmp_path: Path, model_class: str) -> Path:
    """A copy of a real recorded run whose bundle names `model_class`."""
    run = tmp_path / "run"
    shutil.copytree(W.bad_samples_run(), run)
    meta_path = run / "bundles" / f"step={W.BAD_STEP}" / "rank=0" / "bundle.json"
    meta = json.loads(meta_path.read_text())
    meta["model_class"] = model_class
    meta["checksum"] = json_checksum(meta)
    meta_path.write_text(json.dumps(meta))
    return run


def cli(args, cwd: Path, path=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from amp_postmortem.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


COMMANDS = [["replay", "--step", str(W.BAD_STEP)], ["fix", "--step", str(W.BAD_STEP)],
            ["bisect", "--step", str(W.BAD_STEP)]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("model_class", ["sys.exit", "os.abort", "evil.Net"])
def test_without_model_nothing_the_bundle_names_runs(tmp_path, command, model_class):
    run = hostile_run(tmp_path, model_class)
    marker = tmp_path / "marker"
    for where in (tmp_path, run):  # the working directory and the run itself
        (where / "evil.py").write_text(PLANTED.format(marker=str(marker)))
    out = cli([command[0], str(run), *command[1:], "--json"], cwd=tmp_path)
    line = one_error_line(out)
    assert "the replay needs the model" in line and "--model package.module:factory" in line
    assert "--model recorded" in line and not marker.exists()
    assert out.stdout == ""


@pytest.mark.parametrize("model_class, says", [
    ("sys.exit", "not a torch.nn.Module class"),
    ("os.abort", "not a torch.nn.Module class"),
    ("runpy.run_path", "not a torch.nn.Module class"),
    ("evil.Net", "refusing to import 'evil'"),
    ("os.path;import os", "is not a dotted Python name"),
])
def test_model_recorded_imports_installed_modules_only_and_calls_only_module_classes(tmp_path, model_class, says):
    run = hostile_run(tmp_path, model_class)
    marker = tmp_path / "marker"
    (tmp_path / "evil.py").write_text(PLANTED.format(marker=str(marker)))
    out = cli(["replay", str(run), "--step", str(W.BAD_STEP), "--model", RECORDED, "--json"], cwd=tmp_path)
    assert says in one_error_line(out) and not marker.exists()
    assert out.stdout == ""


def test_model_recorded_never_imports_from_the_run_or_the_bundle(tmp_path):
    run = hostile_run(tmp_path, "evil.Net")
    marker = tmp_path / "marker"
    bundle = run / "bundles" / f"step={W.BAD_STEP}" / "rank=0"
    for where in (run, bundle):
        (where / "evil.py").write_text(PLANTED.format(marker=str(marker)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Even with the run on the import path (PYTHONPATH), it is taken off.
    out = cli(["replay", str(run), "--step", str(W.BAD_STEP), "--model", RECORDED], cwd=elsewhere,
              path=[run, bundle])
    assert "refusing to import 'evil'" in one_error_line(out)
    assert not marker.exists()


def test_model_recorded_builds_an_installed_class_and_says_what_it_imports(capsys):
    model = resolve_model(RECORDED, "torch.nn.modules.linear.Identity")
    assert isinstance(model, nn.Identity)
    assert "--model recorded: importing 'torch.nn.modules.linear'" in capsys.readouterr().err
    with pytest.raises(ModelSpecError, match="could not be built with no arguments"):
        build_model(RECORDED, model_class="torch.nn.modules.linear.Linear")  # needs its sizes
    with pytest.raises(ModelSpecError, match="cannot import the recorded model class 'gone.pkg.Net'"):
        recorded_class("gone.pkg.Net")


def test_the_python_api_needs_a_model_too():
    with pytest.raises(ModelSpecError, match="the replay needs the model"):
        resolve_model(None, "tiny_models.TinyNet")
