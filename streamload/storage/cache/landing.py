"""A download in progress, seen from the other processes of the machine (``landing/``).

The process that holds ``downloads/<name>`` writes, as the bytes land in its part file,
which byte ranges are written to ``landing/<name>`` (JSON, replaced atomically). A process
waiting for the same file reads it and serves those ranges from the part file before the
file is complete. The record is only a hint: it takes no lock, and a record that cannot be
read (or names a file outside ``tmp/``) reads as no progress shown.
"""

from __future__ import annotations

import json
import os
import secrets

from ..._errors import CacheError
from .flocks import close_fd, open_fd
from .layout import CacheDir, unlink

__all__ = ["Landings"]


class Landings:
    """The progress records in ``landing/`` of one cache directory.

    Args:
        folder: The cache directory.
    """

    def __init__(self, folder: CacheDir) -> None:
        self.folder = folder

    def publish(self, name: str, part: str, attempt: int, landed: list[tuple[int, int]]) -> None:
        """Say which byte ranges of the download of ``name`` into ``part`` have been written (atomically)."""
        record = {"part": os.path.basename(part), "attempt": attempt, "landed": landed}
        final = self.folder.landing_path(name)
        # A leading dot: no plain name (no shard's record) can be this name.
        tmp = os.path.join(os.path.dirname(final), f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = self.folder.create(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, json.dumps(record).encode())
            finally:
                close_fd(fd)
            os.replace(tmp, final)
        except OSError:
            unlink(tmp)  # progress not shown: the others wait for the whole file, as before

    def clear(self, name: str) -> None:
        """The download of ``name`` ended (done or failed): its progress is no longer shown."""
        unlink(self.folder.landing_path(name))

    def read(self, name: str) -> tuple[str, int, list[tuple[int, int]]] | None:
        """``(part path, attempt, landed ranges)`` of another process's download of ``name``, if it shows one.

        The part path is always inside this cache's ``tmp/`` (a name that is not a part
        file of ``name`` is ignored).
        """
        try:
            fd = open_fd(self.folder.landing_path(name), os.O_RDONLY)
        except (FileNotFoundError, CacheError):
            return None
        try:
            raw = os.read(fd, 1 << 16)
        finally:
            close_fd(fd)
        try:
            record = json.loads(raw)
            part, attempt = str(record["part"]), int(record["attempt"])
            landed = [(int(a), int(b)) for a, b in record["landed"]]
        except (ValueError, KeyError, TypeError):
            return None
        if "/" in part or not part.startswith(f"{name}.") or not part.endswith(".part"):
            return None
        return os.path.join(self.folder.root, "tmp", part), attempt, landed
