"""Plain 8-bit RGB / RGBA PNGs decoded by libspng (vitgraph.images.png, the ``png`` extra) against
PIL, the oracle: the same pixels (interlaced, with ancillary chunks, blended or not), every other
PNG left to PIL (palette, grey, 16-bit, a transparent colour, EXIF that may turn it, APNG), damaged
files decoded or refused as PIL decodes or refuses them, and a lying header refused before libspng
sees a byte. Without imagecodecs, PIL decodes everything, to the same pixels."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from vitgraph.images import png
from vitgraph.images.decode import load_pixels, to_rgb_pil
from vitgraph.images.pipeline import image_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR

pytestmark = pytest.mark.skipif(png.spng_decode() is None, reason="needs imagecodecs with libspng (the png extra)")


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def with_chunks(blob: bytes, *chunks: bytes) -> bytes:
    """``blob`` with ``chunks`` right after its IHDR."""
    return blob[:33] + b"".join(chunks) + blob[33:]


def encoded(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def interlaced(array: np.ndarray) -> bytes:
    """An Adam7-interlaced 8-bit PNG of ``array`` (``HxWx3`` or 4; PIL writes none), Paeth-filtered."""
    h, w, c = array.shape
    raw = b""
    for y0, x0, dy, dx in ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2),
                           (1, 0, 2, 1)):
        sub = array[y0::dy, x0::dx].astype(np.int16)
        if sub.size == 0:
            continue
        for row in range(sub.shape[0]):
            line, up = sub[row].reshape(-1), sub[row - 1].reshape(-1) if row else np.zeros(sub.shape[1] * c, np.int16)
            out = []
            for i in range(line.size):  # Paeth: the byte minus the nearest of left, up, upper left
                a, b = (int(line[i - c]) if i >= c else 0), int(up[i])
                cc = int(up[i - c]) if i >= c else 0
                p = a + b - cc
                pred = min((abs(p - a), 0, a), (abs(p - b), 1, b), (abs(p - cc), 2, cc))[2]
                out.append((int(line[i]) - pred) % 256)
            raw += b"\x04" + bytes(out)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 6 if c == 4 else 2, 0, 0, 1)
    return png.SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def pil_pixels(blob: bytes, alpha: bool) -> np.ndarray:
    """PIL's decode as vitgraph took it before libspng: upright, RGBA kept (alpha) or blended onto white."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(blob)))
    if alpha and image.mode == "RGBA":
        return np.asarray(image)
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255,) * 4), rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


@pytest.fixture
def calls(monkeypatch):
    """The arrays libspng decoded, in order."""
    seen, decode = [], png.spng_decode()
    monkeypatch.setattr(png, "spng_decode", lambda: lambda blob: seen.append(blob) or decode(blob))
    return seen


def screenshot(rng, h: int, w: int, channels: int) -> np.ndarray:
    pixels = np.full((h, w, channels), 245, np.uint8)
    pixels[rng.random((h, w)) < 0.05, :3] = 20
    pixels[h // 4:h // 2, w // 5:w // 2] = rng.integers(0, 256, channels)
    return pixels


def plain_cases() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgba, rgb = screenshot(rng, 61, 83, 4), rng.integers(0, 256, (47, 29, 3), dtype=np.uint8)
    rgba[..., 3] = rng.integers(0, 256, rgba.shape[:2])
    text = chunk(b"tEXt", b"Software\x00vitgraph")
    return {"rgba": encoded(rgba), "rgb": encoded(rgb), "rgba interlaced": interlaced(rgba),
            "rgb interlaced": interlaced(rgb), "1x1 rgba": encoded(rgba[:1, :1]),
            "ancillary chunks": with_chunks(encoded(rgba), chunk(b"gAMA", struct.pack(">I", 20000)),
                                            chunk(b"sRGB", b"\x00"), chunk(b"sBIT", b"\x05" * 4), text)}


@pytest.mark.parametrize("case", list(plain_cases()))
@pytest.mark.parametrize("alpha", [True, False], ids=["alpha kept", "blended"])
def test_plain_pngs_are_decoded_by_libspng_to_pils_pixels(case, alpha, calls):
    blob = plain_cases()[case]
    got = load_pixels(blob, "image", alpha=alpha)
    assert len(calls) == 1, "libspng decoded it"
    expected = pil_pixels(blob, alpha)
    assert got.dtype == np.uint8 and got.shape == expected.shape and np.array_equal(got, expected)
    assert np.array_equal(np.asarray(to_rgb_pil(blob, "image")), pil_pixels(blob, alpha=False))


def other_cases() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG", exif=exif.tobytes())
    turned, frames = buffer.getvalue(), io.BytesIO()
    Image.fromarray(rgb).save(frames, format="PNG", save_all=True,
                              append_images=[Image.fromarray(255 - rgb)], duration=100)
    raw_exif = "\nexif\n" + f"{len(exif.tobytes()) + 6:8d}\n" + (b"Exif\x00\x00" + exif.tobytes()).hex()
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    after_data = encoded(rgb)[:-12]  # before IEND
    sixteen = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in rng.integers(0, 65536, (9, 7, 3)))
    return {
        "palette": encoded(np.asarray(Image.fromarray(rgb).convert("P"))),
        "grey": encoded(rgb[..., 0]),
        "grey with alpha": encoded(np.asarray(Image.fromarray(rgb).convert("LA"))),
        "16-bit": png.SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", 7, 9, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(sixteen)) + chunk(b"IEND", b""),
        "a transparent colour": with_chunks(encoded(rgb), chunk(b"tRNS", struct.pack(">3H", *rgb[0, 0]))),
        "exif orientation": turned,
        "exif in a text chunk": with_chunks(encoded(rgb), chunk(b"tEXt", b"Raw profile type exif\x00" +
                                                                raw_exif.encode())),
        "animated": frames.getvalue(),
        "xmp orientation": with_chunks(encoded(rgb), chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp)),
        "exif in a text chunk named exif": with_chunks(encoded(rgb), chunk(b"tEXt", b"exif\x00Exif\x00\x00" +
                                                                          exif.tobytes())),
        "text after the data": after_data + chunk(b"tEXt", b"Software\x00vitgraph") + chunk(b"IEND", b""),
        "a broken gamma after the data": after_data + chunk(b"gAMA", b"\x00\x00") + chunk(b"IEND", b""),
        "an empty icc profile after the data": after_data + chunk(b"iCCP", b"") + chunk(b"IEND", b""),
    }


