"""From images and clips in any form to the uint8 rows ``encode`` takes: decode, resize, patchify.

Two ways, chosen by ``preprocess``:

* ``"device"``: decode JPEGs on the GPU where nvJPEG decodes them as PIL does (``decode="auto"``,
  the default, or ``"gpu"``), everything else on the host (a thread pool), then resize and
  patchify with torch on the encoder's device (:mod:`vitgraph.images.device`), as transformers'
  torchvision processors do (``Qwen2VLImageProcessor``);
* ``"pil"``: decode, resize (PIL bicubic) and patchify on the host, one image per pool thread,
  as ``Qwen2VLImageProcessorPil`` does.

``"auto"`` is ``"device"`` on CUDA and ``"pil"`` elsewhere. Either way the rows stay uint8 (an
image's bytes twice, for its two temporal copies) until ``encode`` normalises them on its device.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Sequence

import numpy as np
import torch

from . import decode as decoding
from .device import frame_size, rows_of
from .pixel_forms import clip_frames
from .preprocess import (ProcessorConfig, check_list, check_pixel_arguments, clip_max_pixels, image_rows_pil,
                         pixel_limits, video_rows_pil)

PREPROCESS = ("auto", "device", "pil")
DECODE = ("auto", "host", "gpu")

_IMAGE_FORMS = "images (PIL images, HxWx3 or HxWx4 uint8 arrays, 3xHxW or 4xHxW uint8 tensors, encoded bytes or paths)"
_CLIP_FORMS = "clips (each a list of frames or one [T, H, W, C] or [T, C, H, W] uint8 array or tensor)"


def check_choices(preprocess: str, decode: str) -> None:
    if preprocess not in PREPROCESS:
        raise ValueError(f"preprocess must be one of {PREPROCESS}, got {preprocess!r}")
    if decode not in DECODE:
        raise ValueError(f"decode must be one of {DECODE}, got {decode!r}")


def _items(images, videos, image_limits: tuple | None, video_limits: tuple | None, video: ProcessorConfig
           ) -> list[tuple[str, object, tuple[int, int, bool]]]:
    """``(name, image, pixel limits)`` for each image and ``(name, _Clip(frames), limits)`` for
    each clip, images first (a list among the images is not a clip: it is refused by name; a 4-D
    array among the clips is one, split into its frames: :func:`vitgraph.images.pixel_forms.clip_frames`);
    limits are ``(min_pixels, max_pixels, whether they bound a whole clip)``, a clip's
    ``max_pixels`` capped by its frame count where ``video`` asks (:func:`clip_max_pixels`)."""
    items: list[tuple[str, object, tuple[int, int, bool]]] = []
    if images is not None:
        check_list(images, "images", _IMAGE_FORMS)
        items += [(f"images[{i}]", image, image_limits) for i, image in enumerate(images)]
    if videos is not None:
        check_list(videos, "videos", _CLIP_FORMS)
        for i, clip in enumerate(videos):
            frames = clip_frames(clip, f"videos[{i}]")
            if not frames:
                raise ValueError(f"videos[{i}] must have at least one frame")
            low, high, whole = video_limits
            items.append((f"videos[{i}]", _Clip(frames), (low, clip_max_pixels(video, len(frames), low, high), whole)))
    return items


def _given(items) -> bool:
    return isinstance(items, (list, tuple)) and len(items) > 0


class _Clip(list):
    """A clip's frames: only ``videos`` makes one, so an image slot never holds a clip."""


def _map(executor: Executor | None, fn: Callable, items: list) -> list:
    if executor is None or len(items) < 2:
        return [fn(item) for item in items]
    return list(executor.map(fn, items))


def _empty(proc: ProcessorConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(0, proc.row_width, dtype=torch.uint8, device=device),
            torch.empty(0, 3, dtype=torch.long))


def _check_headers(items, max_image_pixels: int) -> None:
    """The cheap checks of every item (type, shape, an encoded image's header) before any is decoded."""
    for name, value, _ in items:
        clip = isinstance(value, _Clip)
        for i, frame in enumerate(value if clip else [value]):
            decoding.check_header(frame, f"{name}[{i}]" if clip else name, max_image_pixels)


