"""Per-sample randomness: augmentations that depend on the sample, not on who decodes it.

Every sample that :class:`~streamload.StreamingDataset` hands to its ``transform`` or
``collate`` carries ``"__epoch__"`` and ``"__position__"``: its epoch and its place in that
epoch's padded sequence (see
:mod:`streamload.plan.planner`), which are the same whichever rank or DataLoader worker
reads it, on any number of them, and after a resume. A generator keyed by
``(seed, epoch, position)`` therefore draws the same random crop for the same sample on
one GPU and on sixty-four, with two workers or eight, before and after a restart.

The generator is counter-based (Philox, from numpy): making one costs a few microseconds
and no state is carried from sample to sample, so nothing depends on the order in which a
worker happens to see its samples.

Example:
    >>> def augment(sample):  # a transform of your own  # doctest: +SKIP
    ...     rng = sample_generator(sample, seed=17)
    ...     angle = rng.uniform(-10, 10)
    ...     ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import SampleError

__all__ = ["place_generator", "sample_generator", "sample_seed"]

#: Tells the sample generator's words apart from other uses of the same seed.
_DOMAIN = 0x5A4D504C


def _where(sample: Mapping[str, Any]) -> tuple[int, int]:
    epoch, position = sample.get("__epoch__"), sample.get("__position__")
    if not isinstance(epoch, int) or not isinstance(position, int) or epoch < 0 or position < 0:
        raise SampleError(
            f"sample {sample.get('__key__')!r} has no '__epoch__'/'__position__': per-sample randomness "
            "needs samples read by StreamingDataset"
        )
    return epoch, position


def _words(seed: int, epoch: int, position: int) -> list[int]:
    return [_DOMAIN, seed & 0xFFFFFFFFFFFFFFFF, (seed >> 64) & 0xFFFFFFFFFFFFFFFF, epoch, position]


def seed_words(seed: int) -> list[int]:
    """The 32-bit words numpy's SeedSequence makes of ``place_generator``'s key before epoch and position.

    Each of the domain and the seed's two 64-bit halves becomes its 32-bit words, lowest
    first (``0``: one word ``0``), as ``SeedSequence`` reads a list of ints; the native crop
    draws (``streamload._draws``) append the sample's epoch and position the same way.
    """
    out: list[int] = []
    for value in _words(seed, 0, 0)[:3]:
        out.append(value & 0xFFFFFFFF)
        value >>= 32
        while value:
            out.append(value & 0xFFFFFFFF)
            value >>= 32
    return out


def sample_seed(sample: Mapping[str, Any], seed: int = 0) -> int:
    """Return a 63-bit seed for ``sample``, keyed by ``(seed, epoch, position)``.

    For generators other than numpy's, e.g. ``torch.Generator().manual_seed(sample_seed(s))``.

    Raises:
        SampleError: If the sample carries no ``"__epoch__"``/``"__position__"``.
    """
    epoch, position = _where(sample)
    state = np.random.SeedSequence(_words(seed, epoch, position)).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def sample_generator(sample: Mapping[str, Any], seed: int = 0) -> np.random.Generator:
    """Return a numpy generator for ``sample``, keyed by ``(seed, epoch, position)``.

    The same sample of the same epoch gets the same draws on any rank, worker or world,
    and after a resume; another epoch or another seed gets independent ones.

    Raises:
        SampleError: If the sample carries no ``"__epoch__"``/``"__position__"``.
    """
    epoch, position = _where(sample)
    return place_generator(epoch, position, seed)


def place_generator(epoch: int, position: int, seed: int = 0) -> np.random.Generator:
    """The generator of the sample at ``position`` of ``epoch``: :func:`sample_generator` without the dict.

    What a batch read straight from the shard readers draws from (it knows each sample's
    ``(epoch, position)`` from the plan, not from a dict): the same draws.
    """
    # Philox seeded with the SeedSequence itself: its key is the sequence's generate_state(2, uint64),
    # counter 0 (the key sample_generator's draws are made from), and no OS entropy is read
    # (``Philox(key=...)`` alone reads ``os.urandom``: a system call that lets go of the GIL,
    # one wait a sample beside a thread running Python).
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(_words(seed, epoch, position))))
