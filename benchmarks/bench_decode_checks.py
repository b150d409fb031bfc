"""What reporting the C libraries' stderr and the JPEG fallback cost per image.

    python benchmarks/bench_decode_checks.py              # made-up images, 2,000 decodes each
    python benchmarks/bench_decode_checks.py --repeat 5000

Per image kind, the median of several rounds of ``--repeat`` decodes, in microseconds:

* ``capture alone``: an empty :func:`streamload._cstderr.c_stderr` block (lock, ``dup``,
  two ``dup2``, ``fstat``): what every TIFF decode pays; other kinds pay nothing.
* TIFF (LZW and group4 fax) through ``ImageDecoder(64)`` in ``image_warnings``: with the capture (as
  shipped) and without it (``image_warnings()`` given no data), the difference being the
  capture's cost on a real decode.
* JPEG likewise: a clean file (simplejpeg) and one with junk
  bytes before a marker (simplejpeg refuses it; Pillow decodes it: the fallback's price).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def _rounds(fns: list[Callable[[], object]], repeat: int, rounds: int = 7) -> list[float]:
    """Per function, the median over ``rounds`` of its mean microseconds over ``repeat`` calls.

    The functions take turns within each round, so a busy machine slows them alike.
    """
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, out, strict=True):
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            times.append((time.perf_counter() - start) / repeat * 1e6)
    return [statistics.median(t) for t in out]


def _images() -> dict[str, bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = (rng.random((256, 256, 3)) * 64 + np.linspace(0, 180, 256)[None, :, None]).astype(np.uint8)
    img = Image.fromarray(pixels)
    out: dict[str, bytes] = {}
    for name, kwargs in {
        "tif (lzw, 256x256 RGB)": dict(format="TIFF", compression="tiff_lzw"),
        "tif (group4, 256x256 1-bit)": dict(format="TIFF", compression="group4"),
        "jpg (256x256)": dict(format="JPEG", quality=90),
    }.items():
        buf = io.BytesIO()
        (img.convert("1") if "group4" in name else img).save(buf, **kwargs)  # type: ignore[arg-type]
        out[name] = buf.getvalue()
    jpeg = out["jpg (256x256)"]
    sos = jpeg.index(b"\xff\xda")
    out["jpg, junk before SOS (fallback)"] = jpeg[:sos] + b"\x00" * 16 + jpeg[sos:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    from streamload import _cstderr
    from streamload.decode import ImageDecoder
    from streamload.sample import image_warnings

    def empty() -> None:
        with _cstderr.c_stderr():
            pass

    print(f"load average: {os.getloadavg()}; python {sys.version.split()[0]}")
    print(f"{'capture alone (empty block)':<36} {_rounds([empty], args.repeat)[0]:8.1f} us")
    decoder = ImageDecoder(64)
    for name, data in _images().items():

        def shipped(data: bytes = data) -> object:
            with image_warnings(data):  # a TIFF: fd 2 captured around the decode
                return decoder.decode(data)

        def uncaptured(data: bytes = data) -> object:
            with image_warnings():  # Python warnings only, fd 2 untouched
                return decoder.decode(data)

        if _cstderr.wants_capture(data):
            with_, without = _rounds([shipped, uncaptured], args.repeat)
            print(f"{name:<36} {with_:8.1f} us   without the capture {without:8.1f} us")
        else:
            print(f"{name:<36} {_rounds([shipped], args.repeat)[0]:8.1f} us")
    print(f"fallbacks counted: {decoder.fallbacks.value}")


if __name__ == "__main__":
    main()
