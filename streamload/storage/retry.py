"""Retrying remote storage calls: which errors are transient, and how long to insist.

Object stores fail in two ways that must be told apart:

* **transient** — connection refused or reset, timeouts, 5xx answers, throttling
  (``SlowDown``, ``429``): the same call will succeed later. These are retried with
  exponential backoff and jitter, until a time budget (default 120 s) is spent, so a
  reader rides out a restart of the storage service.
* **permanent** — the object does not exist (404), access denied or bad credentials
  (401/403), a bad request: retrying cannot help and hides the cause. These fail at
  once, as :class:`~streamload.ShardNotFoundError` / :class:`~streamload.StorageError`
  naming the URL.

The backends wrap errors differently: s3fs raises ``FileNotFoundError`` /
``PermissionError`` for 404/403 and a plain ``OSError`` for other S3 error codes, after
retrying some itself; botocore's ``EndpointConnectionError`` or ``ReadTimeoutError`` and
aiohttp's ``ClientConnectorError`` escape untranslated; fsspec's HTTP backend raises
aiohttp's ``ClientResponseError`` carrying ``.status``. :func:`is_transient` therefore
looks at the error's class names, its HTTP status and error code where present, and its
causes, without importing any of those packages.

A body cut short (the connection closed or reset after part of it) is transient, whatever
status the error object carries: aiohttp's ``ContentLengthError`` has ``code=400``, the
status its *server* would answer to such a message, not one the storage sent.

Every read is also bounded by an **inactivity timeout** (:attr:`RetryPolicy.inactivity_timeout`,
default 30 s; a dataset's ``read_timeout``, whose default ``STREAMLOAD_READ_TIMEOUT`` sets): a body that stalls with
its connection open fails after that long without a byte, and is retried like any other
transient error. The retry budget counts from the start of the first attempt that failed,
so the time a stalled attempt waited is spent from it.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .._errors import ConfigError

__all__ = [
    "DEFAULT_INACTIVITY_TIMEOUT",
    "DEFAULT_RETRY_TIMEOUT",
    "RetryPolicy",
    "is_permanent",
    "is_transient",
    "retry_call",
    "status_of",
]

log = logging.getLogger("streamload")
T = TypeVar("T")

#: Seconds a read may go without a byte before it fails (and is retried).
DEFAULT_INACTIVITY_TIMEOUT = 30.0
#: Seconds after the first failed attempt of a call before giving up.
DEFAULT_RETRY_TIMEOUT = 120.0

#: Errors of a body cut short: transient, whatever HTTP status they carry.
_CUT_BODY_CLASSES = frozenset(
    {
        "ClientPayloadError",
        "PayloadEncodingError",
        "ContentLengthError",
        "TransferEncodingError",
        "ContentEncodingError",
        "IncompleteRead",
        "IncompleteReadError",
        "ResponseStreamingError",
    }
)
#: Exception class names (anywhere in the MRO) that mean "try again later".
_TRANSIENT_CLASSES = frozenset(
    {
        "ConnectionError",  # builtin (refused, reset, aborted) and botocore's
        "TimeoutError",
        "timeout",
        "FSTimeoutError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "IncompleteRead",
        "ProtocolError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientPayloadError",
        "RemoteProtocolError",
        "ServiceUnavailableError",
        "TransportError",
    }
    | _CUT_BODY_CLASSES
)
#: Class names that mean "this will never work": credentials and configuration.
_PERMANENT_CLASSES = frozenset(
    {
        "RangeResponseError",  # a server that answers a range with more bytes answers so again
        "NoCredentialsError",
        "PartialCredentialsError",
        "ParamValidationError",
        "InvalidRegionError",
        "UnknownSignatureVersionError",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EAGAIN,
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "503",
        "500",
        "502",
        "504",
        "429",
    }
)
#: Messages of errors a backend flattened to a plain OSError (s3fs does for 5xx codes).
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|Throttl|ServiceUnavailable|Service Unavailable|InternalError|Internal Server Error|"
    r"RequestTimeout|Bad Gateway|Gateway Timeout|Too Many Requests|\b50[0234]\b|\b429\b|"
    r"Connection (?:reset|refused|aborted)|Could not connect|timed out"
)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, innermost last, without cycles."""
    out: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in out and len(out) < 16:
        out.append(node)
        node = node.__cause__ or node.__context__
    return out


def _http_status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def status_of(exc: BaseException) -> int | None:
    """The HTTP status the storage answered, from ``exc`` or a cause (``None``: no answer, or a cut body's)."""
    for node in _chain(exc):
        if {cls.__name__ for cls in type(node).__mro__} & _CUT_BODY_CLASSES:
            return None  # its "code" is not the storage's answer
        status = _http_status(node)
        if status is not None:
            return status
    return None


