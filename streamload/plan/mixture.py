"""Mixtures: several datasets (streams) read as one epoch, each contributing an exact count.

Pure functions of each stream's per-shard sample counts and the epoch's
:class:`~streamload.plan.split.Split`; nothing here opens a dataset.

**Counts** (:func:`epoch_counts`). Each stream asks for a share of the epoch: a ``weight``
(relative), a ``repeat`` factor of its size, an absolute number of ``samples``, or nothing
(its whole size once). Weights share ``epoch_size`` (default: the streams' total size);
repeats and sample numbers give the counts directly, or, with ``epoch_size``, the relative
proportions scaled to it. Each stream's exact target ``t_s`` (a rational number, computed
with :class:`fractions.Fraction`) is rounded by the largest-remainder method: every count
is ``floor(t_s)`` or ``ceil(t_s)`` and the counts sum exactly to the epoch size (ties go to
the earlier stream). The counts are the same every epoch.

**Which samples** (per stream, per epoch). A stream of ``n`` samples asked for ``c`` reads
``q = c // n`` whole passes over its samples plus a subset of ``r = c % n`` samples, each
sample of the subset once. The subset is uniform and changes every epoch (seeded by seed,
epoch and stream): its size per shard is drawn from the multivariate hypergeometric
distribution over the shard counts (O(shards)), and within shard ``j`` it is the image of
``0 .. m_j - 1`` under a seeded bijection of the shard's indices ``0 .. k_j - 1``: for
shards of up to 65536 samples, a seeded permutation whose first ``m_j`` entries are
sorted (so the subset is read in file order), computed when a worker first reaches the
shard (at most 2**20 indices kept per worker); for larger shards, a keyed Feistel network
on ``2**(2h) >= k_j`` values with cycle walking, evaluated lazily (O(1) memory, read in
the bijection's order). So a subsampled stream reads no sample twice, and an upsampled
one reads every sample ``q`` or ``q + 1`` times.

**The virtual shard list.** Each stream's epoch is a list of *virtual shards*: one per
(pass, shard) of its whole passes, plus one per shard with ``m_j > 0`` for the subset.
With ``shuffle`` the stream's virtual shards are permuted (seed, epoch, stream). The
streams' lists are concatenated into one list, in stream order: the *stream-major*
sequence, positions ``0 .. C-1`` (``C`` = sum of the counts), where stream ``s`` owns
``[base_s, base_s + c_s)``. Memory: O(virtual shards) = O(sum over streams of shards x
passes), never O(samples).

**The interleave.** The epoch sequence is a fixed permutation of the stream-major one that
spreads every stream evenly over the epoch, so any window of the epoch (a batch, a rank
block, the start of an epoch) holds the streams in proportion to their counts. The
streams are the leaves of a balanced binary tree; a node with ``a`` items on its left and
``c`` in all sends its item ``p`` left iff ``round(p * a / c)`` increases at ``p``
(a Bresenham line, with ``round`` half up): the left side then holds ``round(p * a / c)``
of the node's first ``p`` items, exact within one half at every prefix. Position ``p`` of
the epoch walks down the tree (``log2(streams)`` vectorised steps) to ``(stream s, index
t)`` and maps to stream-major position ``base_s + t`` (exact integer arithmetic: int64, and
beyond 2e9 samples a float64 estimate corrected by its exact int64 remainder). With two streams of counts 7 and 3
the epoch starts ``a b a a a b a a b a`` and repeats that pattern.

**On top**: :class:`~streamload.plan.planner.EpochPlan` takes the mixture as its
:class:`~streamload.plan.layout.Layout` and treats the epoch sequence like any other:
contiguous rank blocks (each rank's block is itself in proportion), the shuffle window
inside each block, chunks round-robin to workers, padding, ``drop_last`` and resume stages
all apply unchanged, as they only see positions ``0 .. C-1``. A position is located by the
tree walk, one ``searchsorted`` over the concatenated virtual shards, and, for subset
shards, one lookup in the shard's sorted subset. Shards are numbered globally: stream
``s``'s shard ``j`` is ``offset_s + j`` (:attr:`MixLayout.offsets`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from .._errors import ConfigError, PlanError
from .split import Split, seeded_rng

__all__ = ["SORTED_SUBSET_LIMIT", "MixLayout", "apportion", "epoch_counts", "feistel_permute", "mixture_fingerprint"]

#: rng tags (arbitrary constants) of the three seeded choices, so they never share a stream.
_TAG_ORDER, _TAG_SUBSET, _TAG_SIZES = 0x4D4F52, 0x4D5355, 0x4D535A
#: Shards of at most this many samples get a materialised, sorted subset; larger ones a Feistel bijection.
SORTED_SUBSET_LIMIT = 1 << 16
#: Subset indices (and Feistel keys, counted as 4) kept per layout, least recently used dropped first.
_SUBSET_CACHE_ITEMS = 1 << 20
_FEISTEL_ROUNDS = 4
#: numpy's hypergeometric sampler needs totals below this.
_HYPER_LIMIT = 10**9
#: Epoch sizes up to this are interleaved in plain int64 arithmetic (2 * c * c + c < 2**63) ...
_INT64_SAFE = 2_000_000_000
#: ... up to this with a float64 estimate corrected exactly in wrapping int64 (c * 2**-52 < 1).
_FLOAT_SAFE = 1 << 50


def apportion(targets: Sequence[Fraction], total: int) -> list[int]:
    """Round non-negative ``targets`` to integers summing to ``total``.

    Largest-remainder method: each gets ``floor(target)``, then the ``total - sum(floors)``
    largest fractional parts get one more (ties: the earlier index). ``total`` must lie
    between the sum of the floors and the sum of the ceilings (e.g. the rounded sum).
    """
    floors = [int(t) for t in targets]  # floor: targets are non-negative
    left = total - sum(floors)
    if left < 0 or left > len(targets):
        raise PlanError(f"targets {targets} do not sum to {total}")
    by_rest = sorted(range(len(targets)), key=lambda i: (-(targets[i] - floors[i]), i))
    for i in by_rest[:left]:
        floors[i] += 1
    return floors


def _fraction(value: float, what: str) -> Fraction:
    try:
        out = Fraction(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{what}={value!r} must be a finite number >= 0") from exc
    if out < 0:
        raise ConfigError(f"{what}={value!r} must be >= 0")
    return out


def epoch_counts(
    sizes: Sequence[int],
    *,
    weights: Sequence[float | None],
    repeats: Sequence[float | None],
    samples: Sequence[int | None],
    epoch_size: int | None = None,
) -> list[int]:
    """Return every stream's sample count per epoch (see the module docstring).

    Args:
        sizes: Samples in each stream's dataset.
        weights: Each stream's relative weight, or ``None``.
        repeats: Each stream's repeat factor (``2.5``: two and a half passes), or ``None``.
        samples: Each stream's absolute sample count, or ``None``.
        epoch_size: Samples in the whole epoch; ``None``: the sum of the weighted streams'
            sizes, or of the repeats' and sample numbers' counts.

    Raises:
        ConfigError: If a stream sets more than one of weight/repeat/samples, weights are
            mixed with the others, a value is negative, all weights are zero, or an
            empty stream is asked for samples.
    """
    n = len(sizes)
    if not (len(weights) == len(repeats) == len(samples) == n):
        raise ConfigError("sizes, weights, repeats and samples must have one entry per stream")
    if epoch_size is not None and (isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 0):
        raise ConfigError(f"epoch_size={epoch_size!r} must be an integer >= 0")
    for i, (w, r, c) in enumerate(zip(weights, repeats, samples, strict=True)):
        if sum(v is not None for v in (w, r, c)) > 1:
            raise ConfigError(f"stream {i}: set at most one of weight, repeat and samples")
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ConfigError(f"stream {i}: samples={c!r} must be an integer >= 0")
    weighted = [w is not None for w in weights]
    if any(weighted) and not all(weighted):
        raise ConfigError(
            "either every stream has a weight (shares of epoch_size) or none does (repeat=/samples=/whole "
            f"dataset); got weights {list(weights)}"
        )
    targets: list[Fraction]
    if all(weighted) and n:
        ws = [_fraction(w, f"stream {i}: weight") for i, w in enumerate(weights)]  # type: ignore[arg-type]
        if sum(ws) == 0:
            raise ConfigError("the stream weights are all zero")
        total = sum(sizes) if epoch_size is None else epoch_size
        targets = [total * w / sum(ws) for w in ws]
    else:
        nominal = [
            Fraction(c) if c is not None else size * _fraction(1.0 if r is None else r, f"stream {i}: repeat")
            for i, (size, r, c) in enumerate(zip(sizes, repeats, samples, strict=True))
        ]
        whole = sum(nominal, Fraction(0))
        if epoch_size is None:
            total = int(whole + Fraction(1, 2))  # the rounded sum (half up); counts round each target
            targets = nominal
        else:
            total = epoch_size
            if whole == 0 and total:
                raise ConfigError(f"epoch_size={epoch_size} but every stream asks for 0 samples")
            targets = [t * total / whole for t in nominal] if whole else nominal
    counts = apportion(targets, int(total))
    for i, (size, count) in enumerate(zip(sizes, counts, strict=True)):
        if size == 0 and count > 0:
            raise ConfigError(f"stream {i} is empty but its share of the epoch is {count} samples")
    return counts


def mixture_fingerprint(shard_counts: Sequence[Sequence[int]], counts: Sequence[int]) -> str:
    """Return a short digest of a mixture's streams and counts (stored in resume states)."""
    text = json.dumps([[int(sum(c)), len(c), int(k)] for c, k in zip(shard_counts, counts, strict=True)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _subset_sizes(shard_counts: np.ndarray, r: int, rng: np.random.Generator) -> np.ndarray:
    """Draw how many of a uniform ``r``-subset of the stream fall in each shard."""
    total = int(shard_counts.sum())
    if total < _HYPER_LIMIT:
        sizes: np.ndarray = rng.multivariate_hypergeometric(shard_counts, r, method="marginals")
        return sizes.astype(np.int64)
    out = np.zeros(len(shard_counts), dtype=np.int64)  # huge streams: shard by shard
    rest, left = total, r
    for j, k in enumerate(shard_counts.tolist()):
        if left == 0:
            break
        rest -= k
        if rest < _HYPER_LIMIT and k < _HYPER_LIMIT:
            take = int(rng.hypergeometric(k, rest, left)) if rest or k else 0
        else:  # binomial approximation, kept feasible
            take = int(rng.binomial(left, k / (k + rest)))
        take = min(k, left, max(take, left - rest))
        out[j] = take
        left -= take
    return out


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a ``uint64`` array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def feistel_permute(indices: np.ndarray, size: int, keys: Sequence[int]) -> np.ndarray:
    """Map ``indices`` in ``[0, size)`` through a keyed bijection of ``[0, size)``.

    A balanced Feistel network on ``2**(2h) >= size`` values (one round per key), with
    cycle walking: a value that lands outside ``[0, size)`` is permuted again until it is
    inside, which keeps the map a bijection of ``[0, size)``.
    """
    half = max(1, ((max(size, 2) - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    raw = np.array([(k + i) & 0xFFFFFFFFFFFFFFFF for i, k in enumerate(keys)], dtype=np.uint64)
    words = _mix64(raw).tolist()  # mixed, so small keys mix as well as random ones

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in words:
            left, right = right, left ^ (_mix64(right ^ np.uint64(key)) & mask)
        out: np.ndarray = (left << shift) | right
        return out

    y = rounds(np.asarray(indices, dtype=np.uint64))
    outside = np.flatnonzero(y >= np.uint64(size))
    while len(outside):
        y[outside] = rounds(y[outside])
        outside = outside[y[outside] >= np.uint64(size)]
    return y.astype(np.int64)


def _rounded_share(p: np.ndarray, a: np.ndarray, c: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``q = round(p * a / c)`` (half up) exactly, and ``2 * p * a + c - 2 * c * q`` (in ``[0, 2c)``).

    ``q = floor((2 * p * a + c) / (2 * c))``, for ``0 <= p, a <= c``. Then
    ``round((p + 1) * a / c) > q`` exactly when ``rest + 2 * a >= 2 * c``.
    """
    if p.dtype == object or total < _INT64_SAFE:
        num = 2 * p * a + c
        q: np.ndarray = num // (2 * c)
        return q, num - 2 * c * q
    # float64 estimate (off by at most one for c < 2**50), then the exact remainder in int64:
    # the true remainder is small, so its value modulo 2**64 (wrapping arithmetic) is exact.
    q = np.floor((2.0 * p * a + c) / (2.0 * c)).astype(np.int64)
    with np.errstate(over="ignore"):
        rest = 2 * p * a + c - 2 * c * q
    for _ in range(2):
        low, high = rest < 0, rest >= 2 * c
        q = q - low + high
        rest = rest + 2 * c * low - 2 * c * high
    return q, rest


class MixLayout:
    """The epoch sequence of a mixture of streams (see the module docstring).

    Args:
        shard_counts: Per stream, its samples per shard (manifest order).
        counts: Per stream, its samples in the epoch (:func:`epoch_counts`).
        split: Epoch, seed and shuffle (the rest of the split is the planner's).

    Attributes:
        offsets: ``offsets[s]`` is the global number of stream ``s``'s shard 0; the last
            entry is the number of shards of all streams.
        counts: Per stream, its samples in the epoch.
    """

    def __init__(self, shard_counts: Sequence[Sequence[int]], counts: Sequence[int], split: Split) -> None:
        if len(shard_counts) != len(counts):
            raise PlanError(f"{len(shard_counts)} streams but {len(counts)} counts")
        self.split = split
        self.counts = [int(c) for c in counts]
        per_stream = [np.asarray(c, dtype=np.int64).reshape(-1) for c in shard_counts]
        for s, (k, c) in enumerate(zip(per_stream, self.counts, strict=True)):
            if (k < 0).any() or c < 0:
                raise PlanError(f"stream {s}: shard counts and count must be non-negative")
            if c and not k.sum():
                raise PlanError(f"stream {s} is empty but asked for {c} samples")
        self.offsets = np.concatenate([[0], np.cumsum([len(k) for k in per_stream])]).astype(np.int64)
        self._shard_sizes = np.concatenate([*per_stream, np.zeros(0, dtype=np.int64)])
        self._total = sum(self.counts)
        self._base = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        shards, lengths, subset = [], [], []
        for s, k in enumerate(per_stream):
            v_shard, v_len, v_subset = self._stream_shards(s, k, self.counts[s])
            shards.append(v_shard + int(self.offsets[s]))
            lengths.append(v_len)
            subset.append(v_subset)
        #: Global shard of each virtual shard, stream-major; whether it is a subset shard.
        self._v_shard = np.concatenate([*shards, np.zeros(0, dtype=np.int64)]).astype(np.int32)
        self._v_subset = np.concatenate([*subset, np.zeros(0, dtype=bool)])
        self._v_cum = np.concatenate([[0], np.cumsum(np.concatenate([*lengths, np.zeros(0, dtype=np.int64)]))])
        self._v_cum = self._v_cum.astype(np.int64)
        self._subsets: OrderedDict[int, np.ndarray | tuple[int, ...]] = OrderedDict()
        self._cached_items = 0
        self._build_tree()

    # -- construction ------------------------------------------------------------------

    def _stream_shards(self, s: int, k: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return stream ``s``'s virtual shards (local shard, length, is-subset), in reading order."""
        n = int(k.sum())
        if count == 0 or n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0, dtype=bool)
        passes, rest = divmod(count, n)
        nonempty = np.flatnonzero(k)
        parts_shard = [np.tile(nonempty, passes)]
        parts_len = [np.tile(k[nonempty], passes)]
        parts_subset = [np.zeros(len(nonempty) * passes, dtype=bool)]
        if rest:
            sizes = _subset_sizes(k, rest, seeded_rng(self.split.seed, self.split.epoch, s, _TAG_SIZES))
            chosen = np.flatnonzero(sizes)
            parts_shard.append(chosen)
            parts_len.append(sizes[chosen])
            parts_subset.append(np.ones(len(chosen), dtype=bool))
        v_shard, v_len, v_subset = (np.concatenate(p) for p in (parts_shard, parts_len, parts_subset))
        if self.split.shuffle:
            order = seeded_rng(self.split.seed, self.split.epoch, s, _TAG_ORDER).permutation(len(v_shard))
            v_shard, v_len, v_subset = v_shard[order], v_len[order], v_subset[order]
        return v_shard.astype(np.int64), v_len.astype(np.int64), v_subset

    def _build_tree(self) -> None:
        """The interleave: a balanced binary tree over the streams with a non-zero count."""
        live = [s for s, c in enumerate(self.counts) if c > 0]
        left: list[int] = []
        right: list[int] = []
        a: list[int] = []
        c: list[int] = []
        leaf_stream: list[int] = []
        depth = 0

        def build(streams: list[int], level: int) -> int:
            nonlocal depth
            node = len(a)
            left.append(node)
            right.append(node)
            a.append(0)
            c.append(0)
            leaf_stream.append(-1)
            if len(streams) == 1:
                depth = max(depth, level)
                a[node] = c[node] = self.counts[streams[0]]
                leaf_stream[node] = streams[0]
                return node
            half = len(streams) // 2
            lo, hi = build(streams[:half], level + 1), build(streams[half:], level + 1)
            left[node], right[node] = lo, hi
            a[node] = sum(self.counts[x] for x in streams[:half])
            c[node] = a[node] + sum(self.counts[x] for x in streams[half:])
            return node

        if live:
            build(live, 0)
        self._depth = depth
        self._left, self._right = np.array(left, dtype=np.int64), np.array(right, dtype=np.int64)
        self._a, self._c = np.array(a, dtype=np.int64), np.array(c, dtype=np.int64)
        self._leaf_stream = np.array(leaf_stream, dtype=np.int64)

    # -- positions ---------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Samples in the epoch: the sum of the streams' counts."""
        return self._total

    def stream_of_shard(self, shards: np.ndarray) -> np.ndarray:
        """Map global shard numbers to stream indices."""
        out: np.ndarray = np.searchsorted(self.offsets, shards, side="right") - 1
        return out

    def interleave(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch positions to ``(stream, index within the stream's epoch)`` arrays."""
        p = np.asarray(positions, dtype=np.int64)
        if self._total >= _FLOAT_SAFE:  # beyond any real epoch: exact Python integers
            p = p.astype(object)
        node = np.zeros(len(p), dtype=np.int64)
        for _ in range(self._depth):
            a, c = self._a[node], self._c[node]
            if p.dtype == object:
                a, c = a.astype(object), c.astype(object)
            lo, rest = _rounded_share(p, a, c, self._total)
            go_left = rest + 2 * a >= 2 * c  # round((p + 1) * a / c) > round(p * a / c)
            p = np.where(go_left, lo, p - lo)
            node = np.where(go_left, self._left[node], self._right[node])
        return self._leaf_stream[node], np.asarray(p, dtype=np.int64)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch positions to ``(global shard, index within shard)`` arrays."""
        if self._total == 0:
            raise PlanError("cannot locate samples of an empty mixture")
        streams, within = self.interleave(positions)
        major = self._base[streams] + within
        v = np.searchsorted(self._v_cum, major, side="right") - 1
        locals_ = major - self._v_cum[v]
        subset = self._v_subset[v]
        if subset.any():
            at = np.flatnonzero(subset)
            vs = v[at]
            if len(at) > 1 and bool(np.any(vs[1:] != vs[:-1])):  # several subset shards: group them
                order = np.argsort(vs, kind="stable")
                at, vs = at[order], vs[order]
            cuts = [0, *(np.flatnonzero(vs[1:] != vs[:-1]) + 1).tolist(), len(vs)]
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                pick = at[lo:hi]
                locals_[pick] = self._subset_locals(int(vs[lo]), locals_[pick])
        return self._v_shard[v].astype(np.int64), locals_

    def _subset_locals(self, virtual: int, within: np.ndarray) -> np.ndarray:
        """Map indices ``within`` subset virtual shard ``virtual`` to the shard's sample indices."""
        chosen = self._subsets.get(virtual)
        if chosen is not None:
            self._subsets.move_to_end(virtual)
        else:
            shard = int(self._v_shard[virtual])
            stream = int(self.stream_of_shard(np.array([shard]))[0])
            rng = seeded_rng(self.split.seed, self.split.epoch, stream, shard - int(self.offsets[stream]), _TAG_SUBSET)
            size = int(self._shard_sizes[shard])
            if size <= SORTED_SUBSET_LIMIT:
                chosen = np.sort(rng.permutation(size)[: int(self._v_cum[virtual + 1] - self._v_cum[virtual])])
            else:
                chosen = tuple(int(k) for k in rng.integers(0, 2**63, _FEISTEL_ROUNDS, dtype=np.int64))
            self._subsets[virtual] = chosen
            self._cached_items += len(chosen)
            while self._cached_items > _SUBSET_CACHE_ITEMS and len(self._subsets) > 1:
                self._cached_items -= len(self._subsets.popitem(last=False)[1])
        if isinstance(chosen, tuple):
            return feistel_permute(within, int(self._shard_sizes[self._v_shard[virtual]]), chosen)
        out: np.ndarray = chosen[within]
        return out
