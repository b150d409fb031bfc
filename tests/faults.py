"""A faulty network on loopback: an HTTP proxy in front of the test S3 server that breaks chosen responses.

A real path to a bucket resets connections, cuts bodies short, answers ``503 SlowDown``
in storms, stalls for seconds, and now and then (a faulty middlebox, a bad NIC) hands
over a body with a few bytes changed. :class:`FaultProxy` forwards every HTTP/1.1
request to the server unchanged (headers verbatim, so signatures hold) and applies the
:class:`Fault` s it was given to the responses of the requests they match:

* ``reset``: the connection is reset (RST) after ``at`` bytes of the body;
* ``truncate``: the body ends cleanly (FIN) after ``at`` bytes, short of its length;
* ``status``: the request is not forwarded; the answer is ``status`` with the S3 error
  ``code`` (``503 SlowDown`` by default, a throttling burst with ``times=20``);
* ``stall``: the body stops for ``seconds`` after ``at`` bytes, then goes on;
* ``flip``: ``count`` bytes of the body from ``at`` on are inverted (the length is kept).

A fault matches requests by method and a substring of the path, lets ``skip`` matching
requests through first, then hits the next ``times`` of them (``at`` beyond a body's
end means its last byte). Counters say what crossed the proxy and what each fault hit.

Loopback only; stopped by its fixture (or :meth:`FaultProxy.stop`).

Fixture: ``faulty_s3`` (session): the test S3 server behind one proxy, faults cleared
before and after each test that uses it.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import pytest

from .s3server import ProxiedS3, SeaweedS3

_CHUNK = 64 << 10
_HOP_HEADERS = frozenset({"transfer-encoding", "connection", "keep-alive", "content-length"})

FaultKind = Literal["reset", "truncate", "status", "stall", "flip"]


@dataclass
class Fault:
    """One fault, applied to the responses of the requests it matches.

    Attributes:
        kind: What happens (see the module docstring).
        match: A substring of the request path (``""``: every path).
        method: The request method it matches.
        skip: Matching requests let through before the first hit.
        times: Matching requests hit (then the fault is spent).
        at: Body offset where a ``reset``/``truncate``/``stall``/``flip`` happens.
        seconds: How long a ``stall`` lasts.
        status: The HTTP status of a ``status`` fault.
        code: The S3 error code of a ``status`` fault.
        count: Bytes a ``flip`` inverts.
        ranged: Only requests with (True) or without (False) a ``Range`` header; ``None``: both.
        range_start: Only ranged requests from this byte on.
        unless: Not requests whose path holds this (``".idx"``: a shard, not its sidecar).
        hits: How many requests it hit so far.
        stalled: How many of them a ``stall`` has let go on since (its pause over).
    """

    kind: FaultKind
    match: str = ""
    method: str = "GET"
    skip: int = 0
    times: int = 1
    at: int = 0
    seconds: float = 0.0
    status: int = 503
    code: str = "SlowDown"
    count: int = 4
    ranged: bool | None = None
    range_start: int | None = None
    unless: str = ""
    hits: int = 0
    stalled: int = 0
    _seen: int = 0

    def claims(self, method: str, path: str, byte_range: str | None) -> bool:
        """Count a request (``byte_range``: its ``Range`` header); True if this fault hits it."""
        if method != self.method or self.match not in path or (self.unless and self.unless in path):
            return False
        if self.ranged is not None and (byte_range is not None) != self.ranged:
            return False
        if self.range_start is not None and not (byte_range or "").startswith(f"bytes={self.range_start}-"):
            return False
        self._seen += 1
        if self._seen <= self.skip or self.hits >= self.times:
            return False
        self.hits += 1
        return True


class _Abort(Exception):
    """The connection was broken on purpose: end the handler quietly."""


class FaultProxy:
    """Forward HTTP on ``127.0.0.1:port`` to ``upstream``, breaking the responses that faults match.

    Args:
        upstream: ``(host, port)`` of the real server (loopback).
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests: Counter[str] = Counter()  # by method
        #: ``(event, method, path)`` in the order they happened: ``"start"`` when a request
        #: arrived, ``"end"`` when its response was sent whole (or broken by a fault).
        self.events: list[tuple[str, str, str]] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def inject(self, *faults: Fault) -> list[Fault]:
        """Add faults (applied in the order given when several match one request); return them."""
        with self._lock:
            self._faults.extend(faults)
        return list(faults)

    def clear(self) -> None:
        """Drop every fault and forget the events."""
        with self._lock:
            self._faults.clear()
            self.events.clear()

    def _pick(self, method: str, path: str, byte_range: str | None) -> Fault | None:
        with self._lock:
            self.requests[method] += 1
            self.events.append(("start", method, path))
            for fault in self._faults:
                if fault.claims(method, path, byte_range):
                    return fault
        return None

    def _ended(self, method: str, path: str) -> None:
        with self._lock:
            self.events.append(("end", method, path))

    def stop(self) -> None:
        """Stop serving and close the listener."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._forward()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET  # noqa: N815

    def handle(self) -> None:
        try:
            super().handle()
        except (_Abort, OSError):
            pass
        finally:
            if self._upstream is not None:
                self._upstream.close()

    def finish(self) -> None:
        try:
            super().finish()
        except (OSError, ValueError):
            pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        try:
            self._serve()
        finally:
            self.owner._ended(self.command, self.path)

    def _serve(self) -> None:
        body = self._body()
        fault = self.owner._pick(self.command, self.path, self.headers.get("Range"))
        if fault is not None and fault.kind == "status":
            text = f"<?xml version='1.0'?><Error><Code>{fault.code}</Code><Message>injected</Message></Error>"
            payload = text.encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        response = self._upstream_response(body)
        data_length = response.getheader("Content-Length")
        chunked = data_length is None and self.command != "HEAD"
        payload_all = response.read() if chunked else None
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_HEADERS:
                self.send_header(name, value)
        length = len(payload_all) if payload_all is not None else int(data_length or 0)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        at = min(fault.at, max(0, length - 1)) if fault is not None else -1
        sent = 0
        while sent < length:
            piece = bytearray(payload_all[sent : sent + _CHUNK] if payload_all is not None else response.read(_CHUNK))
            if not piece:
                break
            if fault is not None and sent <= at < sent + len(piece):
                piece = self._apply(fault, piece, at - sent)
            self.wfile.write(piece)
            sent += len(piece)

    def _apply(self, fault: Fault, piece: bytearray, offset: int) -> bytearray:
        """Apply ``fault`` at ``offset`` of ``piece`` (the body's bytes now being sent)."""
        offset = max(0, offset)
        if fault.kind == "flip":
            for i in range(offset, min(len(piece), offset + fault.count)):
                piece[i] ^= 0xFF
            return piece
        self.wfile.write(piece[:offset])
        if fault.kind == "stall":
            time.sleep(fault.seconds)
            fault.stalled += 1
            return piece[offset:]
        if fault.kind == "reset":  # RST, not FIN: the client sees "connection reset"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        raise _Abort(fault.kind)

    def _upstream_response(self, body: bytes) -> http.client.HTTPResponse:
        for attempt in range(2):  # the server may have closed an idle kept-alive connection
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                return conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


class FaultyS3(ProxiedS3):
    """The test S3 server as seen through a :class:`FaultProxy`."""

    proxy: FaultProxy

    def inject(self, *faults: Fault) -> list[Fault]:
        """See :meth:`FaultProxy.inject`."""
        return self.proxy.inject(*faults)


@pytest.fixture(scope="session")
def _fault_proxy(s3_server: SeaweedS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(("127.0.0.1", s3_server.gateway.port))
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def faulty_s3(s3_server: SeaweedS3, _fault_proxy: FaultProxy) -> Iterator[FaultyS3]:
    """The session's S3 server behind the fault proxy, with no fault left from another test."""
    _fault_proxy.clear()
    try:
        yield FaultyS3(s3_server, _fault_proxy)
    finally:
        _fault_proxy.clear()
