"""Inputs as decoders hand them out (issue 75): a clip as one 4-D array or tensor, RGBA arrays
and tensors, a message that fits every refused shape and dtype, and headers that declare far
more pixels than their file holds, refused before anything is decoded."""

import io
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from vitgraph import GraphedVisionEncoder
from vitgraph.images import decode
from vitgraph.images.pipeline import image_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR, preprocess_video


def frames(t: int, h: int = 56, w: int = 84, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, channels), dtype=np.uint8)


def rows(images=None, videos=None, preprocess="pil", **kw):
    return image_rows(images, videos, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess=preprocess, **kw)


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture(scope="module")
def encoder():
    return GraphedVisionEncoder.from_config("tiny", device="cpu")


# -- a clip as one 4-D array or tensor ---------------------------------------------------------

@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_a_4d_clip_gives_the_rows_of_its_frames_as_a_list(preprocess):
    """[T, H, W, 3] as decord, PyAV and torchvision.io.read_video give it, and [T, 3, H, W] as
    torchvision's TCHW: the rows and grid of the same frames as a list (3 frames: padded)."""
    clip = frames(3)
    want = rows(videos=[list(clip)], preprocess=preprocess)
    assert want[1].tolist() == [[2, 4, 6]]
    tensor = torch.from_numpy(clip)
    forms = [clip, tuple(clip), tensor, tensor.permute(0, 3, 1, 2), tensor.permute(0, 3, 1, 2).contiguous(),
             np.ascontiguousarray(clip.transpose(0, 3, 1, 2))]
    for form in forms:
        assert same(rows(videos=[form], preprocess=preprocess), want), type(form)
    # beside images and other clips, each clip its own item
    mixed = rows([clip[0]], videos=[clip, list(clip[:2])], preprocess=preprocess)
    parts = [rows([clip[0]], preprocess=preprocess), want, rows(videos=[list(clip[:2])], preprocess=preprocess)]
    assert torch.equal(mixed[0], torch.cat([p[0] for p in parts])) and torch.equal(mixed[1], torch.cat([p[1] for p in parts]))


def test_a_4d_clip_in_preprocess_video_and_encode_images(encoder):
    clip = frames(4, seed=1)
    assert same(preprocess_video(clip), preprocess_video(list(clip)))
    got = encoder.encode_images(videos=[torch.from_numpy(clip).permute(0, 3, 1, 2)])
    want = encoder.encode_images(videos=[list(clip)])
    assert len(got) == 1 and torch.equal(got[0], want[0])


def test_a_lone_clip_or_batch_is_refused_with_the_list_to_pass(encoder):
    """transformers reads videos=<4-D array> as one clip and a 5-D one as a batch; vitgraph takes
    a list (one output per clip) and names the list that means the same."""
    clip = frames(2)
    with pytest.raises(TypeError, match=r"videos must be a list of clips .*shape \[2, 56, 84, 3\]: one clip: videos=\[x\]"):
        encoder.encode_images(videos=clip)
    with pytest.raises(TypeError, match=r"shape \[1, 2, 56, 84, 3\]: a batch of clips: videos=list\(x\)"):
        encoder.encode_images(videos=clip[None])
    with pytest.raises(TypeError, match=r"images must be a list .*: a batch of images: list\(x\); a clip: videos=\[x\]"):
        encoder.encode_images(images=clip)


def test_a_4d_clip_counts_its_frames_against_the_item_cap():
    with pytest.raises(ValueError, match=r"holds 5 items .* max_items_per_request = 4"):
        rows([frames(1)[0]], videos=[frames(4)], max_items_per_request=4)
    assert rows([frames(1)[0]], videos=[frames(3)], max_items_per_request=4)[1].shape == (2, 3)


# -- RGBA arrays and tensors -------------------------------------------------------------------

