"""Shard files named one by one (what a WebDataset user types), indexed on the fly into the cache.

``StreamingDataset(["shards/a.tar", "shards/b.tar"])``, ``StreamingDataset("shards/{000..009}.tar")``
and the same with URLs (``"s3://bucket/train/{000..099}.tar"``) read those tar shards, in
the order given: their sidecars and an ``index.json`` are built once (as ``streamload
index FOLDER --output DIR`` would) into ``<cache dir>/shard-lists/<key>/``, the manifest
naming the shards' folder as its ``data_root``. The shards themselves are never written;
remote ones are then read through the cache (or streamed) like any remote dataset, and
checked against the manifest's sizes, hashes and sidecar digests as any other.

Gzip-compressed shards (``.tgz``, ``.tar.gz``, which webdataset reads as a stream) are
decompressed once into that folder instead (a remote one downloaded first), indexed and
read there: a tar shard is read by byte offsets, which a gzip stream does not have.
Decompression stops, naming the shard, before it would leave less than 1 GiB free.

One process of a machine indexes a list while the others (the ranks of a job) wait for
it, under a lock file beside the folder. The key is a digest of the folder, the endpoint,
and each shard's name and size (and, for local files, their modification time; for remote
ones, their ETag), so a shard that changes is indexed again (older folders stay until the
cache directory is cleared). Indexing reads every shard whole once (a remote one is
downloaded for it), so for a large remote dataset ``streamload index`` where the shards
are, once, is cheaper.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import zlib
from typing import Any

from ._errors import CacheError, ConfigError, CorruptShardError, ShardNotFoundError, StreamloadError
from .indexing import COMPRESSED_TAR, index_directory
from .manifest import MANIFEST_NAME
from .storage import StorageSettings, is_local, local_path_of
from .storage.cachedir import dataset_cache_key
from .storage.transport import open_transport
from .storageconfig import StorageConfig

__all__ = ["expand_braces", "index_shard_list", "plain_name", "shard_list"]

#: ``{a..b}`` (numbers; zero-padded to the wider bound when one has a leading zero) or ``{x,y,z}``.
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)")
#: Most names one pattern may expand to (a typo such as ``{0..99999999}`` is refused, not listed).
MAX_EXPANDED = 1_000_000


def expand_braces(pattern: str) -> list[str]:
    """Expand the brace patterns of ``pattern`` as a shell (and ``webdataset``) does.

    ``"s/{000..002}.tar"`` gives ``s/000.tar``, ``s/001.tar``, ``s/002.tar`` (numbers are
    zero-padded to the width of the bounds when one has a leading zero, as in bash);
    ``"{a,b}.tar"`` gives ``a.tar``, ``b.tar``.

    Raises:
        ConfigError: If the pattern expands to more than :data:`MAX_EXPANDED` names.
    """
    out = [pattern]
    while True:
        done: list[str] = []
        changed = False
        for text in out:
            match = _BRACE.search(text)
            if match is None:
                done.append(text)
                continue
            body = match.group(1)
            numbers = _RANGE.fullmatch(body)
            if numbers is not None:
                lo, hi = int(numbers.group(1)), int(numbers.group(2))
                a, b = numbers.group(1).lstrip("-"), numbers.group(2).lstrip("-")
                padded = (len(a) > 1 and a.startswith("0")) or (len(b) > 1 and b.startswith("0"))
                width = max(len(numbers.group(1)), len(numbers.group(2))) if padded else 0
                step = 1 if hi >= lo else -1
                if abs(hi - lo) + 1 > MAX_EXPANDED:
                    raise ConfigError(f"{pattern!r}: {{{body}}} names more than {MAX_EXPANDED} shards")
                items = [f"{n:0{width}d}" for n in range(lo, hi + step, step)]
            elif "," in body:
                items = body.split(",")
            else:
                # Not a pattern (a literal "{x}"): kept, and the search goes on after it.
                items = ["\0" + body + "\1"]
            changed = True
            done.extend(text[: match.start()] + item + text[match.end() :] for item in items)
            if len(done) > MAX_EXPANDED:
                raise ConfigError(f"{pattern!r} names more than {MAX_EXPANDED} shards")
        out = done
        if not changed:
            return [t.replace("\0", "{").replace("\1", "}") for t in out]


def _is_shard_name(text: str) -> bool:
    lower = text.lower().rstrip("/")
    return lower.endswith((".tar", *COMPRESSED_TAR)) and not (is_local(text) and os.path.isdir(local_path_of(text)))


def shard_list(source: object) -> list[str] | None:
    """The shard files ``source`` names (braces expanded), or ``None`` if it names datasets.

    A str or path ending in ``.tar`` (not a folder) or holding a brace pattern that
    expands to such names, or a list of them, is a list of shards.

    Raises:
        ConfigError: For a list mixing shard files and datasets.
    """
    if isinstance(source, (str, os.PathLike)):
        items: list[object] = [source]
    elif isinstance(source, (list, tuple)) and source:
        items = list(source)
    else:
        return None
    if not all(isinstance(i, (str, os.PathLike)) for i in items):
        return None
    names = [str(i) for i in items]
    expanded = [n for name in names for n in (expand_braces(name) if "{" in name else [name])]
    shards = [_is_shard_name(n) for n in expanded]
    if not any(shards):
        return None
    if not all(shards):
        other = next(n for n, s in zip(expanded, shards, strict=True) if not s)
        raise ConfigError(
            f"the source mixes tar shard files and datasets ({other!r} is not a .tar file): give shard files "
            "(a list or a brace pattern such as 'shards/{000..009}.tar') or dataset folders, not both"
        )
    return expanded


def _split(url: str) -> tuple[str, str]:
    """``(folder, file name)`` of a shard path or URL (a local folder made absolute)."""
    if is_local(url):
        path = os.path.abspath(local_path_of(url))
        return os.path.dirname(path), os.path.basename(path)
    head, _, name = url.rstrip("/").rpartition("/")
    return head, name


def _cache_folder(cache_dir: str) -> str:
    """``<cache dir>/shard-lists``, made if needed: ours, a real folder, writable by no one else."""
    base = os.path.join(cache_dir, "shard-lists")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.lstat(base)
    except OSError as exc:
        raise CacheError(f"cannot create {base}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"{base}: the folder of indexed shard lists is a link, another user's or writable by others; "
            "use a cache directory of your own (StorageConfig(cache_dir=...))"
        )
    return base


def open_shard_list(source: Any, storage: Any) -> tuple[Any, Any]:
    """Return ``(given, source)``: a list of tar shards as its files and its indexed folder, else ``source`` twice.

    ``storage`` is the dataset's :class:`~streamload.StorageConfig` (its options and cache directory).
    """
    shards = shard_list(source)
    if shards is None:
        return source, source
    return shards, index_shard_list(shards, storage)


def index_shard_list(urls: list[str], config: StorageConfig) -> str:
    """Index the tar shards ``urls`` (one folder or URL prefix) into the cache; return the dataset's folder.

    ``config`` is the dataset's storage settings: its options, its cache directory, and
    for remote shards its transport's settings (resolved here).

    An index built before for the same files (same names, sizes and, locally,
    modification times) is reused.

    Gzip-compressed shards (``.tgz``, ``.tar.gz``; all of the list's or none) are
    decompressed once into the dataset's folder in the cache and read there.

    Raises:
        ConfigError: For compressed and plain shards mixed, shards in several folders, a
            name given twice, or too little disk space for a decompressed shard.
        ShardNotFoundError: If a shard does not exist.
        CorruptShardError, UnsafeShardError: If a shard cannot be indexed (naming it).
    """
    compressed = [u for u in urls if u.lower().endswith(COMPRESSED_TAR)]
    if compressed and len(compressed) != len(urls):
        plain = next(u for u in urls if not u.lower().endswith(COMPRESSED_TAR))
        raise ConfigError(
            f"the shards mix gzip-compressed tar files ({compressed[0]}) and plain ones ({plain}): name one kind "
            "(`gunzip` the compressed ones, or read them as a list of their own)"
        )
    places = [_split(u) for u in urls]
    folders = sorted({folder for folder, _ in places})
    if len(folders) > 1:
        raise ConfigError(
            f"the shards are in {len(folders)} folders ({folders[0]}, {folders[1]}, ...): name shards of one "
            "folder, or mix the folders as streams (index each with `streamload index FOLDER --output DIR`)"
        )
    root, names = folders[0], [name for _, name in places]
    storage_options = config.storage_options
    settings = None if is_local(root) else config.resolve()
    identity = [root, dataset_cache_key(root, storage_options), _fingerprint(root, names, settings)]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    base = _cache_folder(config.cache_directory())
    final = os.path.join(base, key)
    if os.path.isfile(os.path.join(final, MANIFEST_NAME)):
        return final
    # One process of the machine indexes (the ranks of a job all ask at once); the others wait for it.
    lock = os.open(os.path.join(base, f".{key}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(final, MANIFEST_NAME)):
            _build(root, names, compressed, settings, base, key, final)
    finally:
        os.close(lock)  # releases the lock
    return final


def _build(
    root: str,
    names: list[str],
    compressed: list[str],
    settings: StorageSettings | None,
    base: str,
    key: str,
    final: str,
) -> None:
    """Index the shards into a fresh folder of ``base`` and move it to ``final`` whole."""
    work = tempfile.mkdtemp(prefix=f".{key}.", dir=base)
    try:
        if compressed:  # decompressed once into the dataset's folder, read there in place
            plain_names = _decompress_all(root, names, settings, work)
            index_directory(work, "tar", files=plain_names)
        else:
            options = None if settings is None else settings.storage_options
            index_directory(root, "tar", storage_options=options, output=work, files=names)
        try:
            os.rename(work, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, MANIFEST_NAME)):  # else another process indexed them first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: Room left free on the cache's disk while shards are decompressed into it.
_SPARE_DISK = 1 << 30
_PIECE = 1 << 22


def plain_name(name: str) -> str:
    """The name of the decompressed copy of a compressed shard: ``a.tgz`` and ``a.tar.gz`` give ``a.tar``."""
    lower = name.lower()
    return name[: -len(".tgz")] + ".tar" if lower.endswith(".tgz") else name[: -len(".gz")]


def _decompress_all(root: str, names: list[str], settings: StorageSettings | None, out: str) -> list[str]:
    """Decompress each gzip-compressed shard ``root/name`` into ``out``; return the decompressed names."""
    plain = [plain_name(n) for n in names]
    seen: set[str] = set()
    for name, target in zip(names, plain, strict=True):
        if target in seen:
            raise ConfigError(f"{root}/{name}: another shard of the list also decompresses to {target}")
        seen.add(target)
        if settings is None:  # local
            _gunzip(os.path.join(root, name), os.path.join(out, target), f"{root}/{name}")
            continue
        download = os.path.join(out, f".{target}.gz")
        files = open_transport(root, settings)
        with open(download, "wb"):
            pass  # the download writes into an existing file
        files.download(name, download, lambda: False)
        try:
            _gunzip(download, os.path.join(out, target), f"{root}/{name}")
        finally:
            os.unlink(download)
    return plain


def _gunzip(src: str, dst: str, where: str) -> None:
    """Decompress ``src`` into ``dst``, keeping :data:`_SPARE_DISK` free (a gzip bomb cannot fill the disk)."""
    try:
        with gzip.open(src, "rb") as f, open(dst, "wb") as out:
            while True:
                piece = f.read(_PIECE)
                if not piece:
                    break
                out.write(piece)
                if shutil.disk_usage(os.path.dirname(dst)).free < _SPARE_DISK:
                    raise ConfigError(
                        f"{where}: decompressing it would leave less than {_SPARE_DISK >> 30} GiB free in the "
                        f"cache ({os.path.dirname(dst)}); use a cache directory on a larger disk"
                    )
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"{where} does not exist") from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise CorruptShardError(f"{where}: not a whole gzip file ({exc})") from exc


def _fingerprint(root: str, names: list[str], settings: StorageSettings | None) -> list[list[Any]]:
    """Each shard's name, size and (local files: no ``settings``) modification time: what makes a cached index stale."""
    if settings is None:
        out: list[list[Any]] = []
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                out.append([name, None, None])  # indexing names what is missing
                continue
            out.append([name, st.st_size, st.st_mtime_ns])
        return out
    files = open_transport(root, settings)
    prefix = files.path(MANIFEST_NAME).rsplit("/", 1)[0]
    try:  # one listing (paged), not a request per shard
        listed = files.call("list", "", lambda: files.fs.ls(prefix, detail=True, refresh=True))
        found = {str(i.get("name", "")).rstrip("/").rsplit("/", 1)[-1]: i for i in listed if isinstance(i, dict)}
    except (StreamloadError, OSError, ValueError, NotImplementedError):
        found = {}  # a server that does not list (plain HTTP): one request per shard
    out = []
    for name in names:
        info = found.get(name)
        if info is not None:
            out.append([name, info.get("size"), files.backend.version_of(info)])
        else:
            out.append([name, files.size(name), files.version(name)])
    return out
