"""Batch memory: recycled shared-memory segments, handed to the main process in one small message.

A DataLoader worker sends each batch to the main process through a queue. Left to torch,
every tensor of a batch (data, offsets, labels) crosses as its own shared-memory file
descriptor, and every descriptor is fetched by the main process over a socket from the
worker's resource-sharer thread: one round trip per tensor per batch, plus a fresh
segment (``shm_open``, ``mmap``, page faults) for each small tensor. At a batch of 64
images that fixed cost dominated (about 2 ms a batch with two workers).

So all tensors of a batch live in **one** segment, taken from a small per-worker ring of
recycled segments (:class:`BufferPool`), and a segment is sent to the main process only
the first time it is used (or after it grew). Every later batch in it crosses as a few
integers: which worker pool, which slot and generation, and where each tensor lies in
the segment (:func:`pack`). The main process keeps the segments it was given
(:func:`unpack`) and builds each batch's tensors as views of one fresh storage object
over that memory, so it knows when the user has dropped the last view of a batch: a
``weakref.finalize`` on that storage clears the slot's flag in a small shared ``int8``
tensor (sent once per pool), and the worker reuses a slot only when its flag is clear.

Segments of workers that have exited are forgotten the next time a new worker pool
announces itself, so a loader without persistent workers does not leak them epoch after
epoch. A batch that the main process pickles on (to another process) is sent as plain
tensors.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._errors import StreamloadError
from ._fork import ProcessLocal, alive
from ._shared import shared_zeros

__all__ = ["POOL_SLOTS", "BufferPool", "Lease", "allocate", "pack", "unpack"]

#: Segments a worker keeps: prefetch_factor (2) queued + 1 in use + 1 being filled.
POOL_SLOTS = 4
#: Buffers a thread keeps for batches that stay in its process: a Loader thread's prefetch (2)
#: queued + 1 waiting to be queued + 1 the caller holds + 1 being made + its encoded batch being
#: decoded, and one to spare. A batch made beyond them takes a torch allocation (two torch ops,
#: each letting go of the GIL); a buffer is made only when first needed, so memory follows the
#: batches alive at once.
LOCAL_SLOTS = 8
#: Alignment of each tensor inside a segment (bytes): int64 views need 8, cache lines 64.
ALIGN = 64

#: ``(offset in bytes, dtype, shape, strides)`` of one tensor of a batch inside its segment.
Spec = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]
#: What crosses per batch: ``(pool token, slot, generation, segment or None, flags or None)``.
Message = tuple[tuple[int, int], int, int, "torch.UntypedStorage | None", "torch.Tensor | None"]


def _new_shared(nbytes: int) -> torch.UntypedStorage:
    """A storage in a new shared-memory segment (what ``default_collate`` does in workers)."""
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(max(nbytes, 1))  # type: ignore[no-untyped-call]
    return storage


class BufferPool:
    """A worker's recycled shared-memory segments (one per slot) and their lease flags.

    Attributes:
        token: ``(pid, random)``: names this pool to the main process.
        flags: Shared ``int8[slots]``; 1 while the main process holds views of the slot.
    """

    def __init__(self, slots: int = POOL_SLOTS) -> None:
        self.token = (os.getpid(), secrets.randbits(62))
        self.flags = shared_zeros(slots, torch.int8)
        self._in_use = self.flags.numpy()
        self._storages: list[torch.UntypedStorage | None] = [None] * slots
        self._generations = [0] * slots
        self._sent = [-1] * slots  # generation of each slot the main process has been given
        self._flags_sent = False

    def take(self, nbytes: int) -> tuple[torch.UntypedStorage, Lease | None]:
        """Return a shared storage of at least ``nbytes`` and its lease (``None``: not pooled)."""
        free = [i for i in range(len(self._storages)) if not self._in_use[i]]
        for i in free:  # a big enough free segment first
            storage = self._storages[i]
            if storage is not None and storage.nbytes() >= nbytes:
                self._in_use[i] = 1
                return storage, Lease(self, i, self._generations[i])
        if not free:  # the main process holds every segment: a fresh one, not pooled
            return _new_shared(nbytes), None
        i = free[0]
        capacity = -(-max(nbytes, 1) * 9 // 8 // (1 << 20)) * (1 << 20)  # +12 %, whole MiB
        self._storages[i] = None  # drop the old one before allocating
        storage = _new_shared(capacity)
        self._storages[i] = storage
        self._generations[i] += 1
        self._in_use[i] = 1
        return storage, Lease(self, i, self._generations[i])

    def message(self, lease: Lease) -> Message:
        """Return what tells the main process where a batch of ``lease`` lies (marks it sent)."""
        slot = lease.slot
        storage = None
        if self._sent[slot] != lease.generation:
            storage = self._storages[slot]
            self._sent[slot] = lease.generation
        flags = None if self._flags_sent else self.flags
        self._flags_sent = True
        return (self.token, slot, lease.generation, storage, flags)


@dataclass(frozen=True)
class Lease:
    """A batch's claim on one slot of a worker's :class:`BufferPool`."""

    pool: BufferPool
    slot: int
    generation: int

    def here(self) -> bool:
        """True in the process that owns the pool (the worker that made the batch)."""
        return self.pool.token[0] == os.getpid()


#: One pool per process (a forked worker makes its own, never the parent's segments).
_POOL: ProcessLocal[BufferPool] = ProcessLocal(BufferPool)


def _pool() -> BufferPool:
    return _POOL.get()


class _LocalPool:
    """Recycled batch memory for batches used in the process that made them (no workers).

    The pool keeps numpy buffers; each batch is a ``torch.from_numpy`` view whose storage
    holds the buffer, and a finalizer on that storage marks the buffer free once the
    caller has dropped every view (the buffer itself stays, so its pages stay mapped).
    """

    def __init__(self, slots: int = LOCAL_SLOTS) -> None:
        self._buffers: list[np.ndarray | None] = [None] * slots
        self._free = [True] * slots

    def views(self, parts: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor] | None:
        """The parts as ``torch.from_numpy`` views of one pooled buffer, made without a torch op; ``None``: no slot.

        A torch op lets go of the GIL (beside a thread running Python, taking it back may
        wait a switch interval): numpy views and ``torch.from_numpy`` do not. The buffer is
        free again once every part's storage is gone.
        """
        if any(dtype not in _NUMPY for _, dtype in parts):
            return None
        offsets, total = _layout(parts)
        free = [i for i, ok in enumerate(self._free) if ok]
        slot = next((i for i in free if (b := self._buffers[i]) is not None and b.size >= total), None)
        if slot is None and not free:
            return None
        if slot is None:
            slot = free[0]
            self._buffers[slot] = None
            self._buffers[slot] = np.empty(-(-max(total, 1) * 9 // 8 // (1 << 20)) * (1 << 20), dtype=np.uint8)
        buffer = self._buffers[slot]
        assert buffer is not None
        self._free[slot] = False
        left = set(range(len(parts)))

        def gone(part: int) -> None:
            left.discard(part)
            if not left:
                self._free[slot] = True

        out = []
        for i, (off, (shape, dtype)) in enumerate(zip(offsets, parts, strict=True)):
            dims = tuple(int(d) for d in shape)
            count = int(np.prod(dims, dtype=np.int64))
            part: np.ndarray = buffer[off : off + count * _itemsize(dtype)].view(_NUMPY[dtype]).reshape(dims)
            tensor = torch.from_numpy(part)
            weakref.finalize(tensor.untyped_storage(), gone, i)
            out.append(tensor)
        return out

    def take(self, nbytes: int) -> torch.Tensor:
        free = [i for i, ok in enumerate(self._free) if ok]
        slot = next((i for i in free if (b := self._buffers[i]) is not None and b.size >= nbytes), None)
        if slot is None and not free:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if slot is None:
            slot = free[0]
            self._buffers[slot] = None
            self._buffers[slot] = np.empty(-(-max(nbytes, 1) * 9 // 8 // (1 << 20)) * (1 << 20), dtype=np.uint8)
        buffer = self._buffers[slot]
        assert buffer is not None
        tensor = torch.from_numpy(buffer[: max(nbytes, 1)])
        self._free[slot] = False
        weakref.finalize(tensor.untyped_storage(), self._free.__setitem__, slot, True)
        return tensor


#: One pool per thread (a :class:`streamload.Loader` makes batches on several threads at once), per process.
_LOCAL: ProcessLocal[threading.local] = ProcessLocal(threading.local)


def _local_pool() -> _LocalPool:
    mine = _LOCAL.get()
    pool: _LocalPool | None = getattr(mine, "pool", None)
    if pool is None:
        pool = mine.pool = _LocalPool()
    return pool


#: The numpy dtype of each torch dtype a batch's local buffers are viewed as without a torch op.
_NUMPY: dict[torch.dtype, type] = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}

#: Bytes an element of each dtype holds, once per dtype: every torch call lets go of the GIL (a
#: thread beside one running Python may wait up to the switch interval to take it back), so a
#: batch's allocation makes as few as it can.
_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty(0, dtype=dtype).element_size()
    return size


def _layout(parts: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    """Return each part's byte offset (aligned to :data:`ALIGN`) and the total bytes."""
    offsets = []
    end = 0
    for shape, dtype in parts:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
    return offsets, end


