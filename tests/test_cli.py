"""The command line: formats, exit codes, bad inputs, no torch."""
import io
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.cli.output import StderrProgress, render_table
from recorders.format import schema

COMMANDS = ["nans", "scale", "ranges", "summary"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_every_command_is_documented_with_an_example():
    for name, cmd in main.commands.items():
        result = invoke(name, "--help")
        assert result.exit_code == 0
        assert f"amp-postmortem {name} " in result.output, name
        if name != "record":  # runs a script: it reads no run and prints no result
            assert "--json" in result.output and "--rank" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_table_and_json(command, overflow_run):
    table = invoke(command, overflow_run)
    assert table.exit_code == 0, table.output
    assert table.stdout.strip() and "Traceback" not in table.output
    result = invoke(command, overflow_run, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["warnings"] == []


def test_nans_outputs(overflow_run):
    table = invoke("nans", overflow_run).stdout
    assert "forward origin: block.boom, activation, step 7" in table
    assert "ORIGIN      block.boom" in table and "(model)" in table
    doc = json.loads(invoke("nans", overflow_run, "--json").stdout)
    assert doc["origin"]["name"] == "block.boom" and doc["origins"]["backward"]["name"] == "<loss>"
    assert any(layer["name"] == "" for layer in doc["layers"])  # the root keeps its real name in JSON
    csv = invoke("nans", overflow_run, "--csv").stdout.splitlines()
    assert csv[0] == "role,name,kind,phase,first_step,order,rank,nan_count,inf_count,module,last_step,nonfinite_steps"
    assert csv[1].startswith("ORIGIN,block.boom,activation,forward,7,")


def test_ranges_and_summary_csv(underflow_run):
    rows = invoke("ranges", underflow_run, "--csv").stdout.splitlines()
    assert rows[0].startswith("name,kind,dtype,range_dtype,step,absmax,headroom_bits,headroom_trend_per_kstep,")
    import csv
    table = list(csv.DictReader(rows))
    assert any(r["name"] == "inp" and r["kind"] == "grad_output" and r["flags"] == "underflow" for r in table)
    rows = invoke("summary", underflow_run, "--csv").stdout.splitlines()
    assert rows[0] == "severity,kind,step,layer,message,next"
    assert rows[1].startswith("error,stuck_low_scale,")


def test_scale_has_no_csv(collapse_run):
    result = invoke("scale", collapse_run, "--csv")
    assert result.exit_code == 2 and "No such option" in result.output
    doc = json.loads(invoke("scale", collapse_run, "--json").stdout)
    assert doc["status"] == "collapse" and doc["onset_step"] == 42


def test_fail_on(overflow_run, healthy_run):
    assert invoke("summary", overflow_run, "--fail-on", "nonfinite").exit_code == 1
    assert invoke("summary", overflow_run, "--fail-on", "scale_collapse,grad_underflow").exit_code == 0
    assert invoke("summary", healthy_run, "--fail-on", "nonfinite,scale_collapse").exit_code == 0
    result = invoke("summary", healthy_run, "--fail-on", "nonfinite,bogus")
    assert result.exit_code == 2 and "unknown finding kind(s) bogus" in result.output
    assert result.output.count("\n") == 1 and result.output.startswith("Error: fail_on 'nonfinite,bogus' ")


def test_fail_on_takes_a_severity_in_summary_as_in_watch(overflow_run, healthy_run, underflow_run):
    # The same words as `watch --fail-on`: a severity means that one or worse.
    assert invoke("summary", overflow_run, "--fail-on", "critical").exit_code == 1
    assert invoke("summary", underflow_run, "--fail-on", "critical").exit_code == 0  # an error and a warning
    assert invoke("summary", underflow_run, "--fail-on", "error").exit_code == 1
    assert invoke("summary", underflow_run, "--fail-on", "warning").exit_code == 1
    # The healthy finding is an info, but no ailment: never a failure.
    assert invoke("summary", healthy_run, "--fail-on", "info").exit_code == 0
    assert invoke("summary", healthy_run, "--fail-on", "healthy").exit_code == 1  # asked for by kind


def test_ctrl_c_is_one_line_and_exit_130_in_every_command(overflow_run, monkeypatch):
    import amp_postmortem

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    for command in ("summary", "nans", "scale", "ranges"):
        monkeypatch.setattr(amp_postmortem, command, interrupted)
        result = invoke(command, overflow_run)
        assert result.exit_code == 130, (command, result.output)
        assert result.stderr == "stopped (interrupted)\n" and result.stdout == ""


def _one_error_line(result):
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_missing_directory(tmp_path):
    line = _one_error_line(invoke("summary", tmp_path / "missing"))
    assert "run directory not found" in line


def test_not_a_run(tmp_path):
    assert "not an amp-postmortem run" in _one_error_line(invoke("nans", tmp_path))


def test_newer_major_version(copy_run, overflow_run, edit_manifest):
    run = copy_run(overflow_run)
    edit_manifest(run / "manifest.json", schema_version=f"{schema.SCHEMA_MAJOR + 1}.0")
    assert "upgrade amp-postmortem" in _one_error_line(invoke("scale", run))


def test_unknown_rank(two_rank_run):
    assert "rank 7 is not in" in _one_error_line(invoke("nans", two_rank_run, "--rank", "7"))
    assert invoke("nans", two_rank_run, "--rank", "-1").exit_code == 2


def test_rank_option(two_rank_run):
    doc = json.loads(invoke("summary", two_rank_run, "--rank", "1", "--json").stdout)
    assert doc["run"]["ranks"] == [1]


def test_torn_shard_warns_on_stderr_and_keeps_stdout_clean(copy_run, overflow_run):
    run = copy_run(overflow_run)
    torn = run / "rank=0" / "tensors" / "part-000001.parquet"
    torn.write_bytes(torn.read_bytes()[:64])
    result = invoke("nans", run, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert any("part-000001.parquet" in w for w in doc["warnings"])
    assert "Warning: skipped unreadable shard rank=0/tensors/part-000001.parquet" in result.stderr


def test_open_run_warns(open_run):
    result = invoke("summary", open_run)
    assert result.exit_code == 0 and "Warning: the recorder of rank(s) 0 was not closed" in result.stderr


def test_unknown_command_is_a_usage_error():
    assert invoke("nope").exit_code == 2


def test_commands_do_not_import_torch(overflow_run):
    code = (
        "import sys\n"
        "from amp_postmortem.cli import main\n"
        f"for cmd in {COMMANDS!r}:\n"
        "    try:\n"
        f"        main([cmd, {str(overflow_run)!r}, '--json'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (cmd, e.code)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_progress_bar_only_after_the_delay():
    quiet = io.StringIO()
    p = StderrProgress(delay=60, file=quiet)
    p("scan", 0, 10), p("scan", 5, 10), p("scan", 10, 10)
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    p = StderrProgress(delay=0, file=shown, tty_only=False)
    p("scan", 0, 10), p("scan", 5, 10), p("scan", 10, 10)
    assert "scan" in shown.getvalue()


def test_progress_bar_never_on_a_stream_that_is_no_terminal():
    # A log file, a pipe, a test's captured stderr: no bar, ever.
    captured = io.StringIO()
    p = StderrProgress(delay=0, file=captured)
    p("scan", 0, 10), p("scan", 5, 10), p("scan", 10, 10)
    assert captured.getvalue() == ""


def test_render_table_names_the_root_model():
    import pandas as pd
    text = render_table(pd.DataFrame({"name": ["", "fc"], "absmax": [1.23456, None]}))
    assert text.splitlines()[1].startswith("(model)") and text.splitlines()[2].rstrip().endswith("-")


NOISY_FACTORY = """
import os
import sys
sys.path.insert(0, {tests!r})
import whatif_runs as W


def build():
    print("number of parameters: 0.01M")          # nanoGPT's GPT does this in __init__
    os.write(1, b"native code printing on fd 1\\n")  # and native code may write to the descriptor
    return W.AttnNet()
"""


@pytest.mark.parametrize("command", [["scale-window", "--step", "1", "--model"], ["recommend", "--model"],
                                     ["replay", "--step", "1", "--model"]], ids=lambda c: c[0])
def test_json_is_only_json_when_user_code_prints(tmp_path, command):
    import whatif_runs as W
    factory = tmp_path / "noisy.py"
    factory.write_text(NOISY_FACTORY.format(tests=str(Path(__file__).resolve().parent)))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from amp_postmortem.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, command[0], str(W.bad_samples_run()), *command[1:],
                          f"{factory}:build", "--json"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)  # the whole of stdout is one JSON document
    assert "number of parameters" in out.stderr and "native code printing" in out.stderr


def test_python_m_amp_postmortem_is_the_command():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-m", "amp_postmortem", "--help"], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.startswith("Usage: amp-postmortem ") and "watch" in out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    from amp_postmortem.cli.output import colour_enabled, paint
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert colour_enabled(_Terminal()) and not colour_enabled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colour_enabled(_Terminal())
    monkeypatch.setenv("NO_COLOR", "")  # no-color.org: an empty value does not count
    assert colour_enabled(_Terminal())
    line = "  CRITICAL  nonfinite  step 7  layer block.boom"
    assert paint(line) != line and paint(line).startswith("  \x1b[") and "CRITICAL\x1b[0m  nonfinite" in paint(line)
    assert paint("run x  (path)") == "run x  (path)"


def test_captured_output_has_no_colour_codes(overflow_run):
    result = invoke("summary", overflow_run)
    assert "CRITICAL" in result.output and "\x1b[" not in result.output
