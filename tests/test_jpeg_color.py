"""libjpeg-turbo's upsampling and colour conversion in torch (vitgraph.images.jpeg_color) against
PIL, bit for bit, from the planes PIL's own libjpeg-turbo decodes: the luma from a YCbCr decode
at full scale, the chroma of a 4:2:0 JPEG from one at half scale (libjpeg then runs chroma's
8x8 IDCT unscaled and skips its upsampling: the very planes a full decode upsamples)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph.images.decode import _sampling
from vitgraph.images.jpeg_color import planes_to_rgb, upright


def jpeg(height: int, width: int, seed: int, subsampling: int = 2, mode: str = "RGB", **save) -> bytes:
    """A gradient with noise (sharp chroma edges where rounding matters), seeded."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(0, 1, height)[:, None, None]
    pixels = np.concatenate([ramp, 1 - ramp, ramp ** 2], 2) * 255 + rng.normal(0, 30, (height, width, 3))
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", subsampling=subsampling, **save)
    return buffer.getvalue()


def pil_planes(data: bytes) -> list[torch.Tensor]:
    """The decoded planes, chroma at its own resolution (4:2:0 and 4:4:4 only)."""
    full = Image.open(io.BytesIO(data))
    if full.mode == "L":
        return [torch.from_numpy(np.array(full))]
    full.draft("YCbCr", full.size)
    ycc = np.array(full)
    factors = _sampling(Image.open(io.BytesIO(data)))
    if factors[1] == factors[0]:
        return [torch.from_numpy(ycc[..., c].copy()) for c in range(3)]
    half = Image.open(io.BytesIO(data))
    width, height = half.size
    half.draft("YCbCr", (width // 2, height // 2))
    chroma = np.array(half)
    assert chroma.shape[:2] == ((height + 1) // 2, (width + 1) // 2)
    return [torch.from_numpy(ycc[..., 0].copy())] + [torch.from_numpy(chroma[..., c].copy()) for c in (1, 2)]


def check(data: bytes) -> None:
    image = Image.open(io.BytesIO(data))
    got = planes_to_rgb(pil_planes(data), _sampling(image)).permute(1, 2, 0).numpy()
    expected = np.asarray(image.convert("RGB"))
    levels = np.abs(got.astype(int) - expected.astype(int))
    assert levels.max() == 0, f"{image.size} {image.layer}: {int((levels > 0).sum())} values apart, up to {levels.max()}"


def test_every_small_4_2_0_size_equals_pil():
    """Odd and even sizes, planes 1 to 20 samples wide: the narrow planes libjpeg-turbo replicates,
    the edges it repeats, the last row group's context."""
    for height in range(2, 40):
        for width in range(2, 40):
            check(jpeg(height, width, seed=height * 40 + width))


@pytest.mark.parametrize("size", [(480, 640), (601, 799), (720, 1280), (37, 53)])
@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"restart_marker_blocks": 3}, {"quality": 50},
                                  {"quality": 97}], ids=["baseline", "progressive", "restarts", "q50", "q97"])
def test_4_2_0_photos_equal_pil(size, save):
    check(jpeg(*size, seed=sum(size), **save))


@pytest.mark.parametrize("size", [(2, 2), (37, 53), (480, 640)])
def test_4_4_4_and_grey_equal_pil(size):
    check(jpeg(*size, seed=1, subsampling=0))
    check(jpeg(*size, seed=2, mode="L"))


def test_sampling_leaves_what_libjpeg_does_not_decode_as_ycbcr_to_the_host():
    assert _sampling(Image.open(io.BytesIO(jpeg(16, 16, 0)))) == [(2, 2), (1, 1), (1, 1)]
    assert _sampling(Image.open(io.BytesIO(jpeg(16, 16, 0, subsampling=1)))) == [(2, 1), (1, 1), (1, 1)]
    assert _sampling(Image.open(io.BytesIO(jpeg(16, 16, 0, subsampling=0)))) == [(1, 1), (1, 1), (1, 1)]
    rgb_coded = Image.open(io.BytesIO(jpeg(16, 16, 0, subsampling=0, keep_rgb=True)))  # Adobe transform 0
    assert rgb_coded.info.get("adobe_transform") == 0 and _sampling(rgb_coded) is None
    plain = jpeg(16, 16, 0, subsampling=0)
    sof = plain.index(b"\xff\xc0")
    named = bytearray(plain)
    named[sof + 10:sof + 19:3] = b"RGB"  # components named 'R', 'G', 'B': RGB to libjpeg without a JFIF marker
    assert _sampling(Image.open(io.BytesIO(bytes(named)))) is None
    cmyk = Image.open(io.BytesIO(jpeg(16, 16, 0, mode="CMYK")))
    assert cmyk.mode == "CMYK"  # decode_jpeg_on takes RGB and L modes only


