"""One writer per destination: the lock a conversion holds while it writes a dataset.

:class:`LocalLock` for a directory (``fcntl.flock`` on a lock file), :class:`RemoteLock`
for a URL prefix (a lock object with owner and expiry, refreshed while the writer works);
:class:`DestinationLock` is the base (guards only this process). The loser of a race gets
a :class:`~streamload.StorageError` naming the holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from .._errors import DestinationBusyError, ShardNotFoundError, StorageError
from .._fork import forks
from .transport import RemoteFiles

__all__ = ["LOCAL_LOCK_NAME", "REMOTE_LOCK_NAME", "DestinationLock", "LocalLock", "RemoteLock"]

#: The lock file of a local destination (:class:`LocalLock`); it exists while a writer holds it.
LOCAL_LOCK_NAME = ".streamload-lock"
#: The lock object under a remote destination prefix (:class:`RemoteLock`).
REMOTE_LOCK_NAME = "_streamload-lock.json"


def _identity() -> dict[str, Any]:
    """Who is asking for a lock: host, pid, and what tells whether that pid is comparable here."""
    boot_id = pid_ns = None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot_id, "pid_ns": pid_ns}


def _describe_holder(holder: Mapping[str, Any] | None) -> str:
    if not holder:
        return "another conversion"
    text = f"another conversion (pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    return text + ")"


def _busy(url: str, holder: Mapping[str, Any] | None, extra: str = "") -> DestinationBusyError:
    return DestinationBusyError(
        f"{url} is being written by {_describe_holder(holder)}{extra}; wait for it to finish, "
        "or convert into another destination"
    )


class DestinationLock:
    """A destination's writer lock: one conversion at a time per destination.

    Use as a context manager (``with dest.lock():``); :meth:`check` raises if the lock
    was lost while held. This base class only excludes writers of this process.
    """

    _HELD: set[str] = set()

    def __init__(self, url: str) -> None:
        self.url = url
        self.owner: dict[str, Any] = {
            **_identity(),
            "token": secrets.token_hex(16),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.held = False

    def acquire(self) -> None:
        """Take the lock or raise :class:`~streamload.StorageError` naming the holder."""
        if self.url in self._HELD:
            raise _busy(self.url, None)
        self._HELD.add(self.url)
        self.held = True

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        if self.held:
            self._HELD.discard(self.url)
            self.held = False

    def check(self) -> None:
        """Raise :class:`~streamload.StorageError` if the lock is no longer ours."""

    def __enter__(self) -> DestinationLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


#: Local locks held by this process, closed in forked children (see :func:`_forget_locks_in_child`).
_LOCAL_LOCKS: weakref.WeakSet[LocalLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    # A forked child (a conversion worker) shares the parent's lock file description; it
    # closes its copy so that the lock dies with the parent, whatever becomes of the child.
    for lock in list(_LOCAL_LOCKS):
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = None
            lock.held = False
    _LOCAL_LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class LocalLock(DestinationLock):
    """``flock`` on :data:`LOCAL_LOCK_NAME` in the destination directory.

    The kernel releases the lock when the process ends, however it ends (SIGKILL
    included), so a lock is never stale. The holder writes its identity (host, pid,
    start time) into the file, for the message of whoever finds it locked. On release
    the file is deleted while still locked; a process that opened it just before and
    then gets the lock sees that the file it locked is no longer the one at that path
    (inode check), and tries again. Forked children close their copy of the descriptor,
    so the lock never outlives the process that took it. ``flock`` is not reliable on
    every network filesystem (some NFS setups): there, run one conversion at a time.
    """

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url)
        self.path = os.path.join(root, LOCAL_LOCK_NAME)
        self.root = root
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~streamload.StorageError` naming the holder."""
        for _ in range(100):
            try:
                os.makedirs(self.root, exist_ok=True)
                # Never through a link: a planted one would have the holder's identity
                # written over (truncating) whatever file it points to.
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
            except FileNotFoundError:  # the directory was removed meanwhile: make it again
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise StorageError(
                        f"cannot create the lock file {self.path}: it is a symbolic link (not made by streamload); "
                        "delete it"
                    ) from exc
                raise StorageError(f"cannot create the lock file {self.path}: {exc.strerror or exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise _busy(self.url, holder) from None
                raise StorageError(f"cannot lock {self.path}: {exc.strerror or exc}") from exc
            mine = os.fstat(fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)  # the holder deleted that file as it released it: lock the new one
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.owner, sort_keys=True).encode(), 0)
            self.fd = fd
            self.held = True
            _LOCAL_LOCKS.add(self)
            return
        raise StorageError(f"cannot lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        """Delete the lock file and unlock it (idempotent)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        finally:
            _LOCAL_LOCKS.discard(self)
            os.close(self.fd)
            self.fd = None
            self.held = False


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class RemoteLock(DestinationLock):
    """A lock object, :data:`REMOTE_LOCK_NAME`, under a remote destination prefix.

    The protocol:

    1. Read the lock object. If it exists and is not stale, the destination is busy:
       fail, naming the holder (host, pid, start time).
    2. Write our own lock object (host, pid, a random token, start time, and an expiry
       ``ttl_s`` seconds ahead) by an **exclusive create** where the store has one
       (S3's ``If-None-Match: *``, checked atomically by AWS S3 and SeaweedFS): of two
       writers that both saw no lock, only one creates it; the other is busy. A stale
       lock is deleted first (if it is still the stale one read in step 1), then
       created over the same way. A store without exclusive create gets a plain write.
    3. Wait ``settle_s`` seconds, then read it back: only a writer that reads back its
       own token goes on; the other fails, naming it. (Without exclusive create the
       object holds the last of two racing writes, so this alone decides; with it, it
       also catches a stale-lock takeover raced by another taker.)
    4. While working, the holder refreshes the object (new expiry) every ``refresh_s``
       seconds, after reading it back: if the token there is no longer its own, the lock
       was taken over and :meth:`check` (called before ``index.json`` is published) fails,
       so a writer that lost its lock never publishes a dataset.
    5. On release, the holder deletes the object if it still holds its token.

    A lock is stale when its expiry has passed (the holder died or lost its connection
    for ``ttl_s``), or, at once, when its holder ran on this machine (same host, boot
    and pid namespace) and that pid no longer exists (killed). A stale lock is taken
    over by steps 2-3. Expiry compares wall clocks of different machines: keep them in
    sync to well under ``ttl_s``. The wait of step 3 must exceed the time between
    another writer's step 1 and step 2 (one request): a writer paused longer than that
    could still believe it holds the lock until its next refresh finds it lost.
    """

    #: Seconds between writing the lock object and reading it back.
    settle_s = 1.0
    #: Seconds a lock object stays valid without a refresh.
    ttl_s = 120.0
    #: Seconds between refreshes.
    refresh_s = 20.0

    def __init__(self, url: str, files: RemoteFiles) -> None:
        super().__init__(url)
        # A filesystem of its own: the refresh thread never shares the conversion's.
        self.files = RemoteFiles(files.url, files.storage_options, files.retry, s3_direct=files.s3_direct)
        self.lost: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._forks = forks()  # made in this process (a forked child never releases it)

    @staticmethod
    def identity() -> dict[str, Any]:
        """Return this process's identity fields as a lock object records them."""
        return _identity()

    def _read(self) -> dict[str, Any] | None:
        try:
            data = self.files.cat(REMOTE_LOCK_NAME, max_bytes=1 << 16)
        except ShardNotFoundError:
            return None
        try:
            holder = json.loads(data)
        except ValueError:
            return {}  # unreadable: not a live holder
        return holder if isinstance(holder, dict) else {}

    def _write(self) -> None:
        self.owner["expires"] = time.time() + self.ttl_s
        fd, staged = tempfile.mkstemp(prefix="streamload-lock-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(self.owner, sort_keys=True).encode())
            self.files.upload(staged, REMOTE_LOCK_NAME)
        finally:
            os.unlink(staged)

    def _stale(self, holder: Mapping[str, Any]) -> bool:
        try:
            if float(holder.get("expires", 0)) < time.time():
                return True
        except (TypeError, ValueError):
            return True
        here = _identity()
        same_machine = all(holder.get(k) == here[k] for k in ("host", "boot_id", "pid_ns"))
        pid = holder.get("pid")
        if same_machine and isinstance(pid, int) and pid > 0 and pid != os.getpid():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
        return False

    def acquire(self) -> None:
        """Take the lock by the protocol above, or raise :class:`~streamload.StorageError`."""
        holder = self._read()
        if holder is not None and holder.get("token") != self.owner["token"] and not self._stale(holder):
            raise _busy(self.url, holder)
        if holder is not None:  # stale: delete it, unless someone replaced it meanwhile
            now = self._read()
            if now is not None and now.get("token") != holder.get("token"):
                raise _busy(self.url, now, " (it took over the stale lock at the same moment)")
            self.files.remove(REMOTE_LOCK_NAME)
        self.owner["expires"] = time.time() + self.ttl_s
        created = self.files.create(REMOTE_LOCK_NAME, json.dumps(self.owner, sort_keys=True).encode())
        if created is False:
            now = self._read()
            if now is None or now.get("token") != self.owner["token"]:  # not our own retried create
                raise _busy(self.url, now, " (it took the lock at the same moment)")
        elif created is None:
            self._write()
        try:
            time.sleep(self.settle_s)
            holder = self._read()
        except BaseException:  # interrupted while settling: leave no lock object of ours behind
            self._remove_if_ours()
            raise
        if holder is None or holder.get("token") != self.owner["token"]:
            raise _busy(self.url, holder, " (it took the lock at the same moment)")
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._refresh, name="streamload-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                holder = self._read()
                if holder is None or holder.get("token") != self.owner["token"]:
                    self.lost = holder or {}
                    return
                self._write()
            except Exception:  # noqa: BLE001 - an outage: try again; past the expiry the lock is lost
                if time.time() > float(self.owner.get("expires", 0)):
                    self.lost = {}
                    return

    def check(self) -> None:
        """Raise :class:`~streamload.StorageError` unless the lock object still holds our token."""
        if self.lost is None:
            holder = self._read()
            if holder is None or holder.get("token") != self.owner["token"]:
                self.lost = holder or {}
        if self.lost is not None:
            raise StorageError(
                f"{self.url}: lost the destination lock to {_describe_holder(self.lost)} while converting; "
                "nothing was published. Run the conversion again once the other one is done."
            )

    def release(self) -> None:
        """Stop refreshing; delete the lock object if it is still ours (idempotent)."""
        if not self.held or self._forks != forks():
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self._remove_if_ours()

    def _remove_if_ours(self) -> None:
        try:
            holder = self._read()
            if holder is not None and holder.get("token") == self.owner["token"]:
                self.files.remove(REMOTE_LOCK_NAME)
        except StorageError:
            pass  # it expires by itself
