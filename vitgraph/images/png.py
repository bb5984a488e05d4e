"""8-bit RGB and RGBA PNGs decoded by libspng (through imagecodecs, the ``png`` extra), the GIL
released: PIL's pixels (PNG is lossless) in about two thirds of PIL's time (BENCHMARKS.md).

Only PNGs whose pixels and orientation PIL takes from their image data alone: 8 bits a sample,
colour type RGB or RGBA, no transparent colour (``tRNS``), no EXIF or XMP (an ``eXIf`` chunk, or
a text chunk PIL reads EXIF or XMP from: either may turn the image), not animated (APNG), nothing
but image data between the first ``IDAT`` and ``IEND`` (PIL reads and checks chunks there, libspng
stops at the data's end). Every other PNG, and any file libspng refuses, is decoded by PIL, which
also names what is wrong.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # IHDR colour type -> samples a pixel: truecolour, truecolour with alpha
_REFUSED = frozenset((b"tRNS", b"eXIf", b"acTL", b"fcTL", b"fdAT"))  # transparency, EXIF, APNG
_TEXT = frozenset((b"tEXt", b"zTXt", b"iTXt"))
# Text keywords PIL reads EXIF or XMP from (either may hold an orientation), compared in lower case.
_METADATA_KEYWORDS = frozenset((b"exif", b"xmp", b"xml:com.adobe.xmp", b"raw profile type exif",
                                b"raw profile type app1", b"raw profile type xmp"))


@functools.lru_cache(maxsize=1)
def spng_decode():
    """imagecodecs' libspng decoder, or None without imagecodecs (or one built without libspng)."""
    try:
        codecs = importlib.import_module("imagecodecs")
    except ImportError:
        return None
    return getattr(codecs, "spng_decode", None) if getattr(codecs, "SPNG", None) is not None else None


def plain_channels(blob: bytes) -> int | None:
    """3 or 4 for a PNG whose pixels PIL takes from its image data alone (see above), else None:
    its chunks walked by their lengths, nothing decompressed."""
    if blob[:8] != SIGNATURE or len(blob) < 33 or blob[12:16] != b"IHDR" or blob[24] != 8:
        return None
    channels, at, data_seen = _CHANNELS.get(blob[25]), 8, False
    while channels is not None and at + 12 <= len(blob):
        length, kind = int.from_bytes(blob[at:at + 4], "big"), blob[at + 4:at + 8]
        if kind == b"IEND":
            return channels
        if kind in _REFUSED or (data_seen and kind != b"IDAT") or (kind in _TEXT and _metadata(blob, at, length)):
            return None
        data_seen = data_seen or kind == b"IDAT"
        at += 12 + length
    return None


def _metadata(blob: bytes, at: int, length: int) -> bool:
    """Whether the text chunk at ``at`` has a keyword PIL reads EXIF or XMP from."""
    keyword = blob[at + 8:at + 8 + min(length, 80)].split(b"\x00", 1)[0]
    return keyword.lower() in _METADATA_KEYWORDS


def decode_plain(blob: bytes, channels: int) -> np.ndarray | None:
    """A plain PNG's ``HxWx<channels>`` uint8 pixels (``channels``: its :func:`plain_channels`) by
    libspng; None without libspng, or where libspng refuses it (PIL then decodes it, or names
    what is wrong)."""
    decode = spng_decode()
    if decode is None:
        return None
    try:
        pixels = decode(blob)
    except (RuntimeError, ValueError, MemoryError):  # SpngError is a RuntimeError: PIL decides, and names the damage
        return None
    ok = pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == channels
    return pixels if ok else None
