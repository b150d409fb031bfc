"""Storage backends: what is particular to one protocol family, behind a registry of protocol names.

A backend serves the files under one URL prefix: a ranged GET (never more bytes than
asked), a download's part landed into a file, a resumable stream, an object's version,
listing, upload, exclusive create, delete, the endpoint that keys its cache directory and
its default timeouts. The rest of the storage package (retries, parted downloads, the
cache, streaming) names no protocol: it asks :func:`backend_class` for the class of a
URL's protocol and talks to what it gets.

Registered here, imported on first use (as :mod:`streamload.formats` registers formats):

==========================  =============================================  ======================
protocols                   backend                                        module
==========================  =============================================  ======================
``s3``, ``s3a``             S3: ranged reads on botocore's own client      :mod:`.s3`
``http``, ``https``         HTTP: ranged GETs checked before their body    :mod:`.http`
any other fsspec protocol   generic fsspec (``gs``, ``az``, ``memory``...)  :mod:`.fsspec`
==========================  =============================================  ======================

A new backend is one module with a subclass of :class:`~.fsspec.FsspecBackend` and one
call of :func:`register_backend`::

    from streamload.storage.backends import register_backend
    register_backend("gs", "mypackage.gcs:GcsBackend")   # or the class itself
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fsspec import FsspecBackend

__all__ = ["backend_class", "install_hint", "protocol_of", "register_backend", "registered_backends"]

_S3 = "streamload.storage.backends.s3:S3Backend"
_HTTP = "streamload.storage.backends.http:HttpBackend"
_GENERIC = "streamload.storage.backends.fsspec:FsspecBackend"

#: protocol -> the backend (a class, or ``"module:Class"`` imported on first use).
_REGISTRY: dict[str, str | type[FsspecBackend]] = {"s3": _S3, "s3a": _S3, "http": _HTTP, "https": _HTTP}
_LOCK = threading.Lock()

#: protocol -> what to install when fsspec cannot import its implementation.
_INSTALL_HINTS: dict[str, str] = {
    "s3": "pip install 'streamload[s3]'  (s3fs)",
    "s3a": "pip install 'streamload[s3]'  (s3fs)",
    "gs": "pip install 'streamload[gcs]'  (gcsfs)",
    "gcs": "pip install 'streamload[gcs]'  (gcsfs)",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
    "adl": "pip install adlfs",
    "http": "pip install 'streamload[http]'  (aiohttp)",
    "https": "pip install 'streamload[http]'  (aiohttp)",
    "hf": "pip install huggingface_hub",
    "oci": "pip install ocifs",
    "oss": "pip install ossfs",
    "sftp": "pip install paramiko",
    "webdav": "pip install webdav4",
}


def protocol_of(url: str) -> str:
    """Return the protocol of ``url`` (``"s3"`` for ``s3://bucket/x``; ``"file"`` for paths)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def register_backend(
    protocols: str | Iterable[str], backend: str | type[FsspecBackend], *, install_hint: str | None = None
) -> None:
    """Serve URLs of ``protocols`` with ``backend`` (replacing the backend they had).

    Args:
        protocols: A protocol name (``"gs"``) or several.
        backend: A subclass of :class:`~.fsspec.FsspecBackend`, or ``"module:Class"``
            naming one (imported when a URL of the protocol is first opened).
        install_hint: What to ``pip install`` when the backend's package is missing.
    """
    names = [protocols] if isinstance(protocols, str) else list(protocols)
    with _LOCK:
        for name in names:
            _REGISTRY[name.lower()] = backend
            if install_hint is not None:
                _INSTALL_HINTS[name.lower()] = install_hint


def registered_backends() -> dict[str, str]:
    """The registered protocols and their backends (``"module:Class"``), for messages and docs."""
    with _LOCK:
        items = list(_REGISTRY.items())
    return {name: b if isinstance(b, str) else f"{b.__module__}:{b.__qualname__}" for name, b in items}


def install_hint(protocol: str) -> str:
    """What to install for ``protocol``'s filesystem."""
    return _INSTALL_HINTS.get(protocol, f"install the fsspec implementation of {protocol!r}")


def backend_class(url: str) -> type[FsspecBackend]:
    """The backend class serving ``url`` (its protocol's, else the generic fsspec one)."""
    protocol = protocol_of(url)
    with _LOCK:
        found = _REGISTRY.get(protocol, _GENERIC)
    if isinstance(found, str):
        module, _, name = found.partition(":")
        cls: type[FsspecBackend] = getattr(importlib.import_module(module), name)
        with _LOCK:
            if _REGISTRY.get(protocol) == found:
                _REGISTRY[protocol] = cls
        return cls
    return found
