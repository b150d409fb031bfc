"""Where a tensor's bytes live, read from this process's own memory map."""

from __future__ import annotations

import torch


def in_shared_memory(tensor: torch.Tensor) -> bool:
    """True if the tensor's bytes lie in a shared-memory mapping of this process (``/dev/shm``)."""
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return len(rest) >= 5 and rest[4].startswith("/dev/shm/")
    return False
