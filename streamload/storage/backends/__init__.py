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
import importlib.util
import re
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..._errors import ConfigError

if TYPE_CHECKING:
    from .fsspec import FsspecBackend

__all__ = ["backend_class", "install_hint", "protocol_of", "register_backend", "registered_backends"]

_S3 = "streamload.storage.backends.s3:S3Backend"
_HTTP = "streamload.storage.backends.http:HttpBackend"
_GENERIC = "streamload.storage.backends.fsspec:FsspecBackend"

#: protocol -> the backend (a class, or ``"module:Class"`` imported on first use).
_REGISTRY: dict[str, str | type[FsspecBackend]] = {"s3": _S3, "s3a": _S3, "http": _HTTP, "https": _HTTP}
_LOCK = threading.Lock()
#: A URL scheme (RFC 3986): what a registered protocol must be.
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")

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

    Everything is checked here, before anything is registered: a bad registration is a
    :class:`~streamload.ConfigError` naming the argument now, not a raw ``TypeError`` or
    ``ModuleNotFoundError`` at the first open of a URL.

    Args:
        protocols: A protocol name (``"gs"``) or several: each a URL scheme
            (``[a-z][a-z0-9+.-]*``, matched case-insensitively), not ``file``.
        backend: A subclass of :class:`~.fsspec.FsspecBackend`, or ``"module:Class"``
            naming one (imported when a URL of the protocol is first opened; its module
            must be importable now).
        install_hint: What to ``pip install`` when the backend's package is missing.

    Raises:
        ConfigError: If a protocol is not a scheme name, ``backend`` is neither a backend
            class nor a ``"module:Class"`` whose module can be found, or ``install_hint``
            is not a string.
    """
    names = _checked_protocols(protocols)
    _check_backend(backend)
    if install_hint is not None and not isinstance(install_hint, str):
        raise ConfigError(f"register_backend: install_hint must be a string or None, not {install_hint!r}")
    with _LOCK:
        for name in names:
            _REGISTRY[name] = backend
            if install_hint is not None:
                _INSTALL_HINTS[name] = install_hint


def _checked_protocols(protocols: object) -> list[str]:
    """The protocol names of ``protocols``, lower-cased; a :class:`ConfigError` naming a bad one."""
    if isinstance(protocols, str):
        given: list[object] = [protocols]
    elif isinstance(protocols, Iterable) and not isinstance(protocols, (bytes, Mapping)):
        given = list(protocols)
    else:
        raise ConfigError(f"register_backend: protocols must be a protocol name or a list of them, not {protocols!r}")
    if not given:
        raise ConfigError("register_backend: protocols is empty: name at least one protocol")
    names = []
    for name in given:
        if not isinstance(name, str) or not _PROTOCOL.fullmatch(name):
            raise ConfigError(
                f"register_backend: protocol {name!r} is not a URL scheme (a letter, then letters, digits, "
                "'+', '-' or '.', without '://')"
            )
        if name.lower() == "file":
            raise ConfigError("register_backend: protocol 'file' is local paths, read without a backend")
        names.append(name.lower())
    return names


def _check_backend(backend: object) -> None:
    """Raise a :class:`ConfigError` naming ``backend`` unless it is a backend class or a findable ``module:Class``."""
    from .fsspec import FsspecBackend

    if isinstance(backend, type):
        if not issubclass(backend, FsspecBackend):
            raise ConfigError(
                f"register_backend: backend {backend.__module__}.{backend.__qualname__} is not a subclass of "
                "streamload.storage.backends.fsspec.FsspecBackend"
            )
        return
    if not isinstance(backend, str):
        raise ConfigError(
            f"register_backend: backend must be a subclass of FsspecBackend or a 'module:Class' string, not {backend!r}"
        )
    module, colon, name = backend.partition(":")
    if not colon or not all(part.isidentifier() for part in module.split(".")) or not name.isidentifier():
        raise ConfigError(
            f"register_backend: backend {backend!r} is not 'module:Class' (e.g. 'mypackage.gcs:GcsBackend')"
        )
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package is missing, or fails to import
        raise ConfigError(f"register_backend: backend {backend!r}: cannot find module {module!r} ({exc})") from exc
    if found is None:
        raise ConfigError(f"register_backend: backend {backend!r}: no module named {module!r} can be imported")


def registered_backends() -> dict[str, str]:
    """The registered protocols and their backends (``"module:Class"``), for messages and docs."""
    with _LOCK:
        items = list(_REGISTRY.items())
    return {name: b if isinstance(b, str) else f"{b.__module__}:{b.__qualname__}" for name, b in items}


def install_hint(protocol: str) -> str:
    """What to install for ``protocol``'s filesystem."""
    return _INSTALL_HINTS.get(protocol, f"install the fsspec implementation of {protocol!r}")


def backend_class(url: str) -> type[FsspecBackend]:
    """The backend class serving ``url`` (its protocol's, else the generic fsspec one).

    Raises:
        ConfigError: If the ``"module:Class"`` registered for the protocol cannot be
            imported, or is not a backend class (naming the protocol and the backend).
    """
    protocol = protocol_of(url)
    with _LOCK:
        found = _REGISTRY.get(protocol, _GENERIC)
    if isinstance(found, str):
        cls = _imported(protocol, found)
        with _LOCK:
            if _REGISTRY.get(protocol) == found:
                _REGISTRY[protocol] = cls
        return cls
    return found


def _imported(protocol: str, spec: str) -> type[FsspecBackend]:
    """The class ``spec`` (``"module:Class"``) names, imported; a :class:`ConfigError` naming it if it cannot be."""
    from .fsspec import FsspecBackend

    module, _, name = spec.partition(":")
    where = f"the backend registered for {protocol}:// ({spec!r})"
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"{where} cannot be imported: {exc}") from exc
    except AttributeError as exc:
        raise ConfigError(f"{where}: module {module!r} has no {name!r}") from exc
    if not (isinstance(cls, type) and issubclass(cls, FsspecBackend)):
        raise ConfigError(f"{where} is not a subclass of FsspecBackend ({cls!r})")
    return cls
