"""Images in every form a caller holds, to RGB uint8 pixels: PIL images, ``HxWx3`` / ``HxWx4``
uint8 arrays, ``3xHxW`` / ``4xHxW`` uint8 tensors (on any device; the forms: :mod:`vitgraph.images.pixel_forms`),
encoded bytes (JPEG, PNG, WebP, ...) and file paths. RGBA is composited onto white (:func:`as_rgb`).
Plain 8-bit RGB and RGBA PNGs are decoded by libspng where the ``png`` extra is installed
(:mod:`vitgraph.images.png`: the same pixels, faster).

Encoded images are decoded by PIL on the host, after their header is checked against
:data:`MAX_IMAGE_PIXELS` (a 30000 x 30000 PNG is refused before a byte of it is decoded) and
against their own length (:data:`PIXELS_PER_BYTE`: a header that declares 132 MP over 19 KB), and
turned upright by their EXIF orientation, as transformers' ``load_image`` does. A JPEG can
instead be decoded on the GPU, to PIL's pixels (:func:`decode_jpeg_on`: nvJPEG's planes, then
libjpeg-turbo's upsampling and colour conversion in torch).
"""

from __future__ import annotations

import io
import os
import struct
import threading
import warnings
from typing import Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..checkpoints.files import read_regular_file
from . import png
from .pixel_forms import check_image_form, frame_count
from ..runtime.validation import check_int

# The most pixels an encoded image may declare (2**27: 16384 x 8192, 400 MB decoded).
MAX_IMAGE_PIXELS = 1 << 27
MAX_IMAGE_PIXELS_CEILING = 2 * Image.MAX_IMAGE_PIXELS  # the most a caller may raise it to: PIL opens no more


# A PIL image is not thread-safe while it loads, and one may come twice in a call (or in two calls).
_PIL_LOCKS = [threading.Lock() for _ in range(64)]
# Whatever a PIL plugin raises for a broken file.
_BROKEN_FILE = (OSError, ValueError, SyntaxError, TypeError, EOFError, NotImplementedError, Image.DecompressionBombError,
                struct.error,  # exif_transpose re-packs a broken EXIF block
                IndexError)  # an empty iCCP chunk after the image data


def check_image_ceiling(max_image_pixels) -> None:
    """``max_image_pixels``: an int in [1, :data:`MAX_IMAGE_PIXELS_CEILING`]."""
    if (isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int)
            or not 1 <= max_image_pixels <= MAX_IMAGE_PIXELS_CEILING):
        raise ValueError(f"max_image_pixels must be an int in [1, {MAX_IMAGE_PIXELS_CEILING}], got {max_image_pixels!r}")


# The most items (images plus video frames) one call may hold: counted before anything is decoded.
MAX_ITEMS_PER_REQUEST = 4096


def check_item_count(images, videos, cap) -> None:
    """Refuse a call of more than ``cap`` items (images plus the frames of every clip), from
    the lists' lengths alone, before any item is looked at."""
    check_int("max_items_per_request", cap)
    count = len(images) if isinstance(images, (list, tuple)) else 0
    if isinstance(videos, (list, tuple)):
        count += len(videos)  # at least a frame each: a cheap bound before the frames are counted
        if count <= cap:
            count += sum(frame_count(clip) - 1 for clip in videos)
    if count > cap:
        raise ValueError(f"the call holds {count} items (images and video frames), above max_items_per_request "
                         f"= {cap}; split it, or raise the cap")


