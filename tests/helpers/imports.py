"""The package's import graph, read from the source (``ast``, function-level imports included).

Shared by the layout tests and ``benchmarks/walk_read_path.py``: every path under
``streamload/`` is its import name (``streamload/storage/__init__.py`` is ``streamload.storage``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGES = {"streamload": ROOT / "streamload"}

__all__ = ["PACKAGES", "ROOT", "import_graph", "imported_module", "module_imports", "package_modules"]


def package_modules() -> dict[str, Path]:
    """Every module of the package: import name -> file."""
    mods: dict[str, Path] = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            rel = path.relative_to(directory).with_suffix("").parts
            name = ".".join((package, *rel))
            mods[name.removesuffix(".__init__")] = path
    return mods


def imported_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in module ``name`` (at ``path``) imports from, made absolute."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def module_imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Return the modules of the package that ``name`` imports (anywhere in the file).

    A module's own parent packages are not imports of it (``from . import x`` names ``x``).
    """
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = imported_module(name, path, node)
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target in mods and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Return module -> modules it imports, for every module of the package."""
    mods = package_modules()
    return {name: module_imports(name, path, mods) for name, path in mods.items()}
