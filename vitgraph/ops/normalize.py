"""uint8 pixel rows -> normalised rows in the encoder's dtype, on the rows' device.

The arithmetic is transformers' torchvision processors' (``rescale_and_normalize`` with the
rescale folded into the statistics): ``(x - 255 * mean) / (255 * std)`` in fp32, per channel,
rounded once to the output dtype. A row is ``(C, T, P, P)`` flattened, so column ``j`` belongs
to channel ``j // (T * P * P)``. On CUDA it is one Triton kernel (where triton is installed);
elsewhere three torch ops giving the same bits.
"""

from __future__ import annotations

import torch

from . import kernels

RESCALE = 1 / 255  # the processors' rescale_factor


def column_statistics(mean, std, row_width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shift, scale)``, fp32 ``[row_width]`` each: ``255 * mean`` and ``255 * std`` of each
    column's channel, rounded as transformers rounds them."""
    channels = len(mean)
    if row_width % channels:
        raise ValueError(f"a row of {row_width} values does not split into {channels} channels")
    # torch.tensor(stat) * (1 / rescale_factor), in fp32: transformers' _fuse_mean_std_and_rescale_factor
    shift = torch.tensor(mean, dtype=torch.float32) * (1.0 / RESCALE)
    scale = torch.tensor(std, dtype=torch.float32) * (1.0 / RESCALE)
    per = row_width // channels
    return shift.repeat_interleave(per).to(device), scale.repeat_interleave(per).to(device)


def normalize_rows(rows: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None, kernel: bool | None = None) -> torch.Tensor:
    """``rows [N, W]`` uint8 -> ``[N, W]`` of ``dtype`` (into ``out`` when given), on ``rows``' device.
    ``kernel``: the Triton kernel (None: on CUDA where triton is installed; True on a CPU needs
    Triton's interpreter)."""
    if out is None:
        out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
    if rows.shape[0] == 0:
        return out
    if kernel is None:
        kernel = rows.is_cuda and kernels.available()
    if kernel:
        rows = rows.contiguous()
        out_view = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _normalize_kernel[(triton.cdiv(rows.numel(), _BLOCK),)](rows, shift, scale, out_view, rows.numel(),
                                                                rows.shape[1], BLOCK=_BLOCK)
        return out_view if out_view is out else out.copy_(out_view)
    x = rows.to(torch.float32).sub_(shift)
    return torch.div(x, scale, out=out) if dtype == torch.float32 else out.copy_(x.div_(scale))


_BLOCK = 4096

if kernels.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _normalize_kernel(rows_ptr, shift_ptr, scale_ptr, out_ptr, n, width, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        col = i % width
        x = tl.load(rows_ptr + i, mask=mask, other=0).to(tl.float32)
        shift = tl.load(shift_ptr + col, mask=mask, other=0.0)
        scale = tl.load(scale_ptr + col, mask=mask, other=1.0)
        y = tl.math.div_rn(x - shift, scale)  # IEEE division, as torch's
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=mask)
