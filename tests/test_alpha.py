"""Transparency composited onto white on the device (vitgraph.images.alpha) against the host's blend,
PIL's ``Image.alpha_composite`` over opaque white (what vitgraph did on the host before, and what
``preprocess="pil"`` still does): every (colour, alpha) pair, random images, and RGBA, LA, P with
tRNS, RGB / L with tRNS and 16-bit PNGs through both paths, to the bit."""

import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from vitgraph.images.alpha import composite_on_white
from vitgraph.images.decode import load_pixels
from vitgraph.images.device import upload
from vitgraph.images.pipeline import image_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR

WHITE = (255, 255, 255, 255)


def pil_rgb(image) -> np.ndarray:
    """The oracle: an image (or PNG bytes) blended onto white by PIL, as vitgraph's host path has
    always done it (upright by EXIF, converted to RGBA, alpha_composite, RGB)."""
    if isinstance(image, bytes):
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(image)))
    rgba = image.convert("RGBA")
    return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB"))


def device_blend(array: np.ndarray, device="cpu") -> np.ndarray:
    """``HxWxC`` (C = 4 or 2) blended by :func:`upload` on ``device``, back as ``HxWx3``."""
    return upload(array, torch.device(device))[0].permute(1, 2, 0).cpu().numpy()


def pairs(seed: int = 0) -> np.ndarray:
    """Every (colour, alpha) pair in each channel: 256 x 256 RGBA, row = alpha, column = colour
    (shuffled differently per channel, so no channel copies another)."""
    rng = np.random.default_rng(seed)
    out = np.empty((256, 256, 4), np.uint8)
    out[..., 3] = np.arange(256, dtype=np.uint8)[:, None]
    for ch in range(3):
        out[..., ch] = rng.permutation(256).astype(np.uint8)[None, :]
    return out


def test_every_colour_alpha_pair_is_pils():
    rgba = pairs()
    assert np.array_equal(device_blend(rgba), pil_rgb(Image.fromarray(rgba, "RGBA")))
    la = np.ascontiguousarray(rgba[..., [0, 3]])
    assert np.array_equal(device_blend(la), pil_rgb(Image.fromarray(la, "LA")))
    # the closed form the docstring states, for every pair
    c, a = np.meshgrid(np.arange(256), np.arange(256))
    want = np.round(c * a / 255) + 255 - a
    got = composite_on_white(torch.from_numpy(np.stack([c, a]).astype(np.uint8)))[0].numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("alpha", ["uniform", "binary", "zero", "opaque", "mostly_opaque"])
@pytest.mark.parametrize("h, w", [(1, 1), (37, 53), (128, 96)])
def test_random_images_are_pils(alpha, h, w):
    rng = np.random.default_rng(hash((alpha, h, w)) % 2**32)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[..., 3] = {"uniform": rgba[..., 3], "binary": (rgba[..., 3] & 1) * 255, "zero": 0, "opaque": 255,
                    "mostly_opaque": np.where(rgba[..., 3] < 16, rgba[..., 3], 255)}[alpha]
    assert np.array_equal(device_blend(rgba), pil_rgb(Image.fromarray(rgba, "RGBA")))
    assert np.array_equal(device_blend(rgba[..., [1, 3]]), pil_rgb(Image.fromarray(rgba[..., [1, 3]].copy(), "LA")))


