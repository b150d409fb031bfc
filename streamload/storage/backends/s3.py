"""The S3 backend (``s3://``, ``s3a://``): s3fs for metadata and writes, botocore's own client for shard bytes.

s3fs runs every request of a process on one asyncio event-loop thread; the ranged reads
of shard data (a download's parts, streaming's spans) go through :mod:`..s3direct` on a
synchronous botocore client instead (``StorageConfig(s3_direct=False)`` keeps them on
s3fs, read through its own client with the same checks as :mod:`..bounded`).

What is particular to S3 here: botocore's read timeout and connection pool as defaults,
one try per s3fs call (the retry policy retries), sessions sharing botocore's parsed
service models, and the endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` in a
dataset's cache key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ... import _env
from ..bounded import check_answer, read_body
from ..s3direct import DirectS3, direct_s3, shared_boto_loader
from .fsspec import BackendSettings, FsspecBackend

__all__ = ["POOL_CONNECTIONS", "S3Backend"]

#: Connections a process keeps to an S3 endpoint: a download's parts (8) times a few
#: downloads at once, or streaming's range threads (16); botocore's default of 10 is too few.
POOL_CONNECTIONS = 64


class S3Backend(FsspecBackend):
    """Objects under an ``s3://bucket/prefix``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any], settings: BackendSettings) -> None:
        super().__init__(url, storage_options, settings)
        #: Ranged reads on botocore's threads (``None``: through s3fs); see :mod:`..s3direct`.
        timed = self.timed_options(dict(self.options), settings.read_timeout)
        self.direct: DirectS3 | None = direct_s3(timed) if settings.direct else None

    @classmethod
    def timed_options(cls, options: dict[str, Any], read_timeout: float) -> dict[str, Any]:
        """Botocore's ``read_timeout`` (a timeout per socket read), a connect timeout and a larger pool.

        botocore's default read timeout is 60 s per attempt, and s3fs tries a stalled body
        five times itself: a hung server was hidden for five minutes before the retry policy
        saw a failure.
        """
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", read_timeout)
        config.setdefault("max_pool_connections", POOL_CONNECTIONS)
        options["config_kwargs"] = config
        return options

    @classmethod
    def make_filesystem(cls, fs_class: Any, options: dict[str, Any]) -> Any:
        """An s3fs instance whose session reuses the parsed service models; one try per call."""
        session = None
        if "session" not in options:
            try:
                from aiobotocore.session import AioSession
            except ImportError:
                pass
            else:
                session = AioSession()
                shared_boto_loader(session)
        fs = fs_class(**options) if session is None else fs_class(**options, session=session)
        if hasattr(fs, "retries"):
            # One try per call: the retry policy retries (and counts the time of) every
            # failure; s3fs's own five tries of a stalled body took minutes unseen.
            fs.retries = 1
        return fs

    @classmethod
    def cache_endpoint(cls, options: Mapping[str, Any]) -> str | None:
        """The endpoint of the options, else the one botocore reads from the environment."""
        return super().cache_endpoint(options) or _env.aws_endpoint()

    def get_range(self, path: str, url: str, start: int, end: int) -> bytes:
        """One GetObject of ``[start, end)``: on botocore directly, else through s3fs's client."""
        if end <= start:
            return b""
        if self.direct is not None:
            return self.direct.get(path, start, end, url)
        from fsspec.asyn import sync

        fs = self.fs
        data: bytes = sync(fs.loop, _s3fs_range, fs, path, url, start, end)
        return data

    def land(
        self, path: str, url: str, start: int, end: int, fd: int, written: Callable[[int, int], None], keep: int
    ) -> int:
        """Directly on S3 each chunk lands as it arrives (a retry asks only for what did not)."""
        if self.direct is None:
            return super().land(path, url, start, end, fd, written, keep)
        return self.direct.land(path, start, end, fd, written, keep, url)


async def _s3fs_range(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    from s3fs.core import version_id_kw

    bucket, key, version = fs.split_path(path)
    resp = await fs._call_s3(
        "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **version_id_kw(version)
    )
    body = resp["Body"]
    try:
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        length = resp.get("ContentLength")
        check_answer(url, start, end, status, None if length is None else int(length), resp.get("ContentRange"))
        return await read_body(body.read, url, start, end, status)
    finally:
        body.close()
