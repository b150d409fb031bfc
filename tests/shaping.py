"""A far bucket on loopback: a TCP proxy in front of the test S3 server that adds latency and caps bandwidth.

A real bucket answers a request in 20-100 ms and gives one connection a few tens of MB/s;
SeaweedFS on loopback answers in a millisecond at gigabytes per second. This proxy makes
the difference testable: every response's first byte is held back until ``latency`` after
its request (request/response turns are seen as the direction of traffic changing on a
connection), and each connection's bytes are paced to ``bandwidth`` (and all of them
together to ``node_bandwidth``) by deadlines: a chunk of ``n`` bytes may leave at
``max(now, next_free)``, and ``next_free`` moves on by ``n / bandwidth``. Sleeping
``n / bandwidth`` after each write instead delivers well under the nominal rate.

Loopback only, bounded in time (it stops itself after ``max_lifetime`` seconds), stopped by
its fixture. Counters (connections, requests, bytes) let tests see what crossed it.

Fixtures: ``shaped_s3`` (session): the test S3 server behind a proxy with the defaults
(50 ms, 40 MB/s per connection); ``storage_options()`` points s3fs at the proxy.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .s3server import ProxiedS3, SeaweedS3

_CHUNK = 64 << 10


@dataclass
class ProxyStats:
    """What crossed the proxy."""

    connections: int = 0
    requests: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


class _Pacer:
    """Deadline pacing: ``wait(n)`` returns when ``n`` more bytes may leave at ``rate`` bytes/s."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._next_free = 0.0
        self._lock = threading.Lock()

    def wait(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class ShapingProxy:
    """Forward ``127.0.0.1:port`` to ``upstream``, with per-request latency and paced bandwidth.

    Args:
        upstream: ``(host, port)`` of the real server (loopback).
        latency: Seconds from a request to the first byte of its response.
        bandwidth: Bytes/s per connection (server to client), or ``None``.
        node_bandwidth: Bytes/s over all connections together, or ``None``.
        max_lifetime: The proxy stops itself after this many seconds.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        latency: float = 0.05,
        bandwidth: float | None = 40e6,
        node_bandwidth: float | None = None,
        max_lifetime: float = 3600.0,
    ) -> None:
        self.upstream = upstream
        self.latency = latency
        self.bandwidth = bandwidth
        self.node = _Pacer(node_bandwidth)
        self.stats = ProxyStats()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + max_lifetime
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="shaping-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def shape(self, latency: float, bandwidth: float | None, node_bandwidth: float | None = None) -> None:
        """Change the shaping for connections and requests from now on."""
        self.latency, self.bandwidth, self.node = latency, bandwidth, _Pacer(node_bandwidth)

    def _accept_loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()  # the server is down: the client sees a reset, like a real outage
                continue
            server.settimeout(None)
            with self._lock:
                self.stats.connections += 1
                self._sockets.update((client, server))
            _Connection(self, client, server).start()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._listener.close()

    def forget(self, *sockets: socket.socket) -> None:
        """Drop closed sockets from the set the proxy closes on stop."""
        with self._lock:
            self._sockets.difference_update(sockets)

    def stop(self) -> None:
        """Stop accepting, close every connection and join the accept thread."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_all()


class _Connection:
    """One client connection: two pumps, a request clock and a pacer."""

    def __init__(self, proxy: ShapingProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client, self.server = client, server
        self.pacer = _Pacer(proxy.bandwidth)
        self.request_at: float | None = None  # when the current request's first byte arrived
        self.lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._up, daemon=True, name="shaping-up").start()
        threading.Thread(target=self._down, daemon=True, name="shaping-down").start()

    def _up(self) -> None:
        """Client to server: unshaped; marks the start of a request."""
        try:
            while data := self.client.recv(_CHUNK):
                with self.lock:
                    if self.request_at is None:
                        self.request_at = time.monotonic()
                        with self.proxy._lock:
                            self.proxy.stats.requests += 1
                self.server.sendall(data)
                with self.proxy._lock:
                    self.proxy.stats.bytes_up += len(data)
        except OSError:
            pass
        finally:
            self._close()

    def _down(self) -> None:
        """Server to client: the first byte of each response waits for the latency; then paced."""
        try:
            while data := self.server.recv(_CHUNK):
                with self.lock:
                    started, self.request_at = self.request_at, None
                if started is not None:
                    wait = started + self.proxy.latency - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                for at in range(0, len(data), _CHUNK):
                    piece = data[at : at + _CHUNK]
                    self.pacer.wait(len(piece))
                    self.proxy.node.wait(len(piece))
                    self.client.sendall(piece)
                with self.proxy._lock:
                    self.proxy.stats.bytes_down += len(data)
        except OSError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy.forget(self.client, self.server)


class ShapedS3(ProxiedS3):
    """The test S3 server as seen through a :class:`ShapingProxy`."""

    proxy: ShapingProxy


def upstream_of(server: SeaweedS3) -> tuple[str, int]:
    """The ``(host, port)`` of the server's S3 gateway."""
    return ("127.0.0.1", server.gateway.port)


@pytest.fixture(scope="session")
def shaped_s3(s3_server: SeaweedS3) -> Iterator[ShapedS3]:
    """The session's S3 server behind a proxy: 50 ms to the first byte, 40 MB/s per connection."""
    proxy = ShapingProxy(upstream_of(s3_server))
    try:
        yield ShapedS3(s3_server, proxy)
    finally:
        proxy.stop()
