"""The engine's layering: no import cycle, short files, no private name imported across modules.

The import graph is read from the source (the AST), not from ``sys.modules``: every ``import``
and ``from ... import`` anywhere in a module counts, at module level or inside a function, since a
function-local import that closes a cycle is still a cycle a reader has to hold in mind. A
package's ``__init__`` re-exporting its own children is not an edge (it is how a package
presents its layers), and ``from engine.pkg import name`` is an edge to the child module that
``engine/pkg/__init__.py`` takes ``name`` from.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
MAX_LINES = 400
# Pure tables may be longer: the formulas and the drill's question banks.
LONG_TABLES = {"engine/drill/numeric.py", "engine/drill/choice.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _reexports(package: str) -> dict[str, str]:
    """Names ``engine/<package>/__init__.py`` imports, mapped to the module they come from."""
    out = {}
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out[alias.asname or alias.name] = child if child in MODULES else node.module
    return out


def _imported(name: str, source: str | None = None) -> set[tuple[str, str]]:
    """(module, imported name or '') for every engine import anywhere in module ``name``."""
    base = name if name in MODULES and _is_package(name) else name.rpartition(".")[0]
    found = set()
    source = MODULES[name].read_text() if source is None else source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "engine"}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                module = ".".join(parts + ([module] if module else []))
            if module.split(".")[0] == "engine":
                found |= {(module, a.name) for a in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        targets = set()
        for module, imported in _imported(name):
            if f"{module}.{imported}" in MODULES:
                targets.add(f"{module}.{imported}")
            elif module in MODULES and _is_package(module) and imported:
                targets.add(_reexports(module).get(imported, module))
            elif module in MODULES:
                targets.add(module)
        if _is_package(name):  # a package presenting its own children is not a dependency
            targets = {t for t in targets if not t.startswith(name + ".")}
        graph[name] = targets - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    """The finder itself must be able to fail: a two-module cycle and a three-module one."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert import_cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_function_local_and_relative_imports():
    source = ("import engine.theory\n"
              "def f():\n    from engine.comm import ops\n"
              "    class C:\n        def g(self):\n            from .ring import step\n")
    assert _imported("engine.comm.p2p", source) == {
        ("engine.theory", ""), ("engine.comm", "ops"), ("engine.comm.ring", "step")}


def test_engine_has_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles in engine/:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_engine_file_is_longer_than_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not {k: v for k, v in long.items() if k not in LONG_TABLES}, long


def test_no_private_name_is_imported_across_modules():
    offenders = sorted(f"{name}: from {module} import {imported}"
                       for name in MODULES for module, imported in _imported(name)
                       if imported.startswith("_") and not imported.startswith("__"))
    assert not offenders, "\n".join(offenders)


# The layers of engine/, bottom first: a module may import its own layer and the layers below,
# never one above. README.md's Layout section draws the same table. A module belongs to the
# layer of the longest prefix that names it; a new module must be placed here.
LAYERS = (
    ("foundations", ("engine.validation", "engine.theory", "engine.model", "engine.topology",
                     "engine.checkpoint", "engine.launch.env", "engine.observe.clock",
                     "engine.observe.memory", "engine.dp.buckets")),
    ("processes", ("engine.launch",)),
    ("communication", ("engine.comm", "engine.observe")),
    ("strategies", ("engine.dp", "engine.compress", "engine.zero", "engine.tp", "engine.pp",
                    "engine.cp", "engine.moe", "engine.checkpoint.trainer",
                    "engine.checkpoint.recut", "engine.ft",
                    "engine.precision", "engine.fsdp", "engine.optim")),
    ("training", ("engine.compose", "engine.train", "engine.__main__")),
    ("labs", ("engine.labs",)),
    ("teaching", ("engine.drill", "engine.viz", "engine.grading")),
)


def layer_of(module: str) -> int | None:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        if module == "engine":
            continue  # the package root re-exports launch for engine.launch(fn, n)
        mine = layer_of(module)
        if mine is None:
            found.append(f"{module} is in no layer: add it to LAYERS (and README's Layout)")
            continue
        found += [f"{module} ({LAYERS[mine][0]}) imports {target} "
                  f"({LAYERS[layer_of(target)][0]}), a layer above it"
                  for target in sorted(targets) if (layer_of(target) or 0) > mine]
    return found


def test_the_layering_check_can_fail():
    graph = {"engine.comm.ring": {"engine.train"}, "engine.newthing": set()}
    assert layering_violations(graph) == [
        "engine.comm.ring (communication) imports engine.train (training), a layer above it",
        "engine.newthing is in no layer: add it to LAYERS (and README's Layout)"]


def test_each_module_imports_only_its_own_layer_and_those_below():
    violations = layering_violations(import_graph())
    assert not violations, "\n".join(violations)
