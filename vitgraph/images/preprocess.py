"""Images and videos to patch rows, as the Qwen VL processors (PIL backend) make them.

``smart_resize`` -> bicubic resize (PIL) -> patchify (uint8) -> rescale 1/255 and normalise, with the
sizes and statistics of a :class:`ProcessorConfig`: a checkpoint's ``preprocessor_config.json``
where it has one, else its family's defaults (Qwen2-VL and Qwen2.5-VL share one processor;
Qwen3-VL's patches are 16 pixels, so its sides are multiples of 32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from .decode import MAX_IMAGE_PIXELS, to_rgb_pil
from .pixel_forms import clip_frames as frames_of, described, list_advice
from ..ops.normalize import column_statistics, normalize_rows
from .pixel_defaults import MAX_PIXELS, MIN_PIXELS

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2
# The most pixels min_pixels and max_pixels may ask for (16384 x 16384): above it a resize
# alone takes gigabytes.
PIXELS_CEILING = 1 << 28


@dataclass(frozen=True)
class ProcessorConfig:
    """How images become patch rows: the fields of a ``preprocessor_config.json``."""

    patch_size: int = PATCH_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    merge_size: int = MERGE_SIZE
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, float, float] = IMAGE_MEAN
    image_std: tuple[float, float, float] = IMAGE_STD
    # Videos: min_pixels / max_pixels bound a whole clip (frames x height x width), as Qwen3-VL's
    # video processor reads them, not each frame.
    clip_pixels: bool = False
    # Videos: transformers' opt-in cap on each frame's share of a clip's pixels (its videos'
    # cap_pixels_per_frame and max_video_tokens; 128000 is Qwen2-VL's default, 768 Qwen3-VL's).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    # Videos: where set, a call given a video is refused with this message (a checkpoint whose
    # videos transformers would read with another class; its images are served).
    refused: str | None = None

    def __post_init__(self) -> None:
        for name, ceiling in (("patch_size", 64), ("temporal_patch_size", 16), ("merge_size", 8)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= ceiling:
                raise ValueError(f"{name} must be an int in [1, {ceiling}], got {value!r}")
        check_pixel_limits(self.min_pixels, self.max_pixels)
        for name in ("clip_pixels", "cap_pixels_per_frame"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.max_video_tokens, bool) or not isinstance(self.max_video_tokens, int) or not (
                0 < self.max_video_tokens <= PIXELS_CEILING):
            raise ValueError(f"max_video_tokens must be an int in [1, {PIXELS_CEILING}], got {self.max_video_tokens!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3
                    or not all(_finite_number(v) for v in value)
                    or (name == "image_std" and any(v <= 0 for v in value))):
                raise ValueError(f"{name} must be three finite numbers{' > 0' if name == 'image_std' else ''}, "
                                 f"got {value!r}")
        # Pixels in [0, 1] must normalise to values fp16 holds (its max, 65504, is below bf16's).
        ceiling = 65504.0
        widest = max(max(abs(m), abs(1 - m)) / s for m, s in zip(self.image_mean, self.image_std))
        if not widest < ceiling:
            raise ValueError(f"image_std {self.image_std} with image_mean {self.image_mean} normalises pixels in "
                             f"[0, 1] to {widest:.4g} in magnitude; it must stay below {ceiling:g} "
                             f"(the float16 maximum)")

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this."""
        return self.patch_size * self.merge_size

    @property
    def row_width(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base: "ProcessorConfig | None" = None) -> "ProcessorConfig":
        """A processor file's object over ``base`` (a family's defaults); its ``size.shortest_edge`` /
        ``size.longest_edge`` are pixel counts, as transformers reads them (:func:`_pixel_bounds`)."""
        if not isinstance(raw, dict):
            raise ValueError(f"a preprocessor config must be a JSON object, got {type(raw).__name__}")
        base = base or cls()
        values: dict[str, Any] = dict(zip(("min_pixels", "max_pixels"), _pixel_bounds(raw, base)))
        for name in ("patch_size", "temporal_patch_size", "merge_size", "cap_pixels_per_frame", "max_video_tokens"):
            if name in raw and raw[name] is not None:
                values[name] = raw[name]
        for name in ("image_mean", "image_std"):
            if name in raw:
                values[name] = tuple(raw[name]) if isinstance(raw[name], list) else raw[name]
        _check_fixed_settings(raw)
        return replace(base, **values)