def check_header(item, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """What can be checked of an item without decoding it: encoded bytes' header (a format PIL
    knows, the declared size), an array's or tensor's shape and dtype, a PIL image's size, the
    type. A path is checked as it is read."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        open_encoded(item, name, max_pixels)
    elif isinstance(item, Image.Image):
        if item.width == 0 or item.height == 0:
            raise ValueError(f"{name} is empty ({item.width}x{item.height})")
    elif not isinstance(item, (str, os.PathLike)):
        as_pixels(item, name)


# The largest image file read from a path (far above any real photo or screenshot).
MAX_FILE_BYTES = 1 << 30

Encoded = Union[bytes, bytearray, memoryview]
Pixels = Union[np.ndarray, torch.Tensor]  # HxWx3 (or 4) uint8 array, or 3xHxW (or 4) uint8 tensor


def is_encoded(item) -> bool:
    return isinstance(item, (bytes, bytearray, memoryview, str, os.PathLike))


def read_file(path, name: str) -> bytes:
    """A path's bytes: a regular file of at most :data:`MAX_FILE_BYTES`
    (:func:`vitgraph.checkpoints.files.read_regular_file`), its errors prefixed with ``name``."""
    try:
        return read_regular_file(path, MAX_FILE_BYTES, "an image file")
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def open_encoded(data: Encoded, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A lazily opened PIL image whose declared size has been checked: nothing decoded yet."""
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = data.tobytes()
    if len(data) == 0:
        raise ValueError(f"{name}: is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own ceiling speaks below
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as err:
        raise ValueError(f"{name}: declares too many pixels ({err}); the limit is {max_pixels}") from None
    except UnidentifiedImageError:  # its message names a BytesIO's address, which helps nobody
        raise ValueError(f"{name}: not a readable image (no image format recognises its {len(data)} bytes)") from None
    except _BROKEN_FILE as err:
        raise ValueError(f"{name}: not a readable image ({err})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"{name}: declares {width}x{height} = {width * height} pixels, above the limit of "
                         f"{max_pixels}; refused before decoding")
    check_declared_size(image, data.nbytes if isinstance(data, memoryview) else len(data), name)
    return image


# The most pixels an encoded image may declare per byte it holds, by PIL format (else the default),
# 2x above what each format can hold at all (benchmarks/HISTORY.md, "Encoded bytes per declared pixel").
PIXELS_PER_BYTE = {"JPEG": 1024, "MPO": 1024}  # Huffman: >= 1 bit per 8x8 block, so <= 512 pixels per byte
PIXELS_PER_BYTE_DEFAULT = 16384  # deflate (PNG, TIFF) <= 1032:1 on 1-bit pixels: <= 8256; GIF's LZW less
# Arithmetic-coded formats: their flattest real files hold 12,000-44,000 pixels a byte at 16 MP, and more above.
NO_BYTE_BOUND = ("WEBP", "AVIF", "JPEG2000")
BYTE_BOUND_FLOOR = 1 << 20  # pixels: an image this small is cheap to decode, whatever its header says


def check_declared_size(image: Image.Image, nbytes: int, name: str) -> None:
    """Refuse a header that declares more pixels than its file's bytes could hold (a few KB that
    declare 132 MP: PIL would fill grey what is missing, then it is resized), before decoding."""
    pixels, per_byte = image.width * image.height, PIXELS_PER_BYTE.get(image.format, PIXELS_PER_BYTE_DEFAULT)
    if image.format in NO_BYTE_BOUND or pixels <= max(BYTE_BOUND_FLOOR, per_byte * nbytes):
        return
    raise ValueError(f"{name}: declares {image.width}x{image.height} = {pixels} pixels in {nbytes} bytes, more "
                     f"than a {image.format or 'file'} holds (at most {per_byte} pixels a byte here): a truncated "
                     "file or a false header; refused before decoding")


def decode_pil(data: Encoded, name: str, max_pixels: int = MAX_IMAGE_PIXELS, convert=None) -> Image.Image:
    """Encoded bytes -> an upright RGB PIL image (decoded here); ``convert``: what makes it RGB
    (:func:`as_rgb`; :func:`keep_alpha` leaves transparency for the device to composite)."""
    image = open_encoded(data, name, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked above
            ImageOps.exif_transpose(image, in_place=True)  # our own image: turned upright without a copy
            return (convert or as_rgb)(image)
    except _BROKEN_FILE as err:
        raise ValueError(f"{name}: cannot be decoded ({err})") from None


def as_rgb(image: Image.Image) -> Image.Image:
    """RGB with transparency composited onto white, as vLLM's loader (``rgba_to_rgb``) feeds its
    processors and transformers 5's ``convert_to_rgb`` does; 4.x dropped alpha (``convert("RGB")``)."""
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def keep_alpha(image: Image.Image) -> Image.Image:
    """:func:`as_rgb` short of its blend: an image with transparency as RGBA (LA stays LA: its grey
    is R, G and B), loaded, for :func:`vitgraph.images.alpha.composite_on_white` to blend on the device."""
    if image.mode == "RGBA" or (image.mode == "LA" and "transparency" not in image.info):
        image.load()  # decoded here, under the caller's lock, not in a later np.asarray
        return image
    if _has_alpha(image):
        return image.convert("RGBA")
    return as_rgb(image)


def _has_alpha(image: Image.Image) -> bool:
    """An alpha band, or a transparent colour or palette index (PNG's tRNS)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def to_rgb_pil(item, name: str, max_pixels: int = MAX_IMAGE_PIXELS, convert=None) -> Image.Image:
    """Any accepted form as an RGB PIL image (a tensor is brought to the host); ``convert`` as
    :func:`decode_pil`'s."""
    if is_encoded(item):
        data = read_file(item, name) if isinstance(item, (str, os.PathLike)) else item
        pixels = _plain_png(data, name, max_pixels) if convert is None else None
        return Image.fromarray(opaque(pixels)) if pixels is not None else decode_pil(data, name, max_pixels, convert)
    if isinstance(item, Image.Image):
        if item.width == 0 or item.height == 0:
            raise ValueError(f"{name} is empty ({item.width}x{item.height})")
        try:  # decoding happens here for a lazily opened file: one thread at a time per image
            with _PIL_LOCKS[(id(item) >> 4) % len(_PIL_LOCKS)]:
                return (convert or as_rgb)(item)
        except _BROKEN_FILE as err:
            raise ValueError(f"{name} ({item.mode} image) cannot be decoded as RGB: {err}") from None
    return Image.fromarray(_host_hwc(opaque(as_pixels(item, name))))


def as_pixels(item, name: str) -> Pixels:
    """An ``HxWx3`` / ``HxWx4`` uint8 array or a ``3xHxW`` / ``4xHxW`` uint8 tensor, checked
    (:func:`vitgraph.images.pixel_forms.check_image_form`); anything else refused, with what is taken."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        check_image_form(item, name)
        return item
    hint = "; a list of frames is a clip: pass it in videos" if isinstance(item, (list, tuple)) else ""
    raise TypeError(f"{name} must be a PIL image, an HxWx3 or HxWx4 uint8 array, a 3xHxW or 4xHxW uint8 tensor, "
                    f"encoded image bytes or a file path, got {type(item).__name__}{hint}")


def opaque(pixels: Pixels) -> Pixels:
    """Checked pixels with 3 channels as they are; RGBA composited onto white as an RGBA PIL
    image is (:func:`as_rgb`), as an ``HxWx3`` array on the host."""
    if (pixels.shape[0] if isinstance(pixels, torch.Tensor) else pixels.shape[2]) == 3:
        return pixels
    return np.asarray(as_rgb(Image.fromarray(_host_hwc(pixels))))


def _host_hwc(pixels: Pixels) -> np.ndarray:
    """Pixels as a contiguous ``HxWxC`` array on the host (a ``CxHxW`` tensor brought over)."""
    if isinstance(pixels, torch.Tensor):
        pixels = pixels.permute(1, 2, 0).cpu().numpy()
    return np.ascontiguousarray(pixels)


def load_pixels(item, name: str, max_pixels: int = MAX_IMAGE_PIXELS, alpha: bool = False) -> Pixels:
    """Any accepted form as pixels: an RGB tensor stays where it is (no copy); the rest become an
    ``HxWx3`` uint8 array on the host (encoded ones decoded here, RGBA arrays composited).
    ``alpha``: an encoded or PIL image with transparency comes unblended, ``HxWx4`` RGBA or
    ``HxWx2`` LA (:func:`keep_alpha`), for the device to composite."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return opaque(as_pixels(item, name))
    if is_encoded(item):
        item = read_file(item, name) if isinstance(item, (str, os.PathLike)) else item
        pixels = _plain_png(item, name, max_pixels)
        if pixels is not None:
            return pixels if alpha else opaque(pixels)
    return np.asarray(to_rgb_pil(item, name, max_pixels, keep_alpha if alpha else None))


def _plain_png(data: Encoded, name: str, max_pixels: int) -> np.ndarray | None:
    """A plain PNG's pixels by libspng (:mod:`vitgraph.images.png`), its header checked as PIL's
    path checks it; None for any other file (PIL decodes it)."""
    if bytes(memoryview(data)[:8]) != png.SIGNATURE or png.spng_decode() is None:
        return None
    blob = bytes(data)
    channels = png.plain_channels(blob)  # before PIL opens it: another PNG is opened once, by PIL's path
    if channels is None:
        return None
    open_encoded(data, name, max_pixels)  # the declared size, against the ceiling and the bytes
    return png.decode_plain(blob, channels)


def gpu_jpeg_decoder():
    """nvJPEG's planes decoder (:func:`vitgraph.images.nvjpeg.decoder`) where libnvjpeg loads, else None."""
    from . import nvjpeg

    return nvjpeg.decoder()


# The most pixels a JPEG decoded on the GPU may have (4K fits, 8K does not): its upsampling and colour
# conversion hold 28-36 bytes a pixel for a moment (peak RSS on a CPU, 4096x4096); larger ones go to the host.
GPU_DECODE_MAX_PIXELS = 1 << 24


def decode_jpeg_on(data: Encoded, name: str, device: torch.device, max_pixels: int = MAX_IMAGE_PIXELS):
    """A JPEG decoded on ``device``, equal to PIL's pixels: nvJPEG's planes, upsampled and converted
    as libjpeg-turbo does (:mod:`vitgraph.images.jpeg_color`). ``3xHxW`` uint8, or None (the caller
    decodes on the host) for another format, a JPEG above :data:`GPU_DECODE_MAX_PIXELS`, not ending
    in its EOI marker (cut short, or with bytes after it), progressive or arithmetic-coded, coded in
    RGB or CMYK, sampled other than fully or by half each way (grey: other than fully), or refused
    by nvJPEG, or where there is no nvJPEG. Turned upright by its EXIF orientation."""
    decoder = gpu_jpeg_decoder()
    if decoder is None or bytes(memoryview(data)[:2]) != b"\xff\xd8":  # not a JPEG: the host opens it once
        return None
    image = open_encoded(data, name, max_pixels)
    width, height = image.size
    if image.format != "JPEG" or image.mode not in ("RGB", "L") or not 0 < width * height <= GPU_DECODE_MAX_PIXELS:
        return None
    blob = bytes(data)
    # A JPEG that does not end in its EOI marker may be cut short: the host says so, or decodes it.
    # nvJPEG decodes progressive ones up to 3 levels from libjpeg: sequential Huffman frames only.
    sequential = blob[-2:] == b"\xff\xd9" and frame_marker(blob) in SEQUENTIAL_FRAMES
    orientation = _orientation(image) if sequential and not image.info.get("progressive") else None
    if orientation is None:
        return None
    factors = _sampling(image)
    if factors is None:
        return None
    (h_max, v_max) = factors[0]
    shapes = [(-(-height * v // v_max), -(-width * h // h_max)) for h, v in factors]  # libjpeg's, rounded up
    from .jpeg_color import planes_to_rgb, upright

    try:
        planes = decoder.planes(blob, device, shapes)
        if planes is None or [tuple(p.shape) for p in planes] != shapes:
            return None
        rgb = upright(planes_to_rgb(planes, factors), orientation)
    except (OSError, torch.OutOfMemoryError):  # no nvJPEG handle or state here, or no room: the host decodes
        return None
    if rgb.is_cuda:  # converted on this thread's stream; the caller reads it on its own: finish here first
        torch.cuda.current_stream(rgb.device).synchronize()
    return rgb


def _orientation(image) -> int | None:
    """The EXIF orientation (1-8) as ``exif_transpose`` reads it; None for another value, or where
    ``exif_transpose`` could not re-pack the block (the host decode then names the error)."""
    try:
        exif = image.getexif()
        orientation = exif.get(0x0112, 1)
        if orientation in range(2, 9) and "exif" in image.info:
            del exif[0x0112]
            exif.tobytes()
    except _BROKEN_FILE:
        return None
    return orientation if orientation in range(1, 9) else None


def _sampling(image) -> list[tuple[int, int]] | None:
    """Each component's sampling factors ``(h, v)`` where libjpeg decodes the JPEG as YCbCr (or
    grey) with chroma at full or half resolution each way; None otherwise."""
    layers = getattr(image, "layer", None) or []
    factors = [(h, v) for _, h, v, _ in layers]
    ids = tuple(layer[0] for layer in layers)
    if image.mode == "L":  # nvJPEG garbles a lone component declared subsampled (2x2): full only
        return factors if factors == [(1, 1)] else None
    # libjpeg decodes YCbCr unless no JFIF marker comes and an Adobe marker says RGB, or none does and the
    # components are named 'R', 'G', 'B'. PIL's reading of those markers is looser than libjpeg's (a JFIF
    # without its NUL, an Adobe too short for a transform): anything short of certain YCbCr goes to the host.
    info = image.info
    rgb_coded = ids == (82, 71, 66) or ("adobe" in info and info.get("adobe_transform") != 1)
    if rgb_coded or len(factors) != 3 or factors[1] != factors[2]:
        return None
    (h_max, v_max), (h, v) = factors[0], factors[1]
    return factors if h_max in (h, 2 * h) and v_max in (v, 2 * v) else None


SEQUENTIAL_FRAMES = (0xC0, 0xC1)  # SOF0 baseline, SOF1 extended: sequential, Huffman-coded
# Segments that may come before the frame header, each with its length: DHT, DAC, DQT, DNL, DRI,
# APPn, COM. Anything else there (a stray FF 00, a second SOI, JPGn) ends the walk: the host decodes.
_LENGTHED = frozenset((0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)))


def frame_marker(blob: bytes) -> int | None:
    """The second byte of a JPEG's SOFn marker (0xC0 baseline, 0xC2 progressive, ...), found by
    walking its segments from SOI; None where the walk meets anything else before the frame header."""
    at = 2
    while at + 4 <= len(blob) and blob[at] == 0xFF:
        marker, length = blob[at + 1], int.from_bytes(blob[at + 2:at + 4], "big")
        if marker == 0xFF:  # fill byte
            at += 1
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker
        elif marker in _LENGTHED and length >= 2:
            at += 2 + length
        else:
            return None
    return None
