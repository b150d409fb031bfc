"""The HTTP backend (``http://``, ``https://``): ranged GETs whose answer is checked before its body is read.

A server may not serve ranges at all (``python -m http.server``): a download of a file is
one sequential stream that resumes where it stopped, never parts; a ranged read that gets
the whole object is refused before a byte past the range is read (see :mod:`..bounded`).
Reads are bounded by aiohttp's ``sock_read`` (the read timeout).

fsspec's HTTP filesystem turns *any* failure of its size request (a 403, a 503, a
connection refused) into ``FileNotFoundError``: that would call an outage "does not
exist" and never retry it. Here only a 404 is one; any other failure is raised as what
it was (aiohttp's error with its status), for the retry policy to classify.
"""

from __future__ import annotations

from typing import Any

from ..._redact import redact
from ..bounded import check_answer, read_body
from .fsspec import FsspecBackend

__all__ = ["HttpBackend"]


class HttpBackend(FsspecBackend):
    """Files under an ``http(s)://host/prefix``."""

    parted = False  # a server may ignore Range: downloads are one resumable stream

    @classmethod
    def timed_options(cls, options: dict[str, Any], read_timeout: float) -> dict[str, Any]:
        """Aiohttp's ``sock_read`` (a timeout per socket read) and a connect timeout, unless chosen."""
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            try:
                import aiohttp
            except ImportError:
                return options
            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout)
            options["client_kwargs"] = client
        return options

    def get_range(self, path: str, url: str, start: int, end: int) -> bytes:
        """One ranged GET on the filesystem's own session (its headers and credentials)."""
        if end <= start:
            return b""
        from fsspec.asyn import sync

        fs = self.fs
        data: bytes = sync(fs.loop, _http_range, fs, path, url, start, end)
        return data

    def info(self, path: str) -> Any:
        """Fresh metadata of ``path``; a failure other than a 404 is raised as it was."""
        try:
            return super().info(path)
        except FileNotFoundError as exc:
            real = _unhidden(exc)
        raise real

    def open_stream(self, path: str) -> Any:
        """A plain stream: no range requests needed (a failure other than a 404 is raised as it was)."""
        try:
            return self.fs.open(path, "rb", block_size=0)
        except FileNotFoundError as exc:
            real = _unhidden(exc)
        raise real


def _unhidden(exc: FileNotFoundError) -> BaseException:
    """What fsspec's ``FileNotFoundError`` hides: its cause, unless that was a 404 (or there is none)."""
    cause = exc.__cause__
    if cause is None or getattr(cause, "status", None) == 404:
        return exc
    return cause


async def _http_range(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
        if r.status == 404:
            raise FileNotFoundError(redact(url))
        if r.status == 416:
            return b""  # the range starts past the object's end: no bytes there
        r.raise_for_status()  # a ClientResponseError carries the status (classified by .retry)
        check_answer(url, start, end, r.status, r.content_length, r.headers.get("Content-Range"))
        return await read_body(r.content.read, url, start, end, r.status)
