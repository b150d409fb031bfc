"""What a dataset file must be, and how to check it: names, sizes, content hashes.

This is the vocabulary the storage layer and the manifest share. Storage is told what a
file must be (a :class:`FileEntry`: name, size, digest and the digest's algorithm) and
checks it; it never reads or parses a manifest. The manifest (``index.json``, see
:mod:`streamload.manifest`) is where entries come from.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from ._errors import ManifestError

__all__ = [
    "pwrite_all",
    "DEFAULT_HASH_ALGORITHM",
    "HASH_ALGORITHMS",
    "FileEntry",
    "algorithm_of",
    "check_file_name",
    "hash_file",
    "hash_stream",
    "is_local",
    "printable",
    "local_path_of",
    "new_hasher",
]

#: fsspec protocols that read this machine's files (``local://`` is fsspec's alias of ``file://``).
LOCAL_PROTOCOLS = ("file", "local")


def _scheme(url: str) -> str | None:
    """The protocol of ``url`` in lower case, or ``None`` for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else None


def is_local(url: str) -> bool:
    """True if ``url`` names this machine's files: a plain path, or a ``file://`` or ``local://`` URL (any case).

    The one test of the package (storage, argument checks and the manifest's ``data_root``
    all ask it). An fsspec chain (``simplecache::file://...``) is not a plain path; whether
    it is accepted at all is up to the caller (a manifest's ``data_root`` may not be one).
    """
    scheme = _scheme(url)
    return scheme is None or scheme in LOCAL_PROTOCOLS


def local_path_of(url: str) -> str:
    """Return the filesystem path of a local ``url`` (strips ``file://`` or ``local://``, any case)."""
    scheme = _scheme(url)
    return url.split("://", 1)[1] if scheme in LOCAL_PROTOCOLS else url


HASH_ALGORITHMS = ("sha256", "xxh3_128")
#: The digest new datasets get: xxh3-128 hashes a file at memory speed (SHA-256 costs about a
#: second per GB of CPU on every download). Datasets written with ``sha256`` keep it.
DEFAULT_HASH_ALGORITHM = "xxh3_128"
_DIGEST_LENGTHS = {"sha256": 64, "xxh3_128": 32}
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class _Hasher(Protocol):
    """The subset of hashlib's interface streamload uses."""

    def update(self, data: bytes, /) -> None: ...  # pragma: no cover

    def hexdigest(self) -> str: ...  # pragma: no cover


def new_hasher(algorithm: str) -> _Hasher:
    """Return a fresh incremental hasher for ``algorithm`` (one of :data:`HASH_ALGORITHMS`).

    Raises:
        ManifestError: If the algorithm is unknown.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        hasher: _Hasher = xxhash.xxh3_128()
        return hasher
    raise ManifestError(f"unknown hash algorithm {algorithm!r}; known: {', '.join(HASH_ALGORITHMS)}")


def algorithm_of(hexdigest: str) -> str:
    """Return the hash algorithm that produces digests like ``hexdigest`` (by length).

    Only for digests that come with no algorithm (older callers); entries read from a
    manifest carry theirs.

    Raises:
        ManifestError: If no known algorithm has that digest length.
    """
    for algorithm, length in _DIGEST_LENGTHS.items():
        if len(hexdigest) == length:
            return algorithm
    raise ManifestError(f"digest {hexdigest!r} has no known algorithm")


def hash_stream(stream: BinaryIO, algorithm: str, chunk_size: int = 1 << 20) -> tuple[str, int]:
    """Hash a binary stream to its end; return ``(hexdigest, number_of_bytes)``."""
    hasher = new_hasher(algorithm)
    total = 0
    while chunk := stream.read(chunk_size):
        hasher.update(chunk)
        total += len(chunk)
    return hasher.hexdigest(), total


def hash_file(path: str, algorithm: str | None) -> tuple[str | None, int]:
    """Return ``(hexdigest or None, size)`` of a local file; no digest when ``algorithm`` is None."""
    if algorithm is None:
        return None, os.stat(path).st_size
    with open(path, "rb") as f:
        return hash_stream(f, algorithm)


def check_file_name(name: object, what: str) -> str:
    """Return ``name`` if it is a safe plain file name, else raise :class:`ManifestError`.

    A safe name has no path separator, no ``..``, no leading dot and only
    ``[A-Za-z0-9_.-]`` characters, so joining it to a directory can never escape it.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name or len(name) > 255:
        raise ManifestError(f"{what}: {name!r} is not a plain file name")
    return name


@dataclass(frozen=True)
class FileEntry:
    """A file of a dataset: its plain name, its byte size and what its content must hash to.

    Attributes:
        name: Plain file name inside the dataset (see :func:`check_file_name`).
        num_bytes: Exact size.
        hash: Hex digest of the content, or ``None`` if the file is not hashed.
        algorithm: The digest's algorithm (one of :data:`HASH_ALGORITHMS`), or ``None``.
    """

    name: str
    num_bytes: int
    hash: str | None = None
    algorithm: str | None = field(default=None, kw_only=True, compare=False)

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this entry (the algorithm is the manifest's, stored once there)."""
        return {"name": self.name, "bytes": self.num_bytes, "hash": self.hash}

    def digest_problem(self, digest: str, algorithm: str) -> str | None:
        """Return why ``digest`` (of ``algorithm``) does not match this entry, or ``None`` if it does.

        Digests of different algorithms are never compared as if they could match.
        """
        if self.hash is None or digest == self.hash:
            return None
        expected = self.algorithm or {v: k for k, v in _DIGEST_LENGTHS.items()}.get(len(self.hash))
        if expected != algorithm or len(digest) != len(self.hash):
            return (
                f"the hash algorithms differ ({algorithm} {digest[:16]}... against an expected "
                f"{expected or 'unknown'} digest {self.hash[:16]}...)"
            )
        return f"{algorithm} is {digest[:16]}..., expected {self.hash[:16]}..."


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``.

    A short write (a nearly full disk) goes on until the disk says why it stopped
    (``ENOSPC``, which the cache reports as a full disk).
    """
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(28, "No space left on device (a write made no progress)")
        view, offset = view[written:], offset + written


def printable(text: str) -> str:
    r"""Return ``text`` safe to encode as UTF-8 (manifests, messages).

    File names that are not valid UTF-8 reach Python as lone surrogates
    (``surrogateescape``); their bytes are shown as ``\xff`` escapes instead.
    """
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates no file name produces
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