def _pixel_bounds(raw: dict[str, Any], base: ProcessorConfig) -> tuple[Any, Any]:
    """``(min_pixels, max_pixels)`` as transformers' Qwen2-VL processors read a file: ``size``
    (``shortest_edge`` / ``longest_edge``, pixel counts), each edge replaced by a top-level
    ``min_pixels`` / ``max_pixels`` that is set, and both edges then required. Qwen3-VL's video
    processor (a ``clip_pixels`` base) takes no top-level keys: ``size`` alone."""
    size = raw.get("size")
    if size is None:
        size = {"shortest_edge": base.min_pixels, "longest_edge": base.max_pixels}
    if not isinstance(size, dict):
        raise ValueError(f"size must be an object with 'shortest_edge' and 'longest_edge', got {size!r}")
    size = dict(size)
    if base.clip_pixels:  # Qwen3-VL's video processor, the one bounding whole clips, reads size alone
        return _edges(size)
    for edge, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if raw.get(name) is not None:  # the older top-level form wins, and replaces size's own copy
            size[edge] = raw[name]
            size.pop(name, None)
    return _edges(size)


def _edges(size: dict[str, Any]) -> tuple[Any, Any]:
    if size.keys() != {"shortest_edge", "longest_edge"}:
        raise ValueError(f"size must hold 'shortest_edge' and 'longest_edge' (pixel counts) and nothing else once "
                         f"min_pixels / max_pixels are applied, got {size!r}")
    return size["shortest_edge"], size["longest_edge"]


# Settings a processor file may hold that vitgraph's preprocessing implements one way only (the
# processors' defaults); a file that asks for another way is refused, not served another's rows.
FIXED_SETTINGS = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                  "do_convert_rgb": True, "resample": 3}  # resample 3: bicubic


def _check_fixed_settings(raw: dict[str, Any]) -> None:
    for name, value in FIXED_SETTINGS.items():
        got = raw.get(name)
        if got is None:
            continue
        same = (_finite_number(got) and math.isclose(got, value, rel_tol=1e-9)
                if name == "rescale_factor" else type(got) is type(value) and got == value)
        if not same:
            raise ValueError(f"{name} = {got!r} is not supported: vitgraph's preprocessing takes {name} = {value!r}")


def _finite_number(value) -> bool:
    """A finite int or float (not a bool); an int too large for a float is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_pixel_limits(min_pixels, max_pixels) -> None:
    """``min_pixels`` and ``max_pixels``: ints with ``1 <= min_pixels <= max_pixels <= PIXELS_CEILING``."""
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not 1 <= value <= PIXELS_CEILING:
            raise ValueError(f"{name} must be in [1, {PIXELS_CEILING}] (2**28), got {value}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")


def check_same_rows(image: ProcessorConfig, video: ProcessorConfig) -> None:
    """Image and video rows go through one ``encode``: they must be laid out alike."""
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        if getattr(image, name) != getattr(video, name):
            raise ValueError(f"the video processor's {name} ({getattr(video, name)!r}) differs from the image "
                             f"processor's ({getattr(image, name)!r}); the tower takes one row layout")


QWEN2_VL_PROCESSOR = ProcessorConfig()
# Qwen3-VL's processor as its released checkpoints configure it: 16-pixel patches (a resize
# factor of 32), mean and std 0.5, 64k to 16M pixels. A checkpoint's own
# preprocessor_config.json takes precedence.
QWEN3_VL_PROCESSOR = ProcessorConfig(patch_size=16, min_pixels=65536, max_pixels=16777216,
                                     image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Sides divisible by ``factor``, area within [min_pixels, max_pixels], aspect kept."""
    check_pixel_limits(min_pixels, max_pixels)
    if isinstance(factor, bool) or not isinstance(factor, int) or factor <= 0:
        raise ValueError(f"factor must be a positive int, got {factor!r}")
    _check_not_empty(height, width)
    return _fit(height, width, factor, min_pixels, max_pixels)


