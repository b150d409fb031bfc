"""A griffe extension for the API page: find ``streamload.converters`` where Python finds it.

The package is installed as ``streamload.converters`` from a directory that may lie outside
``streamload/`` (``[tool.setuptools] package-dir`` in ``pyproject.toml``). griffe reads
packages from disk and looks for submodules only inside the package's own directory, so
it would not see that one. This extension asks Python's import system where
``streamload.converters`` lives and reads that directory as the submodule. When the
submodule is found inside ``streamload/`` it does nothing.

Used by ``mkdocs.yml`` (``plugins: mkdocstrings: handlers: python: options: extensions``);
excluded from the site itself.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import griffe

PACKAGE, SUBPACKAGE = "streamload", "converters"


class SubpackageElsewhere(griffe.Extension):
    """Attach ``streamload.converters`` to ``streamload`` when it is not in ``streamload/``."""

    def on_module_members(self, *, node: Any, mod: griffe.Module, agent: Any, **kwargs: Any) -> None:
        """After ``streamload/__init__.py`` is read, read the converters package as its member."""
        if mod.path != PACKAGE or SUBPACKAGE in mod.members:
            return
        spec = importlib.util.find_spec(f"{PACKAGE}.{SUBPACKAGE}")
        if spec is None or spec.origin is None:
            return
        root = Path(spec.origin).parent
        if mod.filepath is not None and root.parent == Path(str(mod.filepath)).parent:
            return  # inside streamload/: griffe finds it itself
        options = {
            "extensions": agent.extensions,
            "docstring_parser": agent.docstring_parser,
            "docstring_options": agent.docstring_options,
            "lines_collection": agent.lines_collection,
            "modules_collection": agent.modules_collection,
        }
        init = root / "__init__.py"
        package = griffe.visit(SUBPACKAGE, init, init.read_text(encoding="utf-8"), parent=mod, **options)
        mod.set_member(SUBPACKAGE, package)
        for path in sorted(root.glob("*.py")):
            if path.name != "__init__.py":
                module = griffe.visit(path.stem, path, path.read_text(encoding="utf-8"), parent=package, **options)
                package.set_member(path.stem, module)


_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|py:\w+):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Show the docstrings' Sphinx cross-reference roles (``:class:`~a.B```) as code (`` `B` ``).

    The docstrings are read by Python tooling that understands the roles; the Markdown
    site would otherwise show them raw. A ``~`` keeps only the last dotted name, as Sphinx does.
    """

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the roles of every object's docstring."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)


def _as_code(match: re.Match[str]) -> str:
    target = match.group(1)
    whole = match.group(0)
    return f"`{target.rsplit('.', 1)[-1] if '`~' in whole else target}`"
