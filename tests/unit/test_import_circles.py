"""No two modules of ``inference`` or ``plan`` import each other, counting what
``test_layering`` leaves out: imports under ``if TYPE_CHECKING:`` (a circle for a reader and a
type checker even when Python never runs it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "torsh_distributed"


def _imports(path: Path, package: str) -> set[str]:
    """Every module name ``path`` imports anywhere (top level, functions, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _pairs(subpackage: str) -> list[tuple[str, str]]:
    root = SRC / PKG / subpackage
    package = f"{PKG}.{subpackage}"
    modules = {
        f"{package}.{p.stem}": p for p in sorted(root.glob("*.py")) if p.name != "__init__.py"
    }
    graph = {name: _imports(path, package) & set(modules) for name, path in modules.items()}
    return [(a, b) for a in graph for b in graph[a] if a < b and a in graph[b]]


@pytest.mark.parametrize("subpackage", ["inference", "plan"])
def test_no_two_modules_import_each_other(subpackage: str):
    assert _pairs(subpackage) == []


def test_the_check_sees_a_type_checking_circle(tmp_path, monkeypatch):
    pkg = tmp_path / PKG / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(f"from {PKG}.demo.b import B\n")
    (pkg / "b.py").write_text(
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PKG}.demo.a import A\n"
    )
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    assert _pairs("demo") == [(f"{PKG}.demo.a", f"{PKG}.demo.b")]