def clip_smart_resize(frames: int, height: int, width: int, factor: int, temporal: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """Each frame's size for a clip whose pixels (``frames`` x height x width) the limits bound:
    transformers' Qwen3-VL video ``smart_resize``, step for step. A clip shorter than the temporal
    patch (which transformers refuses) counts as the frames it is padded to."""
    check_pixel_limits(min_pixels, max_pixels)
    _check_not_empty(height, width)
    if height < factor or width < factor:  # scaled up first, aspect kept
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return _fit(height, width, factor, min_pixels, max_pixels, max(frames, temporal), temporal)


def _check_not_empty(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise ValueError(f"image must not be empty, got height={height}, width={width}")


def _fit(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
         temporal: int = 1) -> tuple[int, int]:
    """The sides, multiples of ``factor``, that bring ``frames`` frames (counted in whole
    temporal patches) within the limits: transformers' arithmetic, for images and clips alike."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be at most 200, got {max(height, width) / min(height, width):.1f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def clip_max_pixels(proc: ProcessorConfig, frames: int, min_pixels: int, max_pixels: int) -> int:
    """A clip's ``max_pixels`` under ``proc``'s ``cap_pixels_per_frame`` (else ``max_pixels``), as
    transformers' video processors compute it from the clip's frames (before temporal padding):
    Qwen2-VL's bounds each frame by an even share of 90% of ``max_video_tokens`` tokens per
    temporal patch; Qwen3-VL's (``clip_pixels``) bounds the clip by ``max_video_tokens`` tokens
    per frame or an even share of ``max_pixels``. Both floor a frame at 1.05 ``min_pixels``."""
    if not proc.cap_pixels_per_frame:
        return max_pixels
    floor, tokens = int(min_pixels * 1.05), proc.max_video_tokens * proc.factor * proc.factor
    if proc.clip_pixels:  # a clip shorter than the temporal patch counts as padded, as clip_smart_resize
        frames = max(frames, proc.temporal_patch_size)
        return max(min(tokens, max_pixels // frames), floor) * frames
    return max(min(max_pixels, int(tokens * 0.9) * proc.temporal_patch_size // frames), floor)


def named_resize(name: str, height: int, width: int, proc: ProcessorConfig, low: int, high: int,
                 clip_frames: int | None = None) -> tuple[int, int]:
    """:func:`smart_resize` with the item's name in its errors; with ``clip_frames`` (a clip
    whose processor has ``clip_pixels``), :func:`clip_smart_resize` for that many frames."""
    try:
        if clip_frames is not None:
            return clip_smart_resize(clip_frames, height, width, proc.factor, proc.temporal_patch_size, low, high)
        return smart_resize(height, width, proc.factor, low, high)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def to_pil(image, name: str = "image", max_image_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Any accepted image form (PIL, ``HxWx3`` / ``HxWx4`` uint8 array, ``3xHxW`` / ``4xHxW`` uint8
    tensor, encoded bytes, a file path) as an RGB PIL image (RGBA composited onto white)."""
    return to_rgb_pil(image, name, max_image_pixels)


def statistics(proc: ProcessorConfig, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's per-column ``(shift, scale)`` for :func:`vitgraph.ops.normalize.normalize_rows`."""
    return column_statistics(proc.image_mean, proc.image_std, proc.row_width, device)


def resized_uint8(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """Resize to ``size`` (h, w), bicubic (PIL): ``[h, w, 3]`` uint8."""
    h, w = size
    if (image.height, image.width) != (h, w):
        image = image.resize((w, h), resample=Image.BICUBIC)
    return np.asarray(image)


def patchify(frames: np.ndarray, proc: ProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[F, H, W, C]`` uint8 (F a multiple of the temporal patch, or 1: an image, repeated) ->
    rows ``[gt*gh*gw, C*T*P*P]`` ordered (t, block_row, block_col, in_row, in_col), each row
    flattened as (C, T, P, P)."""
    f, h, w, c = frames.shape
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    if f == 1:
        frames = np.broadcast_to(frames, (tp, h, w, c))  # an image: T copies, made by the copy below
        f = tp
    gt, gh, gw = f // tp, h // p, w // p
    x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # gt, bh, bw, mh, mw, C, T, ph, pw
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def _rows(rows: np.ndarray, proc: ProcessorConfig, normalize: bool) -> torch.Tensor:
    rows = torch.from_numpy(rows)
    return normalize_rows(rows, *statistics(proc), torch.float32) if normalize else rows


def check_list(items, name: str, what: str) -> None:
    """``items`` must be a list or tuple: a lone image (or array) is refused, not iterated, with
    the list to pass (:func:`vitgraph.images.pixel_forms.list_advice`)."""
    if not isinstance(items, (list, tuple)):
        advice = list_advice(items, name)
        raise TypeError(f"{name} must be a list of {what}, got {described(items)}" + (f": {advice}" if advice else ""))


def check_pixel_arguments(min_pixels, max_pixels) -> None:
    """A caller's ``min_pixels`` / ``max_pixels`` (None: the processor's), alone and together."""
    check_pixel_limits(1 if min_pixels is None else min_pixels, PIXELS_CEILING if max_pixels is None else max_pixels)


def pixel_limits(proc: ProcessorConfig, min_pixels, max_pixels) -> tuple[int, int]:
    """``(min_pixels, max_pixels)``: those given, else the processor's; checked."""
    limits = (proc.min_pixels if min_pixels is None else min_pixels, proc.max_pixels if max_pixels is None else max_pixels)
    check_pixel_limits(*limits)
    return limits


def image_rows_pil(image, name: str, proc: ProcessorConfig, low: int, high: int,
                   max_image_pixels: int = MAX_IMAGE_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image (any accepted form) -> its uint8 rows and grid, by PIL on the host."""
    pil = to_pil(image, name, max_image_pixels)
    size = named_resize(name, pil.height, pil.width, proc, low, high)
    return patchify(resized_uint8(pil, size)[None], proc)


def video_rows_pil(frames: Sequence, name: str, proc: ProcessorConfig, low: int, high: int,
                   max_image_pixels: int = MAX_IMAGE_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One clip (a list of frames in any accepted form, or a 4-D array) -> its uint8 rows and grid,
    by PIL on the host."""
    frames = frames_of(frames, name)
    pils = [to_pil(f, f"{name}[{i}]", max_image_pixels) for i, f in enumerate(frames)]
    if not pils:
        raise ValueError(f"{name} must have at least one frame")
    if any((p.height, p.width) != (pils[0].height, pils[0].width) for p in pils):
        raise ValueError(f"all frames of {name} must have the same size")
    clip_frames = len(pils) if proc.clip_pixels else None
    size = named_resize(name, pils[0].height, pils[0].width, proc, low, high, clip_frames)
    arrays = [resized_uint8(p, size) for p in pils]
    arrays += [arrays[-1]] * (-len(arrays) % proc.temporal_patch_size)
    return patchify(np.stack(arrays), proc)


def preprocess_images(images: Sequence, *, min_pixels: int | None = None, max_pixels: int | None = None,
                      processor: ProcessorConfig = QWEN2_VL_PROCESSOR, normalize: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (a list) -> ``(pixels [N, C*T*P*P], grid_thw [k, 3] int64)``, one grid row per
    image: float32 rows, or with ``normalize=False`` the uint8 rows ``encode`` normalises on its
    device (8x fewer bytes to copy). ``min_pixels`` / ``max_pixels``: the processor's unless given."""
    check_list(images, "images", "images (PIL images, HxWx3 or HxWx4 uint8 arrays, 3xHxW or 4xHxW uint8 tensors, "
               "bytes or paths)")
    low, high = pixel_limits(processor, min_pixels, max_pixels)
    parts = [image_rows_pil(image, f"images[{i}]", processor, low, high) for i, image in enumerate(images)]
    if not parts:
        empty = torch.empty(0, processor.row_width, dtype=torch.float32 if normalize else torch.uint8)
        return empty, torch.empty(0, 3, dtype=torch.long)
    rows = np.concatenate([r for r, _ in parts])
    return _rows(rows, processor, normalize), torch.tensor([g for _, g in parts], dtype=torch.long)


def preprocess_video(frames: Sequence, *, min_pixels: int | None = None, max_pixels: int | None = None,
                     name: str = "video", processor: ProcessorConfig = QWEN2_VL_PROCESSOR, normalize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A clip (a list of frames, or one ``[T, H, W, C]`` / ``[T, C, H, W]`` uint8 array or tensor)
    -> ``(pixels, grid_thw [1, 3])``. Every frame is resized to the
    first frame's ``smart_resize`` size (the whole clip's where the processor has ``clip_pixels``,
    as ``vitgraph.models.QWEN3_VL_VIDEO_PROCESSOR``); the count is padded to a multiple of the temporal patch
    by repeating the last frame; ``t = frames / temporal_patch_size``. ``name`` names the clip in
    errors; ``normalize`` as in :func:`preprocess_images`."""
    if processor.refused:
        raise ValueError(processor.refused)
    low, high = pixel_limits(processor, min_pixels, max_pixels)
    frames = frames_of(frames, name)
    rows, grid = video_rows_pil(frames, name, processor, low, clip_max_pixels(processor, max(len(frames), 1), low, high))
    return _rows(rows, processor, normalize), torch.tensor([grid], dtype=torch.long)
