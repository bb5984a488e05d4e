"""``vitgraph bench-images --formats``: each format a serving stack receives, against the encode.

A seeded sample per format: JPEGs of three qualities and the three chroma subsamplings, a
progressive one, photos from 640x480 to 1920x1080; PNG screenshots with and without alpha; a
clip given as one ``[T, H, W, 3]`` uint8 array. One item per call through ``encode_images``
(preprocessing on the device where there is one), decoded on the host (``decode="host"``, PIL)
and, for JPEGs, with ``decode="gpu"`` (nvJPEG's planes, libjpeg-turbo's upsampling; the default
``"auto"`` on CUDA) where libnvjpeg loads. Per format and decoder: the p50 of the
whole call, the p50 of the encode alone (the same rows through ``encode``), images/s of one
caller, and ``max_level_diff``: the largest distance in uint8 levels between the decoder's
pixels and PIL's (0 on the host, which is PIL; None where the GPU leaves the JPEG to the host).
"""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import torch
from PIL import Image

from ..images.decode import decode_jpeg_on, gpu_jpeg_decoder
from . import common

# (name, kind, (width, height), PIL save arguments); kind "clip": (frames, width, height) of a uint8 array.
FORMATS = [
    ("jpeg q90 4:2:0", "photo", (1280, 720), dict(format="JPEG", quality=90, subsampling=2)),
    ("jpeg q75 4:2:0", "photo", (1280, 720), dict(format="JPEG", quality=75, subsampling=2)),
    ("jpeg q95 4:4:4", "photo", (1280, 720), dict(format="JPEG", quality=95, subsampling=0)),
    ("jpeg q90 4:2:2", "photo", (1280, 720), dict(format="JPEG", quality=90, subsampling=1)),
    ("jpeg q90 progressive", "photo", (1280, 720), dict(format="JPEG", quality=90, progressive=True)),
    ("jpeg q90 640x480", "photo", (640, 480), dict(format="JPEG", quality=90)),
    ("jpeg q90 1920x1080", "photo", (1920, 1080), dict(format="JPEG", quality=90)),
    ("png screenshot", "screen", (1024, 768), dict(format="PNG")),
    ("png screenshot with alpha", "screen alpha", (1024, 768), dict(format="PNG")),
    ("clip uint8 array", "clip", (8, 448, 448), {}),
]


def photo_pixels(rng, w: int, h: int) -> np.ndarray:
    """A photo-like ``HxWx3`` uint8 image: smooth fields and grain."""
    coarse = rng.integers(0, 256, (max(h // 48, 2), max(w // 48, 2), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC)).astype(np.int16)
    return np.clip(base + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)


def screen_pixels(rng, w: int, h: int, alpha: bool = False) -> np.ndarray:
    """A screenshot-like ``HxWx3`` (``alpha``: ``HxWx4``, some panels translucent) uint8 image: flat
    panels and sharp text-like strokes."""
    pixels = np.full((h, w, 4 if alpha else 3), 245, np.uint8)
    if alpha:
        pixels[..., 3] = 255
    for _ in range(12):  # panels
        y, x = rng.integers(0, h - 20), rng.integers(0, w - 20)
        colour = list(rng.integers(0, 256, 3)) + ([int(rng.integers(0, 256))] if alpha else [])
        pixels[y:y + rng.integers(20, h // 3), x:x + rng.integers(20, w // 2)] = colour
    pixels[rng.random((h, w)) < 0.04, :3] = 20  # text-like strokes
    return pixels


def make_samples(seed: int, formats=FORMATS) -> list[dict]:
    """The seeded samples: ``{"format", "size", "item"}`` (encoded bytes, or a clip's array)."""
    samples = []
    for i, (name, kind, size, save) in enumerate(formats):
        rng = np.random.default_rng(seed * 1000 + i)
        if kind == "clip":
            frames, w, h = size
            item = np.stack([photo_pixels(rng, w, h) for _ in range(frames)])
            samples.append({"format": name, "size": f"{frames}x{w}x{h}", "item": item})
            continue
        w, h = size
        pixels = photo_pixels(rng, w, h) if kind == "photo" else screen_pixels(rng, w, h, kind.endswith("alpha"))
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, **save)
        samples.append({"format": name, "size": f"{w}x{h}", "item": buffer.getvalue()})
    return samples


def level_diff(blob: bytes, device: torch.device) -> int | None:
    """The largest distance in uint8 levels between the GPU decode's RGB and PIL's; None where the
    GPU leaves the JPEG to the host."""
    decoded = decode_jpeg_on(blob, "image", device)
    if decoded is None:
        return None
    gpu = decoded.cpu().numpy()  # [3, H, W]
    pil = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")).transpose(2, 0, 1)
    return int(np.abs(gpu.astype(np.int16) - pil.astype(np.int16)).max())


def _p50_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        common.sync(device)
        start = time.perf_counter()
        fn()
        common.sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def run(enc, samples: list[dict], repeats: int, limits: dict) -> list[dict]:
    """One row per format and decoder (see the module's docstring)."""
    device, rows_out = enc.device, []
    gpu = device.type == "cuda" and gpu_jpeg_decoder() is not None
    model = enc.tower.name
    for sample in samples:
        clip = sample["item"] if isinstance(sample["item"], np.ndarray) else None
        given = {"videos": [clip]} if clip is not None else {"images": [sample["item"]]}
        rows, grid = enc.encodable_rows(**given, **limits)
        enc.encode(rows, grid)  # warm: its bucket's graph, the plan
        encode_ms = _p50_ms(lambda: enc.encode(rows, grid), repeats, device)
        jpeg = clip is None and sample["item"][:2] == b"\xff\xd8"
        for decode in ("host", "gpu") if gpu and jpeg else ("host",):
            call = lambda: enc.encode_images(**given, decode=decode, **limits)  # noqa: E731
            call()
            p50 = _p50_ms(call, repeats, device)
            rows_out.append({"model": model, "format": sample["format"], "size": sample["size"],
                             "encode_ms": encode_ms, "p50_ms": p50, "p50_over_encode": p50 / encode_ms,
                             "images_per_s": 1e3 / p50, "decode": decode,
                             "max_level_diff": level_diff(sample["item"], device) if decode == "gpu" else 0})
            _print(rows_out[-1])
    return rows_out


def _print(row: dict) -> None:
    print(f"{row['format']:<28} {row['size']:>11} {row['decode']:>5}  encode {row['encode_ms']:7.2f} ms  "
          f"p50 {row['p50_ms']:7.2f} ms ({row['p50_over_encode']:.2f}x)  {row['images_per_s']:7.1f} img/s  "
          f"max level diff {row['max_level_diff']}", flush=True)


def main(args, enc, low: int, high: int) -> dict:
    """``bench-images --formats``: the table, and the JSON's content."""
    print(f"bench-images --formats: {len(FORMATS)} formats, {4 * args.repeats} calls each, one item per call, "
          f"{enc.stats()['mode']} encoder on {enc.device}", file=sys.stderr)
    rows = run(enc, make_samples(args.seed), 4 * args.repeats, {"min_pixels": low, "max_pixels": high})
    return {"environment": common.environment(enc.device), "preset": args.preset, "model": args.model,
            "max_pixels": high, "rows": rows}
