"""The table kinds: which block reader reads a table, by its file extension.

Adding a kind is a module with a :class:`~.blocks.BlockReader` subclass (its ``kind``,
``extensions``, columns, blocks and digest) and one line in :data:`KINDS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from streamload._errors import ConfigError

from .blocks import BlockReader
from .csv_blocks import CsvBlocks
from .jsonl_blocks import JsonlBlocks
from .parquet_blocks import ParquetBlocks

__all__ = ["KINDS", "TABLE_EXTENSIONS", "is_table", "open_reader"]

#: The table kinds, one block reader each.
KINDS: tuple[type[BlockReader], ...] = (ParquetBlocks, CsvBlocks, JsonlBlocks)
#: Table formats by file extension.
TABLE_EXTENSIONS = {ext: k.kind for k in KINDS for ext in k.extensions}


def is_table(src: str) -> bool:
    """True if ``src`` names a listing table by its extension."""
    return os.path.splitext(src.rstrip("/"))[1].lower() in TABLE_EXTENSIONS


def open_reader(url: str, open_table: Callable[[], Any], block_bytes: int, batch_rows: int) -> BlockReader:
    """The block reader of the table at ``url``, chosen by its extension.

    Args:
        url: The table.
        open_table: Opens the table for binary reading.
        block_bytes: Bytes per block of a text table.
        batch_rows: Rows per batch of a Parquet row group.

    Raises:
        ConfigError: If the extension is no table kind's.
    """
    ext = os.path.splitext(url)[1].lower()
    for kind in KINDS:
        if ext in kind.extensions:
            return kind(url, open_table, block_bytes, batch_rows)
    raise ConfigError(f"{url}: not a listing table (expected {', '.join(sorted(TABLE_EXTENSIONS))})")
