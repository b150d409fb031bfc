"""``Loader``: the DataLoader's batches, made on threads of the calling process.

A DataLoader worker is a process: under fork its pages are copied bit by bit as Python's
reference counts touch them, under spawn it imports torch again, and every batch crosses
to the training process through ``/dev/shm`` (64 MB in a default Docker container).
Decoding an image (Pillow, simplejpeg) and reading a shard (``preadv``) run in C with the
GIL released, so threads can do that work in parallel in one process instead.

:class:`Loader` runs the dataset's own pipeline (plan, read, transform, ``collate``) on
``threads`` threads. Thread ``w`` reads exactly what DataLoader worker ``w`` of
``threads`` workers would read (the planner deals a rank's batches to its readers in
turn), and the batches are taken from the threads in turn, as the DataLoader takes them
from its workers. Since the dataset's batches do not depend on the number of workers,
the result is the batches ``DataLoader(dataset, batch_size=None, num_workers=k)`` yields
for any ``k``, bit for bit (random crops and flips are keyed by each sample's epoch and
position, :func:`streamload.sample_generator`), for any number of threads::

    thread 0:  plan -> read batch 0, 2, 4 ... -> collate   -> queue 0 (prefetch batches)
    thread 1:  plan -> read batch 1, 3, 5 ... -> collate   -> queue 1
    main:      queue 0, queue 1, queue 0, ...              -> [pin/copy thread] -> caller

Each thread's work is a whole batch at a time (a :class:`~streamload.batch.RawCollate`
reads it with one ``preadv`` per run; :class:`~streamload.decode.DecodeBatch` decodes
each image into its slot of the batch buffer), so little Python runs per sample.

Nothing leaves the process: no child process, no shared-memory segment, no pickling.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._atexit import close_at_exit
from ._errors import ConfigError
from .dataset import StreamingDataset
from .device import check_device
from .loader_state import dataset_state
from .streams import ReaderKeep
from .timing import LOADER_COLLATE

__all__ = ["Loader"]

log = logging.getLogger("streamload")

#: How often a blocked thread looks whether the iteration was stopped (seconds).
_POLL = 0.1
#: How long leaving a loop (``break``, an error, Ctrl-C) waits for the threads to end; a
#: thread still busy then (inside a slow or hung transform) ends in the background and its
#: batch is dropped.
STOP_WAIT = 1.0
#: How long the interpreter's exit waits for the threads of iterations still alive then.
EXIT_WAIT = 60.0
#: Most threads one Loader runs: ``max(MIN_THREAD_CAP, THREADS_PER_CORE * cores)``.
THREADS_PER_CORE = 4
MIN_THREAD_CAP = 32


class _End:
    """A reader thread's last queue item: it has no more batches."""