@pytest.mark.parametrize("case", list(other_cases()))
def test_other_pngs_are_left_to_pil(case, calls):
    """What PIL reads beyond the image data (a palette, transparency, EXIF or XMP that turn the
    image, chunks after the data it checks): PIL decodes it, or refuses it by name, as before."""
    blob = other_cases()[case]
    assert png.plain_channels(blob) is None
    if case.startswith(("a broken", "an empty")):  # PIL checks chunks after the data: refused by name
        with pytest.raises(ValueError, match="image"):
            load_pixels(blob, "image", alpha=False)
        assert calls == []
        return
    got = load_pixels(blob, "image", alpha=False)
    assert calls == [] and np.array_equal(got, pil_pixels(blob, alpha=False))
    if "orientation" in case or case.startswith("exif"):
        assert got.shape[:2] == (30, 40)  # turned


def damaged(blob: bytes, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    flipped = []
    for _ in range(40):
        copy = bytearray(blob)
        copy[int(rng.integers(8, len(blob)))] ^= 1 << int(rng.integers(0, 8))
        flipped.append(bytes(copy))
    return flipped + [blob[:int(n)] for n in rng.integers(40, len(blob), 20)] + [blob + b"trailing bytes"]


def test_damaged_pngs_decode_or_are_refused_as_pil_does():
    """Flipped bits, files cut short, bytes after IEND: where PIL decodes, the same pixels; where it
    refuses, a ValueError naming the image; never anything else."""
    outcomes = set()
    for blob in damaged(plain_cases()["rgba"], 2):
        try:
            expected = pil_pixels(blob, alpha=True)
        except Exception:
            expected = None
        if expected is None:
            with pytest.raises(ValueError, match="damaged.png"):
                load_pixels(blob, "damaged.png", alpha=True)
            outcomes.add("refused")
        else:
            assert np.array_equal(load_pixels(blob, "damaged.png", alpha=True), expected)
            outcomes.add("decoded")
    assert outcomes == {"refused", "decoded"}


def test_a_lying_header_is_refused_before_libspng_reads_it(calls):
    """A few bytes that declare 25 MP, or more than the caller's ceiling: refused from the header."""
    rgba, tiny = plain_cases()["rgba"], plain_cases()["1x1 rgba"]
    huge = tiny[:16] + struct.pack(">II", 5000, 5000) + tiny[24:29]
    huge = huge + struct.pack(">I", zlib.crc32(huge[12:29])) + tiny[33:]
    assert png.plain_channels(huge) == 4
    with pytest.raises(ValueError, match="lie.png: declares 5000x5000 = 25000000 pixels in"):
        load_pixels(huge, "lie.png", alpha=True)
    with pytest.raises(ValueError, match="small.png: declares"):
        load_pixels(rgba, "small.png", max_pixels=100, alpha=True)
    assert calls == []


def test_without_imagecodecs_pil_decodes_the_same_rows(monkeypatch, calls):
    blobs = list(plain_cases().values())
    with_spng = image_rows(blobs, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    assert len(calls) == len(blobs)
    monkeypatch.setattr(png, "spng_decode", lambda: None)
    without = image_rows(blobs, processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    assert len(calls) == len(blobs)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(with_spng, without))


def test_the_png_bench_checks_and_times_both_decoders(tmp_path, monkeypatch):
    """benchmarks/png_decode.py: both decoders' pixels equal, a row per format and decoder."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("png_bench", Path(__file__).parents[1] / "benchmarks" / "png_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "png.json"
    monkeypatch.setattr(sys, "argv", ["png_decode.py", "--repeats", "2", "--threads", "2", "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["format"], r["decoder"]) for r in rows} == {(f, d) for f in ("png screenshot", "png screenshot with alpha")
                                                             for d in ("pil", "libspng")}
    assert all(r["ms"] > 0 and r["images_per_s_n"] > 0 for r in rows)
