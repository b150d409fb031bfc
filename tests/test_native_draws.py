"""A batch's crop boxes and flips drawn in C (``streamload._draws``) against numpy's generators.

The reference is numpy itself: ``SeedSequence(words).generate_state`` for the keys, and for
the boxes each sample's ``place_generator(epoch, position, seed)`` fed to the same
``ImageDecoder`` geometry in Python (``native._draw_python``, the path the kernel took
before). The C draws must equal them bit for bit, on every geometry ImageDecoder offers.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

from streamload.decode import DecodeBatch, native
from streamload.decode.image import ImageDecoder
from streamload.randomness import _words, place_generator, seed_words

try:
    draws: Any = importlib.import_module("streamload._draws")
except ImportError:  # pragma: no cover - the build's optional part
    draws = None

pytestmark = pytest.mark.skipif(draws is None, reason="streamload._draws is not built here")


def _reference(decoder: ImageDecoder, dims: np.ndarray, where: np.ndarray, seed: int) -> native.Drawn:
    def generator(i: int) -> np.random.Generator:
        return place_generator(int(where[i, 0]), int(where[i, 1]), seed)

    return native._draw_python(decoder, dims, generator)


def test_keys_are_numpys_seed_sequence_keys() -> None:
    rng = np.random.default_rng(11)
    seeds = [0, 1, 17, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 1 << 64, (1 << 128) - 1]
    seeds += [int(s) for s in rng.integers(0, 1 << 63, 40)] + [int(s) << 64 | 9 for s in rng.integers(0, 1 << 40, 10)]
    for seed in seeds:
        epochs = np.concatenate([[0, 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1], rng.integers(0, 1 << 40, 20)])
        positions = np.concatenate([[0, 5, 1 << 32, 1 << 33, 7], rng.integers(0, 1 << 36, 20)])
        where = np.stack([epochs, positions], axis=1).astype(np.int64)
        out = np.zeros((len(where), 2), dtype=np.uint64)
        draws.keys(np.asarray(seed_words(seed), dtype=np.uint32), where, out)
        for (epoch, position), key in zip(where.tolist(), out, strict=True):
            want = np.random.SeedSequence(_words(seed, epoch, position)).generate_state(2, np.uint64)
            assert key.tolist() == want.tolist(), (seed, epoch, position)


GEOMETRIES = [
    {"size": 224, "crop": "random", "flip": True},
    {"size": 160, "crop": "random", "flip": False},
    {"size": (96, 160), "crop": "random", "flip": True, "scale": (0.3, 1), "ratio": (0.5, 2.0)},
    {"size": 224, "crop": "center", "resize": 256, "flip": True},
    {"size": 48, "crop": "center", "flip": False},
    {"size": 64, "crop": "random", "flip": True, "dct_scaling": False},
    {"size": (33, 17), "crop": "center", "resize": 40.5, "flip": True, "max_pixels": 4_000_000},
    {"size": 32, "crop": "random", "flip": True, "scale": (1.0, 1.0), "ratio": (1.0, 1.0)},
]


@pytest.mark.parametrize("config", GEOMETRIES, ids=lambda c: f"{c['size']}-{c['crop']}-{c['flip']}")
def test_a_batchs_boxes_and_flips_are_the_per_sample_generators(config: dict[str, Any]) -> None:
    decoder = ImageDecoder(**config)
    rng = np.random.default_rng(3)
    for round_ in range(40):
        n = 64
        width = rng.integers(1, 3000, n)
        height = rng.integers(1, 3000, n)
        if round_ % 4 == 0:  # slivers and tiny images: the random crop's fallback box
            width[: n // 2] = rng.integers(1, 12, n // 2)
            height[n // 4 : n // 2] = rng.integers(2000, 9000, n // 4)
        kind = rng.integers(0, 3, n)  # 0: not the kernel's (nothing drawn)
        dims = np.stack([width, height, kind], axis=1).astype(np.int32)
        where = np.stack([rng.integers(0, 90, n), rng.integers(0, 1 << 34, n)], axis=1).astype(np.int64)
        seed = int(rng.integers(0, 1 << 63)) if round_ % 3 else round_
        got = native.draw_crops(decoder, dims, where, seed)
        assert got is not None
        want = _reference(decoder, dims, where, seed)
        for name, a, b in zip(("boxes", "params", "full", "taken"), got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, config, round_)


def test_integers_rejection_draws_match_numpys() -> None:
    # Spans near 2**32 / 3 make Lemire's method reject about a draw in three: the retries
    # (and the 32-bit halves they use up) must be numpy's.
    decoder = ImageDecoder(16, crop="random", flip=True, scale=(1e-12, 2e-12), max_pixels=None)
    n = 200
    width = 1_431_655_765 + np.arange(n) * 997
    dims = np.stack([width, width[::-1], np.ones(n)], axis=1).astype(np.int32)
    where = np.stack([np.zeros(n), np.arange(n)], axis=1).astype(np.int64)
    got = native.draw_crops(decoder, dims, where, 5)
    assert got is not None
    want = _reference(decoder, dims, where, 5)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[3].all() and (got[2][:, 0] > 0).any()


def test_a_bad_call_is_refused_with_a_clear_error() -> None:
    decoder = ImageDecoder(32, crop="random", flip=True)
    dims = np.array([[50, 40, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match="non-negative"):
        native.draw_crops(decoder, dims, np.array([[-1, 3]], dtype=np.int64), 0)
    with pytest.raises(ValueError, match="where"):
        native.draw_crops(decoder, dims, np.zeros((2, 2), dtype=np.int64), 0)
    with pytest.raises(ValueError, match="positive"):
        native.draw_crops(decoder, np.array([[0, 40, 1]], dtype=np.int32), np.zeros((1, 2), dtype=np.int64), 0)
    # a seed beyond the key's 128 bits: drawn in Python by the caller
    assert native.draw_crops(decoder, dims, np.zeros((1, 2), dtype=np.int64), 1 << 130) is None


def test_a_module_that_draws_otherwise_is_not_used() -> None:
    class Skewed:
        @staticmethod
        def crops(*args: Any) -> None:
            draws.crops(*args)
            args[-3][:, 0] += 1.0  # every full box one pixel off

    assert native.agrees_with_numpy(draws)
    assert not native.agrees_with_numpy(Skewed())


@pytest.mark.skipif(not native.available(), reason="the native kernel is not built here")
def test_the_kernel_draws_a_batch_with_places_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.synthetic import synthetic_jpeg

    rng = np.random.default_rng(2)
    samples = [
        {"__key__": f"s{i}", "jpg": synthetic_jpeg(rng, 120 + 7 * i, 90 + 5 * i), "__epoch__": 1, "__position__": i}
        for i in range(12)
    ]
    batch = DecodeBatch(64, crop="random", flip=True, native=True, seed=9, label_field=None)
    with_c = batch(samples)[0].clone()
    made: list[int] = []
    real = batch.sample_rng

    def counted(sample: dict[str, Any]) -> np.random.Generator:
        made.append(int(sample["__position__"]))
        return real(sample)

    monkeypatch.setattr(batch, "sample_rng", counted)
    again = batch(samples)[0]
    assert made == [] and bool((with_c == again).all())  # no generator a sample: the C draws
    monkeypatch.setitem(native._STATE, "draws", None)  # as where the extension is not built
    in_python = batch(samples)[0]
    assert made == list(range(12)) and bool((with_c == in_python).all())


def test_a_geometry_of_its_own_is_drawn_in_python() -> None:
    class Corner(ImageDecoder):
        def box(self, width: int, height: int, rng: Any = None) -> tuple[float, float, float, float]:
            return 0.0, 0.0, width / 2, height / 2

    dims = np.array([[50, 40, 1]], dtype=np.int32)
    where = np.zeros((1, 2), dtype=np.int64)
    assert native.draw_crops(Corner(16), dims, where, 0) is None
    patched = ImageDecoder(16, crop="random")
    patched._reduction = lambda w, h, box: 1  # type: ignore[method-assign]
    assert native.draw_crops(patched, dims, where, 0) is None
    assert native.draw_crops(ImageDecoder(16, crop="random"), dims, where, 0) is not None
