"""A loopback HTTP proxy that cuts or stalls response bodies: the faults of a bad network path.

It forwards one connection's requests and responses, reading each request's line (to know
which answers have a body: not a HEAD's) and each response's ``Content-Length``. A response
to a GET whose path matches ``match`` is faulted while ``faults`` is above zero: its
headers and half its body go through, then the connection is closed (``mode="cut"``), or
kept open with nothing more sent (``mode="stall"``) until the proxy stops. A response the
proxy cannot delimit (chunked, no length) turns the connection into a plain pipe.

For reads only (request bodies are not parsed beyond what one read brings). Loopback
only; every socket is closed by :meth:`FaultProxy.stop`.
"""

from __future__ import annotations

import collections
import re
import socket
import threading
from typing import Any

_CHUNK = 64 << 10
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


class FaultProxy:
    """Forward ``127.0.0.1:port`` to ``upstream``, cutting or stalling matching bodies.

    Args:
        upstream: ``(host, port)`` of the real server (loopback).
        mode: ``"cut"`` (close after half the body) or ``"stall"`` (send nothing more).
        faults: How many responses to fault (``-1``: all).
        match: A regular expression that a faulted request's path matches.
    """

    def __init__(self, upstream: tuple[str, int], mode: str, faults: int, match: bytes) -> None:
        self.upstream = upstream
        self.mode = mode
        self.faults = faults
        self.match = re.compile(match)
        self.faulted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True, name="fault-proxy")
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def _take_fault(self, path: bytes) -> bool:
        with self._lock:
            if not self.match.search(path) or self.faults == 0:
                return False
            self.faults -= 1 if self.faults > 0 else 0
            self.faulted += 1
            return True

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            requests: collections.deque[tuple[bytes, bytes]] = collections.deque()
            arrived = threading.Condition()
            threading.Thread(target=self._up, args=(client, server, requests, arrived), daemon=True).start()
            threading.Thread(target=self._down, args=(client, server, requests, arrived), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, requests: Any, arrived: threading.Condition) -> None:
        """Client to server; notes each request's method and path (GET/HEAD have no body)."""
        buffer = b""
        try:
            while data := client.recv(_CHUNK):
                buffer += data
                while b"\r\n\r\n" in buffer:
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    line = head.split(b"\r\n", 1)[0].split(b" ")
                    length = _LENGTH.search(b"\r\n" + head.split(b"\r\n", 1)[-1])
                    skip = int(length.group(1)) if length else 0
                    buffer = buffer[skip:]  # a request body (a PUT): not parsed
                    with arrived:
                        requests.append((line[0], line[1] if len(line) > 1 else b""))
                        arrived.notify_all()
                server.sendall(data)
        except OSError:
            pass

    def _down(self, client: socket.socket, server: socket.socket, requests: Any, arrived: threading.Condition) -> None:
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = server.recv(_CHUNK)
                    if not data:
                        return self._close(client, server)
                    buffer += data
                head, rest = buffer.split(b"\r\n\r\n", 1)
                with arrived:
                    arrived.wait_for(lambda: bool(requests), timeout=10)
                    method, path = requests.popleft() if requests else (b"GET", b"")
                length = _LENGTH.search(head)
                if length is None:  # not delimited: a plain pipe from here on
                    client.sendall(buffer)
                    while data := server.recv(_CHUNK):
                        client.sendall(data)
                    return self._close(client, server)
                size = 0 if method == b"HEAD" else int(length.group(1))
                body = rest
                while len(body) < size:
                    data = server.recv(_CHUNK)
                    if not data:
                        break
                    body += data
                body, buffer = body[:size], body[size:]
                if method == b"GET" and size > 64 and self._take_fault(path):
                    client.sendall(head + b"\r\n\r\n" + body[: size // 2])
                    if self.mode == "stall":
                        self._stop.wait()
                    return self._close(client, server)
                client.sendall(head + b"\r\n\r\n" + body)
        except OSError:
            self._close(client, server)

    @staticmethod
    def _close(*sockets: socket.socket) -> None:
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self) -> None:
        """Stop accepting; close every connection (a stalled one too)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        self._close(*sockets)
