"""libjpeg-turbo's chroma upsampling and YCbCr -> RGB conversion in torch, on any device: from a
JPEG's decoded planes (the IDCT's output, chroma at its own resolution), the RGB pixels PIL gives,
bit for bit. ``tests/test_jpeg_color.py`` checks 4:2:0, 4:4:4 and greyscale JPEGs of every size
from 2x2 to 39x39 and larger ones, baseline, progressive and with restart markers, against PIL.

* Upsampling (libjpeg-turbo's ``jdsample.c``, "fancy"): each output sample is 3/4 of its nearer
  input sample and 1/4 of the next nearer, edges replicated, in integers with alternating rounding
  biases; horizontally and vertically at once for 4:2:0. A plane 2 or fewer samples wide is
  replicated instead when its width is doubled, as libjpeg-turbo does. (4:2:2's and 4:4:0's
  filters have no CPU oracle here: ``tests/test_cuda_images.py`` checks them through nvJPEG.)
* Colour (``jdcolor.c``): the JFIF equations in 16-bit fixed point, clamped to [0, 255].
"""

from __future__ import annotations

import torch

SCALEBITS = 16
ONE_HALF = 1 << (SCALEBITS - 1)


def _fix(x: float) -> int:
    return int(x * (1 << SCALEBITS) + 0.5)


def _neighbours(c: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``c`` shifted by one along ``dim`` each way, its edge repeated: the previous and the next."""
    n = c.shape[dim]
    first, last = c.narrow(dim, 0, 1), c.narrow(dim, n - 1, 1)
    return torch.cat([first, c.narrow(dim, 0, n - 1)], dim), torch.cat([c.narrow(dim, 1, n - 1), last], dim)


def _interleave(even: torch.Tensor, odd: torch.Tensor, dim: int) -> torch.Tensor:
    """``[..., n, ...]`` twice -> ``[..., 2n, ...]``, ``even`` then ``odd`` at each position of ``dim``."""
    shape = list(even.shape)
    shape[dim] *= 2
    return torch.stack([even, odd], dim + 1).reshape(shape)


def upsample(plane: torch.Tensor, wide: bool, tall: bool, height: int, width: int) -> torch.Tensor:
    """A chroma plane ``[h, w]`` (int16: the filters' sums stay below 4096) doubled across (``wide``)
    and down (``tall``) as libjpeg-turbo does, cut to ``[height, width]``."""
    c = plane
    if wide and c.shape[1] <= 2:  # too narrow for the fancy filter: replicated (both ways for h2v2)
        c = c.repeat_interleave(2, 1)
        return (c.repeat_interleave(2, 0) if tall else c)[:height, :width]
    if wide and tall:  # h2v2: column sums of the nearer row (x3) and the next nearer, then across
        above, below = _neighbours(c, 0)
        sums = _interleave(3 * c + above, 3 * c + below, 0)[:height]
        left, right = _neighbours(sums, 1)
        return _interleave((3 * sums + left + 8) >> 4, (3 * sums + right + 7) >> 4, 1)[:, :width]
    if wide:  # h2v1
        left, right = _neighbours(c, 1)
        c = _interleave((3 * c + left + 1) >> 2, (3 * c + right + 2) >> 2, 1)
    if tall:  # h1v2
        above, below = _neighbours(c, 0)
        c = _interleave((3 * c + above + 1) >> 2, (3 * c + below + 2) >> 2, 0)
    return c[:height, :width]


def ycbcr_to_rgb(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
    """Full-resolution ``Y, Cb, Cr`` planes (integers) -> ``[3, H, W]`` uint8, as ``jdcolor.c``; one
    channel at a time, so that a few int32 planes live at once (the products need 32 bits)."""
    out = torch.empty(3, *y.shape, dtype=torch.uint8, device=y.device)
    cb, cr = cb.to(torch.int32) - 128, cr.to(torch.int32) - 128
    terms = (lambda: (_fix(1.40200) * cr + ONE_HALF) >> SCALEBITS,
             lambda: (-_fix(0.34414) * cb - _fix(0.71414) * cr + ONE_HALF) >> SCALEBITS,
             lambda: (_fix(1.77200) * cb + ONE_HALF) >> SCALEBITS)
    for channel, term in enumerate(terms):
        out[channel] = term().add_(y).clamp_(0, 255)
    return out


def planes_to_rgb(planes: list[torch.Tensor], factors: list[tuple[int, int]]) -> torch.Tensor:
    """A JPEG's decoded uint8 planes (Y, or Y, Cb, Cr) and each one's sampling factors ``(h, v)``
    -> ``[3, H, W]`` uint8: the image PIL decodes. Chroma at half or full resolution each way."""
    y = planes[0]
    if len(planes) == 1:
        return y.expand(3, *y.shape).contiguous()
    height, width = y.shape
    (h_max, v_max), chroma = factors[0], []
    for plane, (h, v) in zip(planes[1:], factors[1:]):
        chroma.append(upsample(plane.to(torch.int16), h_max == 2 * h, v_max == 2 * v, height, width))
    return ycbcr_to_rgb(y.to(torch.int16), *chroma)


def upright(rgb: torch.Tensor, orientation: int) -> torch.Tensor:
    """``[3, H, W]`` turned as its EXIF orientation (1-8) says, as PIL's ``ImageOps.exif_transpose``."""
    turns = {1: lambda t: t, 2: lambda t: t.flip(2), 3: lambda t: t.flip(1, 2), 4: lambda t: t.flip(1),
             5: lambda t: t.transpose(1, 2), 6: lambda t: t.rot90(-1, (1, 2)), 7: lambda t: t.transpose(1, 2).flip(1, 2),
             8: lambda t: t.rot90(1, (1, 2))}
    return turns[orientation](rgb).contiguous()