def extended_sequential(blob: bytes) -> bytes:
    """A baseline JPEG rewritten as a real SOF1 frame: its Huffman tables renumbered 2 and 3 (ids
    baseline frames may not use), the frame marked SOF1. The same pixels to libjpeg."""
    out, at = bytearray(blob[:2]), 2
    while True:
        marker, length = blob[at + 1], int.from_bytes(blob[at + 2:at + 4], "big")
        segment = bytearray(blob[at:at + 2 + length])
        if marker == 0xC0:
            segment[1] = 0xC1
        elif marker == 0xC4:  # DHT: each table's class/id byte, then 16 counts and the symbols
            at_table = 4
            while at_table < len(segment):
                segment[at_table] += 2
                at_table += 17 + sum(segment[at_table + 1:at_table + 17])
        elif marker == 0xDA:  # SOS: each component's DC/AC table ids, then the entropy-coded data
            for c in range(segment[4]):
                segment[6 + 2 * c] += 0x22
            return bytes(out + segment + blob[at + 2 + length:])
        out += segment
        at += 2 + length


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def test_frame_marker_finds_the_sof_past_every_segment():
    from vitgraph.images.decode import frame_marker

    baseline, progressive = jpeg(16, 16, 0, quality=90), jpeg(16, 16, 0, progressive=True)
    assert frame_marker(baseline) == 0xC0 and frame_marker(progressive) == 0xC2
    decoy = segment(0xFE, b"\xff\xc0\x00\x11" * 4) + segment(0xE2, b"\xff\xc1" * 50)  # SOF-like bytes in payloads
    assert frame_marker(progressive[:2] + decoy + progressive[2:]) == 0xC2
    extended = extended_sequential(baseline)
    assert frame_marker(extended) == 0xC1
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(extended))), np.asarray(Image.open(io.BytesIO(baseline))))
    sof = baseline.index(b"\xff\xc0")
    for byte in (0xC9, 0xCA):  # arithmetic sequential, progressive
        assert frame_marker(baseline[:sof + 1] + bytes([byte]) + baseline[sof + 2:]) == byte
    assert frame_marker(baseline[:sof]) is None and frame_marker(b"\xff\xd8garbage") is None
    assert frame_marker(b"\xff\xd8\xff\xff\xff\xc0\x00\x11") == 0xC0  # fill bytes skipped
    # A stray FF 00 (PIL and libjpeg skip it to the next marker) read as a length could land on a
    # decoy FF C0 past a progressive frame: anything but a known segment ends the walk instead.
    sof2 = progressive.index(b"\xff\xc2")
    head, frame = progressive[2:sof2], progressive[sof2:sof2 + 2 + int.from_bytes(progressive[sof2 + 2:sof2 + 4], "big")]
    lands = 2 + 4 + len(head) + len(frame) + 4 + 8
    stray = (b"\xff\xd8\xff\x00" + (lands - 4).to_bytes(2, "big") + head + frame
             + segment(0xFE, b"comment!\xff\xc0\x00\x11" + b"x" * 16) + progressive[sof2 + len(frame):])
    opened = Image.open(io.BytesIO(stray))
    assert opened.info.get("progressive") and frame_marker(stray) is None
    for odd in (b"\xff\xd8", b"\xff\xf5"):  # a second SOI, a JPGn segment: PIL opens them, libjpeg does not
        assert frame_marker(baseline[:2] + odd + b"\x00\x04ab" + baseline[2:]) is None
    assert frame_marker(baseline[:2] + b"\xff\xfe\x00\x01" + baseline[2:]) is None  # a length under 2


