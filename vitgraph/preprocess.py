"""Images and videos to patch rows, as Qwen2-VL's own (PIL-backend) processor makes them.

``smart_resize`` -> bicubic resize (PIL) -> rescale 1/255 -> normalise (CLIP mean/std) -> patchify.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from PIL import Image

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 12845056  # the Hub preprocessor_config.json value for Qwen2-VL
# The most pixels min_pixels and max_pixels may ask for (16384 x 16384): above it a resize
# alone takes gigabytes.
PIXELS_CEILING = 1 << 28
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2


def check_pixel_limits(min_pixels, max_pixels) -> None:
    """``min_pixels`` and ``max_pixels``: ints with ``1 <= min_pixels <= max_pixels <= PIXELS_CEILING``."""
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not 1 <= value <= PIXELS_CEILING:
            raise ValueError(f"{name} must be in [1, {PIXELS_CEILING}] (2**28), got {value}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Sides divisible by ``factor``, area within [min_pixels, max_pixels], aspect kept."""
    check_pixel_limits(min_pixels, max_pixels)
    if isinstance(factor, bool) or not isinstance(factor, int) or factor <= 0:
        raise ValueError(f"factor must be a positive int, got {factor!r}")
    if height <= 0 or width <= 0:
        raise ValueError(f"image must not be empty, got height={height}, width={width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be at most 200, got {max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_pil(image, name: str = "image") -> Image.Image:
    """A PIL image (converted to RGB), an ``HxWx3`` uint8 array, or a ``3xHxW`` uint8 tensor, as RGB PIL."""
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise ValueError(f"{name} is empty ({image.width}x{image.height})")
        try:  # decoding happens here for a lazily opened file
            return image.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"{name} ({image.mode} image) cannot be decoded as RGB: {err}") from None
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"{name} tensor must be 3xHxW (RGB), got shape {list(image.shape)}")
        if image.dtype != torch.uint8:
            raise TypeError(f"{name} tensor must be uint8 (0-255), got {image.dtype}")
        image = image.permute(1, 2, 0).cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"{name} array must be HxWx3 (RGB), got shape {list(image.shape)}")
        if image.dtype != np.uint8:
            raise TypeError(f"{name} array must be uint8 (0-255), got {image.dtype}")
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise ValueError(f"{name} is empty ({image.shape[1]}x{image.shape[0]})")
        return Image.fromarray(np.ascontiguousarray(image), mode="RGB")
    raise TypeError(f"{name} must be a PIL image, an HxWx3 uint8 array or a 3xHxW uint8 tensor, "
                    f"got {type(image).__name__}")


def _normalized(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """Resize to ``size`` (h, w), bicubic, then rescale and normalise: ``[3, h, w]`` float32."""
    h, w = size
    if (image.height, image.width) != (h, w):
        image = image.resize((w, h), resample=Image.BICUBIC)
    arr = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(IMAGE_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(IMAGE_STD, dtype=np.float32)[:, None, None]
    return (arr - mean) / std


def _patchify(frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[F, C, H, W]`` (F a multiple of 2) -> rows ``[gt*gh*gw, C*2*14*14]`` ordered
    (t, block_row, block_col, in_row, in_col), each row flattened as (C, T, 14, 14)."""
    f, c, h, w = frames.shape
    gt, gh, gw = f // TEMPORAL_PATCH_SIZE, h // PATCH_SIZE, w // PATCH_SIZE
    p, m, tp = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, bh, bw, mh, mw, C, T, ph, pw
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def check_list(items, name: str, what: str) -> None:
    """``items`` must be a list or tuple: a lone image (or array) is refused, not iterated."""
    if not isinstance(items, (list, tuple)):
        kind = type(items).__name__
        if isinstance(items, (np.ndarray, torch.Tensor)):
            kind += f" of shape {list(items.shape)}"
        raise TypeError(f"{name} must be a list of {what}, got a {kind}; wrap a single one in a list")


def preprocess_images(images: Sequence, *, min_pixels: int = MIN_PIXELS,
                      max_pixels: int = MAX_PIXELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (a list) -> ``(pixels [N, 1176] float32, grid_thw [k, 3] int64)``, one grid row per image."""
    check_list(images, "images", "images (PIL images, HxWx3 uint8 arrays or 3xHxW uint8 tensors)")
    check_pixel_limits(min_pixels, max_pixels)
    rows, grids = [], []
    for i, image in enumerate(images):
        pil = to_pil(image, f"images[{i}]")
        size = smart_resize(pil.height, pil.width, PATCH_SIZE * MERGE_SIZE, min_pixels, max_pixels)
        frame = _normalized(pil, size)
        patches, grid = _patchify(np.stack([frame] * TEMPORAL_PATCH_SIZE))
        rows.append(patches)
        grids.append(grid)
    if not grids:
        return torch.empty(0, 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE ** 2), torch.empty(0, 3, dtype=torch.long)
    return torch.from_numpy(np.concatenate(rows)), torch.tensor(grids, dtype=torch.long)


def preprocess_video(frames: Sequence, *, min_pixels: int = MIN_PIXELS,
                     max_pixels: int = MAX_PIXELS, name: str = "video") -> tuple[torch.Tensor, torch.Tensor]:
    """A clip (a list of frames) -> ``(pixels, grid_thw [1, 3])``. Every frame is resized to the
    first frame's ``smart_resize`` size; an odd count is padded by repeating the last frame;
    ``t = frames / 2``. ``name`` names the clip in errors."""
    check_list(frames, name, "frames")
    check_pixel_limits(min_pixels, max_pixels)
    pils = [to_pil(f, f"{name}[{i}]") for i, f in enumerate(frames)]
    if not pils:
        raise ValueError(f"{name} must have at least one frame")
    if any((p.height, p.width) != (pils[0].height, pils[0].width) for p in pils):
        raise ValueError(f"all frames of {name} must have the same size")
    size = smart_resize(pils[0].height, pils[0].width, PATCH_SIZE * MERGE_SIZE, min_pixels, max_pixels)
    arrays = [_normalized(p, size) for p in pils]
    arrays += [arrays[-1]] * (-len(arrays) % TEMPORAL_PATCH_SIZE)
    patches, grid = _patchify(np.stack(arrays))
    return torch.from_numpy(patches), torch.tensor([grid], dtype=torch.long)
