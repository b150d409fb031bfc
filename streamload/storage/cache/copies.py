"""The verified copies in ``data/`` and their records in ``meta/``.

Which entry a copy was verified against, whether it may be served, and the corrupt ones
dropped.

See "Invariants" and "Corrupt copies" in :mod:`streamload.storage.cache`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat

from ..._errors import CacheError, CorruptShardError
from ..._files import FileEntry, new_hasher
from ..._units import format_bytes
from .flocks import close_fd, open_fd, wait_lock
from .layout import CacheDir, unlink
from .settings import CacheSettings
from .stats import StatsCounter

__all__ = ["Copies", "is_no_space"]

_CHUNK = 8 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Copies:
    """The complete files of one cache directory, each served only for the entry it was verified for.

    Args:
        folder: The cache directory.
        settings: The cache's settings (``verify_hash``, ``lock_timeout``).
        counter: Where hits and discarded copies are counted.
    """

    def __init__(self, folder: CacheDir, settings: CacheSettings, counter: StatsCounter) -> None:
        self.folder = folder
        self.settings = settings
        self.counter = counter

    def lookup(self, entry: FileEntry) -> str | None:
        """Return the cached path of ``entry`` if present and verified for it (caller pins).

        A file of the right size but verified against another hash (a dataset re-written
        at the same URL), or with no record of its verification, is a miss.
        """
        path = self.folder.data_path(entry.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # not a file this cache made (a planted link): replaced by the next download
        if not self.folder.trusted(st):
            return None  # another user could have written it: replaced by the next download
        if st.st_size != entry.num_bytes:
            return None  # a stale file of another version; replaced by the next download
        # Not a hash computation: which manifest entry the file was downloaded for, so it
        # applies with verify_hash=False too.
        if entry.hash is not None:
            record = self._read_record(entry.name)
            if record is None or record[:3] != (entry.hash, entry.num_bytes, st.st_ino):
                return None  # same size, other bytes (or unverified): replaced by the next download
        try:
            os.utime(path)  # the LRU clock
        except FileNotFoundError:
            return None
        self.counter.hit()
        return path

    def _read_record(self, name: str) -> tuple[str, int, int, str] | None:
        """The ``(hash, size, inode, generation)`` recorded for the download renamed into ``data/<name>``.

        A record written before generations existed has none (``""``).
        """
        try:
            fd = open_fd(self.folder.meta_path(name), os.O_RDONLY)
            try:
                fields = os.read(fd, 4096).decode("ascii").split()
            finally:
                close_fd(fd)
            digest, size, inode = fields[:3]
            return digest, int(size), int(inode), fields[3] if len(fields) > 3 else ""
        except (OSError, ValueError, CacheError):
            return None

    def generation(self, name: str) -> str | None:
        """The generation of the copy now in ``data/<name>`` (``None`` if it has no record of one)."""
        record = self._read_record(name)
        try:
            inode = os.lstat(self.folder.data_path(name)).st_ino
        except FileNotFoundError:
            return None
        if record is None or record[2] != inode or not record[3]:
            return None
        return record[3]

    def write_record(self, entry: FileEntry, part: str) -> None:
        """Record what ``part`` was verified against (caller holds the cache lock)."""
        meta = self.folder.meta_path(entry.name)
        # A leading dot: no plain name (no shard's record) can be this name.
        tmp = os.path.join(self.folder.root, "meta", f".{entry.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = self.folder.create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            text = f"{entry.hash or '-'} {entry.num_bytes} {os.stat(part).st_ino} {secrets.token_hex(8)}\n"
            os.write(fd, text.encode("ascii"))
        except OSError as exc:
            close_fd(fd)
            unlink(tmp)
            raise self.no_space(exc, entry) from exc
        close_fd(fd)
        os.replace(tmp, meta)

    def verify(self, part: str, entry: FileEntry) -> None:
        """Check a finished download against ``entry``: its size, and its hash unless ``verify_hash`` is off.

        Raises:
            CorruptShardError: If the bytes are not the entry's.
        """
        size = os.stat(part).st_size
        if size != entry.num_bytes:
            raise CorruptShardError(f"{entry.name}: downloaded {size} bytes, the manifest says {entry.num_bytes}")
        hash_algorithm = entry.algorithm
        if not self.settings.verify_hash or hash_algorithm is None or entry.hash is None:
            return
        problem = entry.digest_problem(_digest(part, hash_algorithm, follow=True), hash_algorithm)
        if problem is not None:
            raise CorruptShardError(f"{entry.name}: downloaded bytes do not match the manifest: {problem}")

    def no_space(self, exc: BaseException, entry: FileEntry) -> BaseException:
        """The :class:`CacheError` for a full disk (``exc`` itself if it is not one)."""
        if not is_no_space(exc):
            return exc
        try:
            free = format_bytes(shutil.disk_usage(self.folder.root).free)
        except OSError:
            free = "unknown"
        return CacheError(
            f"{self.folder.root}: no space left on the cache's disk for {entry.name} "
            f"({format_bytes(entry.num_bytes)} needed, {free} free); free space there, or pass a smaller "
            "cache_limit or a cache_dir on a larger disk"
        )

    # -- corrupt and stale copies --------------------------------------------------------

    def discard(self, entry: FileEntry, generation: str | None) -> bool:
        """Delete the cached copy of ``entry`` a reader found corrupt, so that it is downloaded again.

        Returns:
            True if the next acquire gets another copy (this one was deleted, or another
            process already replaced or deleted it); False if the copy hashes to the
            entry: it is faithful, and a download would bring the same bytes.
        """
        lock = self.folder.download_lock_path(entry.name)
        fd = self.folder.open_lock(lock)
        try:
            # No download of this file meanwhile (bounded by its retries).
            wait_lock(fd, fcntl.LOCK_EX, lock, self.settings.lock_timeout, f"downloading {entry.name}")
            path = self.folder.data_path(entry.name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return True
            if generation is not None and self.generation(entry.name) != generation:
                return True  # already replaced by another reader that found it corrupt
            if st.st_size == entry.num_bytes and _hashes_to(path, entry):
                return False
            with self.folder.cache_lock():
                self._drop_locked(entry.name, st.st_ino)
            self.counter.discarded()
            return True
        finally:
            close_fd(fd)

    def drop(self, name: str) -> None:
        """Delete ``data/<name>`` (a stale copy, about to be replaced) and its record."""
        try:
            inode = os.lstat(self.folder.data_path(name)).st_ino
        except FileNotFoundError:
            return
        with self.folder.cache_lock():
            self._drop_locked(name, inode)

    def _drop_locked(self, name: str, inode: int) -> None:
        """Delete ``data/<name>`` if it is still ``inode``, and its record (caller holds the cache lock)."""
        path = self.folder.data_path(name)
        try:
            if os.lstat(path).st_ino != inode:
                return
        except FileNotFoundError:
            return
        unlink(path)
        unlink(self.folder.meta_path(name))


def _digest(path: str, algorithm: str, *, follow: bool = False) -> str:
    """The hex digest of the file at ``path`` (opened through a link only if ``follow``)."""
    hasher = new_hasher(algorithm)
    nofollow = 0 if follow else os.O_NOFOLLOW
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | nofollow)) as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _hashes_to(path: str, entry: FileEntry) -> bool:
    """True if the file at ``path`` hashes to ``entry``'s digest (False if it has none)."""
    if entry.hash is None or entry.algorithm is None:
        return False
    return entry.digest_problem(_digest(path, entry.algorithm), entry.algorithm) is None


def is_no_space(exc: BaseException) -> bool:
    """True if ``exc`` (or a cause) is a full disk or an exhausted quota."""
    node: BaseException | None = exc
    for _ in range(8):
        if node is None:
            return False
        if isinstance(node, OSError) and node.errno in _NO_SPACE:
            return True
        node = node.__cause__ or node.__context__
    return False