@pytest.mark.parametrize("orientation", range(1, 9))
def test_upright_turns_as_pils_exif_transpose(orientation):
    from PIL import ImageOps

    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "PNG", exif=exif)  # lossless: the turn alone differs
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buffer.getvalue()))).convert("RGB"))
    got = upright(torch.from_numpy(pixels).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert got.shape == expected.shape and np.array_equal(got, expected)


class PilPlanes:
    """A stand-in for nvJPEG's planes decoder on the CPU: the planes PIL's libjpeg-turbo decodes
    (:func:`pil_planes`), for 4:2:0, 4:4:4 and grey; ``answer`` in place of them when given."""

    def __init__(self, answer="planes"):
        self.answer, self.calls = answer, 0

    def planes(self, data, device, shapes):
        self.calls += 1
        self.shapes = shapes
        if isinstance(self.answer, Exception):
            raise self.answer
        return pil_planes(data) if self.answer == "planes" else self.answer


def test_decode_jpeg_on_gives_pils_pixels_or_leaves_the_file_to_the_host(monkeypatch):
    """decode_jpeg_on's own logic, the planes decoder aside: PIL's pixels (turned upright) for what
    it takes; None, for the host to decode, for every file it does not take."""
    from PIL import ImageOps

    from vitgraph.images import decode

    cpu, stand_in = torch.device("cpu"), PilPlanes()
    monkeypatch.setattr(decode, "gpu_jpeg_decoder", lambda: stand_in)

    def pil_pixels(blob):
        return torch.from_numpy(np.array(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("RGB")))

    baseline = jpeg(37, 53, 1)
    for blob in (baseline, extended_sequential(baseline), jpeg(37, 53, 2, subsampling=0), jpeg(20, 9, 3, subsampling=0, mode="L")):
        assert torch.equal(decode.decode_jpeg_on(blob, "img", cpu).permute(1, 2, 0), pil_pixels(blob))
    assert stand_in.shapes == [(20, 9)]
    decode.decode_jpeg_on(jpeg(37, 53, 1), "img", cpu)
    assert stand_in.shapes == [(37, 53), (19, 27), (19, 27)]  # what the planes decoder must agree to
    turned = Image.open(io.BytesIO(jpeg(37, 53, 4)))
    exif = turned.getexif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    turned.save(buffer, "JPEG", exif=exif)
    got = decode.decode_jpeg_on(buffer.getvalue(), "img", cpu)
    assert got.shape == (3, 53, 37) and torch.equal(got.permute(1, 2, 0), pil_pixels(buffer.getvalue()))

    # an EXIF block exif_transpose cannot re-pack (tag 0x152 typed ASCII): the host names the error
    broken_exif = (b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x02\x01R\x00\x02\x00\x00\x00\x06\x00\x00\x00&"
                   b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00\x00\x00\x00\x00heQlo\x00")
    buffer = io.BytesIO()
    Image.open(io.BytesIO(jpeg(16, 16, 0, subsampling=0))).save(buffer, "JPEG", exif=broken_exif, subsampling=0)
    with pytest.raises(ValueError, match="img: cannot be decoded"):
        decode.decode_pil(buffer.getvalue(), "img")
    assert decode.decode_jpeg_on(buffer.getvalue(), "img", cpu) is None
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    calls = stand_in.calls
    whole = jpeg(64, 64, 0)
    cut_short = whole[:len(whole) * 2 // 3]
    for blob in (png.getvalue(), jpeg(16, 16, 0, subsampling=0, keep_rgb=True), jpeg(16, 16, 0, mode="CMYK"),
                 cut_short, whole + b"trailing bytes", jpeg(16, 16, 0, progressive=True),
                 jpeg(16, 16, 0, mode="L")):  # progressive; grey declared 2x2 (nvJPEG is off on both)
        assert decode.decode_jpeg_on(blob, "img", cpu) is None
    assert stand_in.calls == calls  # refused from the header: the decoder never ran
    with monkeypatch.context() as patched:  # a PNG is not even opened here: the host opens it once
        patched.setattr(decode, "open_encoded", lambda *a: pytest.fail("a PNG opened for the GPU"))
        assert decode.decode_jpeg_on(memoryview(png.getvalue()), "img", cpu) is None
    monkeypatch.setattr(decode, "GPU_DECODE_MAX_PIXELS", 16 * 16 - 1)
    assert decode.decode_jpeg_on(jpeg(16, 16, 0), "img", cpu) is None and stand_in.calls == calls  # too large
    monkeypatch.setattr(decode, "GPU_DECODE_MAX_PIXELS", 16 * 16)
    assert decode.decode_jpeg_on(jpeg(16, 16, 0), "img", cpu) is not None
    for answer in (None, OSError("no state"), torch.OutOfMemoryError("no room"),  # refused, failed, no memory,
                   [torch.zeros(16, 16, dtype=torch.uint8)] * 3):  # or planes of the wrong shapes
        monkeypatch.setattr(decode, "gpu_jpeg_decoder", lambda answer=answer: PilPlanes(answer))
        assert decode.decode_jpeg_on(jpeg(16, 16, 0), "img", cpu) is None
    monkeypatch.setattr(decode, "gpu_jpeg_decoder", lambda: None)
    assert decode.decode_jpeg_on(jpeg(16, 16, 0), "img", cpu) is None


def test_the_nvjpeg_binding_lays_out_nvjpeg_image_t_and_stays_off_without_cuda(monkeypatch):
    """nvjpegImage_t is four channel pointers then four size_t pitches (nvjpeg.h); without CUDA no
    library is even looked for, and the host decodes."""
    import ctypes

    from vitgraph.images import nvjpeg

    assert ctypes.sizeof(nvjpeg._Image) == 8 * ctypes.sizeof(ctypes.c_void_p)
    assert nvjpeg._Image.pitch.offset == 4 * ctypes.sizeof(ctypes.c_void_p)
    nvjpeg.decoder.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(nvjpeg, "_candidates", lambda: pytest.fail("looked for libnvjpeg without CUDA"))
    assert nvjpeg.decoder() is None
    nvjpeg.decoder.cache_clear()
