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

The backends (:mod:`.backends`) read through these: s3fs and fsspec's HTTP filesystem
through their own clients (the same sessions, credentials and headers as their
``cat_file``), botocore directly (:mod:`.s3direct`), any other fsspec filesystem through
``cat_file``, whose length is checked after the fact (its memory is the filesystem's).
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import RangeResponseError

__all__ = ["READ_CHUNK", "check_answer", "ignored_range", "longer_than_asked", "read_body"]

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


async def read_body(read: Any, url: str, start: int, end: int, status: int | None) -> bytes:
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
