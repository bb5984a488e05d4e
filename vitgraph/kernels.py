"""Triton kernels for the elementwise work of a block (the "fused" forward).

Three kernels replace the seven elementwise launches of the plain forward:

* :func:`add_layernorm`: ``x += y`` (in place), then ``LayerNorm(x)``. It joins each
  residual add to the LayerNorm after it, across the block boundary too;
* :func:`rotary_`: fp32 2-D rotary of q and k inside the packed ``qkv`` rows. It either
  rotates in place (varlen attention reads q, k, v straight out of ``qkv``), or writes q
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


if available():
    import triton
    import triton.language as tl

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
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=1)[:, None] / N
        diff = tl.where(mask, xf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1)[:, None] / N + eps)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, (diff * rstd * w + b).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, seg_ptr, q_ptr, k_ptr, rows,
                       H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                       ROWS: tl.constexpr, LANE: tl.constexpr, pad_score):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        j = tl.arange(0, BLOCK)[None, :]  # (head, dim) in the output's head dim DP
        head, d = j // DP, j % DP
        half: tl.constexpr = D // 2
        row_ok = r < rows
        real = d < D
        mask = row_ok & (j < H * DP)
        src = head * D + tl.where(real, d, 0)
        partner = head * D + tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        row = r.to(tl.int64) * (3 * H * D)
        cos = tl.load(cos_ptr + r.to(tl.int64) * D + d, mask=row_ok & real, other=0.0)
        sin = tl.load(sin_ptr + r.to(tl.int64) * D + d, mask=row_ok & real, other=0.0)
        load_mask = mask & real
        q = tl.load(qkv_ptr + row + src, mask=load_mask, other=0.0)
        qp = tl.load(qkv_ptr + row + partner, mask=load_mask, other=0.0).to(tl.float32)
        k = tl.load(qkv_ptr + row + H * D + src, mask=load_mask, other=0.0)
        kp = tl.load(qkv_ptr + row + H * D + partner, mask=load_mask, other=0.0).to(tl.float32)
        q_rot = (q.to(tl.float32) * cos + sign * qp * sin).to(q.dtype)
        k_rot = (k.to(tl.float32) * cos + sign * kp * sin).to(k.dtype)
        if LANE:
            # Padding rows: q, k, v zeroed (they may hold NaN) and the key's extra lane set
            # to pad_score, so every real query gives a padding key exactly zero weight.
            pad = tl.load(seg_ptr + r, mask=row_ok, other=-1) < 0
            q_rot = tl.where(real & ~pad, q_rot, tl.where(d == D, 1.0, 0.0).to(q.dtype))
            k_rot = tl.where(real & ~pad, k_rot, tl.where((d == D) & pad, pad_score, 0.0).to(k.dtype))
            out = r.to(tl.int64) * (H * DP) + j
            tl.store(q_ptr + out, q_rot, mask=mask)
            tl.store(k_ptr + out, k_rot, mask=mask)
            v_mask = load_mask & pad
            tl.store(qkv_ptr + row + 2 * H * D + src, tl.zeros_like(q_rot), mask=v_mask)
        else:
            tl.store(qkv_ptr + row + src, q_rot, mask=load_mask)
            tl.store(qkv_ptr + row + H * D + src, k_rot, mask=load_mask)

    @triton.jit
    def _quick_gelu_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + i, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        tl.store(x_ptr + i, (xf * tl.sigmoid(1.702 * xf)).to(x.dtype), mask=mask)


def _rows_per_program(rows: int, width: int) -> int:
    # About 8k elements per program: enough bytes in flight, enough programs to fill the GPU.
    per = max(1, 8192 // triton.next_power_of_2(width))
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
            segment_ids: torch.Tensor | None = None, lane_dim: int | None = None):
    """fp32 rotary of q and k in ``qkv [T, 3 * H * D]`` (contiguous); ``cos``/``sin``: fp32 ``[T, D]``.

    Without ``lane_dim``: rotates in place and returns ``(q, k, v)`` views ``[T, H, D]`` of ``qkv``.
    With ``lane_dim = DP > D``: returns new ``q, k [T, H, DP]`` whose lane ``D`` masks padding keys
    (rows with ``segment_ids < 0``), and ``v``, a view of ``qkv`` with padding rows zeroed.
    """
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (3 * num_heads)
    views = qkv.view(rows, 3, num_heads, head_dim).unbind(1)
    if lane_dim is None:
        dp, q_out, k_out = head_dim, qkv, qkv
    else:
        if lane_dim <= head_dim or segment_ids is None:
            raise ValueError("lane_dim must exceed the head dim, and segment_ids must be given with it")
        dp = lane_dim
        q_out = torch.empty(rows, num_heads, dp, device=qkv.device, dtype=qkv.dtype)
        k_out = torch.empty_like(q_out)
    if rows:
        width = num_heads * dp
        per = _rows_per_program(rows, width)
        _rotary_kernel[(triton.cdiv(rows, per),)](
            qkv, cos, sin, segment_ids if segment_ids is not None else cos, q_out, k_out, rows,
            H=num_heads, D=head_dim, DP=dp, BLOCK=triton.next_power_of_2(width), ROWS=per,
            LANE=lane_dim is not None, pad_score=PAD_KEY_SCORE, num_warps=8)
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
