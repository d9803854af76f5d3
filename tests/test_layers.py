"""runner's import graph: the folders are the layers (docs/design.md: entry -> tools -> the comparison service ->
the engine -> parts -> leaves), and arrows only point down.

Every ``import`` of a runner module counts, including those inside function bodies (the ones that hid
cycles before: prepare <-> distributed, ablation <-> report), read from the source with ``ast`` so nothing
is imported here. Subpackages (``runner.data``, ``runner.tune``, ...) are walked too: a module is named by
its dotted path, a package by its ``__init__``, and a relative import is resolved against its package. Cycles
are looked for twice: between modules, and between the package's top-level units (a folder of runner/ counted as
one), where a cycle through three modules of three packages (report -> interleave -> ablation -> report, before
runner/compare/) shows.
"""

from __future__ import annotations

import ast
from pathlib import Path

from runner import PACKAGE_DIR

#: The layers, top to bottom, each with its top-level units: a folder of runner/, or a module at its top. A unit
#: imports units of its own layer or of a lower one only; a new folder or top-level module is placed here.
LAYERS = {
    "entry": {"__main__", "torchrun"},  # the command lines, which may import anything
    "tools": {"sweeps", "tune", "report", "doctor", "evaluate", "export"},  # what a user runs on the engine
    "service": {"compare"},  # the comparison service the tools share
    "engine": {"engine"},
    "parts": {"task", "data", "models", "techniques", "checkpoint", "measure", "track", "distributed"},
    "leaves": {"config", "errors", "protocols", "objective", "trust", "launch", "files"},
}
#: Modules that must import no other runner module (only torch and the standard library, or nothing); the contracts
#: (``protocols``: Task, Tracker) too, so that every layer may name them without a cycle.
STANDALONE = {"runner.errors", "runner.measure.hardware", "runner.protocols"}
#: The package's size rules (docs/design.md), in ruff format's layout (CI checks it): a module past this many lines
#: is split by concern, a function past this many lines by step. (520 and 80 before that layout, which packed
#: arguments and conditions: the same code is about a quarter longer in it.)
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 100


def runner_modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the runner package, subpackages included, by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _resolve(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module an ``ImportFrom`` names (``from . import x`` inside ``runner.data`` -> ``runner.data``)."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def runner_imports(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """For every module of the runner package, the runner modules it imports anywhere in its source.

    ``import runner.a.b`` and ``from runner.a import b`` both count as importing ``runner.a.b`` (and the
    packages on the way, whose ``__init__`` runs first)."""
    modules = runner_modules(package_dir)
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
    assert {"runner", "runner.engine.train", "runner.measure.hardware"} <= set(modules)
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (node -> the nodes it imports) as ``[a, b, ..., a]``, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for dep in sorted(graph.get(name, ())):
            if cycle := visit(dep, path + [name]):
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        if cycle := visit(name, []):
            return cycle
    return None


def unit(module: str) -> str:
    """The top-level unit a module belongs to: ``runner.compare.stats`` -> ``runner.compare``, ``runner.engine.train``
    -> itself; the package ``runner`` (its ``__init__``) is its own unit."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` collapsed to top-level units; ``runner`` itself (the package's ``__init__``: constants and
    resolvers that every import of a submodule runs first, whose own runner imports happen at call time) is left
    out."""
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        if name == "runner":
            continue
        out.setdefault(unit(name), set()).update(unit(d) for d in deps if d != "runner" and unit(d) != unit(name))
    return out


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(runner_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_packages_import_each_other_without_a_cycle():
    graph = package_graph(runner_imports())
    assert {"runner.compare", "runner.report", "runner.tune", "runner.sweeps"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "a cycle between packages: " + " -> ".join(cycle or [])


def test_a_cycle_between_packages_is_found_where_the_modules_have_none(tmp_path):
    """The cycle of 54356f9: report/paired.py imported interleave/record.py, interleave/coordinator.py the
    ablation, and the ablation the report: no module imports one that imports it back."""
    root = tmp_path / "runner"
    files = {
        "__init__.py": "",
        "report/__init__.py": "",
        "report/paired.py": "from runner.interleave import record\n",
        "interleave/__init__.py": "",
        "interleave/record.py": "",
        "interleave/coordinator.py": "from runner import ablation\n",
        "ablation.py": "import runner.report.paired\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = runner_imports(root)
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == [
        "runner.ablation",
        "runner.report",
        "runner.interleave",
        "runner.ablation",
    ]


def test_the_standalone_modules_import_no_runner_module():
    graph = runner_imports()
    assert {name: graph[name] for name in STANDALONE} == {name: set() for name in STANDALONE}


def test_the_process_layer_knows_nothing_of_the_wrappers_and_prepare():
    graph = runner_imports()
    assert not {"runner.techniques.parallel", "runner.techniques.prepare"} & graph["runner.distributed"]
    assert "runner.techniques.prepare" not in graph["runner.techniques.parallel"]


def test_every_unit_is_in_one_layer():
    units = {unit(name).removeprefix("runner.") for name in runner_modules() if name != "runner"}
    placed = [u for layer in LAYERS.values() for u in layer]
    assert len(placed) == len(set(placed)), "a unit in two layers"
    assert units == set(placed), (units - set(placed), set(placed) - units)  # a new unit is placed, a gone one dropped


def test_imports_only_point_down_the_layers():
    """The tools call the comparison service and the engine; the service calls the engine; the engine calls
    neither; the parts never call the engine, and the leaves call no part. The report reads what the service
    measured and never imports a tool that writes it."""
    rank = {f"runner.{u}": i for i, layer in enumerate(LAYERS.values()) for u in layer}
    graph = package_graph(runner_imports())
    up = {(name, dep) for name, deps in graph.items() for dep in deps if rank[dep] < rank[name]}
    assert not up, f"imports that point up the layers: {sorted(up)}"
    tools = {f"runner.{u}" for u in LAYERS["tools"]}
    assert not graph["runner.report"] & tools, graph["runner.report"] & tools


def test_no_function_is_too_long_to_read():
    """A function past ``MAX_FUNCTION_LINES`` (its definition to its last line, docstring included) is split by
    step, so that each reads in one screen."""
    long = {}
    for name, path in runner_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = lines
    assert not long, f"split by step: {long}"


def test_no_module_is_too_long_to_read():
    long = {
        name: n
        for name, path in runner_modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split by concern (docs/design.md): {long}"
