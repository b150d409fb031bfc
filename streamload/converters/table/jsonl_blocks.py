"""JSONL tables: one JSON object a line, blocks cut at line ends, values as Python lists."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from streamload._errors import SourceError

from ..source import printable
from .blocks import TextBlocks

__all__ = ["JsonlBlocks"]


class JsonlBlocks(TextBlocks):
    """Reads a JSONL table; its columns are the keys of its first object."""

    kind = "jsonl"
    extensions = (".jsonl", ".ndjson")

    def read_columns(self) -> dict[str, Any]:
        """The keys of the first object, of no known type."""
        import pyarrow as pa

        with self.open() as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise SourceError(f"{self.url}: row 0 is not a JSON object")
                    return {str(k): pa.null() for k in obj}
        return {}

    def parse(self, data: bytes, columns: Sequence[str], offset: int, first_row: int) -> dict[str, Any]:
        """Parse a block's objects, naming the first broken row."""
        lines = [line for line in data.split(b"\n") if line.strip()]
        try:  # one call for the block; row by row only to name a broken row
            objs = json.loads(b"[" + b",".join(lines) + b"]") if lines else []
            if len(objs) != len(lines):
                raise ValueError("a line holds more than one value")
        except (ValueError, RecursionError):
            objs = []
            for i, line in enumerate(lines):
                try:
                    objs.append(json.loads(line))
                except ValueError as exc:
                    row = first_row + i
                    raise SourceError(f"{self.url}: row {row} is not valid JSON: {printable(str(exc))}") from exc
        block: dict[str, list[Any]] = {c: [] for c in columns}
        for i, obj in enumerate(objs):
            if not isinstance(obj, dict):
                raise SourceError(f"{self.url}: row {first_row + i} is not a JSON object")
            for c in columns:
                block[c].append(obj.get(c))
        return block
