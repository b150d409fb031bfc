"""A JPEG's frame header (width, height, components, coding) read without decoding a pixel.

:class:`~streamload.DeviceDecode` needs each image's size before the GPU decodes it (the
crop box is drawn from it, as the CPU path draws it), and which images a GPU decoder can
take at all. Walking the marker segments up to the frame header is a few microseconds of
Python per image: the segments before it (APPn, DQT, DHT...) are skipped by their length.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["JpegHead", "jpeg_head"]

#: Start-of-frame markers (0xC0-0xCF less DHT 0xC4, JPG 0xC8 and DAC 0xCC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: Markers without a length: TEM and RST0-7 (SOI/EOI are handled apart).
_BARE = frozenset([0x01, *range(0xD0, 0xD8)])
#: Frame types a GPU JPEG decoder takes: baseline, extended sequential and progressive Huffman.
_GPU_CODINGS = frozenset([0xC0, 0xC1, 0xC2])


class JpegHead(NamedTuple):
    """What a JPEG's start-of-frame segment says.

    Attributes:
        width: Samples per line.
        height: Lines.
        components: Colour components (1 grey, 3 YCbCr/RGB, 4 CMYK/YCCK).
        precision: Bits per sample (8, or 12 for extended JPEGs).
        marker: The SOF marker's second byte (0xC0 baseline, 0xC2 progressive...).
    """

    width: int
    height: int
    components: int
    precision: int
    marker: int

    @property
    def gpu_decodable(self) -> bool:
        """True for an 8-bit grey or colour Huffman JPEG (what nvJPEG and the JPEG engines take)."""
        return self.marker in _GPU_CODINGS and self.precision == 8 and self.components in (1, 3)


def jpeg_head(data: Any, limit: int = 1 << 20) -> JpegHead | None:
    """Return the frame header of the JPEG ``data`` (bytes-like), or ``None`` if none is found.

    ``None`` for data that is not a JPEG, a header cut short, a scan before any frame
    header, a frame of height 0 (its lines given later by a DNL marker), or a frame header
    further than ``limit`` bytes in.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes | bytearray) else data
    n = min(len(view), limit)
    if n < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    at = 2
    while at + 4 <= n:
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # a fill byte before the marker
            at += 1
            continue
        if marker in _BARE:
            at += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # a second SOI, EOI or a scan before any frame
            return None
        length = (view[at + 2] << 8) | view[at + 3]
        if length < 2:
            return None
        if marker in _SOF:
            if at + 10 > n or length < 8:
                return None
            precision = view[at + 4]
            height = (view[at + 5] << 8) | view[at + 6]
            width = (view[at + 7] << 8) | view[at + 8]
            components = view[at + 9]
            if width == 0 or height == 0:
                return None
            return JpegHead(width, height, components, precision, marker)
        at += 2 + length
    return None
