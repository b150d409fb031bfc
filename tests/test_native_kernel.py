"""The native JPEG batch kernel against the per-sample path, and under fuzzed bytes.

Every JPEG here is written by Pillow (libjpeg): photo-like pixels, 4:4:4, 4:2:2 and 4:2:0
subsampling, greyscale, progressive, odd sizes, and sizes that take every DCT reduction.
The per-sample path (``native=False``: simplejpeg or Pillow, then Pillow's resize) is the
reference; the kernel must give the same crop boxes and flips per (seed, epoch, position),
and pixels within the stated bound (0: it reproduces Pillow's bilinear arithmetic).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from streamload import SampleError
from streamload.decode import DecodeBatch, native
from streamload.synthetic import synthetic_jpeg
from tests.helpers.jpegs import corpus as _corpus
from tests.helpers.jpegs import mutants as _mutants
from tests.helpers.jpegs import photo as _photo

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel is not built here")

#: The largest pixel difference allowed between the kernel and the per-sample path.
BOUND = 0


@pytest.fixture(scope="module")
def corpus() -> list[bytes]:
    return _corpus()


def _samples(datas: list[bytes], epoch: int = 0, first: int = 0) -> list[dict[str, object]]:
    return [
        {"__key__": f"s{first + i}", "jpg": d, "cls": b"%d" % (i % 5), "__epoch__": epoch, "__position__": first + i}
        for i, d in enumerate(datas)
    ]


CONFIGS = [
    {"size": 224, "crop": "random", "flip": True},
    {"size": 224, "crop": "center", "resize": 256},
    {"size": (96, 160), "crop": "random", "scale": (0.5, 1.0)},
    {"size": 48, "crop": "center"},  # large images against a small output: DCT reductions of 2, 4 and 8
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['size']}-{c['crop']}")
def test_kernel_matches_the_per_sample_path(corpus: list[bytes], config: dict[str, object]) -> None:
    samples = _samples(corpus, epoch=3)
    fast = DecodeBatch(**config, native=True, seed=11)  # type: ignore[arg-type]
    slow = DecodeBatch(**config, native=False, seed=11)  # type: ignore[arg-type]
    slots = np.full((len(samples), *fast.decoder.shape), 7, dtype=np.uint8)
    taken = native.decode_batch(fast, samples, [s["jpg"] for s in samples], slots)
    assert all(t is native.DONE for t in taken)  # the kernel decoded every one of them
    a, b = fast(samples), slow(samples)
    assert torch.equal(a.labels, b.labels)
    diff = (a.images.int() - b.images.int()).abs()
    assert int(diff.max()) <= BOUND
    assert fast.fallbacks == 0 and slow.fallbacks == 0


def test_the_kernel_cuts_the_box_python_gives_it(corpus: list[bytes]) -> None:
    # The boxes come from ImageDecoder.box (the one source of the crops); the kernel only
    # carries them out. A box given here is cut exactly as Pillow cuts it.
    batch = DecodeBatch(64, crop="center", native=True)
    batch.decoder.dct_scaling = False  # a full-size decode, as the Pillow reference's
    batch.decoder.box = lambda w, h, rng=None: (w / 4, h / 8, w * 3 / 4, h * 5 / 8)  # type: ignore[method-assign]
    datas = [corpus[0], corpus[10], corpus[5]]
    got = batch(_samples(datas)).images.permute(0, 2, 3, 1).numpy()
    for image, data in zip(got, datas, strict=True):
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            box = (w / 4, h / 8, w * 3 / 4, h * 5 / 8)
            want = img.convert("RGB").resize((64, 64), Image.Resampling.BILINEAR, box=box)
        assert int(np.abs(image.astype(int) - np.asarray(want).astype(int)).max()) <= BOUND


def test_a_samples_pixels_do_not_depend_on_its_batch(corpus: list[bytes]) -> None:
    # Keyed by (seed, epoch, position): the same sample decodes the same in any batch, any order.
    batch = DecodeBatch(128, crop="random", flip=True, seed=4)
    assert batch.native
    samples = _samples(corpus[:12], epoch=2)
    whole = batch(samples).images
    halves = [batch(samples[6:][::-1]).images.flip(0), batch(samples[:6]).images]
    assert torch.equal(whole, torch.cat([halves[1], halves[0]]))
    other_epoch = batch(_samples(corpus[:12], epoch=5)).images
    assert not torch.equal(whole, other_epoch)


def test_samples_without_a_position_draw_as_the_per_sample_path_does(corpus: list[bytes]) -> None:
    samples = [{"__key__": f"k{i}", "jpg": d, "cls": b"1"} for i, d in enumerate(corpus[:10])]
    a = DecodeBatch(96, crop="random", flip=True, seed=9, native=True)(samples)
    b = DecodeBatch(96, crop="random", flip=True, seed=9, native=False)(samples)
    assert int((a.images.int() - b.images.int()).abs().max()) <= BOUND


def _png(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(synthetic_jpeg(rng, 120, 90))).save(buf, format="PNG")
    return buf.getvalue()


def _cmyk(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(synthetic_jpeg(rng, 120, 90))).convert("CMYK").save(buf, format="JPEG")
    return buf.getvalue()


def _junk_before_sos(jpeg: bytes) -> bytes:
    sos = jpeg.index(b"\xff\xda")
    return jpeg[:sos] + b"\x00" * 16 + jpeg[sos:]


def test_what_the_kernel_does_not_take_goes_the_per_sample_path(corpus: list[bytes]) -> None:
    rng = np.random.default_rng(3)
    junk = _junk_before_sos(corpus[0])  # libjpeg warns ("extraneous bytes"): the kernel refuses, Pillow reads it
    datas = [corpus[0], _png(rng), corpus[1], _cmyk(rng), junk, corpus[2]]
    samples = _samples(datas)
    fast = DecodeBatch(112, crop="random", flip=True, seed=1, native=True)
    slots = np.zeros((len(samples), *fast.decoder.shape), dtype=np.uint8)
    taken = native.decode_batch(fast, samples, datas, slots)
    assert [type(t).__name__ for t in taken] == ["_Done", "NoneType", "_Done", "NoneType", "Refusal", "_Done"]
    assert "extraneous bytes" in taken[4].reason
    a = fast(samples)
    b = DecodeBatch(112, crop="random", flip=True, seed=1, native=False)(samples)
    assert int((a.images.int() - b.images.int()).abs().max()) <= BOUND
    assert fast.fallbacks == 1  # the refused JPEG, decoded by Pillow with the kernel's box and flip


def test_a_damaged_jpeg_gets_todays_sample_error(corpus: list[bytes]) -> None:
    samples = _samples([corpus[0], corpus[1][: len(corpus[1]) // 2], corpus[2]])
    with pytest.raises(SampleError, match=r"sample 's1' field 'jpg': cannot decode image"):
        DecodeBatch(64, native=True)(samples)


def test_native_is_off_for_an_explicit_backend_and_required_when_asked() -> None:
    assert DecodeBatch(64).native
    assert not DecodeBatch(64, backend="pillow").native
    assert not DecodeBatch(64, native=False).native


# -- fuzz ----------------------------------------------------------------------------------


def _fuzz(count: int, seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    seeds = [
        _photo(rng, 61, 45, subsampling=2),
        _photo(rng, 80, 60, subsampling=0),
        _photo(rng, 70, 50, mode="L"),
        _photo(rng, 64, 64, progressive=True, subsampling=1),
        _photo(rng, 300, 200, subsampling=2, quality=70),
    ]
    mutants = _mutants(seeds, count, rng)
    batch = DecodeBatch(24, crop="random", flip=True, seed=seed, native=True)
    shape = batch.decoder.shape
    tally = {"decoded": 0, "refused": 0, "not taken": 0, "pillow": 0, "error": 0}
    for start in range(0, len(mutants), 64):
        part = mutants[start : start + 64]
        samples = _samples(part, first=start)
        # One slot more than the batch, as a guard: the kernel must not write into it.
        buffer = np.full((len(part) + 1, *shape), 0xA5, dtype=np.uint8)
        taken = native.decode_batch(batch, samples, part, buffer[: len(part)])
        assert (buffer[-1] == 0xA5).all()
        for i, (sample, result) in enumerate(zip(samples, taken, strict=True)):
            if result is native.DONE:
                tally["decoded"] += 1
                continue
            assert (buffer[i] == 0xA5).all()  # a refused sample's slot is left alone
            tally["refused" if result is not None else "not taken"] += 1
            try:  # the per-sample path: Pillow decodes it, or today's sample error
                batch([sample])
                tally["pillow"] += 1
            except SampleError as exc:
                assert f"sample {sample['__key__']!r}" in str(exc)
                tally["error"] += 1
    return tally


def test_fuzzed_jpegs_are_decoded_or_refused_never_a_crash() -> None:
    tally = _fuzz(3000, seed=0)
    assert sum(tally[k] for k in ("decoded", "refused", "not taken")) == 3000
    assert tally["decoded"] > 100 and tally["refused"] > 100 and tally["error"] > 100
    assert tally["refused"] + tally["not taken"] == tally["pillow"] + tally["error"]


def test_random_geometries_match_pillows_resize(corpus: list[bytes]) -> None:
    # Boxes anywhere, outputs larger and smaller than the box, tall and wide: Pillow's
    # bilinear resize of Pillow's own decode is the reference (both passes, either order).
    module = native.kernel()
    assert module is not None
    rng = np.random.default_rng(5)
    for data in (corpus[0], corpus[6], corpus[8], corpus[14], corpus[17]):
        with Image.open(io.BytesIO(data)) as img:
            decoded = img.convert("RGB")
        w, h = decoded.size
        for _ in range(25):
            x0, y0 = float(rng.uniform(0, w * 0.6)), float(rng.uniform(0, h * 0.6))
            box = (x0, y0, float(rng.uniform(x0 + 0.5, w)), float(rng.uniform(y0 + 0.5, h)))
            ow, oh = int(rng.integers(1, 300)), int(rng.integers(1, 300))
            flip = bool(rng.integers(2))
            want = decoded.resize((ow, oh), Image.Resampling.BILINEAR, box=box)
            if flip:
                want = want.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            out = np.zeros((1, oh, ow, 3), dtype=np.uint8)
            params = np.array([[1, int(flip)]], dtype=np.int32)
            boxes = np.array([box], dtype=np.float32)
            assert module.decode([data], boxes, params, out, oh, ow, native._pillow13()) == [None]
            assert int(np.abs(out[0].astype(int) - np.asarray(want).astype(int)).max()) <= BOUND, (box, ow, oh)


def test_a_samples_generator_draws_as_philox_keyed_alone_and_reads_no_os_entropy() -> None:
    # The key alone decides the draws (the same as np.random.Philox(key=...)), and making
    # the generator makes no os.urandom call: a system call that lets go of the GIL.
    import os
    import sys

    from streamload.randomness import _words, sample_generator

    calls: list[str] = []

    def watch_calls(frame: object, event: str, arg: object) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") == "urandom":
            calls.append("urandom")

    for position in range(50):
        sample = {"__epoch__": 2, "__position__": position}
        sys.setprofile(watch_calls)
        try:
            rng = sample_generator(sample, 7)
        finally:
            sys.setprofile(None)
        key = np.random.SeedSequence(_words(7, 2, position)).generate_state(2, np.uint64)
        reference = np.random.Generator(np.random.Philox(key=key))
        assert rng.uniform(size=5).tolist() == reference.uniform(size=5).tolist()
        assert rng.integers(0, 1 << 40, size=3).tolist() == reference.integers(0, 1 << 40, size=3).tolist()
        assert rng.random() == reference.random()
    assert calls == [] and os.urandom is not None


def _gil_releasing_calls(batch: DecodeBatch, samples: list[dict[str, object]]) -> int:
    """C calls a DecodeBatch makes that let go of the GIL (decoders, resizes, OS entropy)."""
    import sys

    count = [0]

    # What a profiler sees of them (simplejpeg's Cython functions are not seen; Pillow's
    # resize and pack of the same image are, so the per-sample path shows >= 2 a sample).
    releasing = {"ImagingCore.resize", "ImagingCore.transpose", "ImagingEncoder.encode", "urandom"}

    def profile(frame: object, event: str, arg: object) -> None:
        if event != "c_call":
            return
        name = getattr(arg, "__qualname__", "")
        if name in releasing or (getattr(arg, "__module__", "") == "streamload.decode._jpegbatch" and name == "decode"):
            count[0] += 1

    batch(samples)  # imports and first-call set-up out of the count
    sys.setprofile(profile)
    try:
        batch(samples)
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_batch_lets_go_of_the_gil_once_whatever_its_size(corpus: list[bytes]) -> None:
    # Beside a thread running Python, each time a decoding thread takes the GIL back costs up
    # to a switch interval: the kernel's batch takes it back once, the per-sample path per call.
    jpegs = [d for d in corpus if len(d) < 400_000][:32]
    for size in (8, 32):
        samples = _samples(jpegs[:size])
        assert _gil_releasing_calls(DecodeBatch(96, crop="random", flip=True, native=True), samples) == 1
        assert _gil_releasing_calls(DecodeBatch(96, crop="random", flip=True, native=False), samples) >= 2 * size
