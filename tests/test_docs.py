"""docs/ stays true: the DuckDB and pandas queries of QUERYING.md run on the
sample runs and print the results the page shows; every PLAYBOOK.md command
runs and prints what the page shows; ARCHITECTURE.md names every module of
the code and no module that is gone.

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

from test_readme import REPO, check_example, console_examples, fenced_blocks

DOCS = REPO / "docs"
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
