"""From image bytes to embeddings: what a caller who starts from JPEGs waits for.

    vitgraph bench-images                           # qwen2-vl-2b random weights on GPU, tiny on CPU
    vitgraph bench-images --preset qwen2.5-vl-7b --concurrency 1 8 --json out.json
    vitgraph bench-images --preset qwen2-vl-2b --serve      # also vitgraph serve (Ray Serve) at saturation

A seeded set of JPEGs at the serving mix's sizes (thumbnails to 1080p photos, screenshots) goes
through each system, one image per call. Per image: end-to-end p50/p99 (ms), and the p50 of each
stage timed apart with the device synchronised between stages (decode, preprocess, copy to the
device, encode). Then images/s at saturation: C caller threads, each encoding images back to back.

Systems (those that cannot run here are skipped with a line):

* ``hf_pil``: transformers' PIL processor on the host + transformers' tower;
* ``hf_torchvision``: transformers' torchvision processor on the GPU + its tower (CUDA, torchvision);
* ``vitgraph_host``: PIL decode, PIL preprocessing into float32 rows, vitgraph's graphs;
* ``vitgraph_device``: host decode, preprocessing on the device from uint8, graphs;
* ``vitgraph_gpu_decode``: the same with JPEGs decoded on the GPU (CUDA, libnvjpeg).

With ``--serve``, also ``vitgraph serve`` (the Ray Serve app, one replica) at saturation: the
JPEGs over HTTP and through its handle, and the same images as uint8 rows preprocessed by the
client (:mod:`vitgraph.bench.images_serve`).
"""

from __future__ import annotations

import io
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from PIL import Image

from ..images.decode import decode_pil, gpu_jpeg_decoder
from ..images.device import rows_of, upload
from ..images.pipeline import load_frame
from ..images.preprocess import pixel_limits, preprocess_images
from .. import cli_args
from . import common, image_formats
from .image_formats import photo_pixels, screen_pixels
from .args import CPU_DEFAULTS, GPU_DEFAULTS
from .args import IMAGES_SYSTEMS as SYSTEMS, images_parser as build_parser

STAGES = ("decode", "preprocess", "copy", "encode")
# (name, width, height, kind): the serving mix's still images.
IMAGES = [("thumbnail", 224, 224, "photo"), ("photo 640x480", 640, 480, "photo"),
          ("photo 1024x768", 1024, 768, "photo"), ("video frame 1280x720", 1280, 720, "photo"),
          ("screenshot 1440x900", 1440, 900, "screen"), ("phone screenshot 828x1792", 828, 1792, "screen"),
          ("photo 1920x1080", 1920, 1080, "photo")]


def make_jpegs(seed: int) -> list[tuple[str, bytes]]:
    """The seeded image set, JPEG quality 90: photos and screenshots."""
    out = []
    for i, (name, w, h, kind) in enumerate(IMAGES):
        rng = np.random.default_rng(seed * 1000 + i)
        pixels = photo_pixels(rng, w, h) if kind == "photo" else screen_pixels(rng, w, h)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        out.append((name, buffer.getvalue()))
    return out


@dataclass
class Staged:
    """One system: its stages as functions of the previous stage's result, and its one-call form."""

    stages: list[tuple[str, Callable]]
    end_to_end: Callable[[bytes], object]
    times: dict = field(default_factory=lambda: {s: [] for s in STAGES + ("total",)})


def _hf_processors(enc, low: int, high: int, device: torch.device):
    """transformers' (PIL, torchvision) processors set up as the encoder's processor; either None
    where it cannot be made here."""
    proc = enc.processor
    kwargs = dict(size={"shortest_edge": low, "longest_edge": high}, patch_size=proc.patch_size,
                  temporal_patch_size=proc.temporal_patch_size, merge_size=proc.merge_size,
                  image_mean=list(proc.image_mean), image_std=list(proc.image_std))
    pil = tv = None
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        pil = Qwen2VLImageProcessorPil(**kwargs)
    except ImportError:
        pass
    if device.type == "cuda":
        try:
            import torchvision  # noqa: F401  (the processor needs it)
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
            tv = Qwen2VLImageProcessor(**kwargs)
        except Exception:  # no torchvision, or one that does not load with this torch
            pass
    return pil, tv


