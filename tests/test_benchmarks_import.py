"""Every benchmark module imports, and every name it takes from qtool exists, including the
imports inside functions: a benchmark is run by hand, rarely, so a renamed qtool name would
otherwise break it silently (benchmarks/int4.py imported a class renamed long before)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Peer runners run inside the peers' own virtual environments (their imports are theirs), and
# those environments live under benchmarks/.peers (ignored by git) where peers.py built them.
MODULES = sorted(
    p
    for p in (ROOT / "benchmarks").rglob("*.py")
    if "peer_runners" not in p.parts
    and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
)


def _qtool_imports(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qtool"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("qtool")]
    return found


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_benchmark_imports_and_its_qtool_names_exist(path: Path) -> None:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    importlib.import_module(name)
    for module, imported, line in _qtool_imports(path):
        target = importlib.import_module(module)
        where = f"{path.relative_to(ROOT)}:{line}"
        if imported:
            assert not imported.startswith("_"), f"{where}: private name {module}.{imported}"
            submodule = f"{module}.{imported}"
            exists = hasattr(target, imported) or importlib.util.find_spec(submodule) is not None
            assert exists, f"{where}: {module} has no {imported}"
