"""The fast JPEG backend never decodes less than Pillow: what simplejpeg refuses, Pillow decodes.

libjpeg-turbo as simplejpeg drives it treats a warning as an error: a JPEG with junk bytes
before a marker ("Corrupt JPEG data: 16 extraneous bytes before marker 0xda") is refused,
though Pillow (libjpeg too, warnings tolerated) decodes it. Such files are common in real
corpora (Pillow's own test images hold six). Each is decoded by Pillow instead, counted
(over DataLoader workers too) and logged once per process.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from streamload import ImageLabel, SampleError, StreamingDataset
from streamload.cli import main
from streamload.decode import DecodeBatch, ImageDecoder
from streamload.writer import DatasetWriter


def _jpeg(seed: int = 0, size: tuple[int, int] = (96, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _junk_before_sos(jpeg: bytes) -> bytes:
    """``jpeg`` with 16 junk bytes before its start-of-scan marker (as a careless writer leaves)."""
    sos = jpeg.index(b"\xff\xda")
    return jpeg[:sos] + b"\x00" * 16 + jpeg[sos:]


@pytest.fixture(scope="module")
def refused() -> bytes:
    data = _junk_before_sos(_jpeg())
    with pytest.raises(ValueError, match="extraneous bytes before marker 0xda"):
        simplejpeg.decode_jpeg(data)  # the fast backend refuses it ...
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # ... and Pillow reads it
    return data


def test_the_default_decoder_falls_back_to_pillow_and_counts(refused: bytes) -> None:
    sample = {"__key__": "junk", "jpg": refused, "cls": b"3"}
    auto = ImageLabel(size=32)
    reference = ImageLabel(size=32, backend="pillow")
    image, label = auto(sample)
    assert label == 3 and auto.fallbacks == 1
    assert torch.equal(image, reference(sample)[0])  # exactly Pillow's decode, same crop
    auto(sample)
    auto({"__key__": "clean", "jpg": _jpeg(1), "cls": b"0"})
    assert auto.fallbacks == 2 and reference.fallbacks == 0
    explicit = ImageDecoder(32, backend="simplejpeg")
    explicit.decode(refused)
    assert int(explicit.fallbacks) == 1


def test_decode_batch_falls_back_per_image(refused: bytes) -> None:
    samples = [
        {"__key__": "a", "jpg": _jpeg(2), "cls": b"0"},
        {"__key__": "b", "jpg": refused, "cls": b"1"},
        {"__key__": "c", "jpg": refused, "cls": b"2"},
    ]
    collate = DecodeBatch(24, crop="random", flip=True, seed=5)
    batch = collate(samples)
    assert batch.labels.tolist() == [0, 1, 2] and collate.fallbacks == 2
    pillow = DecodeBatch(24, crop="random", flip=True, seed=5, backend="pillow")(samples)
    assert torch.equal(batch.images[1:], pillow.images[1:])  # the same random crop as Pillow's own


def test_an_image_neither_decoder_reads_is_an_error_naming_both(refused: bytes) -> None:
    broken = refused[: len(refused) // 3]
    with pytest.raises(SampleError) as info:
        ImageLabel(size=32, label_field=None)({"__key__": "broken", "jpg": broken})
    text = str(info.value)
    assert text.startswith("sample 'broken' field 'jpg': cannot decode image: ") and "(simplejpeg: " in text, text


def test_logged_once_per_process(refused: bytes) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fresh process: its first fallback is logged, the later ones only counted
        code = 1
        try:
            handler = logging.StreamHandler(os.fdopen(write, "w"))
            logging.getLogger("streamload.decode").addHandler(handler)
            decoder = ImageDecoder(16)
            for _ in range(3):
                decoder.decode(refused, name="junk")
            handler.flush()
            code = 0 if decoder.fallbacks.value == 3 else 2
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        logged = f.read().splitlines()
    assert os.waitpid(pid, 0)[1] == 0
    assert len(logged) == 1, logged
    assert logged[0].startswith("sample 'junk': simplejpeg refused this JPEG (Corrupt JPEG data: 16 extraneous")
    assert "decoded with Pillow instead" in logged[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, refused: bytes) -> Path:
    out = tmp_path_factory.mktemp("junk-jpegs")
    with DatasetWriter(str(out), max_samples=4) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "jpg": refused if i % 2 else _jpeg(i), "cls": str(i).encode()})
    return out


def test_workers_fallbacks_are_seen_by_the_main_process(dataset: Path) -> None:
    collate = DecodeBatch(16)
    ds = StreamingDataset(str(dataset), batch_size=4, collate=collate)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    assert sorted(label for batch in loader for label in batch.labels.tolist()) == list(range(8))
    assert collate.fallbacks == 4


@pytest.mark.parametrize("backend", ["auto", "simplejpeg", "pillow"])
def test_bench_decode_takes_a_backend_and_reads_what_simplejpeg_refuses(
    dataset: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", str(dataset), "--mode", "decode", "--size", "16", "--workers", "0", "--seconds", "0.1"]
    assert main([*args, "--batch-size", "4", "--backend", backend, "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["samples"] >= 8
    if backend == "pillow":
        assert result["fallbacks"] == 0
    else:  # every other sample, however many epochs the 0.1 s held (no worker decodes ahead)
        assert result["fallbacks"] * 2 == result["samples"]
    assert main([*args, "--batch-size", "8", "--backend", backend]) == 0
    text = capsys.readouterr().out
    name = {"auto": "auto backend: simplejpeg", "simplejpeg": "simplejpeg backend", "pillow": "pillow backend"}
    assert f"mode decode ({name[backend]})" in text
    assert ("JPEG decodes fell back to Pillow" in text) == (backend != "pillow"), text