def build(systems: list[str], enc, low: int, high: int) -> dict[str, Staged]:
    device = enc.device
    limits = {"min_pixels": low, "max_pixels": high}
    built: dict[str, Staged] = {}
    need_hf = any(s.startswith("hf_") for s in systems)
    hf = common.hf_tower_like(enc) if need_hf else None
    hf_run = common.hf_call(hf, device) if hf is not None else None
    pil_proc, tv_proc = _hf_processors(enc, low, high, device) if need_hf else (None, None)

    def skip(name: str, why: str) -> None:
        print(f"bench-images: {name} skipped: {why}", file=sys.stderr)

    def hf_rows(processor, **call):
        def run(image):
            out = processor(images=[image], return_tensors="pt", **call)
            return out["pixel_values"], out["image_grid_thw"].tolist()
        return run

    def to_device(item):
        rows, grid = item
        return rows.to(device, non_blocking=True), grid

    for name in systems:
        if name == "hf_pil":
            if hf_run is None or pil_proc is None:
                skip(name, "transformers is not installed")
                continue
            stages = [("decode", lambda b: decode_pil(b, "image")), ("preprocess", hf_rows(pil_proc)),
                      ("copy", to_device), ("encode", lambda item: hf_run(item[0].to(enc.dtype), item[1]))]
        elif name == "hf_torchvision":
            if hf_run is None or tv_proc is None:
                skip(name, "needs CUDA, transformers and a torchvision that loads with this torch")
                continue
            stages = [("decode", lambda b: decode_pil(b, "image")),
                      ("preprocess", hf_rows(tv_proc, device=str(device))),
                      ("encode", lambda item: hf_run(item[0].to(enc.dtype), item[1]))]
        elif name == "vitgraph_host":
            stages = [("decode", lambda b: decode_pil(b, "image")),
                      ("preprocess", lambda image: preprocess_images([image], processor=enc.processor, **limits)),
                      ("copy", to_device), ("encode", lambda item: enc.encode(*item))]
        elif name in ("vitgraph_device", "vitgraph_gpu_decode"):
            gpu = name == "vitgraph_gpu_decode"
            if gpu and (device.type != "cuda" or gpu_jpeg_decoder() is None):
                skip(name, "needs CUDA and libnvjpeg")
                continue
            stages = [("decode", lambda b, on=device if gpu else None: load_frame(b, "image", on)),  # bound now
                      ("copy", lambda p: upload(p, device)[0]),
                      ("preprocess", lambda p: rows_of([("image", [p], (low, high, False))], enc.processor, device)),
                      ("encode", lambda item: enc.encode(*item))]
        else:
            raise ValueError(f"unknown system {name!r}; known: {SYSTEMS}")
        built[name] = Staged(stages, _end_to_end(name, enc, stages, limits))
    return built


def _end_to_end(name: str, enc, stages, limits) -> Callable[[bytes], object]:
    """The system as a caller runs it: vitgraph's own entry point, or the stages back to back."""
    if name == "vitgraph_device":
        return lambda blob: enc.encode_images([blob], preprocess="device", **limits)
    if name == "vitgraph_gpu_decode":
        return lambda blob: enc.encode_images([blob], preprocess="device", decode="gpu", **limits)

    def run(blob):
        value = blob
        for _, fn in stages:
            value = fn(value)
        return value
    return run


def time_stages(system: Staged, blob: bytes, device: torch.device) -> None:
    """One image through the stages, each timed apart (the device synchronised between them),
    and once end to end."""
    value = blob
    for stage, fn in system.stages:
        common.sync(device)
        start = time.perf_counter()
        value = fn(value)
        common.sync(device)
        system.times[stage].append((time.perf_counter() - start) * 1e3)
    common.sync(device)
    start = time.perf_counter()
    system.end_to_end(blob)
    common.sync(device)
    system.times["total"].append((time.perf_counter() - start) * 1e3)


def saturation(system: Staged, blobs: list[bytes], callers: int, device: torch.device) -> float:
    """Images/s with ``callers`` threads encoding ``blobs`` back to back (each image once)."""
    queue = list(blobs)
    lock = threading.Lock()

    def caller():
        while True:
            with lock:
                if not queue:
                    return
                blob = queue.pop()
            system.end_to_end(blob)
            common.sync(device)

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        for future in [pool.submit(caller) for _ in range(callers)]:
            future.result()
    common.sync(device)
    return len(blobs) / (time.perf_counter() - start)


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


