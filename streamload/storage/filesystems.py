"""fsspec filesystems, one per process and options, safe across fork (see :mod:`.backends.fsspec`).

Kept for the converters and benchmarks that open a filesystem of their own: each name here
is the backend registry's (:mod:`.backends`).
"""

from __future__ import annotations

from typing import Any

from .backends import backend_class, protocol_of
from .backends.fsspec import detach_finalizers, open_filesystem

__all__ = ["detach_finalizers", "filesystem_class", "open_filesystem", "protocol_of"]


def filesystem_class(url: str) -> Any:
    """Return the fsspec filesystem class for ``url`` (a :class:`~streamload.ConfigError` if it cannot be had)."""
    return backend_class(url).filesystem_class(url)