@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_rgba_arrays_and_tensors_are_composited_as_rgba_pil_images(preprocess):
    """Over white, by the code that composites an RGBA PIL image: the same rows to the bit."""
    rgba = frames(2, 70, 90, channels=4, seed=7)
    pil = [Image.fromarray(f, "RGBA") for f in rgba]
    want = rows(pil, preprocess=preprocess)
    tensors = [torch.from_numpy(f).permute(2, 0, 1) for f in rgba]
    assert same(rows(list(rgba), preprocess=preprocess), want)
    assert same(rows(tensors, preprocess=preprocess), want)
    assert same(rows(videos=[rgba], preprocess=preprocess), rows(videos=[pil], preprocess=preprocess))
    # alpha 255 everywhere: the RGB image itself; alpha 0: white
    opaque = rgba[0].copy()
    opaque[..., 3] = 255
    assert same(rows([opaque], preprocess=preprocess), rows([np.ascontiguousarray(rgba[0, ..., :3])], preprocess=preprocess))
    clear = rgba[0].copy()
    clear[..., 3] = 0
    assert same(rows([clear], preprocess=preprocess), rows([np.full((70, 90, 3), 255, np.uint8)], preprocess=preprocess))


# -- each refusal names the item, what it saw and the fix --------------------------------------

IMAGE_REFUSALS = [
    (np.zeros((10, 10), np.uint8), ValueError, r"array must be HxWx3 \(RGB\) or HxWx4 \(RGBA\), got a uint8 array of "
                                               r"shape \[10, 10\]: greyscale: np.stack"),
    (np.zeros((10, 10, 1), np.uint8), ValueError, r"shape \[10, 10, 1\]: greyscale: np.repeat\(x, 3, axis=2\)"),
    (np.zeros((10, 10, 2), np.uint8), ValueError, r"shape \[10, 10, 2\]: grey and alpha: pass PIL.Image.fromarray\(x\)"),
    (np.zeros((3, 10, 10), np.uint8), ValueError, r"shape \[3, 10, 10\]: channels first: x.transpose\(1, 2, 0\)"),
    (np.zeros((10, 10, 5), np.uint8), ValueError, r"shape \[10, 10, 5\]: no image has 5 channels"),
    (np.zeros((2, 10, 10, 3), np.uint8), ValueError, r"shape \[2, 10, 10, 3\]: a 4-D array is a clip or a batch"),
    (np.zeros((1, 2, 10, 10, 3), np.uint8), ValueError, r"shape \[1, 2, 10, 10, 3\]: a batch of clips: videos=list"),
    (np.zeros((10, 10, 3), np.float32), TypeError, r"array must be uint8 \(0-255\), got a float32 array of shape "
                                                   r"\[10, 10, 3\]: for values in \[0, 1\]: \(x \* 255\)"),
    (np.zeros((10, 10, 3), np.uint16), TypeError, r"got a uint16 array .*: for 16-bit pixels: \(x >> 8\)"),
    (np.zeros((10, 10, 3), np.int8), TypeError, r"got an int8 array of shape \[10, 10, 3\]: cast pixels of 0-255"),
    (np.zeros((10, 10, 3), bool), TypeError, r"got a bool array .*: a mask"),
    (torch.zeros(10, 10, 3, dtype=torch.uint8), ValueError, r"tensor must be 3xHxW \(RGB\) or 4xHxW \(RGBA\), got a "
                                                            r"uint8 tensor of shape \[10, 10, 3\]: channels last: "
                                                            r"x.permute\(2, 0, 1\)"),
    (torch.zeros(1, 10, 10, dtype=torch.uint8), ValueError, r"shape \[1, 10, 10\]: greyscale: x.expand\(3, -1, -1\)"),
    (torch.zeros(2, 10, 10, dtype=torch.uint8), ValueError, r"shape \[2, 10, 10\]: grey and alpha"),
    (torch.zeros(3, 10, 10), TypeError, r"tensor must be uint8 \(0-255\), got a float32 tensor .*\.to\(torch.uint8\)"),
    ([np.zeros((10, 10, 3), np.uint8)], TypeError, r"must be a PIL image, .* got list; a list of frames is a clip"),
]


@pytest.mark.parametrize("bad, error, words", IMAGE_REFUSALS, ids=lambda v: str(list(v.shape)) if hasattr(v, "shape") else "-")
@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_an_image_of_a_shape_or_dtype_no_image_has(bad, error, words, preprocess):
    good = frames(1)[0]
    with pytest.raises(error, match=r"^images\[1\] .*" + words):
        rows([good, bad], preprocess=preprocess)
    if not isinstance(bad, list):  # and as a frame of a clip, named by clip and frame
        with pytest.raises(error, match=r"^videos\[0\]\[1\] .*" + words):
            rows(videos=[[good, bad]], preprocess=preprocess)


