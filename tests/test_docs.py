"""docs/ stays true: the DuckDB and pandas queries of QUERYING.md run on the
sample runs and print the results the page shows; every PLAYBOOK.md and
WALKTHROUGH.md command runs and prints what the page shows; RECORDER.md's
recorder snippets run (its Trainer, Accelerate and Lightning snippets:
tests/test_integrations_readme.py; Keras and Flax:
tests/test_keras_flax_readme.py; Python API: tests/test_api.py); COMMANDS.md
covers every command and option; ARCHITECTURE.md names every module of the
code and no module that is gone; every relative link of README.md and docs/
reaches a file, and a heading of it where it names one.

QUERYING.md: each ```sql block runs through `duckdb.sql(query).df()`,
printed with `to_string(index=False)`; the ```python blocks run in order in one
namespace (a later block uses what an earlier one defined) and print; the
```text block right after a query is its expected output. All run from the
repository root, as the page says.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from test_readme import (COMMANDS, DOCS, README, RECORDER, REPO, WALKTHROUGH, anchors, check_example,
                         console_examples, fenced_blocks, run_recorder_snippets, section_snippets)

QUERYING = DOCS / "QUERYING.md"
PLAYBOOK = DOCS / "PLAYBOOK.md"
ARCHITECTURE = DOCS / "ARCHITECTURE.md"


def run_queries(path: Path) -> list[tuple]:
    """(block, printed output, expected text block or None) for every sql
    and python block of `path`, in order."""
    import duckdb

    blocks = fenced_blocks(path)
    namespace: dict = {}
    results = []
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for i, block in enumerate(blocks):
            code = "\n".join(block.lines)
            if block.lang == "sql":
                out = duckdb.sql(code).df().to_string(index=False) + "\n"
            elif block.lang == "python":
                buffer = io.StringIO()
                with contextlib.redirect_stdout(buffer):
                    exec(compile(code, f"{path.name}:{block.line}", "exec"), namespace)
                out = buffer.getvalue()
            else:
                continue
            following = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].lang == "text" else None
            results.append((block, out, following))
    finally:
        os.chdir(cwd)
    return results


def test_querying_queries_print_what_the_page_shows():
    results = run_queries(QUERYING)
    langs = {block.lang for block, _, _ in results}
    assert langs == {"sql", "python"} and len(results) >= 12
    for block, out, expected in results:
        assert expected is not None, f"QUERYING.md:{block.line}: no ```text result after the query"
        shown = "\n".join(line.rstrip() for line in expected.lines)
        printed = "\n".join(line.rstrip() for line in out.rstrip("\n").split("\n"))
        assert printed == shown, f"QUERYING.md:{block.line} printed:\n{printed}\nthe page shows:\n{shown}"


def test_querying_covers_the_questions_users_ask():
    text = QUERYING.read_text()
    for heading in ("## Loss and loss-scale curve", "## Skipped steps", "## First non-finite rows",
                    "## Per-layer headroom", "## A bundle's tensors in numpy"):
        assert heading in text


PLAYBOOK_EXAMPLES = console_examples(PLAYBOOK)


def test_playbook_has_a_command_for_every_step():
    text = PLAYBOOK.read_text()
    steps = re.findall(r"^## (\d+)\. ", text, re.M)
    assert steps == [str(i) for i in range(10)]
    for number, body in re.findall(r"^## (\d+)\. .*?\n(.*?)(?=^## |\Z)", text, re.M | re.S):
        assert "$ amp-postmortem " in body, f"PLAYBOOK step {number} has no example command"
    assert all("no-test" not in e.flags for e in PLAYBOOK_EXAMPLES)


@pytest.mark.parametrize("example", PLAYBOOK_EXAMPLES, ids=lambda e: e.id)
def test_playbook_command_runs_and_prints_what_the_page_shows(example):
    check_example(example)


WALKTHROUGH_EXAMPLES = console_examples(WALKTHROUGH)


def test_walkthrough_is_a_worked_post_mortem():
    commands = {e.argv[0] for e in WALKTHROUGH_EXAMPLES}
    assert {"summary", "nans", "scale", "replay", "fix"} <= commands
    assert all(e.argv[1].startswith("sample_runs/") for e in WALKTHROUGH_EXAMPLES)


@pytest.mark.parametrize("example", [e for e in WALKTHROUGH_EXAMPLES if "no-test" not in e.flags],
                         ids=lambda e: e.id)
def test_walkthrough_example_prints_what_the_page_shows(example):
    check_example(example)


def test_every_command_and_option_is_in_the_reference():
    from amp_postmortem.cli import main

    reference = COMMANDS.read_text()
    for name, command in main.commands.items():
        heading = f"\n## `amp-postmortem {name} "
        assert heading in reference, f"docs/COMMANDS.md lacks {name}"
        text = reference[reference.index(heading) + 1:]
        nxt = text.find("\n## ", 1)
        text = text if nxt < 0 else text[:nxt]
        options = [o for p in command.params for o in p.opts if o.startswith("--") and o != "--help"]
        missing = [o for o in options if f"`{o}" not in text]
        assert not missing, f"docs/COMMANDS.md's {name} lacks {missing}"


def test_recorder_snippets_run(tmp_path, monkeypatch):
    """The snippets of RECORDER.md "Attach the recorder", in order, on the
    tiny GPT of the sample runs on the CPU, then the runs they wrote are
    read back."""
    from amp_postmortem.reading.bundle import list_bundles
    from amp_postmortem.reading.loader import load_run
    from recorders.fp32 import is_kept_fp32

    snippets = section_snippets(RECORDER, "## Attach the recorder to your training loop")
    assert len(snippets) >= 5
    monkeypatch.chdir(tmp_path)
    namespace = run_recorder_snippets(RECORDER, snippets)

    exp1 = load_run("runs/exp1")
    assert len(exp1.steps) == 8 and exp1.steps["loss_scale"].notna().all()
    accum = load_run("runs/accum")
    assert len(accum.steps) == 2 and (accum.steps["micro_batches"] == 4).all()
    bf16 = load_run("runs/bf16")
    assert len(bf16.steps) == 8 and bf16.steps["loss_scale"].isna().all()
    saved = {step for step, _, _ in list_bundles("runs/bundles")}
    assert {1, 2} <= saved
    assert is_kept_fp32(namespace["model"].blocks[1].attn)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_reach_a_file_and_a_heading():
    pages = [README, *sorted(DOCS.glob("*.md"))]
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            assert where.exists(), f"{page.relative_to(REPO)} links to {target}: no such file"
            if anchor:
                assert anchor in anchors(where), f"{page.relative_to(REPO)} links to {target}: no such heading"


def test_the_guides_keep_the_sections_that_moved_out_of_the_readme():
    """What moved out of the README is in the guides, under the same headings
    (other pages link to them, and the tests find their snippets by them)."""
    for path, headings in (
            (RECORDER, ("## Attach the recorder to your training loop", "### Inside a module: the op probe",
                        "### Distributed, sharded and compiled jobs", "### Replay bundles",
                        "### In-job action: `on_event`", "## Attach to Keras or Flax",
                        "## Attach to Trainer, Accelerate or Lightning", "## Record a script without editing it",
                        "## Watch a running job", "## Python API", "## Object stores and clusters")),
            (WALKTHROUGH, ("# A worked post-mortem: `attention_overflow`", "## What it does not do yet")),
            (COMMANDS, ("# Command reference",))):
        text = path.read_text()
        missing = [h for h in headings if not re.search(rf"^{re.escape(h)}$", text, re.M)]
        assert not missing, f"{path.name} lacks {missing}"


def _code_modules() -> set[str]:
    found = set()
    for package in ("amp_postmortem", "recorders"):
        for path in (REPO / package).rglob("*.py"):
            if path.name != "__init__.py" or path.parent.name != package:
                found.add(path.relative_to(REPO).as_posix())
    return found


def test_architecture_names_every_module_and_only_real_ones():
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`((?:amp_postmortem|recorders)/[\w/]+\.py)`", text))
    gone = sorted(p for p in named if not (REPO / p).exists())
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"
    missing = sorted(_code_modules() - named)
    assert not missing, f"docs/ARCHITECTURE.md does not say what these modules own: {missing}"
