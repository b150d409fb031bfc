"""What libtiff writes straight to stderr is reported per file, counted, never printed raw.

libtiff (under Pillow's TIFF decoder) prints its warnings with ``fprintf(stderr, ...)``,
bypassing Python. The file used here is a real fax TIFF (Pillow, ``compression="group4"``)
with four bytes of its strip overwritten: Pillow still decodes it, and libtiff complains
(``Fax4Decode: Bad code word ...``) on file descriptor 2. Convert (a real CLI process and
its pool), verify, and the readers must name the file and count the lines instead.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamload import ImageLabel, SourceError, StreamingDataset
from streamload.cli import main
from streamload.converters.images import check_image
from streamload.decode import DecodeBatch, decode_sample
from streamload.sample import image_warnings

_CLI = "import sys; from streamload.cli import main; sys.exit(main(sys.argv[1:]))"


def _broken_fax_tiff() -> bytes:
    """A 64x64 group4 TIFF whose strip has 4 bytes overwritten: decodable, libtiff complains."""
    bits = np.random.default_rng(0).random((64, 64)) < 0.5
    buf = io.BytesIO()
    Image.fromarray(bits).convert("1").save(buf, format="TIFF", compression="group4")
    data = bytearray(buf.getvalue())
    with Image.open(io.BytesIO(bytes(data))) as img:
        offset, count = img.tag_v2[273][0], img.tag_v2[279][0]  # StripOffsets, StripByteCounts
    data[offset + count // 2 : offset + count // 2 + 4] = b"\xff" * 4
    return bytes(data)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _raw_lines(stderr: str) -> list[str]:
    """Lines of libtiff's own, printed as it prints them (not inside a report line)."""
    return [line for line in stderr.splitlines() if line.startswith(("Fax4Decode", "TIFF"))]


@pytest.fixture(scope="module")
def fax() -> bytes:
    return _broken_fax_tiff()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, fax: bytes) -> Path:
    root = tmp_path_factory.mktemp("fax-src")
    (root / "a").mkdir()
    (root / "a" / "fax.tif").write_bytes(fax)
    (root / "a" / "red.png").write_bytes(_png())
    return root


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, folder: Path, fax: bytes) -> tuple[Path, str]:
    """The folder converted by the CLI in a process of its own (stderr as the user sees it)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import io, sys; from PIL import Image; Image.open(io.BytesIO(sys.stdin.buffer.read())).load()",
        ],
        input=fax,
        capture_output=True,
        timeout=60,
    )
    raw = _raw_lines(probe.stderr.decode())
    assert probe.returncode == 0 and raw and raw[0].startswith("Fax4Decode: "), probe.stderr  # the chatter is real
    out = tmp_path_factory.mktemp("fax-ds") / "ds"
    proc = subprocess.run(
        [sys.executable, "-c", _CLI, "convert", str(folder), str(out), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout + proc.stderr


def test_convert_names_and_counts_libtiff_lines_and_prints_none_raw(converted: tuple[Path, str]) -> None:
    _, output = converted
    assert _raw_lines(output) == [], output
    reported = [line for line in output.splitlines() if line.startswith("  warning a/fax.tif: libtiff: Fax4Decode: ")]
    assert len(reported) == 3, output  # one per distinct line libtiff wrote
    assert "wrote 2 samples" in output and ", 3 library warnings" in output, output


def test_verify_decode_names_and_counts_them(converted: tuple[Path, str], capfd: pytest.CaptureFixture[str]) -> None:
    out, _ = converted
    assert main(["verify", str(out), "--decode"]) == 0
    captured = capfd.readouterr()  # file descriptor 2 itself: what libtiff would write there
    assert _raw_lines(captured.err) == [] and _raw_lines(captured.out) == [], captured
    warned = [line for line in captured.out.splitlines() if line.startswith("WARN ")]
    assert len(warned) == 3, captured.out
    assert all(
        line.startswith("WARN shard-000000.tar: sample 'a/fax' field 'tif': libtiff: Fax4Decode: ") for line in warned
    )
    assert "OK: 1 shard, 2 samples checked, 2 images decoded in" in captured.out
    assert captured.out.rstrip().endswith("(3 library warnings)")


def test_readers_log_them_naming_the_sample(
    converted: tuple[Path, str], capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    out, _ = converted
    caplog.set_level(logging.WARNING, logger="streamload.decode")
    transform = ImageLabel(label_field=None)  # full size: Pillow
    sized = ImageLabel(size=16, label_field=None)
    collate = DecodeBatch(16, label_field=None)
    ds = StreamingDataset(str(out))
    samples = list(ds)
    for sample in samples:
        transform(sample)
        sized(sample)
        decode_sample(sample)
    batch = collate(samples)
    assert batch.images.shape == (2, 3, 16, 16)
    assert transform.warnings == sized.warnings == collate.warnings == 3
    assert _raw_lines(capfd.readouterr().err) == []
    named = [r.getMessage() for r in caplog.records if "libtiff: Fax4Decode" in r.getMessage()]
    assert len(named) == 4 * 3 and all(m.startswith("sample 'a/fax' field 'tif': libtiff: ") for m in named)


def test_dataloader_workers_print_none_raw(converted: tuple[Path, str], capfd: pytest.CaptureFixture[str]) -> None:
    out, _ = converted
    ds = StreamingDataset(str(out), batch_size=2, collate=DecodeBatch(16, label_field=None))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    assert sum(len(b) for b in loader) == 2
    assert _raw_lines(capfd.readouterr().err) == []


def _overlong_strip(tiff: bytes) -> bytes:
    """``tiff`` with its one strip's byte count past the end of the file: Pillow raises, libtiff says why."""
    data = bytearray(tiff)
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * i
        tag, kind, count = struct.unpack_from("<HHI", data, entry)
        if tag == 279 and kind == 4 and count == 1:  # StripByteCounts, one LONG
            struct.pack_into("<I", data, entry + 8, 100_000)
            return bytes(data)
    raise AssertionError("no StripByteCounts entry")


def test_a_failing_decode_restores_stderr_and_keeps_what_libtiff_said(
    fax: bytes, capfd: pytest.CaptureFixture[str]
) -> None:
    before = os.fstat(2).st_ino
    with pytest.raises(SourceError) as info:
        check_image(_overlong_strip(fax), "a/cut.tif", "decode")
    assert os.fstat(2).st_ino == before
    assert str(info.value).startswith("a/cut.tif: not a valid image: ")
    assert "(libtiff: TIFFFillStrip: Read error on strip 0; got " in str(info.value), info.value
    os.write(2, b"after the capture\n")
    err = capfd.readouterr().err
    assert "after the capture" in err and _raw_lines(err) == []


def test_threads_each_get_their_own_lines(fax: bytes, capfd: pytest.CaptureFixture[str]) -> None:
    png = _png()
    results: dict[int, list[str]] = {}

    def work(i: int) -> None:
        data = fax if i % 2 == 0 else png
        got: list[str] = []
        for _ in range(5):
            with image_warnings(data) as found:
                with Image.open(io.BytesIO(data)) as img:
                    img.load()
            got.extend(found)
        results[i] = got

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(6))
    for i, got in results.items():
        if i % 2:
            assert got == [], got
        else:
            assert len(got) == 5 * 3 and all(line.startswith("libtiff: Fax4Decode: ") for line in got), got
    assert _raw_lines(capfd.readouterr().err) == []