SATURATION_NOTE = ("img/s C=N: N caller threads, each sending one image per call back to back, over --saturation-images "
                   "images cycled through the same set; images / the run's wall time. At C=1 that is 1000 / the mean "
                   "ms of the mix (not 1000 / p50: the large images weigh in the mean); at C>1 calls overlap.")


def _fill_defaults(args, on_gpu: bool) -> None:
    """The GPU's or the CPU's defaults for what was not given; on a CPU, say what the run leaves out."""
    for key, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not on_gpu:
        print(f"bench-images on a CPU: an eager encoder (no CUDA graphs), no GPU preprocessing or nvJPEG; images "
              f"resized to at most {args.max_pixels} pixels, {args.repeats} pass(es), C={' '.join(map(str, args.concurrency))}, "
              f"{args.saturation_images} images per saturation run (the flags change each)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _fill_defaults(args, cli_args.resolve_model_args(args))
    enc = cli_args.make_encoder(args, progress=True)
    low, high = pixel_limits(enc.processor, None, args.max_pixels)
    if args.formats:
        common.write_json(image_formats.main(args, enc, low, high), args.json)
        return 0
    device = enc.device
    jpegs = make_jpegs(args.seed)
    systems = build(args.systems, enc, low, high)
    print(f"bench-images: {len(jpegs)} JPEGs ({', '.join(n for n, _ in jpegs)}), {args.repeats} passes, "
          f"{enc.stats()['mode']} encoder on {device} ({str(enc.dtype).replace('torch.', '')})", file=sys.stderr)
    result = {"environment": common.environment(device), "preset": args.preset, "model": args.model,
              "max_pixels": high, "images": [n for n, _ in jpegs], "systems": {}}
    print_row = _print_heading(args.concurrency)
    for name, system in systems.items():
        for _, blob in jpegs:  # warm-up: kernels, caches, the processors' own set-up
            time_stages(system, blob, device)
        system.times = {s: [] for s in STAGES + ("total",)}
        for _ in range(args.repeats):
            for _, blob in random.Random(args.seed).sample(jpegs, len(jpegs)):
                time_stages(system, blob, device)
        blobs = [blob for _, blob in jpegs] * -(-args.saturation_images // len(jpegs))
        rates = {c: saturation(system, blobs[:args.saturation_images], c, device) for c in args.concurrency}
        times = system.times
        result["systems"][name] = {
            "p50_ms": _p(times["total"], 50), "p99_ms": _p(times["total"], 99),
            "stages_p50_ms": {s: _p(times[s], 50) for s in STAGES if times[s]},
            "encode_share": (_p(times["encode"], 50) / _p(times["total"], 50)) if times["encode"] else None,
            "images_per_s": {str(c): r for c, r in rates.items()}}
        print_row(name, result["systems"][name], args.concurrency)  # each row as it is measured
    print(f"(images: {', '.join(result['images'])}; resized to at most {result['max_pixels']} pixels)")
    print(SATURATION_NOTE)
    if args.serve:
        from . import images_serve

        result["serve"] = images_serve.run(args, enc, [blob for _, blob in jpegs], low, high)
        images_serve.print_table(result["serve"])
    common.write_json(result, args.json)
    return 0


def _print_heading(concurrency: list[int]):
    """Print the table's title and header; returns ``print_row(name, result, concurrency)``."""
    print("\nPer image, ms (p50 of each stage timed apart; end to end p50 and p99), and images/s with C callers:")
    headers = ["system", "decode", "preprocess", "copy", "encode", "p50", "p99", "p50/encode"]
    print_cells = common.row_printer(headers + [f"img/s C={c}" for c in concurrency],
                                     first_width=max(len(s) for s in SYSTEMS))

    def print_row(name: str, r: dict, concurrency: list[int]) -> None:
        st = r["stages_p50_ms"]
        ratio = r["p50_ms"] / st["encode"] if st.get("encode") else None
        print_cells([name] + [st.get(s) for s in STAGES] + [r["p50_ms"], r["p99_ms"], ratio] +
                    [r["images_per_s"][str(c)] for c in concurrency])
    return print_row


if __name__ == "__main__":
    sys.exit(main())
