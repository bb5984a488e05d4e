"""Transparency composited onto white with torch, on any device, to the bit of the host's
:func:`vitgraph.images.decode.as_rgb` (PIL's ``Image.alpha_composite`` over opaque white, as
transformers' ``convert_to_rgb`` and vLLM blend it).

An image with alpha is uploaded as decoded (RGBA or LA, one copy) and blended where it is
resized (:func:`vitgraph.images.device.upload`), so the host only decodes it.
"""

from __future__ import annotations

import torch


def composite_on_white(planes: torch.Tensor) -> torch.Tensor:
    """``[C, H, W]`` uint8 with alpha last (C = 4: RGBA, C = 2: LA) -> ``[3, H, W]`` uint8 on its
    device: each colour ``c`` under alpha ``a`` becomes ``round(c * a / 255) + 255 - a``.

    That is PIL's integer blend over opaque white (its coefficients reduce to ``a * 128`` and
    ``(255 - a) * 128``, its rounding to the nearest integer, never a tie); tests/test_alpha.py
    checks all 65536 (colour, alpha) pairs against ``Image.alpha_composite``."""
    if planes.dtype != torch.uint8 or planes.dim() != 3 or planes.shape[0] not in (2, 4):
        raise ValueError(f"composite_on_white takes [4 or 2, H, W] uint8 planes, got {planes.dtype} "
                         f"{list(planes.shape)}")
    planes = planes.contiguous()  # a permuted upload: one copy here makes every op below dense
    alpha = planes[-1:].to(torch.int32)
    # round(c * a / 255) as ((c * a + 128) * 257) >> 16: exact below 2**31, and all in place
    mixed = planes[:-1].to(torch.int32).mul_(alpha).add_(128).mul_(257).bitwise_right_shift_(16)
    out = mixed.sub_(alpha).add_(255).to(torch.uint8)
    return out.expand(3, -1, -1) if out.shape[0] == 1 else out  # LA: its grey is R, G and B
