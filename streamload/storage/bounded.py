"""Ranged GETs that never take more bytes than they asked for, whatever the server answers.

A ranged GET asks for ``[start, end)``. A server may answer with more: a body longer than
the range (its ``Content-Length`` says so too), or the whole object with ``200`` because it
ignores the ``Range`` header (``python -m http.server``, some proxies). Read whole, such an
answer filled the memory of a streaming reader (2.3 GB for a 1-byte range) and the disk
past a download's reserved part. So every ranged read of the package goes through here or
through the same checks (:func:`check_answer`, used by :mod:`.s3direct` too):

* the answer's status and headers are checked before any byte of the body is read: a
  ``200`` to a range that does not start at byte 0 (or whose object is longer than the
  range), a ``Content-Range`` that is not the range asked, or a ``Content-Length`` above
  it is a :class:`~streamload.RangeResponseError` at once, naming the URL and both sizes;
* the body is read in chunks, at most the bytes asked for and one more (which tells a body
  longer than it said), so memory stays bounded by the range.

s3fs and fsspec's HTTP filesystem are read through their own clients (the same sessions,
credentials and headers as their ``cat_file``); any other fsspec filesystem through
``cat_file``, whose length is checked after the fact (its memory is the filesystem's).
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import RangeResponseError

__all__ = ["READ_CHUNK", "check_answer", "longer_than_asked", "read_range"]

#: Bytes read from a body per call.
READ_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _asked(start: int, end: int) -> str:
    n = end - start
    return f"bytes {start}-{end - 1} ({n} byte{'' if n == 1 else 's'})"


def ignored_range(url: str, start: int, end: int, what: str) -> RangeResponseError:
    """The error for a server that ignored the ``Range`` header (``what``: what it answered)."""
    return RangeResponseError(
        f"{url}: the server ignored the Range header: asked for {_asked(start, end)}, it answered {what}; "
        "ranged reads need a server that serves byte ranges (206 Partial Content)"
    )


def longer_than_asked(url: str, start: int, end: int, got: int | str) -> RangeResponseError:
    """The error for a body longer than its range (``got``: its announced or counted size)."""
    return RangeResponseError(
        f"{url}: asked for {_asked(start, end)}, the server answered with {got} bytes; "
        "nothing past the range was kept (a server or proxy that does not serve byte ranges correctly)"
    )


def check_answer(
    url: str, start: int, end: int, status: int | None, length: int | None, content_range: str | None
) -> None:
    """Check the head of an answer to a GET of ``[start, end)`` before its body is read.

    Args:
        url: The object's URL (for messages).
        start: First byte asked for.
        end: One past the last byte asked for.
        status: The HTTP status (``None``: unknown).
        length: The body's ``Content-Length`` (``None``: not given).
        content_range: The ``Content-Range`` header, if any.

    Raises:
        RangeResponseError: If the server ignored the range or announces more bytes than asked.
    """
    asked = end - start
    if status == 200:
        if start == 0 and (length is None or length <= asked):
            return  # the whole object, no more than the range (the body's read checks it when untold)
        size = "" if length is None else f" of {length} bytes"
        raise ignored_range(url, start, end, f"200 OK with the whole object{size}")
    if content_range:
        match = _CONTENT_RANGE.fullmatch(content_range.strip())
        if match is None or int(match.group(1)) != start:
            raise ignored_range(url, start, end, f"Content-Range {content_range!r}")
        if int(match.group(2)) >= end:
            raise longer_than_asked(url, start, end, int(match.group(2)) + 1 - start)
    if length is not None and length > asked:
        raise longer_than_asked(url, start, end, length)


def read_range(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    """One GET of ``[start, end)`` of ``path`` on ``fs`` (fewer bytes where the object ends).

    Raises:
        RangeResponseError: If the answer holds more than the range (see the module docstring).
    """
    if end <= start:
        return b""
    from fsspec.asyn import sync

    if callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None)):  # s3fs
        data: bytes = sync(fs.loop, _s3fs_range, fs, path, url, start, end)
    elif _is_http(fs):
        data = sync(fs.loop, _http_range, fs, path, url, start, end)
    else:
        data = fs.cat_file(path, start=start, end=end)
    if len(data) > end - start:
        raise longer_than_asked(url, start, end, len(data))
    return data


def _is_http(fs: Any) -> bool:
    try:
        from fsspec.implementations.http import HTTPFileSystem
    except ImportError:  # no aiohttp: no HTTP filesystem either
        return False
    return isinstance(fs, HTTPFileSystem)


async def _read_body(read: Any, url: str, start: int, end: int, status: int | None) -> bytes:
    """Read at most ``end - start`` bytes and one more from ``read(n)``; one more is an error."""
    want = end - start
    chunks: list[bytes] = []
    got = 0
    while got <= want:
        chunk = await read(min(READ_CHUNK, want + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > want:
        if status == 200:
            raise ignored_range(url, start, end, "200 OK with a body longer than the range")
        raise longer_than_asked(url, start, end, f"more than {want}")
    return b"".join(chunks)


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
        return await _read_body(body.read, url, start, end, status)
    finally:
        body.close()


async def _http_range(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status == 416:
            return b""  # the range starts past the object's end: no bytes there
        r.raise_for_status()  # a ClientResponseError carries the status (classified by .retry)
        check_answer(url, start, end, r.status, r.content_length, r.headers.get("Content-Range"))
        return await _read_body(r.content.read, url, start, end, r.status)
