"""Triton kernels that hand the FP8 GEMMs their inputs (:mod:`vitgraph.ops.fp8`): each row rounded
to the stream's dtype, then scaled by its absolute maximum over 448 and stored as e4m3, with its
scale, by the kernel that produces it, so no separate quantize pass reads the activation again:

* add+LayerNorm / RMSNorm (:func:`vitgraph.ops.kernels.add_layernorm` with ``quant=True``): qkv's
  and the MLP's first GEMM's inputs;
* :func:`activation_fp8`: the MLP's activation (or ``silu(gate) * up``) of the first GEMM's
  output, the last GEMM's input;
* :func:`quantize_rows_fp8`: attention's output, proj's input (FlashAttention's kernel is not ours).

One program holds whole rows, so a row's maximum needs no second pass. The values are those of
:func:`vitgraph.ops.fp8.quantize_rows` on the rounded rows, or with ``grouped``, of
:func:`vitgraph.ops.fp8.quantize_groups` (a scale per row and 128 columns, for a block FP8
checkpoint's grouped GEMMs). Under Triton's CPU interpreter, whose
cast to e4m3 loses a binade where rounding carries into the exponent (-124.9 becomes -64, not
-128), the rows are produced by the plain kernels and quantized by torch instead.
"""

from __future__ import annotations

import torch

from . import kernels
from .fp8 import E4M3, MIN_SCALE, empty_scales, kernel_group, quantize_input
from .kernels import LayerNormLaunch

ONE_ROW = LayerNormLaunch(1, 8)  # rows and warps per program

if kernels.available():
    import triton
    import triton.language as tl

    from .kernels import _activate, store_fp8_rows

    @triton.jit
    def _activation_fp8_kernel(f_ptr, q_ptr, scale_ptr, rows, scale_ld, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
                               ACT: tl.constexpr, GATED: tl.constexpr, MIN: tl.constexpr, ROWS: tl.constexpr,
                               GROUP: tl.constexpr):
        # f [T, WIDTH] (GATED: [T, 2 * WIDTH], each row's gate, then its up) -> e4m3 [T, WIDTH], scales [T, 1].
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        mask = (r < rows) & (c < WIDTH)
        src = r.to(tl.int64) * (2 * WIDTH if GATED else WIDTH) + c
        g = tl.load(f_ptr + src, mask=mask, other=0.0)
        a = _activate(g.to(tl.float32), ACT)
        if GATED:
            a = a * tl.load(f_ptr + src + WIDTH, mask=mask, other=0.0).to(tl.float32)
        store_fp8_rows(a.to(g.dtype).to(tl.float32), q_ptr, scale_ptr, r.to(tl.int64) * WIDTH + c, r, mask, rows,
                       scale_ld, MIN, ROWS, BLOCK_N, WIDTH, GROUP)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, rows, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
                              MIN: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        mask = (r < rows) & (c < WIDTH)
        offs = r.to(tl.int64) * WIDTH + c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        store_fp8_rows(x, q_ptr, scale_ptr, offs, r, mask, rows, rows, MIN, ROWS, BLOCK_N, WIDTH, GROUP)


def fp8_outputs(rows: int, width: int, grouped: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 rows ``[rows, width]`` and their scales, as the kernels here write them."""
    return (torch.empty(rows, width, device=device, dtype=E4M3),
            empty_scales(rows, width, grouped, device))


def add_norm_fp8(x: torch.Tensor, *args, grouped: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vitgraph.ops.kernels.add_layernorm`'s rows as e4m3 and their fp32 scales (``[T, 1]``;
    ``grouped``: ``[T, ceil(N / 128)]``)."""
    if kernels.interpreted():
        return quantize_input(kernels.add_layernorm(x, *args, **kwargs), grouped)
    return kernels.add_layernorm(x, *args, **kwargs, quant=True, grouped=grouped)


def activation_fp8(f: torch.Tensor, name: str, gated: bool, launch: LayerNormLaunch = ONE_ROW,
                   grouped: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``name`` of ``f [T, W]`` (``gated``: ``name(gate) * up`` of ``f [T, 2W]``, ``name`` silu), rounded
    to ``f``'s dtype, as e4m3 rows and their fp32 scales (``[T, 1]``; ``grouped``: ``[T,
    ceil(W / 128)]``); ``f`` contiguous; ``launch``: rows and warps per program; ``out``: rows ``T``
    of :func:`fp8_outputs`' pair to write into (a slice of a larger one's rows)."""
    if gated and name != "silu":
        raise ValueError(f"a gated MLP's FP8 activation is silu(gate) * up, got {name!r}")
    rows, width = f.shape[0], f.shape[1] // (2 if gated else 1)
    q, scale = out if out is not None else fp8_outputs(rows, width, grouped, f.device)
    if (tuple(q.shape) != (rows, width) or q.stride() != (width, 1) or q.dtype != E4M3 or scale.shape[0] != rows
            or scale.stride(0) != 1 or scale.dtype != torch.float32):
        raise ValueError(f"out {tuple(q.shape)}, {tuple(scale.shape)} is not e4m3 rows {width} wide and their "
                         f"fp32 scales for {rows} rows, laid out as fp8_outputs lays them")
    if kernels.interpreted():
        made = quantize_input(kernels.silu_mul(f) if gated else kernels.activation_(f, name), grouped)
        return q.copy_(made[0]), scale.copy_(made[1])
    if rows:
        _activation_fp8_kernel[(triton.cdiv(rows, launch.rows),)](
            f, q, scale, rows, scale.stride(1), WIDTH=width, BLOCK_N=triton.next_power_of_2(width),
            ACT=kernels.FUSED_ACTIVATIONS[name],
            GATED=gated, MIN=MIN_SCALE, ROWS=launch.rows, GROUP=kernel_group(grouped, width), num_warps=launch.warps)
    return q, scale


def quantize_rows_fp8(x: torch.Tensor, launch: LayerNormLaunch = ONE_ROW,
                      grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vitgraph.ops.fp8.quantize_rows` (``grouped``: ``quantize_groups``) of ``x [T, W]`` in one kernel."""
    if kernels.interpreted():
        return quantize_input(x, grouped)
    x = x.contiguous()  # rows read at a stride of their width
    rows, width = x.shape
    q, scale = fp8_outputs(rows, width, grouped, x.device)
    if rows:
        _quantize_rows_kernel[(triton.cdiv(rows, launch.rows),)](
            x, q, scale, rows, WIDTH=width, BLOCK_N=triton.next_power_of_2(width), MIN=MIN_SCALE, ROWS=launch.rows,
            GROUP=kernel_group(grouped, width), num_warps=launch.warps)
    return q, scale
