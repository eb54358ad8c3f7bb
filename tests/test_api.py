"""`amp_postmortem` is the Python API and the CLI mirrors it: same names,
same options (keyword arguments), `to_dict()` is `--json`, the command
reference (docs/COMMANDS.md) lists exactly those keys; the layers of `amp_postmortem` and of
`recorders` import only downward; the truths the CLI shows (choices, bundle
priority) have one source."""
from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import shutil

import click
import pytest

import amp_postmortem as api
from amp_postmortem.cli import main
import window_runs
from import_graph import import_cycles, module_graph, module_imports
from test_readme import COMMANDS as REFERENCE, RECORDER, REPO, one_torch_thread, section, section_snippets

MODELS = "sample_runs/models.py:"
# Switches of the CLI that are not analysis options: the output format and
# the exit-code gate of `summary`; `progress` is how the CLI draws its bars.
CLI_ONLY = {"fmt", "fail_on"}
API_ONLY = {"progress"}
# Commands that print a stream of events, not one document: their API
# function returns an iterator; `fail_on` is an option of the API there.
STREAMING = {"watch"}
# Commands that run a program: their API function returns its exit code.
PROCESSES = {"record"}

# Where `report` and the exports write (the API and the CLI write the same
# file; the export directory is emptied between the two): a placeholder that
# the `results` fixture replaces with a temporary directory of its own (one
# per module and worker, removed by pytest), as it replaces WINDOW_RUN with
# the run `rerun` reads (recorded when the fixture first needs it, not at
# collection).
OUT = "{out}"
WINDOW_RUN = "{window_run}"

# One invocation per command on a sample run (small replays: seconds in all).
CALLS = {
    "summary": ("sample_runs/attention_overflow",),
    # With a model: the op origin of the bundle of step 79 (without one: `summary` and the import test).
    "nans": ("sample_runs/attention_overflow", "--from-step", "70", "--model", MODELS + "attention_overflow_gpt"),
    "scale": ("sample_runs/attention_overflow",),
    "ranges": ("sample_runs/grad_underflow", "--window", "0"),
    "compare": ("sample_runs/fp32_baseline", "sample_runs/attention_overflow"),
    "replay": ("sample_runs/fp16_layernorm", "--step", "19", "--model", MODELS + "fp16_layernorm_model",
               "--precisions", "fp16"),
    "fix": ("sample_runs/fp16_layernorm", "--step", "19", "--model", MODELS + "fp16_layernorm_model"),
    "bisect": ("sample_runs/bad_batch", "--step", "60", "--model", MODELS + "feature_mlp"),
    "scale-window": ("sample_runs/scale_collapse", "--step", "45", "--model", MODELS + "multitask_mlp",
                     "--scales", "8:12"),
    "recommend": ("sample_runs/bad_batch", "--model", MODELS + "feature_mlp"),
    # A run with a counterfactual window, recorded here (no sample run has one).
    "rerun": (WINDOW_RUN, "--precision", "fp32", "--model", "tests/window_runs.py:linear_net"),
    "report": ("sample_runs/attention_overflow", "-o", f"{OUT}/report.html"),
    "export tensorboard": ("sample_runs/grad_underflow", "--logdir", f"{OUT}/tb"),
    "export mlflow": ("sample_runs/grad_underflow", "--tracking-uri", f"{OUT}/mlruns"),
    "export wandb": ("sample_runs/grad_underflow", "--offline", "--dir", f"{OUT}/wandb"),
}


def _cli_commands() -> dict:
    """Every command by what a user types: a group's commands as
    `group command` (`export tensorboard`)."""
    out = {}
    for name, command in main.commands.items():
        if isinstance(command, click.Group):
            out.update({f"{name} {sub}": c for sub, c in command.commands.items()})
        else:
            out[name] = command
    return out


COMMANDS = _cli_commands()


def _api_function(command: str):
    return getattr(api, command.replace("-", "_").replace(" ", "_"))


def _cli_json(argv) -> dict:
    from test_readme import run_cli
    code, stdout = run_cli((*argv[0].split(), *argv[1], "--json"))
    assert code == 0, stdout
    return json.loads(stdout)


