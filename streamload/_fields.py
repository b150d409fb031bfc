"""A dataclass made from another object's attributes of the same names: the one place that copies them."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fields_from"]

T = TypeVar("T")


def fields_from(cls: type[T], source: object, **overrides: Any) -> T:
    """Return ``cls(...)``, each field taken from ``source``'s attribute of its name, then from ``overrides``.

    A field ``source`` has no attribute for keeps its default (an ``argparse.Namespace``
    of a command's options, a saved state holding more than an epoch's split).

    Args:
        cls: A dataclass.
        source: Any object (its attributes are read, never changed).
        overrides: Fields set here instead of from ``source``.
    """
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    values = {name: getattr(source, name) for name in names if name not in overrides and hasattr(source, name)}
    return cls(**values, **overrides)
