"""The cache's folders on disk, and the trust checks made before any of them is used.

A cache directory may sit where others can write (a node-wide ``STREAMLOAD_CACHE``), so
the cache never follows a link it did not make: its folders must be real directories
(checked with ``lstat`` whenever one is listed or a file is made in one), every file is
opened with ``O_NOFOLLOW`` (:func:`~streamload.storage.cache.flocks.open_fd`), and the
dataset's folder must belong to the user and not be writable by group or others, unless
the cache is ``shared`` (then a group may write it, and a link planted there is refused).
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from ..._errors import CacheError
from ..._files import check_file_name
from .flocks import close_fd, open_fd, wait_lock
from .settings import SHARED_ENV, CacheSettings

__all__ = ["SUBDIRS", "CacheDir", "trusted_file", "unlink"]

#: The folders of a dataset's cache directory (see the layout in :mod:`streamload.storage.cache`).
SUBDIRS = ("data", "pins", "downloads", "tmp", "meta", "readers", "landing")


def trusted_file(st: os.stat_result, shared: bool) -> bool:
    """Whether a file of the cache with status ``st`` may be read: no one else could have written it.

    Never a file writable by every user; unless the cache is ``shared``, only this user's
    files, not writable by the group either (the cache makes its files ``0o644``, owned by
    the reader). The one rule for every file the cache serves: shards and sidecars in
    ``data/``, the part files of another process's download in progress, key indexes.
    """
    if st.st_mode & stat.S_IWOTH:
        return False
    return shared or (st.st_uid == os.geteuid() and not st.st_mode & stat.S_IWGRP)


class CacheDir:
    """One dataset's cache directory: its folders, the paths in them, and the cache lock.

    Args:
        root: The dataset's cache directory (created, with its folders).
        settings: The cache's settings (``shared`` and ``lock_timeout`` are read here).

    Raises:
        CacheError: If the directory cannot be made or is not safe (see :meth:`check_dir`).
    """

    def __init__(self, root: str, settings: CacheSettings) -> None:
        self.root = root
        self.settings = settings
        self.make_dirs()

    def make_dirs(self) -> None:
        """Create the cache's directories (again, if someone deleted them under a running job).

        Raises:
            CacheError: If the cache folder or one of its folders is a link or not a
                directory, or the cache folder is not safe from other users.
        """
        try:
            # Explicit modes: a umask of 002 must not make the cache writable by a group.
            os.makedirs(self.root, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.root}: {exc.strerror or exc}") from exc
        self.check_dir(self.root, owner=True)
        for sub in SUBDIRS:
            path = os.path.join(self.root, sub)
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                raise CacheError(f"cannot create the cache directory {path}: {exc.strerror or exc}") from exc
            self.check_dir(path, owner=False)

    def check_dir(self, path: str, *, owner: bool) -> None:
        """Refuse a cache folder that is a link or not a directory, or (``owner``) others could write.

        Raises:
            CacheError: Naming the folder and what to do about it.
        """
        shared = self.settings.shared
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # deleted under a running job: made again by the next write
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CacheError(
                f"{path} is {kind}; the cache never follows a link it did not make nor writes outside its "
                "own folders (someone else can write the cache directory: use one only you can write)"
            )
        if not owner:
            if not shared and st.st_uid != os.geteuid():
                raise CacheError(
                    f"{path}: a folder of the cache belongs to another user; use a cache directory of your own, "
                    f"or set {SHARED_ENV}=1 if it is shared on purpose"
                )
            if st.st_mode & stat.S_IWOTH or (not shared and st.st_mode & stat.S_IWGRP):
                who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
                raise CacheError(
                    f"{path}: a folder of the cache is writable by {who} "
                    f"(mode {stat.S_IMODE(st.st_mode):o}); another user could plant or replace its files. "
                    f"chmod go-w {path} (after checking what it holds), or use a cache directory of your own"
                    + ("" if shared else f"; set {SHARED_ENV}=1 if a group shares it on purpose")
                )
            return
        if shared:
            if st.st_mode & stat.S_IWOTH:
                raise CacheError(
                    f"{path}: the cache folder is writable by every user (mode {stat.S_IMODE(st.st_mode):o}); "
                    f"even with {SHARED_ENV}=1 it may only be shared by a group"
                )
            return
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheError(
                f"{path}: the cache folder belongs to another user or others can write it (mode "
                f"{stat.S_IMODE(st.st_mode):o}); another user could make the cache delete or overwrite your "
                f"files. Use a cache directory of your own (or chmod go-w {path}), or set {SHARED_ENV}=1 if it is "
                "shared on purpose"
            )

    def trusted(self, st: os.stat_result) -> bool:
        """Whether a cached file may be served: as the folders, no one else could have written it.

        Never writable by every user; unless the cache is shared, ours and not writable by
        the group either (see :func:`trusted_file`).
        """
        return trusted_file(st, self.settings.shared)

    def create(self, path: str, flags: int) -> int:
        """Open (creating) ``path`` in the cache; its directory is made again if it was deleted."""
        self.check_dir(os.path.dirname(path), owner=path == os.path.join(self.root, ".lock"))
        try:
            return open_fd(path, flags)
        except FileNotFoundError:
            self.make_dirs()
            return open_fd(path, flags)

    def open_lock(self, path: str) -> int:
        """Open (creating) the lock file ``path``."""
        return self.create(path, os.O_RDWR | os.O_CREAT)

    def scan(self, sub: str) -> list[os.DirEntry[str]]:
        """The entries of ``<root>/<sub>`` (none, and the directory made again, if it was deleted).

        A folder replaced by a link is refused, never listed (its entries would be deleted).
        """
        path = os.path.join(self.root, sub)
        self.check_dir(path, owner=False)
        try:
            with os.scandir(path) as it:
                return list(it)
        except FileNotFoundError:
            self.make_dirs()
            return []

    @contextmanager
    def cache_lock(self) -> Iterator[None]:
        """Hold ``.lock`` exclusively: counting bytes, reserving, evicting, renaming into ``data/``."""
        path = os.path.join(self.root, ".lock")
        fd = self.open_lock(path)
        try:
            wait_lock(fd, fcntl.LOCK_EX, path, self.settings.lock_timeout, "counting or evicting")
            yield
        finally:
            close_fd(fd)

    # -- paths (every name checked to be a plain file name: no path leaves the cache) ----

    def data_path(self, name: str) -> str:
        """Where the complete file ``name`` lives (its folder checked: no link)."""
        folder = os.path.join(self.root, "data")
        self.check_dir(folder, owner=False)
        return os.path.join(folder, check_file_name(name, "cached file name"))

    def meta_path(self, name: str) -> str:
        """Where the record of the copy in ``data/<name>`` lives (its folder checked: no link)."""
        folder = os.path.join(self.root, "meta")
        self.check_dir(folder, owner=False)
        return os.path.join(folder, check_file_name(name, "cached file name"))

    def pin_path(self, name: str) -> str:
        """The lock file that pins ``data/<name>``."""
        return os.path.join(self.root, "pins", check_file_name(name, "cached file name"))

    def download_lock_path(self, name: str) -> str:
        """The lock file the downloader of ``name`` holds."""
        return os.path.join(self.root, "downloads", check_file_name(name, "cached file name"))

    def landing_path(self, name: str) -> str:
        """Where the progress of the download of ``name`` is shown to the other processes."""
        return os.path.join(self.root, "landing", check_file_name(name, "cached file name"))


def unlink(path: str) -> None:
    """Delete ``path`` (a link itself, never its target) if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