CLIP_REFUSALS = [
    (frames(2).astype(np.float32), TypeError, r"videos\[0\] array must be uint8 \(0-255\), got a float32 array of "
                                              r"shape \[2, 56, 84, 3\]: for values in \[0, 1\]"),
    (frames(2, channels=1), ValueError, r"videos\[0\]: a clip array must be \[T, H, W, C\] or \[T, C, H, W\] with C = 3 "
                                        r"\(RGB\) or 4 \(RGBA\), got a uint8 array of shape \[2, 56, 84, 1\]: greyscale "
                                        r"frames: np.repeat\(x, 3, axis=3\)"),
    (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), ValueError, r"videos\[0\]: a clip tensor .*shape \[2, 1, 8, 8\]: "
                                                             r"greyscale frames: x.repeat_interleave\(3, dim=1\)"),
    (frames(2, channels=5), ValueError, r"videos\[0\]: a clip array .*shape \[2, 56, 84, 5\]: neither dim 1 \(56\) "
                                        r"nor dim 3 \(5\) holds 3 or 4"),
    (frames(2)[None], TypeError, r"videos\[0\] must be a list of frames or one .* array or tensor, got a uint8 array of "
                                 r"shape \[1, 2, 56, 84, 3\]: a batch of clips"),
    (frames(1)[0], TypeError, r"videos\[0\] must be a list of frames .*shape \[56, 84, 3\]: one frame: a clip of it is \[x\]"),
    ("clip.mp4", TypeError, r"videos\[0\] must be a list of frames .*got a str: vitgraph decodes no video files"),
    (frames(0), ValueError, r"videos\[0\] must have at least one frame"),
]


@pytest.mark.parametrize("bad, error, words", CLIP_REFUSALS, ids=lambda v: str(list(v.shape)) if hasattr(v, "shape") else "-")
def test_a_clip_of_a_shape_or_dtype_no_clip_has(bad, error, words):
    with pytest.raises(error, match="^" + words):
        rows(videos=[bad])
    with pytest.raises(error, match="^" + words.replace("videos\\[0\\]", "video")):
        preprocess_video(bad)


# -- headers that declare more pixels than their file holds ------------------------------------

def small_jpeg(**kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frames(1, 150, 200)[0]).save(buf, "JPEG", **kw)
    return buf.getvalue()


