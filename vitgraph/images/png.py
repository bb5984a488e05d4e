"""8-bit RGB and RGBA PNGs decoded by libspng (through imagecodecs, the ``png`` extra), the GIL
released: PIL's pixels (PNG is lossless) in about two thirds of PIL's time (BENCHMARKS.md).

Only PNGs whose pixels and orientation PIL takes from their image data alone: 8 bits a sample,
colour type RGB or RGBA, no transparent colour (``tRNS``), no EXIF (an ``eXIf`` chunk, or the
text chunk PIL reads EXIF from: it may turn the image), not animated (APNG), ending in ``IEND``.
Every other PNG, and any file libspng refuses, is decoded by PIL, which also names what is wrong.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # IHDR colour type -> samples a pixel: truecolour, truecolour with alpha
_REFUSED = frozenset((b"tRNS", b"eXIf", b"acTL", b"fcTL", b"fdAT"))  # transparency, EXIF, APNG
_TEXT = frozenset((b"tEXt", b"zTXt", b"iTXt"))
_EXIF_TEXT = b"Raw profile type exif\x00"  # PIL's getexif reads EXIF from this text chunk


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
    channels, at = _CHANNELS.get(blob[25]), 8
    while channels is not None and at + 12 <= len(blob):
        length, kind = int.from_bytes(blob[at:at + 4], "big"), blob[at + 4:at + 8]
        if kind in _REFUSED or (kind in _TEXT and blob[at + 8:at + 8 + len(_EXIF_TEXT)] == _EXIF_TEXT):
            return None
        if kind == b"IEND":
            return channels
        at += 12 + length
    return None


def decode_plain(blob: bytes) -> np.ndarray | None:
    """A plain PNG's ``HxWx3`` / ``HxWx4`` uint8 pixels by libspng; None for another file, without
    libspng, or where libspng refuses it (PIL then decodes it, or names what is wrong)."""
    decode = spng_decode()
    channels = plain_channels(blob) if decode is not None else None
    if channels is None:
        return None
    try:
        pixels = decode(blob)
    except (RuntimeError, ValueError, MemoryError):  # SpngError is a RuntimeError: PIL decides, and names the damage
        return None
    ok = pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == channels
    return pixels if ok else None
