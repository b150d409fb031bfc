"""Where a dataset's files live, for readers (:class:`Storage`) and writers (:class:`Destination`).

Readers only ever ask for two things: the manifest's bytes, and a *local path* to a
shard (and its sidecar) that stays valid until they release it. Local datasets answer
with the file itself; remote ones download into a bounded, shared cache first.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable

from .._errors import ManifestNotFoundError, ShardNotFoundError, StorageError
from ..manifest import MANIFEST_NAME, FileEntry, check_file_name, hash_stream, new_hasher

__all__ = ["Destination", "LocalDestination", "LocalStorage", "Storage", "is_local", "local_path_of"]


def is_local(url: str) -> bool:
    """True if ``url`` is a plain path or a ``file://`` URL."""
    return "://" not in url or url.startswith("file://")


def local_path_of(url: str) -> str:
    """Return the filesystem path of a local ``url`` (strips ``file://``)."""
    return url[len("file://") :] if url.startswith("file://") else url


class Storage(ABC):
    """Read access to one dataset's directory or URL prefix."""

    url: str
    #: True if :meth:`prefetch` does anything (readers skip planning ahead otherwise).
    prefetches: bool = False

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """Return the whole content of file ``name`` (small files: the manifest)."""

    @abstractmethod
    def acquire(self, entry: FileEntry) -> str:
        """Return a local path holding ``entry``'s bytes, valid until :meth:`release`."""

    def release(self, entry: FileEntry) -> None:  # noqa: B027 - optional hook
        """Tell the storage the local copy of ``entry`` is no longer in use."""

    def prefetch(self, entries: Iterable[FileEntry]) -> None:  # noqa: B027 - optional hook
        """Start fetching ``entries`` (the next shards, in order of use) in the background.

        Each call replaces the read-ahead window; an empty iterable cancels read-ahead.
        """

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
    """A dataset in a local directory: files are used in place."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = local_path_of(root)

    def path(self, name: str) -> str:
        """Return the path of file ``name`` inside the dataset directory."""
        return os.path.join(self.root, check_file_name(name, "file name"))

    def read_bytes(self, name: str) -> bytes:
        """Return the content of file ``name``."""
        try:
            with open(self.path(name), "rb") as f:
                return f.read()
        except FileNotFoundError as exc:
            if name == MANIFEST_NAME:
                raise ManifestNotFoundError(
                    f"{self.path(name)} does not exist: is {self.root!r} a streamload dataset? "
                    "(for tar shards written by other tools, run `streamload index DIR`)"
                ) from exc
            raise ShardNotFoundError(f"{self.path(name)} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot read {self.path(name)}: {exc}") from exc

    def acquire(self, entry: FileEntry) -> str:
        """Return the file's own path, after checking it exists with the manifest's size."""
        path = self.path(entry.name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError as exc:
            raise ShardNotFoundError(f"{path} does not exist (listed in the manifest)") from exc
        if size != entry.num_bytes:
            from .._errors import CorruptShardError

            raise CorruptShardError(f"{path}: {size} bytes on disk, the manifest says {entry.num_bytes}")
        return path


class Destination(ABC):
    """Write access to a dataset directory or URL prefix, used by converters.

    Files are produced in a local staging directory under temporary names and then
    committed under their final name (renamed, or uploaded). The manifest goes last.
    """

    url: str

    @abstractmethod
    def staging_path(self, name: str) -> str:
        """Return a fresh local temporary path to write the file ``name`` into."""

    @abstractmethod
    def commit(self, staged: str, name: str) -> None:
        """Publish a finished staged file under ``name`` atomically; the staged file is consumed."""

    @abstractmethod
    def exists(self, name: str) -> int | None:
        """Return the size of file ``name`` if it exists, else ``None``."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """Return the content of file ``name``."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name`` if it exists."""

    def write_bytes(self, name: str, data: bytes) -> None:
        """Atomically write small file ``name`` (the manifest)."""
        staged = self.staging_path(name)
        with open(staged, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.commit(staged, name)

    def discard(self, staged: str) -> None:
        """Delete a staged file that will not be committed."""
        try:
            os.unlink(staged)
        except FileNotFoundError:
            pass

    def digest(self, name: str, algorithm: str) -> str:
        """Return the ``algorithm`` hex digest of file ``name`` (for resume checks)."""
        hasher = new_hasher(algorithm)
        hasher.update(self.read_bytes(name))
        return hasher.hexdigest()

    def clean_staging(self) -> None:  # noqa: B027 - optional hook
        """Remove staged files left behind by a crashed writer."""


class LocalDestination(Destination):
    """A local directory; staged files live in it under hidden names and are renamed."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = local_path_of(root)
        os.makedirs(self.root, exist_ok=True)

    def staging_path(self, name: str) -> str:
        """Return a unique hidden path in the destination directory."""
        fd, path = tempfile.mkstemp(prefix=f".tmp-{check_file_name(name, 'file name')}.", dir=self.root)
        os.close(fd)
        return path

    def commit(self, staged: str, name: str) -> None:
        """Rename the staged file to its final name."""
        os.replace(staged, os.path.join(self.root, check_file_name(name, "file name")))

    def exists(self, name: str) -> int | None:
        """Return the size of ``name`` or ``None``."""
        try:
            return os.stat(os.path.join(self.root, check_file_name(name, "file name"))).st_size
        except FileNotFoundError:
            return None

    def digest(self, name: str, algorithm: str) -> str:
        """Hash file ``name`` in chunks."""
        with open(os.path.join(self.root, check_file_name(name, "file name")), "rb") as f:
            return hash_stream(f, algorithm)[0]

    def clean_staging(self) -> None:
        """Remove ``.tmp-*`` files a crashed writer left in the directory."""
        for entry in os.scandir(self.root):
            if entry.name.startswith(".tmp-") and entry.is_file(follow_symlinks=False):
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    def read_bytes(self, name: str) -> bytes:
        """Return the content of ``name``."""
        with open(os.path.join(self.root, check_file_name(name, "file name")), "rb") as f:
            return f.read()

    def remove(self, name: str) -> None:
        """Delete ``name`` if present."""
        try:
            os.unlink(os.path.join(self.root, check_file_name(name, "file name")))
        except FileNotFoundError:
            pass