def with_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` with its start-of-frame header's size replaced (the scan data unchanged)."""
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):  # SOF0, SOF1, SOF2
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return data[:i + 5] + struct.pack(">HH", height, width) + data[i + 9:]


def png_declaring(width: int, height: int, raw_rows: int) -> bytes:
    """A PNG whose IHDR declares ``width x height`` and whose one, complete IDAT holds ``raw_rows``
    rows: PIL fills the rest with black, silently, once it has decoded the rows that are there."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    idat = zlib.compress((b"\0" + b"\x80" * 3 * width) * raw_rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


@pytest.fixture
def loads(monkeypatch):
    """Every PIL decode (ImageFile.load) in the test, counted: a refusal from the header makes none."""
    calls = []
    real = ImageFile.ImageFile.load

    def counted(self):
        calls.append(self.format)
        return real(self)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return calls


@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_a_jpeg_header_that_lies_is_refused_before_decoding(encoder, loads, preprocess):
    """A 200x150 JPEG whose header says 12000x11000 (under the 2**27 pixel ceiling): PIL would
    decode 132 MP, grey where data is missing, in 1.4 s, and the resize took minutes after it.
    Refused from the header: no decode is attempted (the count), and the 5 s bound on the call
    is only a generous backstop (the refusal takes well under a millisecond)."""
    lie = with_jpeg_size(small_jpeg(), 12000, 11000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^images\[1\]: declares 12000x11000 = 132000000 pixels in \d+ bytes, more "
                                         r"than a JPEG holds \(at most 1024 pixels a byte here\): a truncated "
                                         r"file or a false header; refused before decoding"):
        encoder.encode_images([frames(1)[0], lie], preprocess=preprocess)
    assert time.perf_counter() - start < 5
    assert loads == []
    progressive = with_jpeg_size(small_jpeg(progressive=True, quality=100), 12000, 11000)  # SOF2, more bytes
    with pytest.raises(ValueError, match=r"^videos\[0\]\[0\]: declares 12000x11000"):
        encoder.encode_images(videos=[[progressive]], preprocess=preprocess)
    assert loads == []
    # its true size decodes, and the count sees that decode
    assert len(encoder.encode_images([with_jpeg_size(lie, 200, 150)], preprocess=preprocess)) == 1
    assert loads and set(loads) == {"JPEG"}


@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_a_png_header_that_lies_is_refused_before_decoding(encoder, loads, preprocess):
    for lie in (png_declaring(12000, 11000, 1), png_declaring(12000, 11000, 0)):
        with pytest.raises(ValueError, match=r"^images\[0\]: declares 12000x11000 = 132000000 pixels in \d+ bytes, "
                                             r"more than a PNG holds \(at most 16384 pixels a byte here\)"):
            encoder.encode_images([lie], preprocess=preprocess)
    assert loads == []
    # a small file's lie is decoded, and truncation is still an error (PIL's, named), not a grey image
    with pytest.raises(ValueError, match=r"^images\[0\]: cannot be decoded \(image file is truncated"):
        encoder.encode_images([png_declaring(600, 400, 0)], preprocess=preprocess)
    assert loads == ["PNG"]


def test_a_truncated_jpeg_is_still_an_error():
    buf = io.BytesIO()
    Image.fromarray(frames(1, 1200, 1000)[0]).save(buf, "JPEG", quality=90)
    cut = buf.getvalue()[: len(buf.getvalue()) // 2]  # 1.2 MP in ~half its bytes: within the bound
    decode.check_header(cut, "images[0]")
    with pytest.raises(ValueError, match=r"images\[0\]: cannot be decoded \(image file is truncated"):
        decode.load_pixels(cut, "images[0]")


def flat(mode: str, fmt: str, size: int = 2048, **kw) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (size, size), 0).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode, fmt, kw, most", [
    ("L", "JPEG", {"quality": 1, "optimize": True}, 256),  # a Huffman JPEG spends >= 2 bits per 8x8 block here
    ("L", "JPEG", {"quality": 1, "optimize": True, "progressive": True}, 512),  # >= 1 bit per block
    ("RGB", "JPEG", {"quality": 1}, 256),
    ("1", "PNG", {"optimize": True}, 8256),  # deflate <= 1032:1, 8 pixels a byte
    ("RGB", "PNG", {"compress_level": 9}, 8256),
    ("RGB", "GIF", {}, 2730),  # LZW: <= ~4094 pixels a 12-bit code
    ("RGB", "WEBP", {"lossless": True}, None),  # 19,240 pixels a byte: no bound for arithmetic-coded formats
])
def test_the_flattest_real_images_pass_the_byte_bound(mode, fmt, kw, most):
    """4 MP of one colour, as small as PIL writes it: under what the format can hold, and taken
    from the header (benchmarks/HISTORY.md, "Encoded bytes per declared pixel": 16 MP too)."""
    data = flat(mode, fmt, **kw)
    if most is not None:
        assert 2048 * 2048 / len(data) < most
    decode.check_header(data, "images[0]")
    assert decode.open_encoded(data, "images[0]").size == (2048, 2048)


def test_a_broken_exif_block_is_a_value_error():
    """An EXIF block whose values ImageOps.exif_transpose cannot pack again (struct.error inside
    PIL, found by mutating EXIF bytes) is refused as a ValueError naming the item."""
    rng = np.random.default_rng(0)
    exif = Image.Exif()
    exif[0x0112], exif[0x010f], exif[0x8769] = 6, "Cam", {0x9003: "2020:01:01 00:00:00"}
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", exif=exif.tobytes())
    broken = bytearray(buf.getvalue())
    for offset, value in [(41, 74), (78, 49), (84, 111), (48, 1)]:  # inside the EXIF block
        broken[offset] = value
    with pytest.raises(ValueError, match=r"^images\[3\]: cannot be decoded"):
        decode.decode_pil(bytes(broken), "images[3]")
