"""Every import of a package's source files, read from their syntax trees
(lazy ones inside functions included): what the layering tests of
`amp_postmortem` (tests/test_api.py) and `recorders` (tests/test_api.py,
tests/test_core_imports.py) check."""
from __future__ import annotations

import ast
import typing
from pathlib import Path


class Import(typing.NamedTuple):
    line: int
    module: str  # absolute: relative imports resolved against the file's package
    lazy: bool   # inside a function: runs when the function is called


def module_imports(path: Path, package_dir: Path):
    """The `Import`s of the file at `path`, a module of the package at
    `package_dir`. `from . import x` yields the package's `x` (the name may
    be a module); `from pkg import name` yields `pkg`."""
    parts = (package_dir.name,) + path.relative_to(package_dir).with_suffix("").parts
    package = parts[:-1]  # the package the file is in (for __init__.py: its own)
    tree = ast.parse(path.read_text())
    lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[:len(package) - node.level + 1])
            if node.module:
                yield Import(node.lineno, ".".join(base + [node.module]), lazy)
            else:
                yield from (Import(node.lineno, ".".join(base + [a.name]), lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield Import(node.lineno, node.module, lazy)
        elif isinstance(node, ast.Import):
            yield from (Import(node.lineno, a.name, lazy) for a in node.names)