def is_permanent(exc: BaseException) -> bool:
    """True if ``exc`` (or a cause) says the call can never succeed: missing, denied, invalid."""
    for node in _chain(exc):
        if isinstance(node, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return True
        names = {cls.__name__ for cls in type(node).__mro__}
        if names & _PERMANENT_CLASSES:
            return True
        if names & _CUT_BODY_CLASSES:
            return False  # a cut body: its "code" is not the storage's answer
        status = _http_status(node)
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True if retrying the call that raised ``exc`` may succeed (see the module docstring)."""
    if is_permanent(exc):
        return False
    for node in _chain(exc):
        names = {cls.__name__ for cls in type(node).__mro__}
        if names & _TRANSIENT_CLASSES:
            return True
        if isinstance(node, OSError) and node.errno in _TRANSIENT_ERRNOS:
            return True
        status = _http_status(node)
        if status is not None and (status >= 500 or status in (408, 429)):
            return True
        if _error_code(node) in _TRANSIENT_CODES:
            return True
        if isinstance(node, OSError) and _TRANSIENT_TEXT.search(str(node)):
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried: exponential backoff with jitter, bounded in time.

    The n-th wait is drawn uniformly from ``[d / 2, d]`` with
    ``d = min(max_delay, initial_delay * multiplier ** n)`` ("equal jitter": never zero,
    and readers that failed together do not come back together). Retries stop once
    ``timeout`` seconds have passed since the start of the first attempt that failed;
    with the defaults a reader survives an outage of the storage service of about two
    minutes.

    Attributes:
        timeout: Seconds from the start of a call's first failed attempt before giving up
            (default 120; ``StorageConfig(retry_timeout=)``
            and ``STREAMLOAD_RETRY_TIMEOUT`` set it for a dataset's storage).
        initial_delay: First wait, in seconds.
        max_delay: Longest single wait, in seconds.
        multiplier: Growth factor of the wait.
        inactivity_timeout: Seconds a read may go without receiving a byte before it
            fails as a transient error (default 30; ``StorageConfig(read_timeout=)`` and
            ``STREAMLOAD_READ_TIMEOUT`` set it for a dataset's storage);
            applied to s3:// (botocore's ``read_timeout``) and http(s):// (aiohttp's
            ``sock_read``) unless ``storage_options`` choose their own.
    """

    timeout: float = DEFAULT_RETRY_TIMEOUT
    initial_delay: float = 0.2
    max_delay: float = 5.0
    multiplier: float = 2.0
    inactivity_timeout: float = DEFAULT_INACTIVITY_TIMEOUT

    def __post_init__(self) -> None:
        if not self.inactivity_timeout > 0:
            raise ConfigError(f"retry policy {self.inactivity_timeout=} must be > 0")
        if self.timeout < 0 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ConfigError(
                f"retry policy {self.timeout=}, {self.initial_delay=}, {self.max_delay=} must satisfy "
                "timeout >= 0 and 0 < initial_delay <= max_delay"
            )
        if self.multiplier < 1:
            raise ConfigError(f"retry policy {self.multiplier=} must be >= 1")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Return the wait before retry number ``attempt`` (0-based)."""
        ceiling = min(self.max_delay, self.initial_delay * self.multiplier**attempt)
        return (rng or random).uniform(ceiling / 2, ceiling)


def retry_call(
    func: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    stop: threading.Event | None = None,
) -> T:
    """Call ``func`` until it succeeds, raises a non-transient error, or the policy gives up.

    The first failure of a call is logged once (a WARNING stating the budget), its
    retries at DEBUG, a success after retries at INFO.

    Args:
        func: The call (no arguments).
        policy: How long and how often to retry.
        what: Names the call and URL in the log (``"GET s3://b/shard-000001.tar"``).
        stop: If set while waiting, give up at once (the storage is closing).

    Returns:
        What ``func`` returned.

    Raises:
        Exception: The last error of ``func``, unchanged, if it is not transient or the
            time budget is spent (a note says how many attempts over how long, and the
            budget); the caller translates it (see :mod:`.remote`).
    """
    first_failure: float | None = None
    attempt = 0
    while True:
        started = time.monotonic()
        try:
            result = func()
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            # The budget counts from the start of the first failed attempt: a read that
            # stalled until its inactivity timeout has spent that time already.
            first_failure = started if first_failure is None else first_failure
            wait = policy.delay(attempt)
            if now + wait - first_failure > policy.timeout:
                exc.add_note(
                    f"gave up after {attempt + 1} attempts over {now - first_failure:.1f} s "
                    f"(retry budget {policy.timeout:g} s)"
                )
                raise
            # One warning per call, stating the budget; each retry after it is a debug line
            # (an outage of two minutes would otherwise log thirty lines per call).
            level = logging.WARNING if attempt == 0 else logging.DEBUG
            log.log(
                level,
                "%s failed (%s: %s); retrying for up to %g s (retry %d in %.1f s)",
                what,
                type(exc).__name__,
                exc,
                policy.timeout,
                attempt + 1,
                wait,
            )
            attempt += 1
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
        else:
            if attempt:
                log.info("%s succeeded at attempt %d", what, attempt + 1)
            return result