class _Raised:
    """A reader thread's error, re-raised in the caller when its batch is due."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = _End()


class Loader:
    """Iterate a :class:`~streamload.StreamingDataset`'s batches on threads, in this process.

    Yields exactly the batches ``DataLoader(dataset, batch_size=None, num_workers=k)``
    yields, for any ``k`` and any number of threads: the same keys at every step and
    bit-identical tensors, random crops and flips included. The dataset needs a
    ``batch_size``; with a ``collate`` (e.g. :class:`~streamload.decode.DecodeBatch`) its
    batches are yielded as they are, without one each batch of ``batch_size`` samples is
    put together by ``default_collate`` (the batches of ``DataLoader(dataset,
    batch_size=dataset.batch_size)``).

    Args:
        dataset: The dataset to read; it must have a ``batch_size``.
        threads: Threads that read and collate batches (each does a whole batch at a
            time). The batches do not depend on it.
        pin_memory: Copy each batch into page-locked memory (on a background thread), so
            that a copy to the GPU can overlap with compute. Ignored (with a warning) when
            no accelerator is present.
        prefetch: Batches each thread makes ahead of the caller (the DataLoader's
            ``prefetch_factor``); also the batches pinned or copied ahead.
        device: Copy each batch to this device on a background thread (with a CUDA
            device: on a stream of its own, the caller's stream waiting for the copy).

    Raises:
        ConfigError: If ``threads`` or ``prefetch`` is below 1, or the dataset has no
            ``batch_size``.

    ``set_epoch`` goes through the dataset (``loader.dataset.set_epoch(n)``, or
    :meth:`set_epoch`). :meth:`state_dict` is the dataset's plain state with the samples
    this loader's caller has consumed: :meth:`load_state_dict` resumes it exactly, on any
    number of threads, and so does ``dataset.load_state_dict(state)`` followed by any
    DataLoader (and back: a DataLoader run's dataset state, or a ``StatefulDataLoader``'s
    own state, loads here).

    A dataset iterated by a ``Loader`` may not be iterated by a DataLoader at the same
    time (a :class:`~streamload.ConfigError` says so): their epochs would collide.

    Example:
        >>> ds = StreamingDataset("shards/", shuffle=True, batch_size=256,
        ...                       collate=DecodeBatch(224, crop="random", flip=True))  # doctest: +SKIP
        >>> for images, labels in Loader(ds, threads=8, device="cuda"):  # doctest: +SKIP
        ...     ...
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        *,
        threads: int = 4,
        pin_memory: bool = False,
        prefetch: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError(f"Loader reads a StreamingDataset, not {type(dataset).__name__}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads={threads!r} must be an integer >= 1")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch={prefetch!r} must be an integer >= 1")
        if dataset.batch_size is None:
            raise ConfigError(
                f"Loader needs a dataset with batch_size= (got {dataset!r}): the threads take whole batches in turn"
            )
        cap = thread_cap()
        if threads > cap:
            warnings.warn(
                f"Loader(threads={threads}): a process uses at most {cap} threads here "
                f"({THREADS_PER_CORE} per core, at least {MIN_THREAD_CAP}); running {cap} (the batches are the same)",
                UserWarning,
                stacklevel=2,
            )
            threads = cap
        self.dataset = dataset
        self.threads = threads
        self.prefetch = prefetch
        self.device = check_device(device, "Loader")
        self.pin_memory = pin_memory and _accelerator_present()
        if pin_memory and not self.pin_memory:
            log.warning("Loader(pin_memory=True): no accelerator present, batches are not pinned")
        self._run: _Run | None = None
        self._loaded: dict[str, Any] | None = None  # a state loaded and not iterated yet
        # Each thread's open shards (a local tar dataset's), left by one epoch for the next:
        # an epoch's turn then opens no shard again.
        self._keeps = [ReaderKeep() for _ in range(threads)]

    # -- epochs and state ----------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank (``len(dataset)`` for a collated dataset)."""
        n = len(self.dataset)
        if self.dataset.collate is None:
            b = self.dataset.batch_size
            assert b is not None
            return -(-n // b)
        return n

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (:meth:`StreamingDataset.set_epoch`)."""
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Return where this loader's epoch stands: the dataset's plain state, counting the batches yielded.

        The state (ints, bools and ``None``: JSON-safe) is the one
        :meth:`StreamingDataset.state_dict` gives for the samples this loader's caller
        has consumed, all ranks (``steps * batch_size * world_size``); batches made
        ahead by the threads and not yet yielded do not count. It is this loader's own
        position (its latest iteration's), whatever other loaders of the same dataset
        do; after :meth:`load_state_dict`, the loaded state until the next iteration.
        """
        if self._loaded is not None:
            return dict(self._loaded)
        if self._run is not None:
            return self._run.state()
        loaded = self.dataset.loaded_state()  # loaded, not iterated yet
        return self.dataset.state_dict(samples_seen=0) if loaded is None else loaded

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next iteration.

        An iteration running now goes on as it was (as a ``StatefulDataLoader``'s does);
        the next ``iter(loader)`` starts at the loaded position.

        Args:
            state: A state from :meth:`state_dict` or :meth:`StreamingDataset.state_dict`
                (saved by any number of threads, DataLoader workers or ranks with the same
                global batch), or a ``torchdata`` ``StatefulDataLoader``'s own
                ``state_dict()`` of this dataset (every worker's position checked as the
                DataLoader checks it).

        Raises:
            PlanError: If the state is malformed, tampered with, or belongs to another
                dataset configuration.
        """
        ds = self.dataset
        converted = dataset_state(state, ds)
        ds.load_state_dict(converted)
        self._loaded = ds.loaded_state()

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        # Each iteration is its own, as a DataLoader's: one started inside a running loop
        # (``next(iter(loader))``) does not end that loop. An iteration ends when it is
        # exhausted, closed, or dropped (its threads are then stopped).
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        run = _Run(self, self._keeps)
        self._run = run
        self._loaded = None
        try:
            yield from run
        finally:
            run.stop()

    def close(self) -> None:
        """Stop the latest iteration's threads (dropping or exhausting an iteration does it too), close kept shards.

        The threads leave a local dataset's open shards at the end of each epoch for the
        next epoch's threads; closing closes them (a later iteration opens them again).
        """
        if self._run is not None:
            self._run.stop()
        for keep in self._keeps:
            keep.close()

    def __repr__(self) -> str:
        return f"Loader({self.dataset!r}, threads={self.threads}, prefetch={self.prefetch})"


class _Run:
    """One iteration: the reader threads, their queues and the optional transfer thread."""

    def __init__(self, loader: Loader, keeps: list[ReaderKeep]) -> None:
        self.loader = loader
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.transfer: threading.Thread | None = None
        self.out: queue.Queue[Any] | None = None
        self.stream: Any = None
        ds = loader.dataset
        # Registered with the dataset, its storages opened once, one reader per thread (left if any of it fails).
        self.iteration = iteration = ds.thread_readers(loader.threads, keeps)
        readers = iteration.readers
        try:
            self.progress = iteration.progress
            self.world_size = iteration.world.world_size
            self.chunk_size = iteration.chunk_size
            self.queues: list[queue.Queue[Any]] = [queue.Queue(loader.prefetch) for _ in readers]
            self.gate = threading.BoundedSemaphore(_cores())
            collate = ds.collate is None
            table = ds.stage_table  # watched: the threads time their default_collate too
            for w, (reader, q) in enumerate(zip(readers, self.queues, strict=True)):
                thread = threading.Thread(
                    target=self._read, args=(reader, q, collate, table), name=f"streamload-loader-{w}", daemon=True
                )
                self.threads.append(thread)
            if loader.pin_memory or loader.device is not None:
                self.out = queue.Queue(loader.prefetch)
                if loader.device is not None and loader.device.type == "cuda":
                    self.stream = torch.cuda.Stream(loader.device)  # type: ignore[no-untyped-call]
                self.transfer = threading.Thread(target=self._transfer, name="streamload-loader-copy", daemon=True)
            close_at_exit(self)  # an iteration alive at exit is stopped and joined before the teardown
            for thread in self.threads:
                thread.start()
            if self.transfer is not None:
                self.transfer.start()
        except BaseException:
            self.stop()  # the threads started stop and close their readers
            ran = [thread.ident is not None for thread in self.threads]
            for w, reader in enumerate(readers):
                close = getattr(reader, "close", None)
                if close is not None and not (w < len(ran) and ran[w]):
                    close()  # a reader no thread ran
            raise

    def state(self) -> dict[str, Any]:
        """This iteration's dataset state, counting the batches its caller consumed."""
        return self.iteration.state(self.world_size * self.progress.next_item)

    # -- threads -------------------------------------------------------------------

    def _put(self, q: queue.Queue[Any], item: Any) -> bool:
        """Put ``item`` unless the iteration stops first; return False if it stopped."""
        while not self.stopped.is_set():
            try:
                q.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, reader: Iterator[Any], q: queue.Queue[Any], collate: bool, table: Any) -> None:
        """A reader thread: its batches, in its order, into its queue."""
        from torch.utils.data import default_collate, default_convert

        size = self.chunk_size
        stopped = self.stopped
        # The first round of batches: no more at once than there are cores, so that batch 0
        # is not slowed down by every other thread's first batch (the first batch comes as
        # early as with one reader per core).
        gate = self.gate
        waiting = True
        while not gate.acquire(timeout=_POLL):
            if stopped.is_set():
                waiting = False
                break
        try:
            if not waiting:
                return
            # Watched: this thread's clock times what the Loader itself runs, as a DataLoader's
            # collate_fn is timed (the pipeline's own stages are timed by the same clock).
            clock = None if table is None else table.clock()
            if collate:
                samples: list[Any] = []
                for sample in reader:
                    if stopped.is_set():
                        return
                    samples.append(sample)
                    if len(samples) == size:
                        if clock is None:
                            batch = default_collate(samples)
                        else:
                            batch = clock.collate(default_collate, samples, LOADER_COLLATE)
                        if waiting:
                            gate.release()
                            waiting = False
                        if not self._put(q, batch):
                            return
                        samples = []
                if samples:
                    last = default_collate(samples) if clock is None else clock.collate(default_collate, samples)
                    if not self._put(q, last):
                        return
            else:
                for batch in reader:
                    if waiting:
                        gate.release()
                        waiting = False
                    # What DataLoader(batch_size=None) does to each item in its workers.
                    if stopped.is_set() or not self._put(q, default_convert(batch)):  # type: ignore[no-untyped-call]
                        return
            self._put(q, _END)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, in order
            self._put(q, _Raised(exc))
        finally:
            if waiting:
                gate.release()
            close = getattr(reader, "close", None)
            if close is not None:
                close()  # in this thread: the reader's shards and read-ahead end here

    def _ordered(self) -> Iterator[Any]:
        """The readers' batches in turn (a finished reader drops out), as the DataLoader takes them."""
        live = list(range(len(self.queues)))
        turn = 0
        while live:
            turn %= len(live)
            item = self._get(self.queues[live[turn]])
            if item is _END:
                del live[turn]  # the next reader in turn now stands at this index
                continue
            if isinstance(item, _Raised):
                raise item.error
            turn += 1
            yield item

    def _get(self, q: queue.Queue[Any]) -> Any:
        while True:
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                if self.stopped.is_set():
                    raise _Stopped from None

    def _transfer(self) -> None:
        """The copy thread: pin each batch and copy it to the device, ahead of the caller."""
        out = self.out
        assert out is not None
        loader = self.loader
        try:
            for batch in self._ordered():
                if loader.pin_memory:
                    from torch.utils.data._utils.pin_memory import pin_memory

                    batch = pin_memory(batch, loader.device)  # type: ignore[no-untyped-call]
                event = None
                if loader.device is not None:
                    if self.stream is not None:
                        with torch.cuda.stream(self.stream):
                            batch = _to_device(batch, loader.device)
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(self.stream)
                    else:
                        batch = _to_device(batch, loader.device)
                if not self._put(out, (batch, event)):
                    return
            self._put(out, _END)
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._put(out, _Raised(exc))

    # -- the caller's side -----------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        progress = self.progress
        try:
            if self.out is None:
                for batch in self._ordered():
                    progress.next_item += self.chunk_size
                    yield batch
                return
            while True:
                item = self._get(self.out)
                if item is _END:
                    return
                if isinstance(item, _Raised):
                    raise item.error
                batch, event = item
                if event is not None:
                    current = torch.cuda.current_stream(self.loader.device)
                    current.wait_event(event)
                    for tensor in _tensors(batch):
                        if tensor.is_cuda:
                            tensor.record_stream(current)
                progress.next_item += self.chunk_size
                yield batch
        except _Stopped:
            return

    def stop(self, wait: float = STOP_WAIT) -> None:
        """Stop the iteration: unregister it from the dataset, then wait up to ``wait`` s for its threads.

        Unregistered first, so that an interrupt during the wait (a second Ctrl-C) leaves
        the dataset free. A thread still busy after ``wait`` (a slow or hung transform)
        ends in the background when its work returns; what it made is dropped.
        """
        self.stopped.set()
        self.iteration.leave()
        me = threading.current_thread()
        deadline = time.monotonic() + wait
        for thread in [*self.threads, *([self.transfer] if self.transfer is not None else [])]:
            if thread is not me and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the iteration and wait for its threads (at exit: up to :data:`EXIT_WAIT` s)."""
        self.stop(EXIT_WAIT)
        busy = [t.name for t in self.threads if t.is_alive()]
        if busy:
            log.warning("streamload.Loader: threads %s still busy after %.0f s at exit", busy, EXIT_WAIT)


class _Stopped(Exception):
    """The iteration was stopped while a thread waited for a batch."""


def _cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _accelerator_present() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver: no accelerator
        return False


def _to_device(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor on ``device`` (batches with ``.to``, dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    to = getattr(batch, "to", None)
    if to is not None and hasattr(batch, "pin_memory"):  # RawBatch, ImageBatch
        return to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch (for ``record_stream``)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, list | tuple):
        for value in batch:
            yield from _tensors(value)
    else:
        for name in ("images", "labels", "data", "offsets"):
            value = getattr(batch, name, None)
            if isinstance(value, torch.Tensor):
                yield value


def thread_cap() -> int:
    """Most threads a :class:`Loader` runs in this process."""
    return max(MIN_THREAD_CAP, THREADS_PER_CORE * _cores())
