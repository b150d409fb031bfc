"""The exception tree of streamload.

Every error raised on purpose by streamload derives from :class:`StreamloadError`.
Where a builtin exception has the same meaning, the error also derives from it, so
``except FileNotFoundError`` keeps working for a missing shard::

    StreamloadError
    ├── ManifestError (ValueError)           index.json missing fields, bad values, bad version
    │   └── ManifestNotFoundError (FileNotFoundError)
    ├── ShardError                           anything wrong with one shard
    │   ├── ShardNotFoundError (FileNotFoundError)
    │   ├── CorruptShardError (ValueError)   bad bytes, offsets, size or hash mismatch
    │   └── UnsafeShardError (ValueError)    hostile content: path escape, links, huge sizes
    ├── SampleError (ValueError)             one sample cannot be decoded
    ├── SampleNotFoundError (KeyError)       no sample has the key asked for (random access)
    ├── SourceError (ValueError)             a conversion input is unreadable or corrupt
    ├── StorageError (OSError)               remote storage failed after retries / permanently
    │   ├── CacheError                       the local shard cache cannot work as configured
    │   ├── RangeResponseError               a ranged GET answered with other bytes than asked
    │   └── DestinationBusyError             another conversion is writing the destination
    ├── PlanError (ValueError)               the requested split or resume state is impossible
    ├── ConfigError (ValueError)             an option has a bad value or a missing extra
    └── ConversionInterrupted                Ctrl-C during a conversion; resumable

Every message names the path, URL, shard, key or field involved; the password of a URL in
it is shown as ``***`` (``http://alice:***@host/...``, see :mod:`streamload._redact`).
"""

from __future__ import annotations

from ._redact import redact

__all__ = [
    "CacheError",
    "ConfigError",
    "ConversionInterrupted",
    "CorruptShardError",
    "DestinationBusyError",
    "ManifestError",
    "ManifestNotFoundError",
    "PlanError",
    "RangeResponseError",
    "SampleError",
    "SampleNotFoundError",
    "ShardError",
    "ShardNotFoundError",
    "SourceError",
    "StorageError",
    "StreamloadError",
    "UnsafeShardError",
]


class StreamloadError(Exception):
    """Root of every error streamload raises on purpose.

    The password of any URL in a string argument is replaced by ``***``.

    Args:
        *args: The message (and any further arguments), as for :class:`Exception`.
        message: The message, as a keyword (how torch's DataLoader re-raises a worker's
            error in the main process, see :attr:`message`).
    """

    def __init__(self, *args: object, message: str | None = None) -> None:
        given = args if message is None else (message, *args)
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in given))

    # A DataLoader re-raises a worker's error as ``type(message=...)`` when the class has a
    # ``message`` attribute, and otherwise from a local variable: that frame and the
    # exception then hold each other, so the iterator stays alive in a reference cycle.
    # The garbage collector frees such a cycle later, closing the iterator's queues before
    # its shutdown asks the workers to stop: each worker was then waited on for 5 s.
    @property
    def message(self) -> str:
        """The error's message (its first argument)."""
        return str(self.args[0]) if self.args else ""


class ManifestError(StreamloadError, ValueError):
    """``index.json`` is malformed, inconsistent or of an unknown version."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No ``index.json`` where a dataset was expected."""


class ShardError(StreamloadError):
    """A shard cannot be used; the message names the shard."""


class ShardNotFoundError(ShardError, FileNotFoundError):
    """A shard listed in the manifest does not exist."""


class CorruptShardError(ShardError, ValueError):
    """A shard's bytes do not match its manifest entry or its own structure."""


class UnsafeShardError(ShardError, ValueError):
    """A shard holds hostile content (path escapes, links, device files, absurd sizes)."""


class SampleError(StreamloadError, ValueError):
    """One sample (or one field of it) cannot be read or decoded."""


class SampleNotFoundError(StreamloadError, KeyError):
    """No sample of the dataset has the key asked for; the message names the key and the dataset."""

    def __str__(self) -> str:
        # KeyError shows repr(message); show the message itself, like every other error here.
        return str(self.args[0]) if self.args else ""


class SourceError(StreamloadError, ValueError):
    """A conversion input is unreadable or not what its extension says."""


class StorageError(StreamloadError, OSError):
    """Reading or writing storage failed permanently or after all retries."""


class CacheError(StorageError):
    """The local shard cache cannot work as configured (e.g. a limit below one shard)."""


class RangeResponseError(StorageError):
    """A server answered a ranged GET with more bytes than asked, or ignored the ``Range`` header.

    Never retried (the same server answers the same way); the message names the URL, the
    bytes asked for and what came (or was announced).
    """


class DestinationBusyError(StorageError):
    """Another conversion holds the destination's lock; the message names the holder."""


class PlanError(StreamloadError, ValueError):
    """The requested split, epoch or resume state is impossible."""


class ConfigError(StreamloadError, ValueError):
    """An option has an invalid value, or an optional dependency is missing."""


class ConversionInterrupted(StreamloadError):
    """A conversion was interrupted (Ctrl-C); the message says how to resume it."""
