"""Where conversion tasks run: this machine's process pool, a Dask cluster or a Ray cluster.

The engine plans every shard before any task starts; a task writes one whole shard
straight to the destination and returns its :class:`~streamload.writer.ShardResult`. An
executor only submits those tasks and hands results back as they complete
(``concurrent.futures``' shape), so the output is byte-identical whatever runs it.

* ``local`` (the default): a fork pool of ``--workers`` processes (see :mod:`.engine`).
* ``dask`` / ``dask://HOST:PORT``: a :class:`distributed.LocalCluster` of ``--workers``
  single-threaded worker processes, or the scheduler at that address. A task whose worker
  dies is run again elsewhere by the scheduler; tasks are also submitted with
  ``retries=`` for failures of the environment (errors of the input itself are returned
  as values and never retried).
* ``ray`` / ``ray://HOST:PORT``: the Ray instance already initialised in this process, the
  cluster named by ``RAY_ADDRESS``, a local one of ``--workers`` CPUs, or the cluster at
  that address (Ray Client). Tasks
  have ``max_retries``: a task whose worker process dies is run again.

Engines are imported only when chosen; they are the optional extras ``streamload[dask]``
and ``streamload[ray]``.
"""

from __future__ import annotations

import importlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from streamload._errors import ConfigError, StorageError, StreamloadError

__all__ = ["TASK_RETRIES", "DaskExecutor", "Executor", "TaskFailed", "RayExecutor", "open_executor", "parse_executor"]

T = TypeVar("T")
#: Times a task is run again after its worker died or its environment failed.
TASK_RETRIES = 3


@dataclass
class TaskFailed:
    """A task that failed on its input (an error it returns instead of raising, so it is not retried)."""

    error: StreamloadError


def parse_executor(spec: str) -> tuple[str, str | None]:
    """Return ``(engine, address or None)`` of an ``--executor`` value.

    Raises:
        ConfigError: If the value names no known engine.
    """
    spec = (spec or "local").strip()
    if spec in ("local", "dask", "ray"):
        return spec, None
    engine, sep, rest = spec.partition("://")
    if sep and engine in ("dask", "tcp", "tls") and rest:
        return "dask", f"{'tcp' if engine == 'dask' else engine}://{rest}"
    if sep and engine == "ray" and rest:
        return "ray", spec
    raise ConfigError(f"--executor {spec!r}: expected local, dask, dask://HOST:PORT, ray or ray://HOST:PORT")


class Executor(ABC):
    """Runs whole-shard tasks; results come back as they complete."""

    #: How the executor is named in messages.
    name: str = "executor"

    @abstractmethod
    def run(self, fn: Callable[[T], Any], tasks: Sequence[T]) -> Iterator[Any]:
        """Run ``fn`` on every task; yield the results (or :class:`TaskFailed`) as tasks complete."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the executor started (a local cluster)."""


class DaskExecutor(Executor):
    """Tasks on a Dask cluster: a local one of ``workers`` processes, or the scheduler at ``address``."""

    name = "dask"

    def __init__(self, address: str | None, workers: int) -> None:
        try:
            distributed: Any = importlib.import_module("distributed")
        except ImportError as exc:
            raise ConfigError(
                "--executor dask needs Dask's scheduler: pip install 'streamload[dask]' (dask[distributed])"
            ) from exc
        self._cluster: Any = None
        try:
            if address is None:
                self._cluster = distributed.LocalCluster(
                    n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
                )
                self.client: Any = distributed.Client(self._cluster)
            else:
                self.client = distributed.Client(address, timeout=30)
        except (OSError, TimeoutError) as exc:
            self.close()
            where = address or "a local cluster"
            raise StorageError(f"cannot connect to the Dask scheduler at {where}: {exc}") from exc
        self.name = f"dask ({address or f'local, {workers} processes'})"

    def run(self, fn: Callable[[T], Any], tasks: Sequence[T]) -> Iterator[Any]:
        """Submit every task (``retries=``); yield results as they complete; cancel the rest on exit."""
        as_completed = importlib.import_module("distributed").as_completed

        run_id = uuid.uuid4().hex[:8]
        futures = [
            self.client.submit(fn, task, key=f"streamload-shard-{i}-{run_id}", retries=TASK_RETRIES, pure=False)
            for i, task in enumerate(tasks)
        ]
        try:
            for future in as_completed(futures):
                try:
                    yield future.result()
                except StreamloadError:
                    raise
                except Exception as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    raise StorageError(f"a conversion task failed on the Dask cluster: {why}") from exc
        finally:
            self.client.cancel([f for f in futures if not f.done()])

    def close(self) -> None:
        """Close the client and the local cluster it started."""
        client, self.__dict__["client"] = self.__dict__.get("client"), None
        if client is not None:
            client.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def _ray_call(fn: Callable[[Any], Any], task: Any) -> Any:
    return fn(task)


class RayExecutor(Executor):
    """Tasks on Ray: the instance already initialised here, a local one, or the cluster at ``address``.

    ``default_address`` is the cluster to join when ``address`` names none (the caller reads
    ``RAY_ADDRESS``: :func:`open_executor`'s ``ray_address``).
    """

    name = "ray"

    def __init__(self, address: str | None, workers: int, default_address: str | None = None) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConfigError("--executor ray needs Ray: pip install 'streamload[ray]'") from exc
        self._ray = ray
        self._owned = False
        if not ray.is_initialized():
            try:
                address = address or default_address
                if address is None:
                    ray.init(
                        num_cpus=workers,
                        object_store_memory=100 * 2**20,
                        include_dashboard=False,
                        log_to_driver=False,
                        configure_logging=False,
                    )
                else:
                    ray.init(address=address, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise StorageError(f"cannot start or join Ray at {address or 'a local instance'}: {exc}") from exc
            self._owned = True
        self.name = f"ray ({address or 'local'})"

    def run(self, fn: Callable[[T], Any], tasks: Sequence[T]) -> Iterator[Any]:
        """Submit every task (``max_retries``); yield results as they complete; cancel the rest on exit."""
        ray = self._ray
        remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False)(_ray_call)
        fn_ref = ray.put(fn)
        pending = [remote.remote(fn_ref, task) for task in tasks]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    yield ray.get(done[0])
                except Exception as exc:
                    raise StorageError(f"a conversion task failed on Ray: {type(exc).__name__}: {exc}") from exc
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)

    def close(self) -> None:
        """Shut down the Ray instance this executor started (one it found is left running)."""
        if self._owned:
            self._ray.shutdown()
            self._owned = False


def open_executor(spec: str, workers: int, ray_address: str | None = None) -> Executor | None:
    """Return the executor of ``spec`` (``None`` for the local pool, which the engine runs itself).

    ``ray_address``: the Ray cluster a plain ``"ray"`` joins when Ray is not initialised here
    (the engine passes ``RAY_ADDRESS``); ``None``: a local instance.
    """
    engine, address = parse_executor(spec)
    if engine == "dask":
        return DaskExecutor(address, workers)
    if engine == "ray":
        return RayExecutor(address, workers, ray_address)
    return None
