"""Where a dataset's files are read from: the :class:`Storage` interface and local directories.

Readers ask a storage for three things: a small file's bytes (the manifest), a *local
path* to a file that stays valid until they release it (a shard, a sidecar), and, as a
hint, which files they will need next. Callers tell the storage what each file must be
(a :class:`~streamload._files.FileEntry`: size, digest, algorithm); a storage never reads
a manifest. Local datasets answer with the files themselves; remote ones download into a
bounded, shared cache first (:mod:`streamload.storage.remote`).
"""

from __future__ import annotations

import errno
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterable

from .._errors import CorruptShardError, ManifestNotFoundError, ShardNotFoundError, StorageError, UnsafeShardError
from .._files import FileEntry, check_file_name, is_local, local_path_of

__all__ = ["LocalStorage", "Storage", "is_local", "local_path_of"]


class Storage(ABC):
    """Read access to one dataset's directory or URL prefix."""

    url: str
    #: The most shards a reader should name to :meth:`prefetch` ahead of the one it reads
    #: (0: none); :meth:`ahead_depth` says how many now.
    read_ahead: int = 0
    #: Bytes the local cache may hold (``None``: unbounded, or no cache: read in place).
    limit: int | None = None

    @abstractmethod
    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return the whole content of the small file ``name`` (the manifest).

        Args:
            name: Plain file name inside the dataset.
            max_bytes: Refuse a file larger than this (:class:`~streamload.StorageError`)
                without reading more than it.
            not_found: Message of the :class:`~streamload.ManifestNotFoundError` raised if
                the file does not exist (``None``: a :class:`~streamload.ShardNotFoundError`).
        """

    @abstractmethod
    def acquire(self, entry: FileEntry) -> str:
        """Return a local path holding ``entry``'s bytes, valid until :meth:`release`."""

    def release(self, entry: FileEntry) -> None:  # noqa: B027 - optional hook
        """Tell the storage the local copy of ``entry`` is no longer in use."""

    def prefetch(self, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:  # noqa: B027
        """Start fetching ``entries`` (the next files, in order of use) in the background.

        Each call replaces the read-ahead window; an empty iterable cancels read-ahead.
        ``together``: names of those files the reader needs now, with the one it opens (a
        shuffled reader's first batches draw on all of them): fetched at once, never held
        back for the reader's first item.
        """

    def ahead_depth(self) -> int:
        """Return how many shards a reader should name to :meth:`prefetch` now (0: none).

        A storage that measures its downloads adapts it (see
        :class:`~streamload.storage.remote.RemoteStorage`); by default it is :attr:`read_ahead`.
        """
        return self.read_ahead

    def check_capacity(self, largest: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~streamload.CacheError` if files of ``largest`` bytes cannot be served."""

    def max_open(self, largest: int) -> int | None:
        """Return how many shards of ``largest`` bytes a reader may keep acquired at once.

        ``None`` means no bound. A bounded cache needs readers to release shards to make room.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release resources."""

    def describe(self) -> str:
        """Return a one-line description for messages."""
        return self.url


class LocalStorage(Storage):
    """A dataset in a local directory: files are used in place.

    A file must be a regular file inside the dataset directory: a symbolic link is followed
    only when its target stays inside the directory, and a FIFO, device or socket is
    refused before it is opened (opening a FIFO would wait forever).
    """

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = local_path_of(root)

    def path(self, name: str) -> str:
        """Return the path of file ``name`` inside the dataset directory."""
        return os.path.join(self.root, check_file_name(name, "file name"))

    def _checked(self, name: str, missing: Exception) -> tuple[str, int]:
        """Return ``(path, size)`` of ``name`` after checking it is a regular file of the dataset."""
        path = self.path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise missing from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeShardError(f"{path} is not a regular file (a FIFO, device, socket or directory); refused")
        if os.path.islink(path):
            real, root = os.path.realpath(path), os.path.realpath(self.root)
            if os.path.commonpath([real, root]) != root:
                raise UnsafeShardError(f"{path} is a symbolic link out of the dataset directory (to {real}); refused")
        return path, st.st_size

    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return the content of file ``name`` (at most ``max_bytes``)."""
        path = self.path(name)
        missing: Exception = (
            ShardNotFoundError(f"{path} does not exist") if not_found is None else ManifestNotFoundError(not_found)
        )
        path, size = self._checked(name, missing)
        if max_bytes is not None and size > max_bytes:
            raise StorageError(f"{path} is {size} bytes, larger than the {max_bytes} accepted for it")
        try:
            with open(path, "rb") as f:
                return f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise missing from exc
            raise StorageError(f"cannot read {path}: {exc}") from exc

    def acquire(self, entry: FileEntry) -> str:
        """Return the file's own path, after checking it is a regular file of the manifest's size."""
        path, size = self._checked(
            entry.name, ShardNotFoundError(f"{self.path(entry.name)} does not exist (listed in the manifest)")
        )
        if size != entry.num_bytes:
            raise CorruptShardError(f"{path}: {size} bytes on disk, the manifest says {entry.num_bytes}")
        return path
