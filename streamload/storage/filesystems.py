"""fsspec filesystems, one per process and options, safe across fork.

A DataLoader worker must never use its parent's connections: async filesystems (s3fs,
gcsfs) own an event-loop thread that a forked child does not inherit. So instances are
never shared through fsspec's own instance cache; :func:`open_filesystem` keeps one per
``(process id, protocol, options)``, and a filesystem inherited across a fork is kept
alive but never finalized in the child (its finalizer would try to close the parent's
sessions on the child's loop: ``attached to a different loop`` errors at exit). s3fs
sessions of a process and its children share botocore's parsed service models, so a
worker's first request does not wait for them to be parsed again.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError

__all__ = [
    "detach_finalizers",
    "filesystem_class",
    "forget_inherited",
    "open_filesystem",
    "protocol_of",
    "shared_boto_loader",
    "with_default_timeouts",
]

#: Filesystems inherited across a fork, kept alive so they are never finalized in a child.
_INHERITED: list[Any] = []
#: (pid, protocol, options) -> filesystem: see :func:`open_filesystem`.
_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


#: botocore's data loader (the parsed service models) of this process's first s3fs session,
#: shared by its later sessions and, through fork, by DataLoader workers: parsing the
#: models again costs every new client 0.1-0.3 s of CPU before its first request.
_BOTO_LOADER: Any = None


def _s3_session(protocol: str, options: Mapping[str, Any]) -> Any:
    """A fresh aiobotocore session for s3fs that reuses the parsed models (``None``: let s3fs make one).

    Only the loader is shared (read-only data); credentials and clients stay per session.
    """
    if protocol not in ("s3", "s3a") or "session" in options:
        return None
    try:
        from aiobotocore.session import AioSession
    except ImportError:
        return None
    session = AioSession()
    shared_boto_loader(session)
    return session


def shared_boto_loader(session: Any) -> None:
    """Give a botocore (or aiobotocore) ``session`` the process's parsed models, or make its own the shared ones."""
    global _BOTO_LOADER
    if _BOTO_LOADER is None:
        _BOTO_LOADER = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _BOTO_LOADER)


def _reset_after_fork() -> None:
    global _FILESYSTEMS_LOCK
    _FILESYSTEMS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)

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


#: Connections a process keeps to an S3 endpoint: a download's parts (8) times a few
#: downloads at once, or streaming's range threads (16); botocore's default of 10 is too few.
POOL_CONNECTIONS = 64
#: The inactivity timeout when the caller gives none (see :class:`~.retry.RetryPolicy`).
_DEFAULT_INACTIVITY = 30.0


def with_default_timeouts(protocol: str, options: dict[str, Any], inactivity: float) -> dict[str, Any]:
    """Bound connects and every read by ``inactivity`` seconds without a byte, unless the user chose.

    For S3 also the size of botocore's connection pool (:data:`POOL_CONNECTIONS`).

    botocore's default read timeout is 60 s per attempt, and s3fs tries a stalled body
    five times itself: a hung server was hidden for five minutes before the retry policy
    saw a failure. s3:// gets botocore's ``read_timeout`` (a timeout per socket read, so an
    inactivity timeout), http(s):// aiohttp's ``sock_read``.
    """
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", inactivity)
        # botocore pools 10 connections; a process's parts and ranges in flight are more
        config.setdefault("max_pool_connections", POOL_CONNECTIONS)
        options["config_kwargs"] = config
    elif protocol in ("http", "https"):
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            try:
                import aiohttp
            except ImportError:
                return options
            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=inactivity)
            options["client_kwargs"] = client
    return options


def forget_inherited(fs: Any) -> None:
    """Keep a filesystem inherited across a fork from ever being finalized in this child."""
    _INHERITED.append(fs)
    detach_finalizers(fs)


def detach_finalizers(fs: Any) -> None:
    """Detach the ``weakref.finalize`` callbacks registered on ``fs``.

    s3fs registers one when it first connects, which would schedule the session's close
    on whatever event loop the collecting thread has (``Task exception was never
    retrieved`` at worker exit); the operating system closes the sockets with the process.
    Callers run it once after a filesystem's first remote call (see
    :class:`~streamload.storage.transport.RemoteFiles`).
    """
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[0] is fs:
            finalizer.detach()


def filesystem_class(url: str) -> Any:
    """Return the fsspec filesystem class for ``url``'s protocol.

    Raises:
        ConfigError: If the protocol is unknown or its package is missing (with the
            ``pip install`` that fixes it).
    """
    import fsspec

    protocol = protocol_of(url)
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(protocol, f"install the fsspec implementation of {protocol!r}")
        raise ConfigError(f"{url}: reading {protocol}:// URLs needs a package that is missing ({exc}); {hint}") from exc
    except ValueError as exc:
        raise ConfigError(f"{url}: unknown protocol {protocol!r} ({exc})") from exc


def open_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None, inactivity_timeout: float | None = None
) -> tuple[Any, str]:
    """Return ``(filesystem, root path)`` for ``url``, one instance per process and options.

    Args:
        url: The URL (its protocol picks the filesystem).
        storage_options: The filesystem's options.
        inactivity_timeout: Seconds a read may wait for a byte (default 30 s); a stalled
            read fails after it, and the retry policy (not the filesystem) retries it.

    Raises:
        ConfigError: If the protocol is unknown, its package is not installed (the
            message says what to ``pip install``), or the options are not accepted.
    """
    protocol = protocol_of(url)
    inactivity = _DEFAULT_INACTIVITY if inactivity_timeout is None else inactivity_timeout
    options = with_default_timeouts(protocol, dict(storage_options or {}), inactivity)
    options.setdefault("skip_instance_cache", True)
    cls = filesystem_class(url)
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            session = _s3_session(protocol, options)
            try:
                fs = cls(**options) if session is None else cls(**options, session=session)
            except TypeError as exc:
                raise ConfigError(f"{url}: bad storage_options for {protocol}:// ({exc})") from exc
            detach_finalizers(fs)
            if protocol in ("s3", "s3a") and hasattr(fs, "retries"):
                # One try per call: the retry policy retries (and counts the time of) every
                # failure; s3fs's own five tries of a stalled body took minutes unseen.
                fs.retries = 1
            _FILESYSTEMS[key] = fs
    root = cls._strip_protocol(url)
    root = root.rstrip("/") if isinstance(root, str) else root
    return fs, root
