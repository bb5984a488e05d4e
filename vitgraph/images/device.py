"""The Qwen VL processors in torch, on any device: what transformers' torchvision processors
(``Qwen2VLImageProcessor``, ``Qwen3VLImageProcessor``) do, from uint8 images to uint8 rows.

``smart_resize`` -> bicubic resize with antialias (torch's ``interpolate``, the op torchvision
runs for a tensor: in fp32, then clamped and rounded back to uint8) -> patchify. An image's
temporal copies are made by the patchify's one copy on the device, never on the host.
Rescale and normalise follow in ``encode`` (:mod:`vitgraph.ops.normalize`).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .alpha import composite_on_white
from .preprocess import ProcessorConfig, named_resize

Grid = tuple[int, int, int]


def resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[F, 3, H, W]`` uint8 -> ``[F, 3, h, w]`` uint8: bicubic with antialias, as torchvision
    resizes a uint8 tensor off the CPU's native path (fp32, clamped, rounded)."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    x = F.interpolate(frames.to(torch.float32), size=size, mode="bicubic", align_corners=False, antialias=True)
    return x.clamp_(0, 255).round_().to(torch.uint8)


def patchify_into(frames: torch.Tensor, proc: ProcessorConfig, out: torch.Tensor) -> Grid:
    """``[F, C, H, W]`` uint8 (F a multiple of the temporal patch, or 1: an image, repeated) ->
    its rows written into ``out [gt*gh*gw, C*T*P*P]``, in the processors' order: (t, block_row,
    block_col, in_row, in_col), each row (C, T, P, P). Returns the grid."""
    f, c, h, w = frames.shape
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    if f == 1:
        frames = frames.expand(tp, c, h, w)  # a view: the copy below makes the T copies
        f = tp
    gt, gh, gw = f // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    out.view(x.shape).copy_(x)
    return gt, gh, gw


def upload(pixels, device: torch.device) -> torch.Tensor:
    """An ``HxWx3`` uint8 array or a ``3xHxW`` uint8 tensor -> ``[1, 3, H, W]`` uint8 on ``device``;
    an ``HxWx4`` RGBA or ``HxWx2`` LA array is uploaded as it is and composited onto white there
    (:func:`vitgraph.images.alpha.composite_on_white`: the host's bits)."""
    if isinstance(pixels, np.ndarray):
        with warnings.catch_warnings():  # a PIL image's array is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(np.ascontiguousarray(pixels))
        pixels = host.to(device, non_blocking=True).permute(2, 0, 1)
        if pixels.shape[0] != 3:
            pixels = composite_on_white(pixels)
    return pixels.to(device, non_blocking=True).contiguous()[None]


def frame_size(pixels) -> tuple[int, int]:
    """``(H, W)`` of an ``HxWx3`` array or a ``3xHxW`` tensor."""
    return tuple(pixels.shape[:2]) if isinstance(pixels, np.ndarray) else tuple(pixels.shape[1:])


def clip_rows_into(frames: Sequence, size: tuple[int, int], proc: ProcessorConfig, device: torch.device,
                   out: torch.Tensor) -> Grid:
    """Frames (uint8 pixels of one size: one for an image) resized to ``size`` and patchified
    into ``out``; a clip's count padded to a multiple of the temporal patch with its last frame."""
    stacked = torch.cat([upload(f, device) for f in frames])
    if len(frames) > 1:
        pad = -len(frames) % proc.temporal_patch_size
        if pad:
            stacked = torch.cat([stacked, stacked[-1:].expand(pad, *stacked.shape[1:])])
    return patchify_into(resize(stacked, size), proc, out)


def rows_of(clips: Sequence[tuple[str, Sequence, tuple[int, int, bool]]], proc: ProcessorConfig, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips, each ``(name, frames, (min_pixels, max_pixels, whether they bound the whole clip))``
    (uint8 frames of one size; an image is a clip of one frame) -> ``(rows [N, C*T*P*P] uint8 on
    device, grid_thw [k, 3] int64)``, written into one buffer."""
    plans = []
    for name, frames, (low, high, per_clip) in clips:
        h, w = frame_size(frames[0])
        size = named_resize(name, h, w, proc, low, high, len(frames) if per_clip else None)
        t = 1 if len(frames) == 1 else -(-len(frames) // proc.temporal_patch_size)
        plans.append((frames, size, t * (size[0] // proc.patch_size) * (size[1] // proc.patch_size)))
    rows = torch.empty(sum(n for _, _, n in plans), proc.row_width, dtype=torch.uint8, device=device)
    grids, offset = [], 0
    for frames, size, n in plans:
        grids.append(clip_rows_into(frames, size, proc, device, rows[offset:offset + n]))
        offset += n
    return rows, torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
