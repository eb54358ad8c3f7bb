"""README.md stays true: its set-up commands are the ones CI runs, its
`summary` example prints what the README shows, its plain-loop snippet runs
(the Trainer and Lightning ones: tests/test_integrations_readme.py), its
command table names every command and links to its reference, and it keeps
the cost table. The guides it fronts (docs/WALKTHROUGH.md, docs/RECORDER.md,
docs/COMMANDS.md) are kept true by tests/test_docs.py with the helpers below.

The console examples are the fenced ```console blocks: a line
`$ amp-postmortem ...` is a command, the lines after it its expected stdout.
In the expected output a line `...` stands for any number of lines left out.
Info-string flags after `console`: `no-test` (shown, not re-run) and `approx`
(replay numbers: floating-point rounding differs between CPUs, so numbers
agree within `APPROX_REL`, and values below `APPROX_TINY`, which are rounding
noise of float32, all agree). `docs/WALKTHROUGH.md` and `docs/PLAYBOOK.md`
use the same blocks (`tests/test_docs.py` imports the helpers below).
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
RECORDER = DOCS / "RECORDER.md"
COMMANDS = DOCS / "COMMANDS.md"
WALKTHROUGH = DOCS / "WALKTHROUGH.md"

# The two commands a new user runs (README "Start here"): the main job on
# the runtime dependencies alone, then every extra and the tests. `.ci/run`
# runs both commands' parts, and other tools copy them from the README verbatim.
LIGHT_INSTALL = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ."
INSTALL = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[dev,hf,lightning,report,mlflow,s3,dask,wandb,tensorflow,jax]'"
SETUP_COMMANDS = (
    f"{LIGHT_INSTALL} && amp-postmortem summary sample_runs/attention_overflow",
    f"{INSTALL} && python -m pytest -n 2",
)

APPROX_REL = 0.05
APPROX_TINY = 1e-5
GAP = "..."


# ------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class Block:
    lang: str
    flags: frozenset
    line: int            # 1-based line of the opening fence
    lines: tuple


def fenced_blocks(path: Path) -> list[Block]:
    blocks, current = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if current is None:
            if line.startswith("```"):
                info = line[3:].split()
                current = (info[0] if info else "", frozenset(info[1:]), number, [])
        elif line.startswith("```"):
            blocks.append(Block(current[0], current[1], current[2], tuple(current[3])))
            current = None
        else:
            current[3].append(line)
    assert current is None, f"{path.name}: unclosed fence at line {current[2]}"
    return blocks


def section(path: Path, heading: str) -> str:
    """The text from the heading line to the next heading of the same or a
    higher level."""
    text = path.read_text()
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


@dataclass(frozen=True)
class ConsoleExample:
    where: str           # "README.md:123", "WALKTHROUGH.md:45"
    argv: tuple          # the arguments after `amp-postmortem`
    expected: tuple      # expected stdout lines, `...` for a gap
    flags: frozenset

    @property
    def id(self) -> str:
        return " ".join(self.argv[:2])


def console_examples(path: Path) -> list[ConsoleExample]:
    examples = []
    for block in fenced_blocks(path):
        if block.lang != "console":
            continue
        command, expected = None, []
        for offset, line in enumerate(block.lines + ("$ ",), 1):
            if line.startswith("$ "):
                if command is not None:
                    examples.append(ConsoleExample(f"{path.name}:{block.line}", command,
                                                   tuple(expected), block.flags))
                if line == "$ ":
                    break
                words = shlex.split(line[2:])
                assert words[0] == "amp-postmortem", f"{path.name}:{block.line + offset}: {line}"
                command, expected = tuple(words[1:]), []
            else:
                assert command is not None, f"{path.name}:{block.line}: output before a command"
                expected.append(line)
    return examples


# ------------------------------------------------------------------ running
def _runner():
    from click.testing import CliRunner
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout
    except TypeError:
        return CliRunner()


@contextlib.contextmanager
def one_torch_thread():
    """Tiny models on a busy 2-core machine run several times faster on one
    thread (measured: OpenMP workers spin while they wait for a core); the
    replays print the same numbers on 1, 2 and 4 threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def run_cli(argv: tuple) -> tuple[int, str]:
    """Run `amp-postmortem ARGV` in-process from the repository root; the
    exit code and stdout (progress bars and warnings go to stderr). Cached:
    README, WALKTHROUGH and PLAYBOOK share commands, and replays take seconds."""
    from amp_postmortem.cli import main

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with one_torch_thread():
            result = _runner().invoke(main, list(argv), catch_exceptions=False)
    finally:
        os.chdir(cwd)
    return result.exit_code, result.stdout.replace(f"{REPO}{os.sep}", "")


