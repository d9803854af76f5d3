"""runner's import graph: arrows only point down (DESIGN.md: entry -> engine -> parts -> leaves).

Every ``import`` of a runner module counts, including those inside function bodies (the ones that hid
cycles before: prepare <-> distributed, ablation <-> report), read from the source with ``ast`` so nothing
is imported here.
"""

from __future__ import annotations

import ast

from runner import PACKAGE_DIR

#: Modules that must import no other runner module (only torch and the standard library, or nothing).
LEAVES = {"runner.errors", "runner.hardware"}


def runner_imports() -> dict[str, set[str]]:
    """For every module of the runner package, the runner modules it imports anywhere in its source."""
    modules = {f"runner.{p.stem}" if p.stem != "__init__" else "runner": p for p in PACKAGE_DIR.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runner":
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_import_graph_has_no_cycle():
    graph = runner_imports()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_leaves_import_no_runner_module():
    graph = runner_imports()
    assert {leaf: graph[leaf] for leaf in LEAVES} == {leaf: set() for leaf in LEAVES}


def test_the_process_layer_knows_nothing_of_the_wrappers_and_prepare():
    graph = runner_imports()
    assert "runner.parallel" not in graph["runner.distributed"] and "runner.prepare" not in graph["runner.distributed"]
    assert "runner.prepare" not in graph["runner.parallel"]
    assert "runner.ablation" not in graph["runner.report"] | graph["runner.sweep_report"]