def test_composite_refuses_what_it_cannot_blend():
    for bad in (torch.zeros(3, 4, 4, dtype=torch.uint8), torch.zeros(4, 4, 4, dtype=torch.int32),
                torch.zeros(4, 4, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="composite_on_white takes"):
            composite_on_white(bad)


def screen(h: int, w: int, seed: int) -> np.ndarray:
    """A screenshot-like RGBA image: flat panels, sharp strokes, a gradient, noise, and alpha
    of every kind (opaque, clear, an anti-aliased edge, a translucent band)."""
    rng = np.random.default_rng(seed)
    out = np.full((h, w, 4), 255, np.uint8)
    out[: h // 4, :, :3] = (40, 44, 52)
    out[h // 4:, : w // 4, :3] = (232, 234, 238)
    out[h // 2:, w // 2:, :3] = rng.integers(0, 256, (h - h // 2, w - w // 2, 3), dtype=np.uint8)
    out[h // 3: h // 3 + 2, w // 4:, :3] = 20
    out[..., 0] = np.maximum(out[..., 0], np.linspace(0, 255, w, dtype=np.uint8)[None, :] // 2)
    out[: h // 8, :, 3] = 0
    out[:, : max(w // 10, 1), 3] = np.linspace(0, 255, max(w // 10, 1), dtype=np.uint8)[None, :]
    out[h // 2: h // 2 + h // 6, :, 3] = 128
    return out


def png(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", **kw)
    return buf.getvalue()


def png16(array: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG (PIL writes none with alpha): ``array`` uint16 ``HxWxC``, its own chunks."""
    h, w = array.shape[:2]
    rows = array.astype(">u2").reshape(h, -1)
    raw = b"".join(b"\0" + rows[y].tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def transparent_pngs(h: int, w: int) -> dict[str, bytes]:
    """Every way a PNG carries transparency that PIL reads, from one screenshot-like image."""
    rgba = screen(h, w, 3)
    image = Image.fromarray(rgba, "RGBA")
    rng = np.random.default_rng(4)
    wide = rgba.astype(np.uint16) * 256 + rng.integers(0, 256, rgba.shape, dtype=np.uint16)  # low bytes: noise
    palette = image.convert("RGB").quantize(64)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees: the device path must still turn it upright
    return {
        "RGBA": png(image), "LA": png(image.convert("LA")),
        "P+tRNS bytes": png(palette, transparency=bytes(range(0, 256, 9))),
        "P+tRNS index": png(palette, transparency=5),
        "RGB+tRNS": png(image.convert("RGB"), transparency=(40, 44, 52)),
        "L+tRNS": png(image.convert("L"), transparency=255),
        "RGBA 16-bit": png16(wide, 6), "LA 16-bit": png16(wide[..., [0, 3]], 4),
        "RGBA EXIF": png(image, exif=exif), "P+tRNS EXIF": png(palette, transparency=7, exif=exif),
    }


CASES = list(transparent_pngs(8, 8))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("h, w", [(224, 280), (61, 83)])  # no resize (the pixels themselves), and a resize
def test_transparent_pngs_give_the_host_blends_rows(case, h, w):
    data = transparent_pngs(h, w)[case]
    want = pil_rgb(data)
    kept = load_pixels(data, "png", alpha=True)  # uploaded unblended: blended on the device
    assert kept.shape == (*want.shape[:2], 2 if case == "LA" else 4)  # PIL reads a 16-bit LA as RGBA
    for preprocess in ("device", "pil"):
        got, grid = image_rows([data], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess=preprocess)
        rows, want_grid = image_rows([want], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess=preprocess)
        assert torch.equal(grid, want_grid) and torch.equal(got, rows), (case, preprocess)


def test_pil_images_and_clips_take_the_device_blend():
    """PIL images with transparency (RGBA, LA, P with a transparent index, a lazily opened file
    listed eight times across threads) and a clip mixing them with an RGB array."""
    rgba = Image.fromarray(screen(84, 112, 5), "RGBA")
    palette = rgba.convert("RGB").quantize(32)
    palette.info["transparency"] = 3
    images = [rgba, rgba.convert("LA"), palette, Image.open(io.BytesIO(png(rgba)))]
    want = [pil_rgb(image) for image in images]
    got, grid = image_rows(images, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    rows, want_grid = image_rows(want, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    assert torch.equal(grid, want_grid) and torch.equal(got, rows)
    lazy = Image.open(io.BytesIO(png(rgba)))
    with ThreadPoolExecutor(8) as pool:
        got, _ = image_rows([lazy] * 8, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device",
                            executor=pool)
    assert all(torch.equal(part, rows[: len(rows) // 4]) for part in got.split(len(rows) // 4))
    frames = [png(rgba), want[0], png(rgba.convert("LA"))]
    clip, _ = image_rows(videos=[frames], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    oracle, _ = image_rows(videos=[[want[0], want[0], want[1]]], processor=QWEN2_VL_PROCESSOR, device="cpu",
                           preprocess="device")
    assert torch.equal(clip, oracle)


def test_encode_images_of_a_transparent_png_is_the_blended_arrays():
    from vitgraph import GraphedVisionEncoder

    enc = GraphedVisionEncoder.from_config("tiny", device="cpu", dtype=torch.float32, seed=1)
    try:
        data = transparent_pngs(96, 128)["RGBA"]
        for preprocess in ("device", "pil"):
            got = enc.encode_images([data], preprocess=preprocess)[0]
            assert torch.equal(got, enc.encode_images([pil_rgb(data)], preprocess=preprocess)[0])
    finally:
        enc.close()


@pytest.mark.cuda
def test_cuda_blend_is_the_hosts_to_the_bit():
    """On a GPU: every pair, and each kind of transparent PNG through the device path (host
    decode, and decode="gpu", which leaves PNGs to the host), against the host-blended arrays."""
    rgba = pairs(1)
    assert np.array_equal(device_blend(rgba, "cuda"), pil_rgb(Image.fromarray(rgba, "RGBA")))
    assert np.array_equal(device_blend(rgba[..., [2, 3]].copy(), "cuda"), device_blend(rgba[..., [2, 3]].copy()))
    pngs = transparent_pngs(768, 1024)
    want = [pil_rgb(data) for data in pngs.values()]
    rows, grid = image_rows(want, processor=QWEN2_VL_PROCESSOR, device="cuda", preprocess="device")
    for decode in ("host", "gpu"):
        got, got_grid = image_rows(list(pngs.values()), processor=QWEN2_VL_PROCESSOR, device="cuda",
                                   preprocess="device", decode=decode)
        assert got.is_cuda and torch.equal(got_grid, grid) and torch.equal(got, rows), decode