# ----------------------------------------------------------------- matching
_PUNCT = ",;:()[]"


def _number(token: str):
    try:
        return float(token.strip(_PUNCT))
    except ValueError:
        return None


def _affixes(token: str) -> tuple[str, str]:
    core = token.strip(_PUNCT)
    start = token.index(core) if core else 0
    return token[:start], token[start + len(core):]


def _same_token(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is None or y is None or _affixes(a) != _affixes(b):
        return False
    if x == y:  # inf, -inf
        return True
    if abs(x) < APPROX_TINY and abs(y) < APPROX_TINY:
        return True
    return abs(x - y) <= APPROX_REL * max(abs(x), abs(y))


def _same_line(expected: str, actual: str, approx: bool) -> bool:
    if expected == actual:
        return True
    if not approx:
        return False
    e, a = expected.split(), actual.split()
    return len(e) == len(a) and all(_same_token(x, y) for x, y in zip(e, a))


def _matches_at(segment, actual, pos, approx) -> bool:
    return pos + len(segment) <= len(actual) and all(
        _same_line(e, a, approx) for e, a in zip(segment, actual[pos:pos + len(segment)]))


def output_mismatch(expected: tuple, stdout: str, approx: bool = False) -> str | None:
    """None when `stdout` is what `expected` shows, else a diff to read.

    `expected` is cut at its `...` lines into segments; each must appear as
    consecutive lines, in order; the first at the very start unless the
    expected output opens with `...`, the last at the very end unless it
    closes with one."""
    actual = [line.rstrip() for line in stdout.rstrip("\n").split("\n")]
    segments, current = [], []
    for line in expected:
        if line.strip() == GAP:
            segments.append(current)
            current = []
        else:
            current.append(line.rstrip())
    segments.append(current)
    pos = 0
    for i, segment in enumerate(segments):
        if not segment:
            continue
        last = i == len(segments) - 1
        if i == 0:
            candidates = [0]
        elif last:
            candidates = [len(actual) - len(segment)]
        else:
            candidates = range(pos, len(actual) - len(segment) + 1)
        found = next((p for p in candidates if p >= pos and _matches_at(segment, actual, p, approx)), None)
        if found is None or (i == 0 and last and len(actual) != len(segment)):
            diff = difflib.unified_diff(list(segment), actual, "shown", "printed", lineterm="", n=1)
            return "segment %d of the expected output not found:\n%s" % (i + 1, "\n".join(diff))
        pos = found + len(segment)
    return None


def check_example(example: ConsoleExample) -> None:
    code, stdout = run_cli(example.argv)
    assert code == 0, f"{example.where}: exit code {code}\n{stdout}"
    assert "Traceback" not in stdout
    problem = output_mismatch(example.expected, stdout, approx="approx" in example.flags)
    assert problem is None, f"{example.where}: amp-postmortem {' '.join(example.argv)}\n{problem}"


# -------------------------------------------------------------------- tests
def test_matcher_handles_gaps_and_approximate_numbers():
    out = "a 1\nb 2\nc 3\nd 4\n"
    assert output_mismatch(("a 1", "...", "d 4"), out) is None
    assert output_mismatch(("...", "b 2", "c 3", "..."), out) is None
    assert output_mismatch(("a 1", "b 2"), out) is not None          # stops early
    assert output_mismatch(("...", "c 3"), out) is not None           # not at the end
    assert output_mismatch(("a 1", "...", "b 3", "..."), out) is not None
    assert output_mismatch(("x 1.000e-07 0.2503 inf",), "x 1.3e-07 0.25 inf", approx=True) is None
    assert output_mismatch(("x 0.2503",), "x 0.30", approx=True) is not None
    assert output_mismatch(("x 0.2503",), "x 0.25", approx=False) is not None


def test_setup_commands_are_in_readme_verbatim():
    start_here = section(README, "## Start here")
    commands = [line for block in fenced_blocks(README) if block.lang == "bash"
                for line in block.lines if line in start_here]
    assert commands[:2] == list(SETUP_COMMANDS)


def _section_lines(ci: list[str], start: str, end: str) -> list[str]:
    lines = ci[ci.index(start) + 1:ci.index(end)]
    return [line for line in lines if line.strip() and not line.startswith("#")]


def test_ci_runs_what_the_readme_says():
    """`.ci/run` runs the first set-up command's parts in a venv of its own
    (the main job on the runtime dependencies alone: a light start that
    works), then the second's: every install line a part of it, its test
    line the command's last part."""
    ci = (REPO / ".ci" / "run").read_text().split("\n")
    light = _section_lines(ci, "# --- light start (as in README.md)", "# --- end of the light start")
    # The install section's own lines: the light start's `wait` (it runs
    # beside the torch install) is no install step.
    install = [line for line in _section_lines(ci, "# --- install (as in README.md)", "# --- test (as in README.md)")
               if not line.startswith(("wait ", "cat "))]
    test = [l for l in ci[ci.index("# --- test (as in README.md)") + 1:] if l.strip() and not l.startswith("#")]
    assert light and install and test
    light_parts = [p.strip() for p in SETUP_COMMANDS[0].split("&&")]
    # Its own venv (not the test venv): the steps past the venv's creation, verbatim.
    assert [line for line in light if line in light_parts] == light_parts[2:], (light, light_parts)
    parts = [p.strip() for p in SETUP_COMMANDS[1].split("&&")]
    assert all(line in parts for line in install), (install, parts)
    assert SETUP_COMMANDS[1].split("&&")[-1].strip() == test[-1]
    readme = README.read_text()
    assert all(line in readme for line in light_parts[2:] + install + test)


EXAMPLES = console_examples(README)


def test_readme_shows_a_summary():
    assert [e.argv for e in EXAMPLES] == [("summary", "sample_runs/attention_overflow")]


@pytest.mark.parametrize("example", [e for e in EXAMPLES if "no-test" not in e.flags], ids=lambda e: e.id)
def test_readme_example_prints_what_the_readme_shows(example):
    check_example(example)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (its text after the #s)."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    fenced = re.compile(r"^```.*?^```", re.M | re.S)
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", fenced.sub("", text), re.M)}


def test_readme_table_has_every_command_linked_to_its_reference():
    from amp_postmortem.cli import main

    table = section(README, "## Commands")
    rows = re.findall(r"^\| \[`([\w -]+)`\]\(docs/COMMANDS\.md#([\w-]+)\) \| .+ \|$", table, re.M)
    names = []
    for name, command in main.commands.items():
        names += [f"{name} {sub}" for sub in command.commands] if hasattr(command, "commands") else [name]
    assert sorted(name for name, _ in rows) == sorted(names)
    reference = anchors(COMMANDS)
    for name, anchor in rows:
        assert anchor in reference, f"README's {name} row links to a missing heading #{anchor}"
        assert anchor.startswith(github_anchor(f"amp-postmortem {name} ")), (name, anchor)


def test_readme_keeps_the_cost_table():
    text = section(README, "## What it costs")
    assert "benchmarks/sentinel_cost.py" in text
    assert '| job | default (sentinel) | `mode="every_step"` |' in text
    for job in ("| launch-bound proxy (242 modules", "| a 5-module MLP (fp16 + GradScaler) |",
                "| ResNet-18 at quarter width (bf16) |", "| GPT, 4 layers, d 256 (bf16) |",
                "| a diverging job (every step an event) |"):
        assert job in text, job


def _load_sample_models():
    spec = importlib.util.spec_from_file_location("sample_models", REPO / "sample_runs" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_snippets(path: Path, heading: str, lang: str = "python") -> list[Block]:
    """The fenced `lang` blocks of `path` inside its section `heading`."""
    text = section(path, heading)
    return [b for b in fenced_blocks(path) if b.lang == lang and "\n".join(b.lines) in text]


def run_recorder_snippets(path: Path, snippets: list[Block]):
    """Run `snippets`, in order in one namespace, from the current directory
    on the tiny GPT of the sample runs on the CPU (`"cuda"` replaced by
    `"cpu"`); the namespace they leave."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    models = _load_sample_models()
    model = models.tiny_gpt()
    gen = torch.Generator().manual_seed(0)
    loader = [(x, x.roll(1, dims=1)) for x in
              (torch.randint(0, models.VOCAB, (4, models.BLOCK), generator=gen) for _ in range(8))]
    namespace = {
        "model": model,
        "opt": torch.optim.Adam(model.parameters(), lr=1e-3),
        "loader": loader,
        "loss_fn": lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)),
    }
    with one_torch_thread():
        for block in snippets:
            code = "\n".join(block.lines).replace('"cuda"', '"cpu"')
            exec(compile(code, f"{path.name}:{block.line}", "exec"), namespace)
    return namespace


def test_readme_plain_loop_snippet_runs(tmp_path, monkeypatch):
    """The plain loop of "Attach in three lines" (the Trainer and Lightning
    snippets: tests/test_integrations_readme.py)."""
    from amp_postmortem.reading.loader import load_run

    snippets = [b for b in section_snippets(README, "## Attach in three lines")
                if "AmpPostmortemCallback" not in "\n".join(b.lines)]
    assert len(snippets) == 1
    monkeypatch.chdir(tmp_path)
    run_recorder_snippets(README, snippets)
    exp1 = load_run("runs/exp1")
    assert len(exp1.steps) == 8 and exp1.steps["loss_scale"].notna().all()
