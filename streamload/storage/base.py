"""Where a dataset's files are read from: the :class:`Storage` interface and local directories.

Readers ask a storage for a small file's bytes (the manifest), a *local path* to a file
that stays valid until they release it (a shard, a sidecar), or the file's bytes as
positioned reads (:meth:`Storage.open_bytes`: a local file, a download read as its parts
land, ranges streamed from a bucket; see :mod:`.bytes`), and, as a hint, which files
they will need next (:meth:`Storage.fetch_ahead`). A storage whose files are copies in a
cache shared by the readers of a machine (:attr:`Storage.cached`) also admits readers,
discards copies found corrupt and streams ranges; the others answer with no-ops.

Callers tell the storage what each file must be (a :class:`~streamload._files.FileEntry`:
size, digest, algorithm); a storage never reads a manifest. Local datasets answer with the
files themselves; remote ones download into a bounded, shared cache first
(:mod:`streamload.storage.remote`).
"""

from __future__ import annotations

import errno
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import CorruptShardError, ManifestNotFoundError, ShardNotFoundError, StorageError, UnsafeShardError
from .._files import FileEntry, check_file_name, is_local, local_path_of
from .._pread import open_files
from .bytes import FileBytes, ShardBytes, StreamedFile

if TYPE_CHECKING:
    from .ranges import RangeFetcher

__all__ = ["InPlace", "LocalStorage", "Storage", "is_local", "local_path_of"]


class Storage(ABC):
    """Read access to one dataset's directory or URL prefix."""

    url: str
    #: The most shards a reader should name to :meth:`fetch_ahead` ahead of the one it reads
    #: (0: none); :meth:`ahead_depth` says how many now.
    read_ahead: int = 0
    #: Bytes the local cache may hold (``None``: unbounded, or no cache: read in place).
    limit: int | None = None
    #: The files are local copies of remote ones, in a cache shared by the readers of a machine.
    cached: bool = False
    #: The cache bound the storage chose itself (no ``cache_limit`` was given), else ``None``.
    default_limit: int | None = None

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

    def open_in_place(self, shard: FileEntry, sidecar: FileEntry) -> InPlace | None:
        """Open a local shard read in place and read its sidecar, in one call that releases the GIL once.

        ``None`` (the default): not a local dataset, or the native helper is not built; the
        caller acquires the files and opens them itself. No :meth:`release` pairs with it.
        """
        return None

    def open_bytes(self, entry: FileEntry, *, early: bool = False, ranges: RangeFetcher | None = None) -> ShardBytes:
        """Return ``entry``'s bytes as positioned reads; pair with :meth:`release` (except with ``ranges``).

        Args:
            entry: The file.
            early: A file not cached yet may come as its download in progress
                (:class:`~.bytes.Landing`: read as its parts land), where the storage can.
            ranges: Streaming: read by ranges fetched ahead by this fetcher (see
                :meth:`open_ranges`); nothing is pinned.
        """
        if ranges is not None:
            return StreamedFile(ranges, entry.name, entry.num_bytes)
        for retry in (True, False):
            path = self.acquire(entry)
            try:
                return FileBytes(os.open(path, os.O_RDONLY))
            except OSError as exc:
                # Gone between the acquire and the open: another process deleted a cached copy it
                # found corrupt. Discarded here too, the next acquire brings it again (once); a
                # storage that reads files in place has no copy to discard.
                again = retry and isinstance(exc, FileNotFoundError) and self.discard(entry)
                self.release(entry)
                if not again:
                    raise StorageError(f"cannot open {path}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def open_ranges(self) -> RangeFetcher | None:
        """A new fetcher of byte ranges for streaming mode (its owner closes it); ``None``: it cannot stream."""
        return None

    def discard(self, entry: FileEntry) -> bool:
        """Drop the copy of ``entry`` a reader found corrupt; True if the next acquire brings another.

        A storage that reads files in place has no copy to drop: False.
        """
        return False

    def register_reader(self, largest: int) -> None:  # noqa: B027 - optional hook
        """A reader of files of up to ``largest`` bytes starts (admission; may raise ``CacheError``)."""

    def unregister_reader(self) -> None:  # noqa: B027 - optional hook
        """A reader ended."""

    def started(self) -> None:  # noqa: B027 - optional hook
        """The reader made its first item (read-ahead held back until then may start)."""

    def fetch_ahead(self, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:  # noqa: B027
        """Start fetching ``entries`` (the next files, in order of use) in the background.

        Each call replaces the read-ahead window; an empty iterable cancels read-ahead.
        ``together``: names of those files the reader needs now, with the one it opens (a
        shuffled reader's first batches draw on all of them): fetched at once, never held
        back for the reader's first item.
        """

    def ahead_depth(self) -> int:
        """Return how many shards a reader should name to :meth:`fetch_ahead` now (0: none).

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


@dataclass(frozen=True)
class InPlace:
    """A local shard opened and its sidecar read (:meth:`Storage.open_in_place`).

    Attributes:
        path: The shard's path.
        fd: Its open descriptor (the caller's to close).
        size: Its size in bytes (the manifest's).
        sidecar_path: The sidecar's path.
        sidecar: The sidecar's bytes.
    """

    path: str
    fd: int
    size: int
    sidecar_path: str
    sidecar: bytes


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
        self._check_kind(path, st.st_mode, os.path.islink(path))
        return path, st.st_size

    def _check_kind(self, path: str, mode: int, link: bool) -> None:
        """A regular file, and a symbolic link only to a place inside the dataset directory."""
        if not stat.S_ISREG(mode):
            raise UnsafeShardError(f"{path} is not a regular file (a FIFO, device, socket or directory); refused")
        if link:
            real, root = os.path.realpath(path), os.path.realpath(self.root)
            if os.path.commonpath([real, root]) != root:
                raise UnsafeShardError(f"{path} is a symbolic link out of the dataset directory (to {real}); refused")

    def open_in_place(self, shard: FileEntry, sidecar: FileEntry) -> InPlace | None:
        """Check, open and read the shard's files in one native call (:func:`streamload._pread.open_files`).

        The checks are :meth:`acquire`'s: each a regular file of the dataset (a link only
        inside it), of the manifest's size. ``None`` when the native helper is not built.

        Raises:
            ShardNotFoundError: If a file does not exist.
            UnsafeShardError: If one is not a regular file, or links out of the directory.
            CorruptShardError: If one's size is not the manifest's.
            StorageError: If one cannot be read.
        """
        paths = [self.path(shard.name), self.path(sidecar.name)]
        opened = open_files(paths, [False, True], [0, sidecar.num_bytes])
        if opened is None:
            return None
        fd = opened[0].fd
        try:
            for path, got in zip(paths, opened, strict=True):
                if got.error == errno.ENOENT:
                    raise ShardNotFoundError(f"{path} does not exist (listed in the manifest)")
                if got.error:
                    raise StorageError(f"cannot read {path}: {os.strerror(got.error)}")
                self._check_kind(path, got.mode, got.link)
            for path, got, entry in zip(paths, opened, (shard, sidecar), strict=True):
                if got.size != entry.num_bytes or (got.data is not None and len(got.data) != entry.num_bytes):
                    size = got.size if got.data is None else len(got.data)
                    raise CorruptShardError(f"{path}: {size} bytes on disk, the manifest says {entry.num_bytes}")
            data = opened[1].data
            assert data is not None and fd >= 0
            return InPlace(paths[0], fd, shard.num_bytes, paths[1], data)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

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
