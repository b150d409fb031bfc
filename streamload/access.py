"""Random access: :class:`ShardedDataset`, a map-style view of a dataset, by index or by key.

::

    ds = ShardedDataset("s3://bucket/train", storage=StorageConfig(storage_options=...))
    len(ds); ds[0]; ds[-1]; ds[10:20]          # samples by global index (a slice is a lazy view)
    ds.get("n01440764/n01440764_10026")        # by key, through the key index
    DataLoader(ds, sampler=DistributedSampler(ds), num_workers=8)

**Index -> sample.** Global index ``i`` is located by a binary search over the manifest's
cumulative shard counts (O(shards) memory), then read with the shard's reader
(``ShardReader.get``); shards are opened on first use in each process through
:class:`~streamload.shards.ShardSource` (local files in place, remote ones through the
shared cache), at most ``open_readers`` at a time. The dataset is picklable and holds
nothing open when pickled, so DataLoader workers open their own shards.

**Key -> index.** Built once from the shards' own indexes (``ShardReader.keys_of``: the
tar sidecar, the LMDB catalog record, the HDF5 keys table), never by reading samples:
two ``N``-long arrays, the keys' 64-bit xxh3 hashes sorted, and the global index of each
(16 bytes per sample). A lookup is a binary search for the hash, then the real key of
each candidate is read from its shard's index and compared, so a hash collision never
returns the wrong sample. The arrays are one ``.npy`` file under
``<cache_dir>/keys/`` (default ``$STREAMLOAD_CACHE`` or ``~/.cache/streamload``), named by
the dataset's URL and manifest digest, written atomically and memory-mapped, so every
worker and rank on a machine shares one copy in the page cache and builds it at most once
per process that finds it missing. The cache's rules hold for it: ``keys/`` must be a real
directory of this user that others cannot write (else the index is kept in memory), the
file is opened with ``O_NOFOLLOW``, used only if no one else could have written it (else
rebuilt), and replaced by a rename (a link there is never followed), and
a file read back is checked (hashes ascending, each position once, a few samples' keys where
it says); a key it says is missing is confirmed against the shards' own indexes once per
process, and a file that disagrees is rebuilt. For a remote dataset, building it reads every shard's
index through the cache (LMDB and HDF5 keep it inside the shard, so those are downloaded).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import operator
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch.utils.data
import xxhash

from ._atexit import close_at_exit
from ._errors import ConfigError, SampleNotFoundError, StreamloadError
from ._fork import ProcessLocal
from ._redact import redact
from .ahead import ShardsAhead
from .dataref import DatasetRef
from .formats import Sample
from .manifest import Manifest
from .plan import Run
from .recovery import raise_located
from .shards import ShardSource
from .storage import is_local, local_path_of
from .storage.cache.layout import trusted_file
from .storageconfig import CACHE_KEYWORDS, CacheKeywords, StorageConfig, config_from_arguments

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11 (only read by type checkers here)

__all__ = ["KeyIndex", "SampleView", "ShardedDataset"]

log = logging.getLogger("streamload")

#: Shard readers a process keeps open by default (random access touches shards at random;
#: reopening one costs from ~0.1 ms for tar to ~2 ms for HDF5, see benchmarks/bench_access.py).
DEFAULT_OPEN_READERS = 64

KeyIndexMode = Literal["disk", "memory"]


def key_hash(key: str) -> int:
    """Return the 64-bit hash the key index sorts by (xxh3_64 of the UTF-8 key)."""
    return int(xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape")))


class KeyIndex:
    """Sorted key hashes and the global index of each: ``2 x N`` ``uint64`` (see the module docstring).

    Args:
        table: ``uint64[2, N]``: row 0 the hashes, ascending; row 1 the global indices
            (ascending among equal hashes).
    """

    def __init__(self, table: np.ndarray) -> None:
        if table.ndim != 2 or table.shape[0] != 2 or table.dtype != np.uint64:
            raise ConfigError(f"a key index is uint64[2, N], got {table.dtype}{list(table.shape)}")
        self.table = table
        self.hashes = table[0]
        self.positions = table[1]

    def __len__(self) -> int:
        return int(self.table.shape[1])

    @classmethod
    def from_keys(cls, hashes: np.ndarray, positions: np.ndarray) -> KeyIndex:
        """Build the index from unsorted ``hashes`` and their global ``positions``."""
        order = np.lexsort((positions, hashes))
        table = np.empty((2, len(order)), dtype=np.uint64)
        table[0] = hashes[order]
        table[1] = positions[order]
        return cls(table)

    def candidates(self, key: str) -> list[int]:
        """Return the global indices whose key has ``key``'s hash (ascending)."""
        h = np.uint64(key_hash(key))
        lo = int(np.searchsorted(self.hashes, h, side="left"))
        hi = int(np.searchsorted(self.hashes, h, side="right"))
        return [int(p) for p in self.positions[lo:hi]]

    def save(self, path: str, shared: bool = False) -> None:
        """Write the index to ``path`` atomically (a ``.npy`` file), never through a link.

        The folder must be a real directory of this user (see :func:`open_keys_dir`); the
        file is written under a temporary name and renamed over ``path`` (a link there is
        replaced, never followed).

        Raises:
            OSError: If the folder cannot be made or is refused (a link, another user's).
        """
        folder, name = os.path.split(path)
        dir_fd = open_keys_dir(folder, shared=shared)
        tmp = f".keys-{os.getpid()}-{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, self.table, allow_pickle=False)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)

    @classmethod
    def load(cls, path: str, expected: int, shared: bool = False) -> KeyIndex | None:
        """Memory-map the index at ``path``; ``None`` if it is missing, not ``expected`` keys long, or unsafe.

        Unsafe: a link (never followed), not a regular file, a file someone else could have
        written (the cache's rule: writable by every user, or, unless the cache is shared,
        another user's or writable by the group), or a file in a folder that is a link or
        others can write (see :func:`open_keys_dir`). Its content is checked as
        :meth:`check` does.
        """
        folder, name = os.path.split(path)
        try:
            dir_fd = open_keys_dir(folder, create=False, shared=shared)
        except OSError:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:  # missing, or a link (ELOOP)
            return None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or not trusted_file(st, shared):
                return None  # rebuilt and written over by this user
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    return None
            except ValueError:
                return None
            offset = f.tell()
            if shape != (2, expected) or fortran or dtype != np.dtype(np.uint64):
                return None
            if st.st_size != offset + 16 * expected:
                return None
            if expected == 0:
                return cls(np.empty((2, 0), dtype=np.uint64))
            table = np.memmap(f, dtype=np.uint64, mode="r", offset=offset, shape=(2, expected))
        keys = cls(table)
        return keys if keys.check() else None

    def check(self) -> bool:
        """Return True if the table is well formed: hashes ascending, positions each index once."""
        n = len(self)
        if not n:
            return True
        if bool(np.any(self.hashes[1:] < self.hashes[:-1])) or int(self.positions.max()) >= n:
            return False
        return bool(np.all(np.bincount(self.positions.astype(np.int64), minlength=n) == 1))


