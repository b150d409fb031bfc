"""Real conversion engines for tests: a Dask ``LocalCluster`` of processes and a local Ray instance.

Import the fixtures into a test module (``from tests.engines import dask_address, ray_local``);
each module gets its own engine, started on first use and always shut down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dask_address() -> Iterator[str]:
    """A ``distributed.LocalCluster`` of 2 single-threaded worker processes, as ``dask://HOST:PORT``."""
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        yield "dask://" + cluster.scheduler_address.removeprefix("tcp://")
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[str]:
    """A local Ray instance (2 CPUs, 100 MiB object store, no dashboard) whose workers import ``tests``."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        object_store_memory=100 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        yield "ray"
    finally:
        ray.shutdown()