def _api_dict(command, argv) -> dict:
    """The API call the CLI makes for `argv`, spelled as a user would."""
    ctx = COMMANDS[command].make_context(command, list(argv))
    params = {k: v for k, v in ctx.params.items() if k not in CLI_ONLY}
    runs = [params.pop(k) for k in ("run", "run_a", "run_b") if k in params]
    with one_torch_thread():
        return _api_function(command)(*[str(REPO / r) for r in runs], **params).to_dict()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{command: (api to_dict, --json)} of CALLS, computed once."""
    import os
    out_dir = tmp_path_factory.mktemp("api-out")
    places = {OUT: str(out_dir), WINDOW_RUN: None}
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        out = {}
        for command, argv in CALLS.items():
            if WINDOW_RUN in argv and places[WINDOW_RUN] is None:
                places[WINDOW_RUN] = str(window_runs.instability_run())
            argv = tuple(_resolve(arg, places) for arg in argv)
            from_api = _api_dict(command, argv)
            if command == "export tensorboard":
                shutil.rmtree(out_dir / "tb")  # an export refuses a directory that holds one
            out[command] = (from_api, _cli_json((command, argv)))
        return out
    finally:
        os.chdir(cwd)


def _resolve(arg: str, places: dict) -> str:
    """An argument of CALLS with its placeholders (OUT, WINDOW_RUN) replaced."""
    for placeholder, value in places.items():
        if placeholder in arg:
            arg = arg.replace(placeholder, value)
    return arg


def _relative(doc):
    """Paths in a document relative to the repository (the CLI is run from it)."""
    return json.loads(json.dumps(doc).replace(f"{REPO}/", ""))


# ------------------------------------------------------------ the mirror
def test_every_command_has_an_api_function_of_its_name():
    assert {c.replace("-", "_").replace(" ", "_") for c in COMMANDS} <= set(api.__all__)
    assert set(CALLS) | STREAMING | PROCESSES == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(set(CALLS) | STREAMING | PROCESSES))
def test_every_cli_option_is_a_keyword_argument_of_the_api_function(command):
    cli = {p.name for p in COMMANDS[command].params} - (CLI_ONLY - ({"fail_on"} if command in STREAMING else set()))
    signature = inspect.signature(_api_function(command)).parameters
    assert cli - {"run", "run_a", "run_b"} == set(signature) - {"run", "run_a", "run_b"} - API_ONLY
    for p in COMMANDS[command].params:
        default = signature[p.name].default if p.name in signature else inspect.Parameter.empty
        if default is not inspect.Parameter.empty and default not in (None, "", False, ()):
            shown = ",".join(default) if p.name == "precisions" else (
                "{}:{}".format(*default) if p.name == "scales" else default)
            assert p.default == shown, (command, p.name)


def test_api_defaults_are_the_analyses_defaults():
    from amp_postmortem.analyses.compare import compare_runs
    from amp_postmortem.analyses.ranges import WINDOW
    from amp_postmortem.whatif.bisect import MAX_REPLAYS
    from amp_postmortem.whatif.fix import MAX_CANDIDATES, MAX_SET
    from amp_postmortem.whatif.scale_result import MAX_UNDERFLOW, SCALES

    def default(f, name):
        return inspect.signature(f).parameters[name].default

    assert default(api.ranges, "window") == default(api.summary, "window") == WINDOW
    assert (default(api.fix, "max_candidates"), default(api.fix, "max_set")) == (MAX_CANDIDATES, MAX_SET)
    assert default(api.bisect, "max_replays") == MAX_REPLAYS
    assert (tuple(default(api.scale_window, "scales")), default(api.scale_window, "max_underflow")) == \
        (tuple(SCALES), MAX_UNDERFLOW)
    assert (default(api.compare, "threshold"), default(api.compare, "persist")) == \
        (default(compare_runs, "threshold"), default(compare_runs, "persist"))


@pytest.mark.parametrize("command", sorted(CALLS))
def test_the_api_returns_what_json_prints(results, command):
    from_api, printed = json.loads(json.dumps(results[command]))  # copies: the fixture is shared
    if command == "export tensorboard":
        # TensorBoard names each event file with a per-process counter: the
        # second export's names end differently; their folders are the same.
        for doc in (from_api, printed):
            doc["files"] = [str(Path(f).parent) for f in doc["files"]]
    if command in ("export mlflow", "export wandb"):
        # Each export is a new tracker run, with an id (and a W&B folder) of its own.
        for doc in (from_api, printed):
            doc.pop("run_ids")
            doc.pop("run_dirs", None)
    if command == "report":
        # The page names the run as it was given: an absolute path through
        # the API, a relative one on the command line; sizes differ by that.
        for doc in (from_api, printed):
            doc.pop("bytes")
    assert _relative(from_api) == printed


def _documented_keys(command: str) -> list[str]:
    """Top-level keys of the `JSON:` paragraph of a command's reference
    (docs/COMMANDS.md): the backticked names outside parentheses, up to the
    first full stop outside them."""
    reference = REFERENCE.read_text()
    text = reference[reference.index(f"\n## `amp-postmortem {command} "):]
    text = text[text.index("\nJSON: ") + 7:]
    keys, depth, i = [], 0, 0
    while i < len(text):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "." and depth == 0 and not text.startswith("...", i):
            break
        elif c == "`" and depth == 0:
            end = text.index("`", i + 1)
            keys.append(text[i + 1:end])
            i = end
        i += 1
    return keys


@pytest.mark.parametrize("command", sorted(CALLS))
def test_reference_lists_exactly_the_json_keys(results, command):
    documented = _documented_keys(command)
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == set(results[command][0]), command


def test_import_needs_neither_torch_nor_pandas_and_the_table_commands_no_torch():
    code = ("import sys, amp_postmortem as a, amp_postmortem.cli; "
            "print(sorted(m for m in ('torch', 'pandas', 'scipy') if m in sys.modules)); "
            "run = 'sample_runs/attention_overflow'; "
            "[f(run) for f in (a.summary, a.nans, a.scale, a.ranges, a.scale_window, a.recommend)]; "
            "a.compare('sample_runs/fp32_baseline', run); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]


def test_replay_and_report_are_the_api_functions_after_their_packages_are_imported():
    import amp_postmortem.replaying.engine  # noqa: F401
    import amp_postmortem.reporting.data  # noqa: F401
    from amp_postmortem import replay, report
    assert api.replay is replay and callable(replay) and "step" in inspect.signature(replay).parameters
    assert api.report is report and callable(report) and "output" in inspect.signature(report).parameters


def test_a_loaded_run_is_accepted_and_reopened_for_a_rank():
    run = api.load_run(REPO / "sample_runs/attention_overflow")
    assert api.load_run(run) is run
    assert api.nans(run).to_dict() == api.nans(REPO / "sample_runs/attention_overflow").to_dict()
    assert api.load_run(run, rank=0).ranks == [0]


def test_recorder_guide_python_api_section_runs(monkeypatch):
    blocks = section_snippets(RECORDER, "## Python API")
    assert blocks
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    for block in blocks:
        exec(compile("\n".join(block.lines), f"RECORDER.md:{block.line}", "exec"), namespace)
    assert namespace["first"] == 79 and namespace["doc"] == _cli_json(("nans", ("sample_runs/attention_overflow",
                                                                              "--from-step", "70")))


# --------------------------------------------------------- one source
def test_bundle_priority_reads_the_same_in_help_reference_and_docs():
    from click.testing import CliRunner

    from amp_postmortem.analyses.bundle_choice import priority_description
    said = priority_description()

    def flat(text):
        return " ".join(text.replace("`", "").split())

    help_text = CliRunner().invoke(main, ["recommend", "--help"], terminal_width=1000).output
    assert said in flat(help_text)
    assert said in flat(section(REFERENCE, "## `amp-postmortem recommend RUN`"))
    import amp_postmortem.advice
    assert said in flat(amp_postmortem.advice.__doc__)


def test_cli_choices_come_from_the_one_vocabulary():
    from amp_postmortem.names import DEVICES, POLICIES, PRECISIONS, REDUCED_PRECISIONS, RERUN_PRECISIONS
    from amp_postmortem.replaying.run_config import POLICY_MODES
    from amp_postmortem.replaying.run_config import PRECISIONS as ENGINE_PRECISIONS
    assert (ENGINE_PRECISIONS, POLICY_MODES) == (PRECISIONS, POLICIES)
    for command in COMMANDS.values():
        for p in command.params:
            if p.name == "policy":
                assert tuple(p.type.choices) == POLICIES
            if p.name == "device":
                assert tuple(p.type.choices) == DEVICES
            if p.name == "precision":  # a re-run may also go to float32 or float64
                assert tuple(p.type.choices) == (RERUN_PRECISIONS if command.name == "rerun" else REDUCED_PRECISIONS)


# ----------------------------------------------------------- the layers
LAYERS = [  # each imports only from its own layer and the ones before it
    {"errors", "names", "op_words", "display", "result", "record_script"},
    {"reading"},
    {"analyses"},
    {"replaying", "framework_replay"},
    {"whatif"},
    {"advice"},
    {"reporting", "export", "export_tracking"},
    {"__init__"},
    {"cli", "__main__"},
]
PACKAGE = REPO / "amp_postmortem"


def _layer(module: str, layers=LAYERS) -> int:
    top = module.split(".")[0] or "__init__"
    found = [i for i, names in enumerate(layers) if top in names]
    assert found, f"module {module!r} is in no layer: add it to the layer list of its package"
    return found[0]


def _imports(path: Path, package_dir: Path = PACKAGE):
    """(line, imported module relative to the package) of every import of
    the package in the file, lazy ones inside functions included."""
    name = package_dir.name
    for line, module, _ in module_imports(path, package_dir):
        if module == name or module.startswith(name + "."):
            yield line, module[len(name) + 1:]


def _upward_imports(package_dir: Path, layers) -> list[str]:
    wrong = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        me = _layer(".".join(rel.parts), layers)
        for line, module in _imports(path, package_dir):
            if _layer(module, layers) > me:
                wrong.append(f"{rel}:{line} imports {module or '__init__'}")
    return wrong


def test_layers_import_only_downward():
    assert not _upward_imports(PACKAGE, LAYERS)


RECORDERS = REPO / "recorders"
RECORDER_LAYERS = [  # each imports only from its own layer and the ones before it
    {"format"},                                                                 # the run format, both sides' one import
    {"errors", "unwrap", "fp32", "attach_choice"},                              # pure helpers
    {"layout", "aggregate", "stats", "staged_stats", "full_stage", "xp_stats", "loss_tap", "schedule", "events",
     "guard", "stance", "survey"},  # a tensor's and a step's values
    {"durable", "index", "journal", "writer", "writer_thread", "event_thread", "lease", "status_slot", "storage"},  # threads, files, stores
    {"manifest", "run_id", "step_rows", "graph_rows", "host_run", "rank_files", "run_writer", "host_bundle"},  # the job described, rows
    {"collectors", "hooks", "bundles", "reexecute", "quiet_step"},              # the parts on the training path
    {"options"},                                                                # the parts a user passes in
    {"recorder"},                                                               # AmpRecorder assembles them
    {"integrations", "jax_grad_tap", "jax_program", "keras_recorder", "keras_loss_scaling", "flax_recorder", "attach"},  # the frameworks' glue and recorders
    {"__init__"},
]


def test_recorder_layers_import_only_downward():
    """`recorders.stats`, `aggregate`, `schema` never import the recorder:
    a part can be read, tested and changed without what assembles it."""
    assert not _upward_imports(RECORDERS, RECORDER_LAYERS)


# What `amp_postmortem` may import of `recorders`, beside the package's public API (the names
# in `recorders.__all__`, and the package itself): the run format, and the one recorder
# option the CLI quotes.
ANALYZER_READS_OF_RECORDERS = {
    "recorders.format": "the run format: schema, JSON-plain values, checksums",
    "recorders.format.locations": "where a run is: URIs, local paths, filesystems, a recorder's spool",
    "recorders.format.tensors": "the tensor codec, and the recorder's rules a replay applies alike",
    "recorders.format.keras_names": "how the Keras recorder names layers and variables",
    "recorders.format.flax_names": "how the Flax recorder names module calls and parameters",
    "recorders.schedule": "MODES: `record --mode`'s choices, `AmpRecorder(mode=)`'s",
}


def test_the_analyzer_reads_recorders_only_through_the_format():
    """The analyzer reads the run format from `recorders.format`, never from
    the recorder's internals (imports inside functions included)."""
    import recorders
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported = [(node.module, [a.name for a in node.names])]
            else:
                continue
            for module, names in imported:
                if module.split(".")[0] != "recorders" or module in ANALYZER_READS_OF_RECORDERS:
                    continue
                if module == "recorders" and (names is None or set(names) <= set(recorders.__all__)):
                    continue
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {module}"
                             + (f" ({', '.join(names)})" if names else ""))
    assert not wrong


