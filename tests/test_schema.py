"""docs/FORMAT.md and recorders/format/schema.py describe the same format."""
import re
from pathlib import Path

import pytest

from recorders.format import schema

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def documented_tables() -> dict[str, list[tuple[str, str, str]]]:
    """Map 'Table: NAME' headings to the (column, type, unit) rows of the
    first `| column | Arrow type | ...` table that follows."""
    tables: dict[str, list] = {}
    current = None
    in_table = False
    for line in FORMAT_MD.read_text().splitlines():
        m = re.match(r"#+\s+Table:\s+(.+?)\s*$", line)
        if m:
            current, in_table = m.group(1), False
            tables[current] = []
            continue
        if current is None:
            continue
        if line.startswith("| column |"):
            in_table = True
            continue
        if in_table and line.startswith("| ---"):
            continue
        if in_table and line.startswith("|"):
            cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            tables[current].append((cells[0], cells[1], cells[2]))
        elif in_table:
            in_table, current = False, None
    return tables


@pytest.mark.parametrize("table", sorted(schema.TABLES))
def test_format_md_lists_exactly_the_schema_columns(table):
    documented = documented_tables()
    assert table in documented, f"docs/FORMAT.md has no 'Table: {table}' section"
    expected = [(c.name, str(c.type), c.unit) for c in schema.TABLES[table]]
    assert documented[table] == expected


def test_format_md_states_the_schema_version():
    assert f"version {schema.SCHEMA_VERSION}" in FORMAT_MD.read_text().splitlines()[0]


def test_arrow_schemas_match_column_definitions():
    assert schema.STEP_SCHEMA.names == [c.name for c in schema.STEP_COLUMNS]
    assert schema.TENSOR_SCHEMA.names == [c.name for c in schema.TENSOR_COLUMNS]
    for col in schema.CHEAP_STATS + schema.FULL_STATS:
        assert col in schema.TENSOR_SCHEMA.names


def test_format_md_states_the_bundle_version_and_every_placement_kind():
    text = FORMAT_MD.read_text()
    assert f"(`amp-postmortem-bundle` `{schema.BUNDLE_SCHEMA_VERSION}`)" in text
    assert f"`amp-postmortem-bundle`, `MAJOR.MINOR` (`{schema.BUNDLE_SCHEMA_VERSION}`)" in text
    section = text.split("### Sharded jobs", 1)[1].split("###", 1)[0]
    for kind in schema.PLACEMENT_KINDS:
        assert f"`{kind}`" in section
