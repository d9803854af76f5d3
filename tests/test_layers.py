"""runner's import graph: arrows only point down (docs/design.md: entry -> engine -> parts -> leaves).

Every ``import`` of a runner module counts, including those inside function bodies (the ones that hid
cycles before: prepare <-> distributed, ablation <-> report), read from the source with ``ast`` so nothing
is imported here. Subpackages (``runner.data``, ``runner.tune``, ...) are walked too: a module is named by
its dotted path, a package by its ``__init__``, and a relative import is resolved against its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from runner import PACKAGE_DIR

#: Modules that must import no other runner module (only torch and the standard library, or nothing).
LEAVES = {"runner.errors", "runner.hardware"}
#: The package's size rule (docs/design.md): a module past this many lines is split by concern.
MAX_MODULE_LINES = 520


def runner_modules() -> dict[str, Path]:
    """Every module of the runner package, subpackages included, by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _resolve(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module an ``ImportFrom`` names (``from . import x`` inside ``runner.data`` -> ``runner.data``)."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def runner_imports() -> dict[str, set[str]]:
    """For every module of the runner package, the runner modules it imports anywhere in its source.

    ``import runner.a.b`` and ``from runner.a import b`` both count as importing ``runner.a.b`` (and the
    packages on the way, whose ``__init__`` runs first)."""
    modules = runner_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node, name, path)
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
        with_parents = {".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 2)}
        graph[name] = {m for m in found | with_parents if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def test_every_module_is_found_subpackages_included():
    modules = runner_modules()
    assert {"runner", "runner.train", "runner.hardware"} <= set(modules)
    packages = {p.parent for p in PACKAGE_DIR.rglob("__init__.py")} - {PACKAGE_DIR}
    for package in packages:
        dotted = ".".join(package.relative_to(PACKAGE_DIR.parent).parts)
        assert dotted in modules and any(m.startswith(dotted + ".") for m in modules), dotted


def test_relative_imports_resolve_to_their_package(tmp_path):
    tree = ast.parse("from . import loading\nfrom .images import IMAGE_DATASETS\nfrom .. import config\n")
    init, images = Path("runner/data/__init__.py"), Path("runner/data/images.py")
    first, second, third = tree.body
    assert _resolve(first, "runner.data", init) == "runner.data"
    assert _resolve(second, "runner.data.images", images) == "runner.data.images"
    assert _resolve(third, "runner.data", init) == "runner"


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


def _imports_within(graph: dict[str, set[str]], prefix: str) -> set[str]:
    """What the modules named ``prefix`` or under it import."""
    return set().union(*(deps for name, deps in graph.items() if name == prefix or name.startswith(prefix + ".")))


def test_the_process_layer_knows_nothing_of_the_wrappers_and_prepare():
    graph = runner_imports()
    assert "runner.parallel" not in graph["runner.distributed"] and "runner.prepare" not in graph["runner.distributed"]
    assert "runner.prepare" not in graph["runner.parallel"]


def test_the_engine_never_imports_the_tools_built_on_it():
    """The ablation launcher, tuners, doctor and reports call the engine; the engine never calls them, and the
    report (which the ablation launcher uses to decide its rounds) never imports the launcher."""
    graph = runner_imports()
    tools = {m for m in graph for t in ("runner.ablation", "runner.tune", "runner.doctor", "runner.report")
             if m == t or m.startswith(t + ".")}
    engine = {"runner.train", "runner.data", "runner.task", "runner.prepare", "runner.measure", "runner.track"}
    for module in engine & set(graph):
        assert not (_imports_within(graph, module) & tools), (module, _imports_within(graph, module) & tools)
    assert "runner.ablation" not in _imports_within(graph, "runner.report")


def test_no_module_is_too_long_to_read():
    long = {name: n for name, path in runner_modules().items() if (n := len(path.read_text().splitlines()))
            > MAX_MODULE_LINES}
    assert not long, f"split by concern (docs/design.md): {long}"
