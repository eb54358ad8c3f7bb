"""Every import of a package's source files, read from their syntax trees
(lazy ones inside functions included): what the layering and import-cycle
tests of `amp_postmortem` (tests/test_api.py) and `recorders`
(tests/test_api.py, tests/test_core_imports.py) check."""
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


def module_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    """{module: {module of the same package it imports: the line}} for every
    source file of the package at `package_dir`, every import counted (lazy
    ones too). An import names the longest module it reaches (`from .pkg
    import name` the package's `__init__`, `from . import mod` the module);
    the parent packages an import runs on the way are not counted."""
    name = package_dir.name
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (name,) + path.relative_to(package_dir).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for line, imported, _ in module_imports(path, package_dir):
            if imported != name and not imported.startswith(name + "."):
                continue
            while imported not in files:
                imported = imported.rsplit(".", 1)[0]
            if imported != module:
                edges.setdefault(imported, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The modules of each import cycle (a strongly connected component of
    more than one module), each sorted; Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles
