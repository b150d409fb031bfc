"""Where converters write a dataset: a local directory or any fsspec URL prefix.

Files are produced in a local staging area under temporary names and then committed under
their final name (renamed, or uploaded whole), so a reader never sees a half-written file;
the converter commits ``index.json`` last.

One writer at a time: :meth:`Destination.lock` returns the destination's lock, which a
conversion holds from before it looks at the destination until it is done
(:class:`LocalLock` for a directory, :class:`RemoteLock` for a URL prefix).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from .._errors import ShardNotFoundError
from .._files import check_file_name, hash_stream, new_hasher
from .._fork import forks
from .base import local_path_of
from .locks import DestinationLock, LocalLock, RemoteLock
from .retry import RetryPolicy
from .transport import RemoteFiles

__all__ = ["STAGING_PREFIX", "Destination", "LocalDestination", "RemoteDestination"]

#: Prefix of the temporary files a :class:`LocalDestination` stages in the dataset directory.
#: Only files with this prefix are ever cleaned up: nothing else in the directory is ours.
STAGING_PREFIX = ".streamload-tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Destination(ABC):
    """Write access to a dataset directory or URL prefix, used by converters."""

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

    @abstractmethod
    def list_names(self) -> list[str]:
        """Return the sorted names of the files directly under the destination."""

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
        """Remove staged files left behind by a crashed writer (only files it staged)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release local resources (a staging directory)."""

    def lock(self) -> DestinationLock:
        """Return the destination's writer lock (not yet taken: use it as a context manager).

        The base class has none that other processes would see: a destination of another
        kind should override this; the default only guards this process.
        """
        return DestinationLock(self.url)


class LocalDestination(Destination):
    """A local directory; staged files live in it under hidden names and are renamed.

    Committed files get the permissions of any new file (``0666`` less the umask), like
    the output of other tools, so the dataset is readable by whoever the umask allows.
    """

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = local_path_of(root)
        self.created = not os.path.isdir(self.root)
        os.makedirs(self.root, exist_ok=True)
        self._mode = 0o666 & ~_umask()

    def lock(self) -> LocalLock:
        """Return the directory's lock (:class:`LocalLock`)."""
        return LocalLock(self.url, self.root)

    def close(self) -> None:
        """Remove the directory if this destination created it and nothing was written in it."""
        if self.created:
            try:
                os.rmdir(self.root)
            except OSError:
                pass

    def _path(self, name: str) -> str:
        return os.path.join(self.root, check_file_name(name, "file name"))

    def staging_path(self, name: str) -> str:
        """Return a unique hidden path in the destination directory."""
        fd, path = tempfile.mkstemp(prefix=f"{STAGING_PREFIX}{check_file_name(name, 'file name')}.", dir=self.root)
        os.close(fd)
        return path

    def commit(self, staged: str, name: str) -> None:
        """Give the staged file its final permissions and rename it to its final name."""
        os.chmod(staged, self._mode)
        os.replace(staged, self._path(name))

    def exists(self, name: str) -> int | None:
        """Return the size of ``name`` or ``None``."""
        try:
            return os.stat(self._path(name)).st_size
        except FileNotFoundError:
            return None

    def digest(self, name: str, algorithm: str) -> str:
        """Hash file ``name`` in chunks."""
        with open(self._path(name), "rb") as f:
            return hash_stream(f, algorithm)[0]

    def clean_staging(self) -> None:
        """Remove the staged files (:data:`STAGING_PREFIX`) a crashed writer left in the directory."""
        for entry in os.scandir(self.root):
            if entry.name.startswith(STAGING_PREFIX) and entry.is_file(follow_symlinks=False):
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    def read_bytes(self, name: str) -> bytes:
        """Return the content of ``name``."""
        with open(self._path(name), "rb") as f:
            return f.read()

    def remove(self, name: str) -> None:
        """Delete ``name`` if present."""
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def list_names(self) -> list[str]:
        """Return the sorted names of the directory's entries."""
        return sorted(os.listdir(self.root))


class RemoteDestination(Destination):
    """A dataset being written to a remote URL prefix: staged locally, uploaded whole.

    Args:
        url: The destination URL prefix (``s3://bucket/prefix``). The bucket must exist.
        storage_options: Passed to the fsspec filesystem.
        retry: How transient upload errors are retried.
        s3_direct: Ranged reads on botocore's own client (see :func:`~.transport.open_transport`).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        *,
        s3_direct: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.files = RemoteFiles(self.url, dict(storage_options or {}), retry or RetryPolicy(), s3_direct=s3_direct)
        self._staging = tempfile.mkdtemp(prefix="streamload-upload-")
        self._owner_forks = forks()

    def staging_path(self, name: str) -> str:
        """Return a fresh local temporary file for ``name``."""
        os.makedirs(self._staging, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"{check_file_name(name, 'file name')}.", dir=self._staging)
        os.close(fd)
        return path

    def commit(self, staged: str, name: str) -> None:
        """Upload ``staged`` as ``name`` (retried), then delete the local file."""
        self.files.upload(staged, name)
        os.unlink(staged)

    def exists(self, name: str) -> int | None:
        """Return the size of ``name`` or ``None``."""
        return self.files.size(name)

    def read_bytes(self, name: str) -> bytes:
        """Return the content of ``name``."""
        return self.files.cat(name)

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        self.files.remove(name)

    def list_names(self) -> list[str]:
        """Return the sorted names of the objects directly under the prefix (none if it does not exist)."""
        try:
            return self.files.list_names()
        except ShardNotFoundError:
            return []

    def lock(self) -> RemoteLock:
        """Return the prefix's lock (:class:`RemoteLock`)."""
        return RemoteLock(self.url, self.files)

    def close(self) -> None:
        """Delete the local staging directory."""
        shutil.rmtree(self._staging, ignore_errors=True)

    def __del__(self) -> None:
        staging = getattr(self, "_staging", None)
        if staging is not None and getattr(self, "_owner_forks", -1) == forks():
            shutil.rmtree(staging, ignore_errors=True)