def _view(
    storage: torch.UntypedStorage,
    offset: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
) -> torch.Tensor:
    size = _itemsize(dtype)
    dims = tuple(int(d) for d in shape)
    if stride is None:
        stride = tuple(int(np.prod(dims[i + 1 :], dtype=np.int64)) for i in range(len(dims)))
    return torch.empty(0, dtype=dtype).set_(storage, offset // size, dims, tuple(stride))


def allocate(
    parts: Sequence[tuple[Sequence[int], torch.dtype]], shared: bool | None = None
) -> tuple[list[torch.Tensor], Lease | None]:
    """Return uninitialised tensors of the given shapes and dtypes, all in one recycled buffer.

    Inside a DataLoader worker (``shared=None`` detects it) the buffer is one of the
    worker's shared-memory segments and the lease says which; elsewhere it is ordinary
    memory and the lease is ``None``. The buffer is reused once every view of it is gone.
    """
    if shared is None:
        from torch.utils.data import get_worker_info

        shared = get_worker_info() is not None
    offsets, total = _layout(parts)
    lease = None
    if shared:
        storage, lease = _pool().take(total)
    else:
        views = _local_pool().views(parts)
        if views is not None:
            return views, None
        storage = _local_pool().take(total).untyped_storage()
    return [_view(storage, off, dtype, shape) for off, (shape, dtype) in zip(offsets, parts, strict=True)], lease


def channels_first(images: torch.Tensor, lease: Lease | None) -> torch.Tensor:
    """``images`` (``[N, H, W, C]``) as its ``[N, C, H, W]`` view: ``images.permute(0, 3, 1, 2)``'s values and strides.

    A batch in this process's memory (``lease`` is ``None``) gets the view through numpy
    (``torch.from_numpy`` of a transposed ``Tensor.numpy()``), not a torch op: a torch op
    lets go of the GIL, and beside a thread running Python taking it back may wait a
    switch interval. The numpy view holds ``images``, so the pooled buffer stays taken
    until the view is gone. A leased batch (a worker's shared-memory segment, described
    to the main process by its storage) keeps ``permute``.
    """
    if lease is not None or images.requires_grad or images.dtype not in _NUMPY:
        return images.permute(0, 3, 1, 2)
    return torch.from_numpy(images.numpy().transpose(0, 3, 1, 2))


def pack(tensors: Sequence[torch.Tensor | None], lease: Lease) -> tuple[Message, list[Spec | None]]:
    """In the worker: describe ``tensors`` (views of ``lease``'s segment) for :func:`unpack`."""
    base = lease.pool._storages[lease.slot]
    assert base is not None
    specs: list[Spec | None] = []
    for t in tensors:
        if t is None:
            specs.append(None)
            continue
        if t.untyped_storage().data_ptr() != base.data_ptr():
            raise StreamloadError("a batch tensor does not live in its leased segment")
        offset = int(t.storage_offset()) * t.element_size()
        specs.append((offset, t.dtype, tuple(t.shape), tuple(t.stride())))
    return lease.pool.message(lease), specs


@dataclass
class _Peer:
    """A worker pool as the main process knows it: its flags and the segments it was sent."""

    flags: torch.Tensor
    slots: dict[int, tuple[int, np.ndarray]]


_PEERS: dict[tuple[int, int], _Peer] = {}
_PEERS_LOCK = threading.Lock()


def _release(flags: torch.Tensor, slot: int) -> None:
    flags[slot] = 0


def unpack(message: Message, specs: Sequence[Spec | None]) -> list[torch.Tensor | None]:
    """In the main process: rebuild a batch's tensors from :func:`pack`'s output.

    Raises:
        StreamloadError: If the message names a segment this process was never given.
    """
    token, slot, generation, storage, flags = message
    with _PEERS_LOCK:
        if flags is not None:
            for old in [t for t in _PEERS if not alive(t[0])]:
                del _PEERS[old]  # the segments of exited workers
            _PEERS[token] = _Peer(flags, {})
        peer = _PEERS.get(token)
        if peer is None:
            raise StreamloadError(f"a batch from worker pid {token[0]} names buffers it never sent")
        if storage is not None:
            peer.slots[slot] = (generation, torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        known = peer.slots.get(slot)
        if known is None or known[0] != generation:
            raise StreamloadError(f"a batch from worker pid {token[0]} names segment {slot}.{generation}, not sent")
        array = known[1]
    end = 0
    for spec in specs:
        if spec is not None:
            offset, dtype, shape, stride = spec
            size = _itemsize(dtype)
            span = 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) if all(shape) else 0
            end = max(end, offset + span * size)
    whole = torch.from_numpy(array[: max(end, 1)]).untyped_storage()  # a storage object of this batch's own
    out = [None if spec is None else _view(whole, spec[0], spec[1], spec[2], spec[3]) for spec in specs]
    weakref.finalize(whole, _release, peer.flags, slot)
    return out
