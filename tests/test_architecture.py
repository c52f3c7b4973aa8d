"""The layering rules of docs/architecture.md, checked on the source.

Imports are read with `ast` from every module of the package, including those inside functions
and `if TYPE_CHECKING:` blocks: a lazy import still ties two modules together, and a cycle held
apart by one is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qtool"

# Lower layers never import higher ones (docs/architecture.md, "Layers"). Modules at the top of
# the package (errors, io, phases, kernels, distributed) are utilities under all.
LAYERS = [
    # qtool.metrics.signal (numpy only) is the one signal-quality accumulator every layer uses.
    {
        "qtool.errors",
        "qtool.io",
        "qtool.phases",
        "qtool.progress",
        "qtool.kernels",
        "qtool.zip_members",
        "qtool.metrics.signal",
    },
    {"qtool.distributed", "qtool.ort"},
    {"qtool.data", "qtool.model"},
    {"qtool.plan"},
    {"qtool.calibration"},
    {"qtool.runtime"},
    {"qtool.write"},
    {"qtool.algorithms"},
    {"qtool.metrics"},
    {"qtool.report"},
    {"qtool.pipeline"},
    {"qtool.search"},
    {"qtool.qat"},
    {"qtool.config"},
    {"qtool.app"},
    {"qtool.cli"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(imported: str, names: list[str], modules: dict[str, Path]) -> set[str]:
    """The qtool modules an import statement loads: `from qtool.x import y` is module x.y when
    y is a submodule, else x."""
    if not imported.startswith("qtool"):
        return set()
    targets = set()
    for name in names:
        if f"{imported}.{name}" in modules:
            targets.add(f"{imported}.{name}")
        elif imported in modules:
            targets.add(imported)
    if not names and imported in modules:
        targets.add(imported)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported, names, _ in _imports(path):
            edges |= _resolve(imported, names, modules)
        edges.discard(name)
        # a package's __init__ is loaded with any of its modules; ignore that implicit edge
        graph[name] = {e for e in edges if not name.startswith(e + ".")}
    return graph


def _layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: add it to the design first")


def test_every_module_is_in_a_layer() -> None:
    for module in _modules():
        if module != "qtool":
            _layer(module)


def test_no_module_imports_a_higher_layer() -> None:
    wrong = [
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in _graph().items()
        if module != "qtool"
        for target in sorted(targets)
        if target != "qtool" and _layer(target) > _layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_only_orchestrators_read_the_recipe() -> None:
    readers = sorted(
        module
        for module, targets in _graph().items()
        if any(t.startswith("qtool.config") for t in targets)
        and not module.startswith(("qtool.config", "qtool.app", "qtool.cli"))
    )
    assert not readers, f"below the orchestrators, these import qtool.config: {readers}"


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_is_imported_across_modules() -> None:
    modules = _modules()
    wrong = []
    for path in modules.values():
        for imported, names, line in _imports(path):
            if not imported.startswith("qtool"):
                continue
            for name in names:
                if (
                    name.startswith("_")
                    and not name.startswith("__")
                    and f"{imported}.{name}" not in modules
                ):
                    wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {imported}.{name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", ["qtool.cli"])
def test_the_checker_sees_lazy_imports(name: str) -> None:
    """The CLI imports its orchestrators inside each command: they must be edges too, or the
    layer rules above would pass on code that breaks them."""
    assert any(t.startswith("qtool.app") for t in _graph()[name])
