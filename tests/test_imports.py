"""The package's import graph, read with ast: no circle among actmap modules, the detectors
import no baseline, and the library never imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "actmap"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the actmap modules it imports anywhere (top level or inside functions)."""

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("actmap")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.startswith("actmap"):
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        deps.add(full if full in files else owner(base))
        graph[module] = deps - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "actmap"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from actmap.c import g\n")
    (pkg / "c.py").write_text("import actmap.sub.b\n")
    graph = import_graph(module_files(pkg))
    assert graph["actmap.sub"] == {"actmap.sub.b"} and graph["actmap.sub.b"] == {"actmap.c"}
    assert cycles(graph) == [["actmap.c", "actmap.sub.b"]]


def test_no_import_circle_among_actmap_modules(graph):
    assert len(graph) > 40  # the whole package was read
    assert cycles(graph) == []


@pytest.mark.parametrize("package", ["actmap.detectors", "actmap.scoring", "actmap.training"])
def test_detectors_import_no_baseline(graph, package):
    offending = {
        module: sorted(d for d in deps if d.startswith("actmap.baselines"))
        for module, deps in graph.items()
        if module == package or module.startswith(package + ".")
    }
    assert {m: d for m, d in offending.items() if d} == {}


def test_the_library_never_imports_the_cli(graph):
    library = {m: d for m, d in graph.items() if not m.startswith("actmap.cli")}
    assert {
        m: sorted(d) for m, d in library.items() if any(x.startswith("actmap.cli") for x in d)
    } == {}


def test_the_recipe_does_not_import_its_users(graph):
    assert not {
        d
        for d in graph["actmap.training.recipe"]
        if d.startswith(("actmap.detectors", "actmap.experiments"))
    }
    assert not {d for d in graph["actmap.scoring.contract"] if d != "actmap"}


def unit(module: str) -> str:
    """The room a module belongs to: its package under actmap (``actmap.store.rows`` ->
    ``actmap.store``), or the module itself when it sits at the top (``actmap.maps``)."""
    return ".".join(module.split(".")[:2])


def two_way_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of rooms that import each other (in any of their modules)."""
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        rooms.setdefault(unit(module), set()).update(unit(d) for d in deps)
    return sorted(
        (a, b) for a in rooms for b in rooms[a] if a < b and a in rooms.get(b, set()) and a != b
    )


def test_two_way_finder_finds_packages_that_import_each_other():
    graph = {
        "actmap.capture.run": {"actmap.store"},
        "actmap.store": {"actmap.maps"},
        "actmap.store.generations": {"actmap.capture.records"},  # store -> capture: a pair
        "actmap.capture.records": set(),
        "actmap.maps": set(),
    }
    assert two_way_pairs(graph) == [("actmap.capture", "actmap.store")]
    del graph["actmap.store.generations"]
    assert two_way_pairs(graph) == []


def test_no_two_packages_import_each_other(graph):
    assert two_way_pairs(graph) == []


def test_the_signals_sit_below_the_detectors_and_the_baselines(graph):
    """RAUQ's and TAD's formulas and the log-prob signals (`actmap.signals`) are read by the
    stacked actmap-plus (`actmap.detectors.stacked`) and by the baselines; they import neither,
    so the detectors need no baseline."""
    signals = {
        m: d for m, d in graph.items() if m == "actmap.signals" or m.startswith("actmap.signals.")
    }
    assert signals, "actmap.signals was not read"
    assert {
        m: sorted(x for x in d if x.startswith(("actmap.detectors", "actmap.baselines")))
        for m, d in signals.items()
        if any(x.startswith(("actmap.detectors", "actmap.baselines")) for x in d)
    } == {}
    assert "actmap.detectors.stacked" in graph
    assert {d for d in graph["actmap.detectors.stacked"] if d.startswith("actmap.signals")} >= {
        "actmap.signals.rauq",
        "actmap.signals.tad",
    }


DETECTOR_CLASSES = ("CorrectnessDetector", "ActMapPlus", "StackedPlus")


def isinstance_checks_on_detectors(root: Path = PACKAGE) -> list[str]:
    """``file:line`` of every ``isinstance(x, <a detector class>)`` outside actmap/detectors/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "detectors"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & set(DETECTOR_CLASSES):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_isinstance_finder_finds_a_check(tmp_path):
    pkg = tmp_path / "actmap"
    (pkg / "detectors").mkdir(parents=True)
    (pkg / "serve.py").write_text("def f(d):\n    return isinstance(d, ActMapPlus | StackedPlus)\n")
    (pkg / "detectors" / "x.py").write_text("def g(d):\n    return isinstance(d, StackedPlus)\n")
    assert isinstance_checks_on_detectors(pkg) == ["serve.py:2"]


def test_no_isinstance_on_a_detector_class_outside_the_detectors():
    """Callers ask a detector what it reads (``requires``, ``capture_needs()``) and score it
    through the one contract; none branches on its class."""
    assert isinstance_checks_on_detectors() == []
