"""Passwords in URLs are never shown: ``http://alice:secret@host/x`` is written ``http://alice:***@host/x``.

A URL may carry its credentials (``https://user:password@host/...``: aiohttp sends them as
basic authentication). Every place streamload shows a URL goes through :func:`redact`:

* every :class:`~streamload.StreamloadError`'s message (the error base class redacts it);
* every log line of the ``streamload`` loggers (a filter on them, installed on import);
* every line the command line prints (``say``, its log formatter, ``info --json``);
* the ``repr`` of datasets and views, and what a conversion writes about its source
  into ``index.json``;
* the messages of the errors a remote call met (fsspec's ``FileNotFoundError(url)``...),
  chained to the error streamload raises (:func:`scrub_chain`).

The user name is kept (it says which account was used); only the password is replaced.
A user without a password (``https://TOKEN@host/x``) is taken for a token, as pip and git
take it, and replaced whole: ``https://***@host/x``.
The URL a dataset was opened with is kept as it was for reading.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)

__all__ = ["LOGGERS", "RedactingFilter", "redact", "redacted_repr", "scrub_chain"]

#: ``scheme://user:password@``: the password is anything up to the ``@`` that ends the user
#: information (no ``/``, ``?``, ``#``, white space or ``@`` in it, as RFC 3986 allows there).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@:]*):(?P<password>[^\s/?#@]*)@")

#: ``scheme://token@``: user information without a password (a token sent as the user name).
_TOKEN = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^\s/?#@:]+@")

#: The loggers streamload writes to (a filter on a logger does not see its children's records).
LOGGERS = ("streamload", "streamload.decode")


def redact(text: str) -> str:
    """Return ``text`` with the password (or the token) of every URL in it replaced by ``***``.

    >>> redact("cannot read http://alice:pw@host/ds/index.json")
    'cannot read http://alice:***@host/ds/index.json'
    >>> redact("cannot read https://ghp_abc123@host/ds")
    'cannot read https://***@host/ds'
    """
    if "@" not in text or "://" not in text:  # the common case, without a regex
        return text
    return _TOKEN.sub(r"\g<head>***@", _USERINFO.sub(r"\g<head>:***@", text))


def redacted_repr(cls: T) -> T:
    """Class decorator: the class's ``repr`` (a dataclass's, naming its URL) with passwords redacted."""
    plain: Callable[[object], str] = cls.__dict__["__repr__"]

    def __repr__(self: object) -> str:  # noqa: N807 - the method it replaces
        return redact(plain(self))

    cls.__repr__ = __repr__  # type: ignore[assignment]
    return cls


def scrub_chain(exc: BaseException) -> None:
    """Redact the string arguments (and ``filename``) of ``exc`` and of its causes and contexts, in place.

    A library's error may name the URL as it was given (fsspec raises
    ``FileNotFoundError(url)``); chained to a streamload error, its message would show in
    a traceback.
    """
    seen: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in seen and len(seen) < 16:
        seen.append(node)
        try:
            args = node.args
            if any(isinstance(a, str) and redact(a) != a for a in args):
                node.args = tuple(redact(a) if isinstance(a, str) else a for a in args)
            for attr in ("filename", "filename2"):
                value = getattr(node, attr, None)
                if isinstance(value, str) and redact(value) != value:
                    setattr(node, attr, redact(value))
        except (AttributeError, TypeError):  # an error type that does not let its fields be set
            pass
        node = node.__cause__ or node.__context__


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the passwords of URLs in a record's message (it passes every record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact ``record``'s message in place; always True."""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: logging reports it itself
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def _install() -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())


_install()
