"""Triton kernels for the elementwise work of a block (the "fused" forward).

Four launches per block (LayerNorm twice, rotary, QuickGELU) replace the plain forward's
elementwise ops (two LayerNorms, two residual adds, the rotary's half-dozen ops, a copy
of v, QuickGELU's three ops):

* :func:`add_layernorm`: ``x += y`` (in place), then ``LayerNorm(x)``. It joins each
  residual add to the LayerNorm after it, across the block boundary too;
* :func:`rotary_`: fp32 2-D rotary of q and k inside the packed ``qkv`` rows. It either
  rotates in place (packed attention reads q, k, v straight out of ``qkv``; padding rows
  optionally zeroed, for kernels that read past a segment's end), or writes q
  and k into a wider head dim whose extra lane masks padding keys (dense attention over
  a padded bucket, see :mod:`vitgraph.attention`);
* :func:`quick_gelu_`: ``x * sigmoid(1.702 x)`` in place.

Arithmetic is fp32 inside; results are rounded once to the tensor dtype, where the
plain forward rounds after every op. Each kernel handles whole rows in one program and
never reads a row another program writes, so in-place updates are safe. They run on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import importlib.util
import os

import torch

PAD_KEY_SCORE = -16384.0  # extra-lane value of a padding key: q.k gains -16384, exp() of it is 0


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton's interpreter is on: the kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(device: torch.device | str) -> bool:
    """The kernels can run on tensors of ``device``: triton is there, and the device is
    CUDA or the interpreter is on."""
    return available() and (torch.device(device).type == "cuda" or interpreted())


if available():
    import triton
    import triton.language as tl

    @triton.jit
    def layernorm_rows(x, mask, c, w_ptr, b_ptr, N: tl.constexpr, eps):
        """LayerNorm of fp32 rows ``x [ROWS, BLOCK_N]`` whose lanes past ``N`` (``mask`` off) are 0;
        ``c``: the column indices ``[1, BLOCK_N]``. Returns fp32."""
        mean = tl.sum(x, axis=1)[:, None] / N
        diff = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1)[:, None] / N + eps)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        return diff * rstd * w + b

    @triton.jit
    def _add_layernorm_kernel(x_ptr, y_ptr, h_ptr, w_ptr, b_ptr, rows, eps,
                              N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_Y: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        mask = (r < rows) & (c < N)
        offs = r.to(tl.int64) * N + c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_Y:
            # Round the sum to the stream dtype first: the residual stream is stored rounded.
            x = (x.to(tl.float32) + tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(x_ptr + offs, x, mask=mask)
        h = layernorm_rows(x.to(tl.float32), mask, c, w_ptr, b_ptr, N, eps)
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, seg_ptr, q_ptr, k_ptr, rows, pad_score,
                       H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, LANE: tl.constexpr, ZERO_PAD: tl.constexpr):
        # Tile [rows, heads, pairs, 2]: a head's dims are one contiguous run and the two dims a
        # rotation mixes sit side by side (the tower's interleaved qkv), so no gathers.
        half: tl.constexpr = D // 2
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None, None]
        p = tl.arange(0, BLOCK_HALF)[None, None, :, None]
        e = tl.arange(0, 2)[None, None, None, :]
        r64 = r.to(tl.int64)
        row_ok = r < rows
        mask = row_ok & (h < H) & (p < half) & (e < 2)
        # One angle per pair: cos/sin [rows, D/2], indexed [rows, 1, pairs].
        r3 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
        p3 = tl.arange(0, BLOCK_HALF)[None, None, :]
        cs_mask = (r3 < rows) & (p3 < half)
        cos = tl.load(cos_ptr + r3.to(tl.int64) * half + p3, mask=cs_mask, other=0.0)
        sin = tl.load(sin_ptr + r3.to(tl.int64) * half + p3, mask=cs_mask, other=0.0)
        src = r64 * (3 * H * D) + h * D + 2 * p + e
        q = tl.load(qkv_ptr + src, mask=mask, other=0.0)
        k = tl.load(qkv_ptr + src + H * D, mask=mask, other=0.0)
        dtype = q.dtype
        q0, q1 = tl.split(q.to(tl.float32))
        k0, k1 = tl.split(k.to(tl.float32))
        # (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): the reference's x * cos + rotate_half(x) * sin
        oq = tl.join(q0 * cos - q1 * sin, q1 * cos + q0 * sin).to(dtype)
        ok = tl.join(k0 * cos - k1 * sin, k1 * cos + k0 * sin).to(dtype)
        if ZERO_PAD:
            # Padding rows: q, k, v zeroed (they may hold NaN). With the lane (below) padding
            # keys then get exactly zero weight; kernels that load whole key tiles past a
            # segment's end weight those rows' v by 0, and 0 * NaN is NaN.
            pad = tl.load(seg_ptr + r, mask=row_ok, other=-1) < 0
            zero = tl.zeros_like(oq)
            oq, ok = tl.where(pad, zero, oq), tl.where(pad, zero, ok)
            tl.store(qkv_ptr + src + 2 * H * D, zero, mask=mask & pad)
        if LANE:
            # The key's extra lane gets pad_score, so every real query gives a padding key
            # exactly zero weight.
            dst = r64 * (H * DP) + h * DP + 2 * p + e
            tl.store(q_ptr + dst, oq, mask=mask)
            tl.store(k_ptr + dst, ok, mask=mask)
            h3 = tl.arange(0, BLOCK_H)[None, :, None]
            lanes = tl.arange(0, DP - D)[None, None, :]  # the lanes past the head dim
            lane_mask = (r3 < rows) & (h3 < H)
            pad3 = tl.load(seg_ptr + r3, mask=r3 < rows, other=-1) < 0
            lane_dst = r3.to(tl.int64) * (H * DP) + h3 * DP + D + lanes
            tl.store(q_ptr + lane_dst, tl.where(lanes == 0, 1.0, 0.0).to(dtype), mask=lane_mask)
            tl.store(k_ptr + lane_dst, tl.where((lanes == 0) & pad3, pad_score, 0.0).to(dtype), mask=lane_mask)
        else:
            tl.store(qkv_ptr + src, oq, mask=mask)
            tl.store(qkv_ptr + src + H * D, ok, mask=mask)

    @triton.jit
    def _quick_gelu_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + i, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        tl.store(x_ptr + i, (xf * tl.sigmoid(1.702 * xf)).to(x.dtype), mask=mask)


def _rows_per_program(rows: int, width: int, per_program: int = 8192) -> int:
    # About 8k elements per program: enough bytes in flight, enough programs to fill the GPU.
    per = max(1, per_program // triton.next_power_of_2(width))
    return min(per, triton.next_power_of_2(max(rows, 1)))


def add_layernorm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """``x += y`` in place (when ``y`` is given), then return ``LayerNorm(x)``. ``x``, ``y``: ``[T, N]`` contiguous."""
    rows, n = x.shape
    h = torch.empty_like(x)
    if rows == 0:
        return h
    per = _rows_per_program(rows, n)
    _add_layernorm_kernel[(triton.cdiv(rows, per),)](
        x, y if y is not None else x, h, weight, bias, rows, eps,
        N=n, BLOCK_N=triton.next_power_of_2(n), ROWS=per, HAS_Y=y is not None, num_warps=8)
    return h


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            segment_ids: torch.Tensor | None = None, lane_dim: int | None = None, zero_padding: bool = False):
    """fp32 rotary of q and k in ``qkv [T, 3 * H * D]`` (contiguous, q's and k's head dims
    interleaved: :func:`vitgraph.models.qwen2_vl.interleave_order`); ``cos``/``sin``: fp32
    ``[T, D/2]``, one angle per rotated pair (:meth:`Qwen2VisionTower.rotary`).

    Without ``lane_dim``: rotates in place and returns ``(q, k, v)`` views ``[T, H, D]`` of ``qkv``;
    with ``zero_padding`` it also zeroes q, k and v of the rows whose ``segment_ids < 0``.
    With ``lane_dim = DP > D``: returns new ``q, k [T, H, DP]`` whose lane ``D`` masks padding keys
    (rows with ``segment_ids < 0``), and ``v``, a view of ``qkv`` with padding rows zeroed.
    """
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (3 * num_heads)
    views = qkv.view(rows, 3, num_heads, head_dim).unbind(1)
    if zero_padding and segment_ids is None:
        raise ValueError("zero_padding needs segment_ids")
    if lane_dim is None:
        dp, q_out, k_out = head_dim, qkv, qkv
    else:
        extra = lane_dim - head_dim
        if extra <= 0 or extra & (extra - 1) or segment_ids is None:
            raise ValueError("lane_dim must exceed the head dim by a power of two, and needs segment_ids")
        dp = lane_dim
        q_out = torch.empty(rows, num_heads, dp, device=qkv.device, dtype=qkv.dtype)
        k_out = torch.empty_like(q_out)
    if rows:
        block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim // 2)
        per = _rows_per_program(rows, block_h * block_half, per_program=4096)
        _rotary_kernel[(triton.cdiv(rows, per),)](
            qkv, cos, sin, segment_ids if segment_ids is not None else cos, q_out, k_out, rows, PAD_KEY_SCORE,
            H=num_heads, D=head_dim, DP=dp, BLOCK_H=block_h, BLOCK_HALF=block_half, ROWS=per,
            LANE=lane_dim is not None, ZERO_PAD=zero_padding or lane_dim is not None, num_warps=4)
    if lane_dim is None:
        return views
    return q_out, k_out, views[2]


def quick_gelu_(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` in place; ``x`` contiguous."""
    n = x.numel()
    if n:
        block = 4096
        _quick_gelu_kernel[(triton.cdiv(n, block),)](x, n, BLOCK=block, num_warps=8)
    return x
