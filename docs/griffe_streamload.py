"""A griffe extension for the API page: show the docstrings' Sphinx roles as code.

Used by ``mkdocs.yml`` (``plugins: mkdocstrings: handlers: python: options: extensions``);
excluded from the site itself.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

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
