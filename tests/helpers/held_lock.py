"""A conversion source whose ``load`` takes a module lock: a lock another thread of the converting process holds.

Imported by reference in the conversion's worker processes. A worker forked from the
converting process while another of its threads holds :data:`LOCK` starts with a copy
that nobody will release; a worker started fresh imports this module with the lock free.
"""

from __future__ import annotations

import threading
from typing import Any

from streamload._errors import StreamloadError
from streamload.converters.imagefolder import ImageFolderSource
from streamload.converters.source import Item

#: Held by a thread of the test (the converting process) for the whole conversion.
LOCK = threading.Lock()


class HeldLockSource(ImageFolderSource):
    """An image folder whose every load takes :data:`LOCK` (and gives up after 20 s)."""

    def load(self, item: Item) -> dict[str, Any]:
        if not LOCK.acquire(timeout=20):
            raise StreamloadError("the worker started with a lock held by a thread of the converting process")
        try:
            return super().load(item)
        finally:
            LOCK.release()
