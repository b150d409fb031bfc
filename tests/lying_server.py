"""A small HTTP object server on loopback that misbehaves on purpose (S3 path-style or plain HTTP).

It serves a dict of objects by path (``/bucket/key`` for S3 clients, which use path-style
addressing against an IP endpoint; any path for plain HTTP), answers ``HEAD`` with the
size, an ETag and a date, ``GET`` with or without ``Range``, and lies as told:

* ``extra=N``: a ranged GET is answered ``206`` with ``N`` bytes more than asked, its
  ``Content-Length`` and ``Content-Range`` saying so (an object that grew, a proxy that
  rounds ranges up);
* ``ignore_range=True``: a ranged GET is answered ``200`` with the whole object
  (``python -m http.server``, some CDNs);
* ``tail=N``: every object is served as if it were ``N`` bytes longer (zeros past its
  end, made as they are sent: never held in memory);
* ``status=S`` (e.g. 401, 403, 503): every request is answered ``S`` with an S3-style
  error body, as an endpoint that lost its credentials or is failing answers;
* ``down=True``: every request's connection is reset without an answer (a server that
  went away; :meth:`LyingServer.stop` closes the listener too, so new connections are
  refused).

It records every request's method, path and headers (:attr:`LyingServer.requests`) and
counts the body bytes it managed to send (:attr:`LyingServer.sent`: what a client that
hangs up early did not take stays unsent). Signatures are not checked. Threads are daemon
threads, bounded by the clients' connections; :meth:`LyingServer.stop` ends it.
"""

from __future__ import annotations

import email.utils
import hashlib
import re
import socket
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_CHUNK = 64 << 10


@dataclass
class Seen:
    """One request the server answered: ``method``, ``path`` (with its query) and ``headers`` (lower-case names)."""

    method: str
    path: str
    headers: dict[str, str]


class LyingServer:
    """Serve ``objects`` on ``http://127.0.0.1:PORT`` (see the module docstring).

    Args:
        objects: Object bytes by path (``"/bucket/ds/index.json"``).
    """

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects: dict[str, bytes] = dict(objects or {})
        self.extra = 0
        self.ignore_range = False
        self.tail = 0
        self.status = 0
        self.down = False
        self.requests: list[Seen] = []
        self.sent = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="lying-server", daemon=True)
        self._thread.start()

    def s3_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs/botocore options for this server as an S3 endpoint."""
        return {
            "key": "test-key",
            "secret": "test-secret",
            "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
            **extra,
        }

    def seen(self, method: str = "GET", match: str = "") -> list[Seen]:
        """The requests of ``method`` whose path holds ``match``."""
        with self._lock:
            return [r for r in self.requests if r.method == method and match in r.path]

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client hanging up on a lie it refused is the point, not an error


class _Handler(BaseHTTPRequestHandler):
    server_owner: LyingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _record(self) -> LyingServer:
        owner = self.server_owner
        with owner._lock:
            owner.requests.append(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        return owner

    def _object(self, owner: LyingServer) -> bytes | None:
        path = self.path.split("?", 1)[0]
        return owner.objects.get(path)

    def _refused(self, owner: LyingServer) -> bool:
        """Answer as told when the server is failing (``status``/``down``); True if it did."""
        if owner.down:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return True
        if not owner.status:
            return False
        body = f"<?xml version='1.0'?><Error><Code>{owner.status}</Code><Message>failing</Message></Error>".encode()
        self.send_response(owner.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return True

    def _missing(self) -> None:
        body = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _head(self, data: bytes, size: int, status: int, length: int, first: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"')
        self.send_header("Last-Modified", email.utils.formatdate(1_700_000_000, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if first is not None:
            self.send_header("Content-Range", f"bytes {first}-{first + length - 1}/{size}")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        owner = self._record()
        if self._refused(owner):
            return None
        data = self._object(owner)
        if data is None:
            return self._missing()
        size = len(data) + owner.tail
        self._head(data, size, 200, size)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        owner = self._record()
        if self._refused(owner):
            return None
        data = self._object(owner)
        if data is None:
            return self._missing()
        size = len(data) + owner.tail
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip())
        if match is None or owner.ignore_range:
            self._head(data, size, 200, size)
            return self._send(owner, data, 0, size)
        first = int(match.group(1))
        last = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if first >= size:
            self.send_response(416)
            self.send_header("Content-Length", "0")
            self.send_header("Content-Range", f"bytes */{size}")
            self.end_headers()
            return None
        end = last + 1 + owner.extra  # the lie: more than asked, announced as such
        self._head(data, max(size, end), 206, end - first, first)
        return self._send(owner, data, first, end)

    def _send(self, owner: LyingServer, data: bytes, start: int, end: int) -> None:
        at = start
        try:
            while at < end:
                stop = min(end, at + _CHUNK)
                chunk = data[at:stop] if stop <= len(data) else data[at:] + bytes(stop - max(at, len(data)))
                self.wfile.write(chunk[: stop - at])
                with owner._lock:
                    owner.sent += stop - at
                at = stop
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
