"""How a table's labels are read: class indices, or class names sorted and numbered, as the scan found them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from streamload._errors import SourceError

from .checks import int_label, unusable

__all__ = ["TableLabels"]


class TableLabels:
    """The label mode and class table of a listing table, settled by its scan.

    Labels are class indices when every one is an integer (of a Hugging Face
    ``ClassLabel``'s names, if the column has them); else every label is a class name
    (sorted, numbered).

    Args:
        named: A ``ClassLabel``'s names: the classes of integer labels (which must index them).

    Attributes:
        as_index: Whether the labels are class indices (else class names).
        classes: The class names, in index order.
        force_names: Read every label as a name (an earlier scan found names).
        seen: The distinct label values of the last scan.
    """

    def __init__(self, named: Sequence[str] | None) -> None:
        self.named = None if named is None else list(named)
        self.as_index = True
        self.classes: list[str] = []
        self.force_names = False
        self.seen: dict[Any, None] = {}
        self._index: dict[str, int] | None = None

    def settle(self) -> bool:
        """Fix the label mode and class table from the labels seen; True if the scan must run again.

        A scan that left negative integers out as bad indices and then found names must
        run again, keeping them as names.
        """
        values = list(self.seen)
        self._index = None
        if not self.force_names and all(int_label(v) is not None for v in values):
            self.as_index = True
            self.classes = list(self.named or ())
            return False
        self.as_index = False
        self.classes = sorted({str(v) for v in values})
        if self.force_names:
            return False
        rescan = any((i := int_label(v)) is not None and i < 0 for v in values)
        self.force_names = True
        return rescan

    def text(self, value: Any, where: str) -> str:
        """The ``cls`` field of a row's label value, through the class table of the scan.

        Raises:
            SourceError: Naming ``where``, if the value is not a class (the table changed).
        """
        if self.as_index:
            index = int_label(value)
            if index is None or index < 0:
                raise SourceError(f"{where}: label {value!r} is not a class index (has the table changed?)")
            if self.named is not None and index >= len(self.named):
                raise SourceError(
                    f"{where}: label {index} is not one of the {len(self.named)} classes of the "
                    f"column's ClassLabel (0..{len(self.named) - 1})"
                )
            return str(index)
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.classes)}
        found = self._index.get(str(value)) if unusable(value) is None else None
        if found is None:
            raise SourceError(f"{where}: label {value!r} is not one of the classes (has the table changed?)")
        return str(found)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index"] = None
        state["seen"] = {}
        return state
