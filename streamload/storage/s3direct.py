"""Ranged GETs of S3 objects on botocore's own thread-safe client: the hot path of every shard byte.

s3fs runs every request of a process on one asyncio event-loop thread (aiobotocore,
aiohttp) and hands a body back as one joined ``bytes``. For the parts of a shard fetched
in parallel that loop thread becomes the bottleneck: on the 2-core development machine, a
64 MiB object fetched as 8 ranged parts through a shaped link (50 ms, 40 MB/s per
connection) came at 150-220 MB/s through s3fs and 235-263 MB/s through botocore's
synchronous client in 8 threads, with about half the CPU (``benchmarks/bench_remote.py``
measures the link the same way). So the ranged reads of shard data -- a download's parts
(cached mode) and the spans of streaming mode -- go through this module for ``s3://``
URLs, one client per process (re-created after a fork; its connection pool sized for
every download and range thread of the process), while everything else (the manifest,
listings, uploads, other protocols) stays on fsspec.

The client is made from the same ``storage_options`` as s3fs (``key``/``secret``/
``token``, ``anon``, ``profile``, ``endpoint_url``, ``client_kwargs``, ``config_kwargs``,
``requester_pays``, GetObject's fields of ``s3_additional_kwargs``). Options this module
does not know, or ``StorageConfig(s3_direct=False)`` (default: ``STREAMLOAD_S3_DIRECT``),
keep the ranged reads on s3fs. Errors come out as the rest of the package expects them: a missing object as
``FileNotFoundError``, access denied as ``PermissionError``, a range past the end as
no bytes, an answer holding more than the range asked for (or the whole object: a server
that ignores ``Range``) as a :class:`~streamload.RangeResponseError` before a byte past
the range is read into memory or written (see :mod:`.bounded`), everything else as
botocore raised it (classified by :mod:`.retry`). botocore
does not retry (the retry policy does, and resumes a body cut short at the byte where it
stopped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import RangeResponseError
from .._files import pwrite_all
from .._fork import ProcessLocal, on_fork
from .bounded import check_answer, ignored_range, longer_than_asked

__all__ = ["DirectS3", "direct_s3", "shared_boto_loader"]

#: Bytes read from a body per call while landing it into a file: what a waiting reader sees
#: land at once (a reader needing a few KB past a lead part does not wait for a whole MiB).
_CHUNK = 256 << 10

#: s3fs options that change nothing about a GET of a byte range (caching, listing, uploads).
_NEUTRAL = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
        "asynchronous",
        "loop",
        "max_concurrency",
        "fixed_upload_size",
        "version_aware",
        "use_ssl",
    }
)
#: Fields of ``s3_additional_kwargs`` that GetObject takes.
_GET_FIELDS = frozenset(
    {
        "SSECustomerAlgorithm",
        "SSECustomerKey",
        "SSECustomerKeyMD5",
        "RequestPayer",
        "ExpectedBucketOwner",
        "ChecksumMode",
    }
)


class _CutShort(ConnectionError):
    """A body ended before the bytes its range asked for (transient: a connection cut)."""


class DirectS3:
    """Ranged GETs of the objects of one bucket on a botocore client of this process.

    Made by :func:`direct_s3` from a dataset's s3fs ``storage_options``.

    Args:
        client_args: ``create_client`` keyword arguments made from them.
        get_args: Extra GetObject fields (requester pays, customer keys).
        profile: The AWS profile of the session, if any.
    """

    def __init__(self, client_args: dict[str, Any], get_args: dict[str, Any], profile: str | None = None) -> None:
        self._client_args = client_args
        self._get_args = get_args
        self._profile = profile
        self._client: ProcessLocal[Any] = self._local()

    def _local(self) -> ProcessLocal[Any]:
        return ProcessLocal(lambda: _session(self._profile).create_client("s3", **self._client_args))

    def __getstate__(self) -> dict[str, Any]:
        return {"_client_args": self._client_args, "_get_args": self._get_args, "_profile": self._profile}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = self._local()

    @property
    def client(self) -> Any:
        """This process's client (made on first use, again after a fork)."""
        return self._client.get()

    def get(self, path: str, start: int, end: int, url: str | None = None) -> bytes:
        """The bytes ``[start, end)`` of ``bucket/key`` (fewer at the object's end; none past it).

        At most the bytes asked for (and one more) are read from the body, whatever it holds.

        Raises:
            RangeResponseError: If the server answered with more bytes than asked, or
                ignored the range (``url`` names the object in the message).
        """
        response = self._open(path, start, end)
        if response is None:
            return b""
        where = url or f"s3://{path}"
        body = response["Body"]
        try:
            status = _check(response, where, start, end)
            data = bytearray()
            while len(data) <= end - start:
                chunk = body.read(min(_CHUNK, end - start + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
            if len(data) > end - start:
                raise _longer(where, start, end, status)
        finally:
            body.close()
        return bytes(data)

    def land(
        self,
        path: str,
        start: int,
        end: int,
        fd: int,
        landed: Callable[[int, int], None] | None = None,
        keep: int | None = None,
        url: str | None = None,
    ) -> int:
        """Write ``[start, end)`` of ``bucket/key`` into ``fd`` at the same offsets as it arrives.

        ``landed(a, b)`` is called after each chunk is written (a reader may read it).
        Returns the offset the bytes reached: ``end``, or less where the object ends
        first. No byte at or past ``keep`` (default ``end``) is written: a caller that asks
        for one byte more than it keeps learns from the offset that the object goes on. A
        body cut short raises a transient ``ConnectionError`` after writing (and
        reporting) what came: the caller's retry asks for the rest only.

        Raises:
            RangeResponseError: If the server announces or sends more than ``[start, end)``,
                or ignored the range; nothing past ``end`` (nor ``keep``) is written.
        """
        response = self._open(path, start, end)
        if response is None:
            return start
        where = url or f"s3://{path}"
        keep = end if keep is None else min(keep, end)
        body = response["Body"]
        offset = start
        try:
            status = _check(response, where, start, end)
            length = response.get("ContentLength")
            stop = end if length is None else start + int(length)  # checked: never past end
            while offset < stop:
                chunk = body.read(min(_CHUNK, stop - offset))
                if not chunk:
                    if length is None:
                        break  # no length given: the object ended here
                    raise _CutShort(f"{path}: the body ended at byte {offset} of {start}-{stop}")
                kept = chunk[: max(0, keep - offset)]
                if kept:
                    pwrite_all(fd, kept, offset)
                    if landed is not None:
                        landed(offset, offset + len(kept))
                offset += len(chunk)
            if offset >= end and body.read(1):
                raise _longer(where, start, end, status)
        finally:
            body.close()
        return offset

    def _open(self, path: str, start: int, end: int) -> Any:
        bucket, _, key = path.partition("/")
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **self._get_args)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(error.get("Code", ""))
            if status == 416 or code == "InvalidRange":
                return None  # the range starts past the object's end: no bytes there
            if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404"):
                raise FileNotFoundError(f"{path}: {code or status}") from exc
            if status == 403 or code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise PermissionError(f"{path}: {code or status}") from exc
            raise


def _check(response: Mapping[str, Any], url: str, start: int, end: int) -> int | None:
    """Check a GetObject answer's status and headers (:func:`.bounded.check_answer`); return its status."""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    length = response.get("ContentLength")
    check_answer(url, start, end, status, None if length is None else int(length), response.get("ContentRange"))
    return None if status is None else int(status)


def _longer(url: str, start: int, end: int, status: int | None) -> RangeResponseError:
    if status == 200:
        return ignored_range(url, start, end, "200 OK with a body longer than the range")
    return longer_than_asked(url, start, end, f"more than {end - start}")


def direct_s3(options: Mapping[str, Any]) -> DirectS3 | None:
    """A :class:`DirectS3` for these s3fs options, or ``None`` (options this module does not know).

    ``options`` must already carry the timeouts of :meth:`~.backends.s3.S3Backend.timed_options`.
    """
    try:
        import botocore.config
        import botocore.session  # noqa: F401
        from botocore import UNSIGNED
    except ImportError:
        return None
    known = {
        "key",
        "secret",
        "token",
        "username",
        "password",
        "anon",
        "profile",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "requester_pays",
        "s3_additional_kwargs",
    }
    if set(options) - known - _NEUTRAL:
        return None  # something s3fs understands and this module does not: stay on s3fs
    client = dict(options.get("client_kwargs") or {})
    if "config" in client:
        return None
    extra = dict(options.get("s3_additional_kwargs") or {})
    if set(extra) - _GET_FIELDS:
        return None
    for ours, theirs in (("aws_access_key_id", ("key", "username")), ("aws_secret_access_key", ("secret", "password"))):
        for name in theirs:
            if options.get(name) is not None:
                client.setdefault(ours, options[name])
    if options.get("token") is not None:
        client.setdefault("aws_session_token", options["token"])
    if options.get("endpoint_url") is not None:
        client.setdefault("endpoint_url", options["endpoint_url"])
    if "use_ssl" in options:
        client.setdefault("use_ssl", bool(options["use_ssl"]))
    config = dict(options.get("config_kwargs") or {})  # timeouts and pool size: see .filesystems
    config["retries"] = {"total_max_attempts": 1, "mode": "standard"}  # the retry policy retries
    if options.get("anon"):
        config["signature_version"] = UNSIGNED
    try:
        client["config"] = botocore.config.Config(**config)
    except TypeError:
        return None
    if options.get("requester_pays"):
        extra.setdefault("RequestPayer", "requester")
    return DirectS3(client, extra, options.get("profile"))


#: profile -> this process's botocore session.
_SESSIONS: ProcessLocal[dict[str | None, Any]] = ProcessLocal(dict)
_SESSIONS_LOCK = threading.Lock()
#: botocore's data loader (the parsed service models) of this process's first session, shared
#: by its later sessions and, through fork, by DataLoader workers (read-only data): parsing the
#: models again costs every new client 0.1-0.3 s of CPU before its first request.
_BOTO_LOADER: Any = None


def _reset_after_fork() -> None:
    global _SESSIONS_LOCK
    _SESSIONS_LOCK = threading.Lock()


on_fork(_reset_after_fork)


def shared_boto_loader(session: Any) -> None:
    """Give a botocore (or aiobotocore) ``session`` the process's parsed models, or make its own the shared ones."""
    global _BOTO_LOADER
    if _BOTO_LOADER is None:
        _BOTO_LOADER = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _BOTO_LOADER)


def _session(profile: str | None) -> Any:
    """One botocore session per process and profile, sharing the parsed models of s3fs's sessions."""
    import botocore.session

    with _SESSIONS_LOCK:
        sessions = _SESSIONS.get()
        session = sessions.get(profile)
        if session is None:
            session = sessions[profile] = botocore.session.Session(profile=profile)
            shared_boto_loader(session)
        return session
