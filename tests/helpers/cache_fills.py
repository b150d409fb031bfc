"""What a test hands ``ShardCache.fill``: the entry of some bytes, and a download that writes them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from streamload.manifest import FileEntry


def file_entry(name: str, data: bytes) -> FileEntry:
    """The manifest entry of a file ``name`` holding ``data`` (its SHA-256)."""
    return FileEntry(name, len(data), hashlib.sha256(data).hexdigest(), algorithm="sha256")


def write_download(data: bytes) -> Callable[[str, Callable[[], bool]], None]:
    """A download callback that writes ``data`` into the part file it is given."""

    def download(part: str, cancelled: Callable[[], bool]) -> None:
        with open(part, "r+b") as f:
            f.write(data)

    return download