def image_rows(images: Sequence | None = None, videos: Sequence[Sequence] | None = None, *,
               processor: ProcessorConfig, device: torch.device, video_processor: ProcessorConfig | None = None,
               min_pixels: int | None = None, max_pixels: int | None = None, preprocess: str = "auto",
               decode: str = "auto", executor: Executor | None = None,
               max_image_pixels: int = decoding.MAX_IMAGE_PIXELS,
               max_items_per_request: int = decoding.MAX_ITEMS_PER_REQUEST) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, C*T*P*P] uint8, grid_thw [k, 3] int64)`` of the images, then the clips: on
    ``device`` for ``preprocess="device"``, on the host for ``"pil"``. Images are sized by
    ``processor``'s pixel limits, clips by ``video_processor``'s (default: the same; a whole
    clip's pixels where it has ``clip_pixels``, as Qwen3-VL's), both by ``min_pixels`` /
    ``max_pixels`` where given. ``executor``: the thread pool that decodes (and,
    for ``"pil"``, preprocesses) several items at once. ``max_image_pixels``: the most pixels an
    encoded image may declare (refused from its header, before decoding; each decoding thread
    holds at most that many RGB pixels, about 3 bytes each). ``max_items_per_request``: the most
    images plus video frames in the call. Both are checked before anything is decoded: the
    count first, then each item's type, shape or encoded header, in order."""
    decoding.check_item_count(images, videos, max_items_per_request)
    decoding.check_image_ceiling(max_image_pixels)
    check_choices(preprocess, decode)
    device = torch.device(device)
    video = video_processor or processor
    if video.refused and _given(videos):  # a checkpoint whose videos vitgraph must not read: its images are fine
        raise ValueError(video.refused)
    check_pixel_arguments(min_pixels, max_pixels)
    # Each kind's limits are its processor's where not given; only a kind present is checked.
    limits = (*pixel_limits(processor, min_pixels, max_pixels), False) if _given(images) else None
    video_limits = (*pixel_limits(video, min_pixels, max_pixels), video.clip_pixels) if _given(videos) else None
    if preprocess == "auto":
        preprocess = "device" if device.type == "cuda" else "pil"
    if decode == "gpu" and (device.type != "cuda" or preprocess != "device"):
        raise ValueError(f"decode='gpu' needs preprocess='device' on a CUDA device, got {preprocess!r} on {device}")
    items = _items(images, videos, limits, video_limits, video)
    _check_headers(items, max_image_pixels)
    if not items:
        return _empty(processor, device if preprocess == "device" else "cpu")
    if preprocess == "pil":
        def host(item):
            name, value, (low, high, _) = item
            if isinstance(value, _Clip):
                return video_rows_pil(value, name, video, low, high, max_image_pixels)
            return image_rows_pil(value, name, processor, low, high, max_image_pixels)

        parts = _map(executor, host, items)
        rows = torch.from_numpy(np.concatenate([r for r, _ in parts]))
        return rows, torch.tensor([g for _, g in parts], dtype=torch.long)

    gpu = device if decode == "gpu" or (decode == "auto" and device.type == "cuda") else None

    def load(item):  # -> the clip's frames as pixels (an image: one frame), and its limits
        name, value, limits = item
        clip = isinstance(value, _Clip)
        frames = value if clip else [value]
        names = [f"{name}[{i}]" for i in range(len(frames))] if clip else [name]
        pixels = [load_frame(f, n, gpu, max_image_pixels) for f, n in zip(frames, names)]
        if any(frame_size(p) != frame_size(pixels[0]) for p in pixels):
            raise ValueError(f"all frames of {name} must have the same size")
        return name, pixels, limits

    return rows_of(_map(executor, load, items), processor, device)


def load_frame(item, name: str, gpu: torch.device | None, max_pixels: int = decoding.MAX_IMAGE_PIXELS):
    """One frame as uint8 pixels; a JPEG decoded on ``gpu`` where that is given and possible; an
    image with transparency unblended (RGBA or LA), for ``upload`` to composite on the device."""
    if gpu is not None and decoding.is_encoded(item):
        data = decoding.read_file(item, name) if not isinstance(item, (bytes, bytearray, memoryview)) else item
        decoded = decoding.decode_jpeg_on(data, name, gpu, max_pixels)
        return decoded if decoded is not None else decoding.load_pixels(data, name, max_pixels, alpha=True)
    return decoding.load_pixels(item, name, max_pixels, alpha=True)  # alpha blended on the device