def open_keys_dir(folder: str, *, create: bool = True, shared: bool = False) -> int:
    """Open the key index folder (``<cache_dir>/keys``) as a directory descriptor, never through a link.

    The cache's own rules: the folder is made with mode ``0o755``, must be a real
    directory (``O_NOFOLLOW``: a symbolic link is refused, not followed), never writable by
    every user, and belong to this user and not be writable by its group unless
    ``shared`` (the dataset's resolved ``cache_shared``: ``STREAMLOAD_CACHE_SHARED=1``).

    Raises:
        OSError: If it cannot be made or opened, or is refused (the message says why).
    """
    if create:
        os.makedirs(os.path.dirname(folder) or ".", mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o755)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(exc.errno, f"{folder} is a link or not a directory; the cache never follows one") from exc
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() and not shared:
        os.close(fd)
        raise OSError(errno.EPERM, f"{folder} belongs to another user (set STREAMLOAD_CACHE_SHARED=1 if on purpose)")
    if st.st_mode & stat.S_IWOTH or (not shared and st.st_mode & stat.S_IWGRP):
        os.close(fd)
        who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
        raise OSError(
            errno.EPERM,
            f"{folder} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): another user could plant a key "
            "index there",
        )
    return fd


class ShardedDataset(torch.utils.data.Dataset[Any]):
    """A map-style dataset over a sharded dataset: ``ds[i]``, slices, and ``ds.get(key)``.

    Reads the same samples as :class:`~streamload.StreamingDataset` (sample ``i`` is the
    ``i``-th in manifest order: shard by shard), one at a time, for samplers, evaluation,
    debugging and lookups. Picklable; shards are opened lazily in each process.

    Args:
        source: Dataset directory or URL prefix holding ``index.json``.
        transform: Function applied to each sample dict (e.g. :class:`~streamload.ImageLabel`).
        storage: How the files are reached (a :class:`~streamload.StorageConfig`): fsspec
            options, the cache of remote shards (its ``cache_dir`` also holds the key
            index), its bound, and ``read_ahead`` (shards downloaded ahead while the key
            index is built). Random access reads whole shards through the cache:
            ``cache`` may be ``"shards"`` or ``"auto"`` (the same here), not ``"none"``;
            ``stream_buffer`` does not apply. The keywords ``storage_options=``,
            ``cache_dir=``, ``cache_limit=`` and ``read_ahead=`` are deprecated (a
            ``DeprecationWarning``; they go in the next release).
        open_readers: Shard readers each process keeps open (least recently used closed first).
        key_index: ``"disk"``: keep the key index in a file under ``<cache_dir>/keys/``,
            shared by every process of the machine; ``"memory"``: build it per process.

    Raises:
        ManifestNotFoundError: If ``source`` holds no dataset.

    Example:
        >>> ds = ShardedDataset("/data/imagenet-shards", transform=ImageLabel(224))  # doctest: +SKIP
        >>> image, label = ds[12345]  # doctest: +SKIP
        >>> sample = ShardedDataset("/data/imagenet-shards").get("n01440764/n01440764_10026")  # doctest: +SKIP
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        transform: Callable[[Sample], Any] | None = None,
        storage: StorageConfig | None = None,
        open_readers: int = DEFAULT_OPEN_READERS,
        key_index: KeyIndexMode = "disk",
        **deprecated: Unpack[CacheKeywords],
    ) -> None:
        config = config_from_arguments("ShardedDataset", storage, deprecated, accepted=CACHE_KEYWORDS)
        config = config or StorageConfig()
        if config.cache == "none":
            raise ConfigError(
                "ShardedDataset reads whole shards through the cache: cache='none' (streaming) is for "
                "StreamingDataset; use cache='shards' or 'auto'"
            )
        if open_readers < 1:
            raise ConfigError(f"{open_readers=} must be >= 1")
        if key_index not in ("disk", "memory"):
            raise ConfigError(f"key_index={key_index!r} must be 'disk' or 'memory'")
        self.source = str(source)
        self.transform = transform
        self.open_readers = open_readers
        self.key_index_mode: KeyIndexMode = key_index
        #: How the files are reached (``cache`` is ``"shards"``).
        self.storage: StorageConfig = replace(config, cache="shards")
        self.ref = DatasetRef.open(self.source, self.storage)
        self.manifest: Manifest = self.ref.manifest
        #: Global index of each shard's first sample; the last entry is the sample count.
        self.starts = np.concatenate([[0], np.cumsum(self.manifest.shard_counts, dtype=np.int64)]).astype(np.int64)
        #: This process's open shards over its own storage (made on first access, anew after a fork).
        self._readers: ProcessLocal[ShardSource] = _readers_of(self.ref, open_readers)
        self._keys: KeyIndex | None = None
        #: The key index in use was built (or compared with one built) by this process.
        self._keys_checked = False

    # -- by index ----------------------------------------------------------------------

    def __len__(self) -> int:
        """Samples in the dataset."""
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """Return ``(shard, index within the shard)`` of global index ``index`` (negative counts from the end).

        Raises:
            IndexError: If ``index`` is out of range.
        """
        n = len(self)
        if isinstance(index, (bool, np.bool_)):  # True is 1 to operator.index: never what was meant
            raise TypeError(f"sample indices are integers, not {type(index).__name__} ({index!r})")
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for {redact(self.source)} ({n} samples)")
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return shard, i - int(self.starts[shard])

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> SampleView: ...

    def __getitem__(self, index: int | slice) -> Any:
        """Return sample ``index`` (transformed), or a lazy :class:`SampleView` of a slice.

        Raises:
            IndexError: If the index is out of range.
        """
        if isinstance(index, slice):
            return SampleView(self, range(len(self))[index])
        shard, local = self.locate(index)
        return self._read(shard, local)

    def key_of(self, index: int) -> str:
        """Return the key of sample ``index`` from its shard's index (no sample is read)."""
        shard, local = self.locate(index)
        return self._key_at(shard, local)

    def _read(self, shard: int, local: int) -> Any:
        readers = self._source()
        entry = self.manifest.shards[shard]
        try:
            sample = readers.get(shard).get(local)
        except StreamloadError as exc:
            raise_located(exc, self.source, self.ref.where(entry))
        return sample if self.transform is None else self.transform(sample)

    def _key_at(self, shard: int, local: int) -> str:
        return self._source().get(shard).keys_of(np.array([local], dtype=np.int64))[0]

    # -- by key ------------------------------------------------------------------------

    def index_of(self, key: str) -> int:
        """Return the global index of the sample keyed ``key`` (the first, if keys repeat).

        Raises:
            SampleNotFoundError: If no sample has that key (a :class:`KeyError`).
            TypeError: If ``key`` is not a string.
        """
        if not isinstance(key, str):
            raise TypeError(f"sample keys are strings, not {type(key).__name__} ({key!r}); use ds[index] for an index")
        found = self._find(self.key_index(), key)
        if found is None and not self._keys_checked:
            # A key index read from disk is confirmed against the shards' own indexes (once
            # per process) before a key is called missing: a damaged or planted file is rebuilt.
            found = self._find(self._confirm_key_index(), key)
        if found is None:
            raise SampleNotFoundError(f"no sample with key {key!r} in {self.source}")
        return found

    def _find(self, keys: KeyIndex, key: str) -> int | None:
        for position in keys.candidates(key):
            shard, local = self.locate(position)
            if self._key_at(shard, local) == key:
                return position
        return None

    def get(self, key: str) -> Any:
        """Return the sample keyed ``key`` (transformed).

        Raises:
            SampleNotFoundError: If no sample has that key (a :class:`KeyError`).
            TypeError: If ``key`` is not a string (an index is ``ds[index]``).
        """
        return self[self.index_of(key)]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            self.index_of(key)
        except SampleNotFoundError:
            return False
        return True

    def key_index(self) -> KeyIndex:
        """Return the key index, loading it from the disk cache or building it on first use."""
        if self._keys is not None:
            return self._keys
        path = self.key_index_path()
        if self.key_index_mode == "disk":
            loaded = KeyIndex.load(path, len(self), self.storage.cache_is_shared())
            if loaded is not None and self._spot_check(loaded):
                self._keys, self._keys_checked = loaded, False
                return loaded
            if loaded is not None:
                log.warning("the key index %s does not match %s: rebuilding it", path, self.source)
        return self._keep(self._build_key_index())

    def _keep(self, keys: KeyIndex) -> KeyIndex:
        """Use ``keys`` (just built from the shards) and, in ``"disk"`` mode, keep it in its file."""
        if self.key_index_mode == "disk":
            path = self.key_index_path()
            try:
                shared = self.storage.cache_is_shared()
                keys.save(path, shared)
                loaded = KeyIndex.load(path, len(self), shared)  # mapped: the pages are shared, not this process's
                if loaded is not None and np.array_equal(loaded.table, keys.table):
                    keys = loaded
            except OSError as exc:
                log.warning("cannot keep the key index of %s in %s (%s); it stays in memory", self.source, path, exc)
        self._keys, self._keys_checked = keys, True
        return keys

    def _spot_check(self, keys: KeyIndex, samples: int = 32) -> bool:
        """Check that the keys of a few samples, spread over the dataset, are where ``keys`` says."""
        n = len(self)
        for position in sorted({int(p) for p in np.linspace(0, n - 1, min(n, samples))}):
            shard, local = self.locate(position)
            if position not in keys.candidates(self._key_at(shard, local)):
                return False
        return True

    def _confirm_key_index(self) -> KeyIndex:
        """Compare the key index read from disk with one built from the shards; keep the built one if they differ."""
        built = self._build_key_index()
        current = self._keys
        if current is not None and np.array_equal(current.table, built.table):
            self._keys_checked = True
            return current
        log.warning("the key index %s does not match %s: rebuilt", self.key_index_path(), self.source)
        return self._keep(built)

    def key_index_path(self) -> str:
        """Return where the key index file of this dataset (URL and manifest) lives."""
        from .storage.cachedir import dataset_cache_key

        url = os.path.abspath(local_path_of(self.source)) if is_local(self.source) else self.source
        where = dataset_cache_key(url, self.ref.config.options)
        digest = hashlib.sha256(self.manifest.dumps()).hexdigest()[:16]
        base = os.path.expanduser(self.storage.cache_directory())
        return os.path.join(base, "keys", f"{where}-{digest}.npy")

    def _build_key_index(self) -> KeyIndex:
        """Read every shard's keys from its own index (no sample is read)."""
        readers = self._source()
        n = len(self)
        hashes = np.empty(n, dtype=np.uint64)
        counts = self.manifest.shard_counts
        shards = [s for s, count in enumerate(counts) if count]
        zero = np.zeros(1, dtype=np.int64)
        touch = (Run(s, zero, zero, zero) for s in shards)
        for run in ShardsAhead(readers, iter(shards)).fetch_ahead(touch):  # remote: downloads ahead of the reads
            start, count = int(self.starts[run.shard]), counts[run.shard]
            keys = readers.get(run.shard).keys_of(np.arange(count, dtype=np.int64))
            hashes[start : start + count] = [key_hash(k) for k in keys]
        return KeyIndex.from_keys(hashes, np.arange(n, dtype=np.uint64))

    # -- per-process resources ---------------------------------------------------------

    def _source(self) -> ShardSource:
        readers = self._readers.peek()
        if readers is None:
            readers = self._readers.get()
            close_at_exit(self)  # its shards are closed before the interpreter's teardown
        return readers

    def close(self) -> None:
        """Close this process's open shards and storage (reopened on the next access)."""
        self._readers.clear()  # after a fork, the parent's are left alone (not closed here)

    def __del__(self) -> None:
        # Shards left open by a dataset dropped without close(): their descriptors go with it.
        # Never raises, also at interpreter exit (when the modules' globals may be gone).
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - best effort at collection time
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_readers"]
        if self.key_index_mode == "disk":
            state["_keys"] = None  # mapped again from the file in the receiving process
            state["_keys_checked"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = _readers_of(self.ref, self.open_readers)

    def __repr__(self) -> str:
        return (
            f"ShardedDataset({redact(repr(self.source))}, format={self.manifest.format!r}, samples={len(self)}, "
            f"shards={len(self.manifest.shards)})"
        )


def _readers_of(ref: DatasetRef, capacity: int) -> ProcessLocal[ShardSource]:
    """A process's shard readers of ``ref`` over a storage of its own, opened on first use."""

    def make() -> ShardSource:
        storage = ref.open_storage()
        try:
            return ShardSource(ref, storage, capacity, own_storage=True)
        except BaseException:
            storage.close()
            raise

    return ProcessLocal(make, ShardSource.close)


class SampleView:
    """A lazy slice of a :class:`ShardedDataset`: indexing, ``len`` and iteration read on demand.

    Args:
        dataset: The dataset.
        indices: The global indices of the view, in order.
    """

    def __init__(self, dataset: ShardedDataset, indices: range) -> None:
        self.dataset = dataset
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> SampleView: ...

    def __getitem__(self, index: int | slice) -> Any:
        """Return the view's sample ``index``, or a narrower view.

        Raises:
            IndexError: If the index is out of range of the view.
        """
        if isinstance(index, slice):
            return SampleView(self.dataset, self.indices[index])
        if isinstance(index, (bool, np.bool_)):
            raise TypeError(f"sample indices are integers, not {type(index).__name__} ({index!r})")
        try:
            position = self.indices[operator.index(index)]
        except IndexError:
            raise IndexError(f"index {index} out of range for a view of {len(self)} samples") from None
        return self.dataset[position]

    def __iter__(self) -> Iterator[Any]:
        for position in self.indices:
            yield self.dataset[position]

    def keys(self) -> list[str]:
        """Return the keys of the view's samples (from the shards' indexes)."""
        return [self.dataset.key_of(i) for i in self.indices]

    def __repr__(self) -> str:
        r, source = self.indices, redact(repr(self.dataset.source))
        return f"SampleView({source}, range({r.start}, {r.stop}, {r.step}), {len(self)} samples)"
