"""Datasets at any fsspec URL: ``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``...

Reading (:class:`RemoteStorage`), per process::

    read_bytes("index.json")          -> one GET, retried; never cached
    acquire(entry)                    -> pin in the shared cache (see .cache)
      hit:  data/<name>, mtime bumped  -> local path, no remote call
      miss: reserve room (evict LRU unpinned), download to tmp/ (retried, resumed at
            the byte it stopped), verify size + hash, rename into data/
    prefetch([next shards])           -> the same, in `read_ahead` daemon threads, never
                                         waiting for room (nor pinning: an idle reader's
                                         pins would starve the others)
    release(entry)                    -> drop the pin: the file becomes evictable

Writing (:class:`RemoteDestination`): files are staged in a local temporary directory and
uploaded when complete (an object appears whole or not at all), then deleted locally;
the converter writes ``index.json`` last, so a reader never sees a partial dataset.

The fsspec filesystem is created per process, lazily, and re-created after a fork
(async filesystems own an event-loop thread, which a forked child does not inherit).
Instances are not shared through fsspec's instance cache, so a DataLoader worker never
uses its parent's connections.

Streaming tar shards without caching them whole (not implemented): with the sidecar
local, a reader could fetch each sample's byte range ``[sample_start[i],
sample_start[i+1])`` with a range GET (or coalesce a run of samples into one GET),
which suits one-pass, shuffle-free reads of datasets much larger than the local disk.
The cache is the default because a second epoch then costs no remote reads and a
range GET per sample costs a round trip per sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import (
    CacheError,
    ConfigError,
    CorruptShardError,
    ManifestError,
    ManifestNotFoundError,
    ShardNotFoundError,
    StorageError,
    StreamloadError,
)
from .._units import format_bytes, parse_bytes
from ..manifest import MANIFEST_NAME, FileEntry, Manifest, ShardEntry, check_file_name
from .base import Destination, Storage
from .cache import DEFAULT_WAIT_TIMEOUT, CacheStats, Pin, ShardCache
from .retry import RetryPolicy, is_permanent, is_transient, retry_call

__all__ = [
    "DEFAULT_READ_AHEAD",
    "RemoteDestination",
    "RemoteStorage",
    "default_cache_dir",
    "filesystem_class",
    "index_remote",
    "open_filesystem",
]

#: Shards each worker downloads ahead of the one it reads.
DEFAULT_READ_AHEAD = 2
#: Digest length -> algorithm, for the algorithms a manifest may name (HASH_ALGORITHMS).
_ALGORITHM_BY_HEX_LENGTH = {64: "sha256", 32: "xxh3_128"}
#: Smallest workable cache: the shard being read plus the one being fetched.
MIN_CACHE_SHARDS = 2
_CHUNK = 8 << 20
#: Filesystems inherited across a fork, kept alive so they are never finalized in a child.
_INHERITED: list[Any] = []
#: (pid, protocol, options) -> filesystem: see :func:`open_filesystem`.
_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _reset_after_fork() -> None:
    global _FILESYSTEMS_LOCK
    _FILESYSTEMS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)

#: protocol -> what to install when fsspec cannot import its implementation.
_INSTALL_HINTS: dict[str, str] = {
    "s3": "pip install 'streamload[s3]'  (s3fs)",
    "s3a": "pip install 'streamload[s3]'  (s3fs)",
    "gs": "pip install 'streamload[gcs]'  (gcsfs)",
    "gcs": "pip install 'streamload[gcs]'  (gcsfs)",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
    "adl": "pip install adlfs",
    "http": "pip install 'streamload[http]'  (aiohttp)",
    "https": "pip install 'streamload[http]'  (aiohttp)",
    "hf": "pip install huggingface_hub",
    "oci": "pip install ocifs",
    "oss": "pip install ossfs",
    "sftp": "pip install paramiko",
    "webdav": "pip install webdav4",
}


def protocol_of(url: str) -> str:
    """Return the protocol of ``url`` (``"s3"`` for ``s3://bucket/x``; ``"file"`` for paths)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _with_default_timeouts(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """Give s3fs bounded connect/read timeouts unless the user chose some.

    botocore's default read timeout is 60 s per attempt, which hides a hung server for minutes.
    """
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        options["config_kwargs"] = config
    return options


def _forget_inherited(fs: Any) -> None:
    """Keep a filesystem inherited across a fork from ever being finalized in this child.

    Its event loop and connections belong to the parent; s3fs's finalizer would try to
    close them on this process's loop (``attached to a different loop`` errors at exit).
    """
    _INHERITED.append(fs)
    _detach_finalizers(fs)


def _detach_finalizers(fs: Any) -> None:
    import weakref

    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[0] is fs:
            finalizer.detach()


def filesystem_class(url: str) -> Any:
    """Return the fsspec filesystem class for ``url``'s protocol.

    Raises:
        ConfigError: If the protocol is unknown or its package is missing (with the
            ``pip install`` that fixes it).
    """
    import fsspec

    protocol = protocol_of(url)
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(protocol, f"install the fsspec implementation of {protocol!r}")
        raise ConfigError(f"{url}: reading {protocol}:// URLs needs a package that is missing ({exc}); {hint}") from exc
    except ValueError as exc:
        raise ConfigError(f"{url}: unknown protocol {protocol!r} ({exc})") from exc


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Return ``(filesystem, root path)`` for ``url``, one instance per process and options.

    Instances are cached here per process id, never shared with a parent through fsspec's
    own instance cache; they live as long as the process, and their finalizers are
    detached: s3fs's would schedule the session's close on whatever event loop the
    collecting thread has (``Task exception was never retrieved`` at worker exit), and
    the operating system closes the sockets with the process anyway.

    Raises:
        ConfigError: If the protocol is unknown or its package is not installed (the
            message says what to ``pip install``).
    """
    protocol = protocol_of(url)
    options = _with_default_timeouts(protocol, dict(storage_options or {}))
    options.setdefault("skip_instance_cache", True)
    cls = filesystem_class(url)
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            try:
                fs = cls(**options)
            except TypeError as exc:
                raise ConfigError(f"{url}: bad storage_options for {protocol}:// ({exc})") from exc
            _detach_finalizers(fs)
            _FILESYSTEMS[key] = fs
    root = cls._strip_protocol(url)
    root = root.rstrip("/") if isinstance(root, str) else root
    return fs, root


def default_cache_dir() -> str:
    """``$STREAMLOAD_CACHE`` if set, else ``$XDG_CACHE_HOME/streamload`` or ``~/.cache/streamload``."""
    env = os.environ.get("STREAMLOAD_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "streamload")


def dataset_cache_key(url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Return a short hash naming a dataset's cache directory: of its URL and endpoint.

    The same ``s3://bucket/x`` on two servers must not share a cache.
    """
    client = (storage_options or {}).get("client_kwargs") or {}
    endpoint = client.get("endpoint_url") if isinstance(client, Mapping) else None
    endpoint = endpoint or (storage_options or {}).get("endpoint_url")
    text = json.dumps([url.rstrip("/"), endpoint])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _translate(exc: BaseException, url: str, action: str, *, manifest: bool = False) -> StreamloadError:
    """Return the streamload error for a failed remote call (the caller raises it ``from exc``)."""
    if isinstance(exc, StreamloadError):
        return exc
    if isinstance(exc, FileNotFoundError) or getattr(exc, "status", None) == 404:
        if manifest:
            return ManifestNotFoundError(
                f"{url} does not exist: is this a streamload dataset? (for tar shards written by other "
                "tools, run `streamload index URL`)"
            )
        return ShardNotFoundError(f"{url} does not exist (listed in the manifest)")
    if isinstance(exc, PermissionError) or is_permanent(exc):
        return StorageError(f"cannot {action} {url}: access denied or bad request ({type(exc).__name__}: {exc})")
    if is_transient(exc):
        notes = "; ".join(getattr(exc, "__notes__", []))
        return StorageError(f"cannot {action} {url}: storage unavailable ({type(exc).__name__}: {exc}) {notes}".strip())
    return StorageError(f"cannot {action} {url}: {type(exc).__name__}: {exc}")


class _Remote:
    """An fsspec filesystem for one URL prefix, re-created in each process."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, retry: RetryPolicy) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()
        filesystem_class(self.url)  # fail now on a missing package; connect lazily

    @property
    def fs(self) -> Any:
        """The filesystem of this process (created lazily, again after a fork)."""
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                if self._fs is not None:
                    _forget_inherited(self._fs)
                self._fs, self._root = open_filesystem(self.url, self.storage_options)
                self._pid = os.getpid()
            return self._fs

    def path(self, name: str) -> str:
        """The filesystem path of file ``name`` under the prefix."""
        self.fs  # noqa: B018 - sets _root
        return f"{self._root}/{check_file_name(name, 'file name')}"

    def url_of(self, name: str) -> str:
        """The URL of file ``name``, for messages."""
        return f"{self.url}/{name}"

    def call(
        self,
        action: str,
        name: str,
        func: Callable[[], Any],
        *,
        manifest: bool = False,
        stop: threading.Event | None = None,
    ) -> Any:
        """Run ``func`` with retries; translate its final error into a streamload error."""
        url = self.url_of(name)
        try:
            return retry_call(func, self.retry, f"{action} {url}", stop)
        except Exception as exc:
            raise _translate(exc, url, action, manifest=manifest) from exc
        finally:
            _detach_finalizers(self._fs)  # s3fs registers one when it first connects

    def cat(self, name: str, *, manifest: bool = False) -> bytes:
        """Return the bytes of file ``name``."""
        path = self.path(name)
        data = self.call("read", name, lambda: self.fs.cat_file(path), manifest=manifest)
        assert isinstance(data, bytes)
        return data

    def size(self, name: str) -> int | None:
        """Return the size of file ``name``, or ``None`` if it does not exist."""
        path = self.path(name)
        try:
            info = self.call("stat", name, lambda: self.fs.info(path))
        except ShardNotFoundError:
            return None
        size = info.get("size")
        return int(size) if size is not None else None

    def download(
        self,
        name: str,
        part: str,
        cancelled: Callable[[], bool],
        stop: threading.Event | None = None,
        max_bytes: int | None = None,
    ) -> int:
        """Copy file ``name`` into local ``part``; return the number of bytes.

        A transient failure resumes at the byte where it stopped (or restarts, for streams
        that cannot seek). With ``max_bytes`` (the bytes the cache reserved for ``part``),
        the file never grows past it: an object longer than that is a
        :class:`~streamload.CorruptShardError` at once, not a cache over its limit until
        the size check after the download.
        """
        path = self.path(name)
        with open(part, "r+b") as out:
            state = {"offset": 0}

            def attempt() -> None:
                out.seek(state["offset"])
                out.truncate()
                with self._open(path) as src:
                    if state["offset"]:
                        if src.seekable():
                            src.seek(state["offset"])
                        else:
                            state["offset"] = 0
                            out.seek(0)
                            out.truncate()
                    while not cancelled():
                        chunk = src.read(_CHUNK)
                        if not chunk:
                            return
                        if max_bytes is not None and state["offset"] + len(chunk) > max_bytes:
                            raise CorruptShardError(
                                f"{name}: the object is longer than the {max_bytes} bytes the manifest says"
                            )
                        out.write(chunk)
                        state["offset"] += len(chunk)

            self.call("download", name, attempt, stop=stop)
            out.flush()
            return state["offset"]

    def _open(self, path: str) -> Any:
        if protocol_of(self.url) in ("http", "https"):
            return self.fs.open(path, "rb", block_size=0)  # a plain stream: no range requests needed
        return self.fs.open(path, "rb", block_size=_CHUNK, cache_type="none")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fs=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


@dataclass
class _Task:
    entry: FileEntry
    cancelled: bool = False


class RemoteStorage(Storage):
    """A dataset at a remote fsspec URL, read through a bounded, shared local cache.

    Args:
        url: The dataset's URL prefix (``s3://bucket/prefix``...).
        storage_options: Passed to the fsspec filesystem (credentials, ``client_kwargs``,
            ``anon``...). Without them, fsspec's usual sources apply (``AWS_*`` variables,
            ``~/.aws/credentials``, ``GOOGLE_APPLICATION_CREDENTIALS``...).
        cache_dir: Cache directory shared by all processes of the machine (default:
            :func:`default_cache_dir`); this dataset uses ``<cache_dir>/<hash of URL>``.
        cache_limit: Byte bound of this dataset's cache (int or ``"20GB"``); ``None``: none.
            Must hold at least two of the largest shards (with its sidecar); allow
            ``(readers on the machine + 1)`` for them not to wait on each other.
        read_ahead: Shards each process downloads ahead in background threads.
        verify_hash: Hash every download against the manifest (size is always checked).
        retry: How transient errors are retried (default: up to 120 s per call).
        wait_timeout: Seconds an acquire waits for other readers to free cache room.
    """

    prefetches = True

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        *,
        read_ahead: int = DEFAULT_READ_AHEAD,
        verify_hash: bool = True,
        retry: RetryPolicy | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        if read_ahead < 0:
            raise ConfigError(f"{read_ahead=} must be >= 0")
        self.url = url.rstrip("/")
        self.read_ahead = read_ahead
        self.prefetches = read_ahead > 0
        self.limit = None if cache_limit is None else parse_bytes(cache_limit, name="cache_limit")
        if self.limit is not None and self.limit <= 0:
            raise CacheError(f"cache_limit={cache_limit!r} must be positive (cache for {self.url})")
        self._remote = _Remote(self.url, storage_options, retry or RetryPolicy())
        base = cache_dir if cache_dir is not None else default_cache_dir()
        self.cache_root = os.path.join(os.path.expanduser(str(base)), dataset_cache_key(self.url, storage_options))
        try:
            self.cache = ShardCache(self.cache_root, self.limit, verify_hash=verify_hash, wait_timeout=wait_timeout)
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.cache_root} for {self.url}: {exc}") from exc
        self._hash_algorithm: str | None = None
        self._largest = 0
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pins: dict[str, tuple[Pin, int]] = {}  # name -> (pin, acquire count)
        self._queue: list[_Task] = []
        self._running: dict[str, _Task] = {}
        self._threads: list[threading.Thread] = []
        self._window: set[str] = set()
        self._starved: set[str] = set()  # acquires waiting for room: read-ahead pauses

    def _check_process(self) -> None:
        """After a fork, forget the parent's threads and pins.

        The child's copies of the parent's lock descriptors are closed; the parent's locks
        are unaffected (a flock belongs to the open file, which the parent still holds).
        """
        if self._pid != os.getpid():
            for pin, _ in self._pins.values():
                pin.close()
            self._init_process_state()

    @property
    def stats(self) -> CacheStats:
        """Hits, downloads and bytes downloaded by this process."""
        return self.cache.stats

    # -- Storage interface -----------------------------------------------------------

    def read_bytes(self, name: str) -> bytes:
        """Return file ``name`` (the manifest) from the remote, retried, not cached.

        Reading the manifest also checks that ``cache_limit`` can hold its largest shards.
        """
        self._check_process()
        data = self._remote.cat(name, manifest=name == MANIFEST_NAME)
        if name == MANIFEST_NAME:
            self._learn(data)
        return data

    def _learn(self, data: bytes) -> None:
        try:
            manifest = Manifest.loads(data, where=self._remote.url_of(MANIFEST_NAME))
        except ManifestError:
            return  # the caller parses it again and reports the problem
        self.learn_manifest(manifest)

    def learn_manifest(self, manifest: Manifest) -> None:
        """Record the hash algorithm and check the cache can hold the largest shards.

        Raises:
            CacheError: If ``cache_limit`` is below :data:`MIN_CACHE_SHARDS` largest shards.
        """
        self._hash_algorithm = manifest.hash_algorithm
        self._largest = max((_with_sidecar(s) for s in manifest.shards), default=0)
        need = MIN_CACHE_SHARDS * self._largest
        if self.limit is not None and self.limit < need:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {self.url}: the largest shard "
                f"with its sidecar is {format_bytes(self._largest)}, and a reader needs at least "
                f"{MIN_CACHE_SHARDS} of them ({format_bytes(need)}) cached at once"
            )

    def _algorithm(self, entry: FileEntry) -> str | None:
        """Return the hash algorithm of ``entry.hash``.

        The manifest's, if this storage read it; else told by the digest's length (the
        storage of a DataLoader worker never reads the manifest).
        """
        if self._hash_algorithm is not None or entry.hash is None:
            return self._hash_algorithm
        return _ALGORITHM_BY_HEX_LENGTH.get(len(entry.hash))

    def max_open(self, largest: int) -> int | None:
        """How many shards of ``largest`` bytes one reader should keep open (pinned) at once."""
        if self.limit is None or largest <= 0:
            return None
        return max(1, self.limit // largest // 2 - 1)

    def acquire(self, entry: FileEntry) -> str:
        """Pin ``entry`` in the cache, downloading it first if needed; return its local path.

        Raises:
            ShardNotFoundError: The object does not exist.
            StorageError: Access denied, or the storage stayed unavailable past the retry budget.
            CorruptShardError: The downloaded bytes do not match the manifest.
            CacheError: No room could be made within ``wait_timeout``.
        """
        self._check_process()
        with self._lock:
            held = self._pins.get(entry.name)
            if held is not None:
                self._pins[entry.name] = (held[0], held[1] + 1)
                return self.cache.data_path(entry.name)
        self._check_fits(entry)
        pin = self.cache.pin(entry.name)
        try:
            path = self.cache.fill(
                entry,
                self._algorithm(entry),
                self._downloader(entry),
                on_wait=lambda: self._drop_ahead(keep=entry.name),
            )
        except CorruptShardError as exc:
            pin.close()
            raise CorruptShardError(f"{self._remote.url_of(entry.name)}: {exc}") from exc
        except BaseException:
            pin.close()
            raise
        finally:
            with self._lock:
                self._starved.discard(entry.name)
        assert path is not None
        with self._lock:
            self._pins[entry.name] = (pin, 1)
        return path

    def _check_fits(self, entry: FileEntry) -> None:
        if self.limit is not None and MIN_CACHE_SHARDS * entry.num_bytes > self.limit:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {self._remote.url_of(entry.name)} "
                f"({format_bytes(entry.num_bytes)}): it must hold at least {MIN_CACHE_SHARDS} such files"
            )

    def release(self, entry: FileEntry) -> None:
        """Unpin ``entry``: it stays cached until evicted."""
        self._check_process()
        with self._lock:
            held = self._pins.get(entry.name)
            if held is None:
                return
            pin, count = held
            if count > 1:
                self._pins[entry.name] = (pin, count - 1)
                return
            del self._pins[entry.name]
        pin.close()

    def prefetch(self, entries: Iterable[FileEntry]) -> None:
        """Make the first ``read_ahead`` of ``entries`` (with their sidecars) the read-ahead window.

        They are fetched in background threads; queued fetches that left the window are
        forgotten. An empty iterable cancels all read-ahead (end of an epoch).
        """
        self._check_process()
        if not self.prefetches:
            return
        wanted: list[FileEntry] = []
        for entry in list(entries)[: self.read_ahead]:
            if isinstance(entry, ShardEntry) and entry.sidecar is not None:
                wanted.append(entry.sidecar)
            wanted.append(entry)
        names = {e.name for e in wanted}
        with self._lock:
            self._window = names
            for task in self._queue:
                task.cancelled = task.entry.name not in names
            self._queue = [t for t in self._queue if not t.cancelled]
            if not names:
                for task in self._running.values():
                    task.cancelled = True
            queued = {t.entry.name for t in self._queue} | set(self._running)
            for entry in wanted:
                if entry.name not in queued and entry.name not in self._pins:
                    self._queue.append(_Task(entry))
            self._start_threads()

    def _start_threads(self) -> None:
        """Start read-ahead threads up to ``read_ahead`` (caller holds the lock)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        while self._queue and len(self._threads) < self.read_ahead and not self._stop.is_set():
            thread = threading.Thread(target=self._read_ahead_loop, name="streamload-read-ahead", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _read_ahead_loop(self) -> None:
        """Fetch queued files until the queue is empty, then exit (no idle threads)."""
        while not self._stop.is_set():
            with self._lock:
                if not self._queue:
                    return
                task = self._queue.pop(0)
                self._running[task.entry.name] = task
            try:
                self._fetch_ahead(task)
            except Exception as exc:  # noqa: BLE001 - the reader's acquire reports it
                import logging

                logging.getLogger("streamload").debug("read-ahead of %s failed: %s", task.entry.name, exc)
            finally:
                with self._lock:
                    self._running.pop(task.entry.name, None)

    def _fetch_ahead(self, task: _Task) -> None:
        entry = task.entry
        pin = self.cache.pin(entry.name)

        def cancelled() -> bool:
            return task.cancelled or self._stop.is_set() or bool(self._starved)

        if cancelled():
            pin.close()
            return

        try:
            self.cache.fill(entry, self._algorithm(entry), self._downloader(entry), wait=False, cancelled=cancelled)
        finally:
            # Read-ahead files are not kept pinned: pins held by a reader that is not
            # reading (its DataLoader queue is full) would starve the others. A fresh file
            # is the most recently used, so it is evicted last.
            pin.close()

    def _drop_ahead(self, keep: str) -> None:
        """Pause read-ahead (and stop its downloads) while an acquire waits for room.

        Otherwise read-ahead could take the room that acquire waits for.
        """
        with self._lock:
            self._starved.add(keep)

    def _downloader(self, entry: FileEntry) -> Callable[[str, Callable[[], bool]], None]:
        def download(part: str, cancelled: Callable[[], bool]) -> None:
            self._remote.download(entry.name, part, cancelled, self._stop, max_bytes=entry.num_bytes)

        return download

    def close(self) -> None:
        """Stop read-ahead (in-flight downloads stop at their next chunk) and drop all pins."""
        if self._pid != os.getpid():
            self._init_process_state()
            return
        self._stop.set()
        with self._lock:
            self._queue.clear()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)
        with self._lock:
            pins = [p for p, _ in self._pins.values()]
            self._pins.clear()
            self._threads = []
        for pin in pins:
            pin.close()
        self._stop = threading.Event()

    def describe(self) -> str:
        """The URL and the cache directory."""
        return f"{self.url} (cache {self.cache_root})"

    def __getstate__(self) -> dict[str, Any]:
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k
            in (
                "url",
                "read_ahead",
                "prefetches",
                "limit",
                "_remote",
                "cache_root",
                "cache",
                "_hash_algorithm",
                "_largest",
            )
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()


def _with_sidecar(entry: ShardEntry) -> int:
    return entry.num_bytes + (entry.sidecar.num_bytes if entry.sidecar else 0)


class RemoteDestination(Destination):
    """A dataset being written to a remote URL prefix: staged locally, uploaded whole.

    Args:
        url: The destination URL prefix (``s3://bucket/prefix``). The bucket must exist.
        storage_options: Passed to the fsspec filesystem.
        retry: How transient upload errors are retried.
    """

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._remote = _Remote(self.url, storage_options, retry or RetryPolicy())
        self._staging = tempfile.mkdtemp(prefix="streamload-upload-")
        self._owner_pid = os.getpid()

    def staging_path(self, name: str) -> str:
        """Return a fresh local temporary file for ``name``."""
        os.makedirs(self._staging, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"{check_file_name(name, 'file name')}.", dir=self._staging)
        os.close(fd)
        return path

    def commit(self, staged: str, name: str) -> None:
        """Upload ``staged`` as ``name`` (retried), then delete the local file."""
        path = self._remote.path(name)
        self._remote.call("upload", name, lambda: self._remote.fs.put_file(staged, path))
        os.unlink(staged)

    def exists(self, name: str) -> int | None:
        """Return the size of ``name`` or ``None``."""
        path = self._remote.path(name)

        def info() -> Any:
            self._remote.fs.invalidate_cache(path)
            return self._remote.fs.info(path)

        try:
            result = self._remote.call("stat", name, info)
        except ShardNotFoundError:
            return None
        return int(result["size"])

    def read_bytes(self, name: str) -> bytes:
        """Return the content of ``name``."""
        return self._remote.cat(name, manifest=name == MANIFEST_NAME)

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        path = self._remote.path(name)
        try:
            self._remote.call("delete", name, lambda: self._remote.fs.rm_file(path))
        except ShardNotFoundError:
            pass

    def list_names(self, suffix: str) -> list[str]:
        """Return the sorted plain file names under the prefix ending with ``suffix``."""
        root = self._remote.path(MANIFEST_NAME).rsplit("/", 1)[0]
        listed = self._remote.call("list", "", lambda: self._remote.fs.ls(root, detail=False, refresh=True))
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed]
        return sorted(n for n in names if n.endswith(suffix) and not n.startswith("."))

    def close(self) -> None:
        """Delete the local staging directory."""
        shutil.rmtree(self._staging, ignore_errors=True)

    def __del__(self) -> None:
        staging = getattr(self, "_staging", None)
        if staging is not None and getattr(self, "_owner_pid", -1) == os.getpid():
            shutil.rmtree(staging, ignore_errors=True)


def index_remote(
    url: str,
    fmt: Any,
    hash_algorithm: str | None = "sha256",
    classes: tuple[str, ...] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """``streamload index`` for a URL prefix: index every ``*.tar`` (sorted by name).

    Each shard is downloaded to a temporary file (one at a time), its sidecar is built
    and uploaded, and ``index.json`` is uploaded last.

    Raises:
        ConfigError: If the prefix holds no shard of the format.
    """
    from ..verify import index_shard, publish_index

    dest = RemoteDestination(url, storage_options)
    try:
        names = dest.list_names(fmt.extension)
        if not names:
            raise ConfigError(f"{url}: no *{fmt.extension} objects to index")
        indexed = []
        for name in names:
            local = dest.staging_path(name)
            try:
                dest._remote.download(name, local, lambda: False)
                indexed.append(index_shard(fmt, dest, local, name, hash_algorithm))
            finally:
                dest.discard(local)
        return publish_index(dest, fmt, indexed, hash_algorithm, classes)
    finally:
        dest.close()
