"""The processes reading through a cache, registered in ``readers/``.

One exclusively flocked file per process, so a crash unregisters it (see "Admission" in
:mod:`streamload.storage.cache`).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time

from .flocks import HeldFd, close_fd, open_fd, try_lock
from .layout import CacheDir, unlink

__all__ = ["Readers", "Registration"]

#: A registration being created (``readers/.<name>``) left by a crash is deleted after this long.
STALE_NEW_REGISTRATION = 60.0


class Registration(HeldFd):
    """A process's registration as a reader of a cache (see :meth:`Readers.register`)."""

    def __init__(self, fd: int, path: str) -> None:
        super().__init__(fd)
        self.path = path

    def close(self) -> None:
        """Unregister: delete the file, then drop its lock (in a forked child: nothing, the parent's)."""
        if self.open_here:
            unlink(self.path)
        self.release()


class Readers:
    """The registrations in ``readers/`` of one cache directory.

    Args:
        folder: The cache directory.
    """

    def __init__(self, folder: CacheDir) -> None:
        self.folder = folder

    def register(self) -> Registration:
        """Register this process as a reader of the cache until the registration is closed.

        The file appears in ``readers/`` already locked (it is locked under a dot-name,
        then renamed), so a live registration is never taken for a dead one.
        """
        readers = os.path.join(self.folder.root, "readers")
        name = f"{os.getpid()}.{secrets.token_hex(6)}"
        new = os.path.join(readers, f".{name}")
        fd = self.folder.create(new, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
            path = os.path.join(readers, name)
            os.rename(new, path)
        except BaseException:
            unlink(new)
            close_fd(fd)
            raise
        return Registration(fd, path)

    def count(self) -> int:
        """Count the live registrations; delete those of dead processes."""
        count = 0
        for item in self.folder.scan("readers"):
            if item.name.startswith("."):
                _forget_stale_new(item.path)
                continue
            try:
                fd = open_fd(item.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                # A shared probe: two processes probing a dead registration both see it dead.
                if try_lock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB):
                    unlink(item.path)  # its process died (its lock with it)
                else:
                    count += 1
            finally:
                close_fd(fd)
        return count


def _forget_stale_new(path: str) -> None:
    try:
        if time.time() - os.stat(path).st_mtime > STALE_NEW_REGISTRATION:
            unlink(path)  # a crash between creating and renaming a registration
    except FileNotFoundError:
        pass