@pytest.mark.parametrize("package", [PACKAGE, RECORDERS], ids=lambda p: p.name)
def test_no_import_cycles(package):
    """No two modules need each other, not even through an import inside a
    function: the shared piece is a module below both (STYLE.md, 20)."""
    graph = module_graph(package)
    cycles = [[f"{m}:{line} imports {n}" for m in c for n, line in graph[m].items() if n in c]
              for c in import_cycles(graph)]
    assert not cycles


@pytest.mark.parametrize("package", ["amp_postmortem", "recorders"])
def test_no_private_name_is_imported_across_modules(package):
    wrong = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package)):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    assert not wrong


def test_the_root_module_has_one_display_name():
    copies = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
              if re.search(r"""["']\(model\)["']""", p.read_text())]
    assert copies == ["amp_postmortem/names.py"]


@pytest.mark.parametrize("call", ["summary", "nans", "scale", "ranges", "compare"])
def test_results_read_as_html_in_jupyter_and_as_lines_in_a_repr(call):
    run = str(REPO / "sample_runs/attention_overflow")
    result = (api.compare(str(REPO / "sample_runs/fp32_baseline"), run) if call == "compare"
              else getattr(api, call)(run))
    page = result._repr_html_()
    assert "<table" in page and "</table>" in page and "<pre>" in page
    assert repr(result).startswith(result.lines()[0])
