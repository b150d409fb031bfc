"""The far-bucket proxy itself: it delays every response and paces every connection."""

from __future__ import annotations

import time

import pytest

from tests.s3server import SeaweedS3
from tests.shaping import ShapingProxy, upstream_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_every_request_waits_for_the_latency_and_bytes_are_paced(s3_server: SeaweedS3) -> None:
    bucket = s3_server.make_bucket()
    s3_server.filesystem().pipe(f"{bucket}/blob", b"x" * (2 << 20))
    proxy = ShapingProxy(upstream_of(s3_server), latency=0.2, bandwidth=8e6)
    try:
        options = s3_server.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        fs.info(f"{bucket}/blob")  # connect (and one request)
        requests = proxy.stats.requests
        start = time.monotonic()
        for _ in range(3):
            fs.info(f"{bucket}/blob")
            fs.invalidate_cache()
        small = time.monotonic() - start
        start = time.monotonic()
        data = fs.cat_file(f"{bucket}/blob")
        big = time.monotonic() - start
    finally:
        proxy.stop()
    assert data == b"x" * (2 << 20)
    assert proxy.stats.requests >= requests + 4
    assert small >= 3 * 0.2 * 0.95, f"3 requests took {small:.3f} s, below 3 x 200 ms"
    assert big >= 0.2 + (2 << 20) / 8e6 * 0.9, f"2 MiB at 8 MB/s took only {big:.3f} s"
    assert proxy.stats.bytes_down >= 2 << 20


def test_a_stopped_proxy_refuses_connections(s3_server: SeaweedS3) -> None:
    import socket

    proxy = ShapingProxy(upstream_of(s3_server))
    port = proxy.port
    proxy.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert conn.recv(1)  # a closed listener: refused, or closed at once
