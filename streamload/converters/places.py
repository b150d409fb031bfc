"""Where a conversion's data is: destinations checked, places compared however spelled.

Sources use these to refuse a destination that would destroy them or be read back as part
of them (:meth:`~.source.Source.check_destination`); the engine checks that a destination
names a place at all.
"""

from __future__ import annotations

import os
import re

from streamload._errors import ConfigError
from streamload.storage import is_local, local_path_of

__all__ = ["check_destination", "normal_url", "same_place", "within"]


def check_destination(dst: str) -> None:
    """Refuse a destination that names no directory, bucket or path, or is a file.

    Raises:
        ConfigError: Naming ``dst``.
    """
    if not dst:
        raise ConfigError("the destination is an empty string")
    if is_local(dst):
        path = local_path_of(dst)
        if not path:
            raise ConfigError(f"the destination {dst!r} names no directory")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"the destination {dst} exists and is not a directory")
    elif not normal_url(dst).partition("://")[2]:
        raise ConfigError(f"the destination {dst!r} names no bucket or path")


def same_place(a: str, b: str) -> bool:
    """True if ``a`` and ``b`` name the same directory or URL prefix, however spelled."""
    if is_local(a) and is_local(b):
        pa, pb = local_path_of(a), local_path_of(b)
        try:
            return os.path.samefile(pa, pb)
        except OSError:
            return os.path.realpath(pa) == os.path.realpath(pb)
    if is_local(a) or is_local(b):
        return False
    return normal_url(a) == normal_url(b)


PROTOCOL_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs"}


def normal_url(url: str) -> str:
    """``url`` with its scheme lower case and aliases merged (``s3a`` is ``s3``), runs of ``/`` folded, no end ``/``."""
    protocol, _, rest = url.partition("://")
    protocol = protocol.lower()
    return f"{PROTOCOL_ALIASES.get(protocol, protocol)}://{re.sub('/+', '/', rest).strip('/')}"


def within(path: str, root: str) -> bool:
    """True if ``path`` is ``root`` or below it, through any symlink or bind mount of either."""
    try:
        top = os.stat(root)
    except OSError:
        return False
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
            if (st.st_dev, st.st_ino) == (top.st_dev, top.st_ino):
                return True
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent
