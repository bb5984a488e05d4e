"""A Triton attention kernel for packed batches of short frames, with the rotary fused in.

FlashAttention 4 and cuDNN give each (query tile, head) its own CTA and spend most of a short
frame's time in each CTA's prologue and epilogue: 16 frames of 256 tokens take FA4 ~30 µs per
block on an H200 for ~1.3 GFLOP. Short frames need many small programs that start and finish
quickly, which a plain Triton flash-attention loop gives.

* Programs are ``(query tile, head)``. Query tiles are numbered across the batch's segments
  (``cu_seqlens``) by a prefix sum inside each program, so the grid is static for a graph
  (``ceil(T / BLOCK_M) + segments`` tiles bound any packing) and the tiles past the last one
  do nothing. Tiles start at their segment's start, so a row's result does not depend on
  where its segment sits or on the padding around it.
* Key tiles past a segment's end are masked on load: padding rows are never read, whatever
  they hold, and their outputs are left unwritten (every later op is row-local).
* ``qkv`` is the tower's packed projection ``[T, 3 * H * D]`` with q's and k's rotated pairs
  side by side (:func:`vitgraph.models.qwen2_vl.interleave_order`). Given ``cos``/``sin``
  the kernel rotates q and k as it loads them, in fp32, rounded to the input dtype exactly
  as :func:`vitgraph.kernels.rotary_` does, so no separate rotary launch is needed.
* The head dim is split into two power-of-two parts (80 = 64 + 16) so no MMA runs on padding
  lanes.
"""

from __future__ import annotations

import math

import torch

from . import kernels

# The query and key tiles, warps and pipeline stages, by the batch's longest segment (see
# config); measured on an H200 by benchmarks/short_attention.py.
SHORT_ATTENTION_MAX_SEQLEN = 1024


def head_dim_parts(head_dim: int) -> tuple[int, int] | None:
    """``head_dim`` as ``a + b``, ``a`` the largest power of two in it and ``b`` 0 or a power
    of two of at least 16 (an MMA's depth); None where it does not split so."""
    a = 1 << (head_dim.bit_length() - 1)
    b = head_dim - a
    if a < 16 or (b and (b < 16 or b & (b - 1))):
        return None
    return a, b


def supported(qkv: torch.Tensor, num_heads: int) -> bool:
    """The kernel can attend over ``qkv``: fp16/bf16, a head dim that splits, CUDA or the interpreter."""
    return (qkv.dtype in (torch.float16, torch.bfloat16) and kernels.usable(qkv.device)
            and head_dim_parts(qkv.shape[-1] // (3 * num_heads)) is not None)


def config(max_seqlen: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for segments of at most ``max_seqlen`` tokens."""
    if max_seqlen <= 256:
        return 64, 64, 4, 2
    return 128, 64, 8, 2


if kernels.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_part(qkv_ptr, cos_ptr, sin_ptr, rows, row_ok, col0: tl.constexpr, WIDTH: tl.constexpr,
                   STRIDE: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
        """Columns ``[col0, col0 + WIDTH)`` of ``rows`` (the q or k of one head starts at
        ``qkv_ptr``), rotated when ``ROPE``: ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``
        per side-by-side pair, in fp32, rounded back."""
        c = col0 + tl.arange(0, WIDTH)[None, :]
        r = rows.to(tl.int64)[:, None]
        ok = row_ok[:, None]
        x = tl.load(qkv_ptr + r * STRIDE + c, mask=ok, other=0.0)
        if ROPE:
            partner = tl.load(qkv_ptr + r * STRIDE + (c ^ 1), mask=ok, other=0.0).to(tl.float32)
            angle = r * HALF + c // 2
            cos = tl.load(cos_ptr + angle, mask=ok, other=0.0)
            sin = tl.load(sin_ptr + angle, mask=ok, other=0.0)
            xf = x.to(tl.float32)
            # even lane: x0 cos - x1 sin; odd lane: x1 cos + x0 sin (its partner is x0)
            rotated = tl.where((c & 1) == 0, xf * cos - partner * sin, xf * cos + partner * sin)
            x = rotated.to(x.dtype)
        return x

    @triton.jit
    def _short_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, cu_ptr, segments, qk_scale,
                                H: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCK: tl.constexpr,
                                ROPE: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        # The segment that owns this query tile: tiles are numbered segment after segment.
        s = tl.arange(0, SEG_BLOCK)
        starts = tl.load(cu_ptr + s, mask=s < segments, other=0)
        ends = tl.load(cu_ptr + s + 1, mask=s < segments, other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        through = tl.cumsum(tiles, 0)  # tiles of the segments up to and including each
        seg = tl.sum((through <= tile).to(tl.int32), 0)
        mine = s == seg  # all false past the last tile: an empty key range, nothing stored
        start = tl.sum(tl.where(mine, starts, 0), 0)
        end = tl.sum(tl.where(mine, ends, 0), 0)
        first = tl.sum(tl.where(mine, through - tiles, 0), 0)
        rows = start + (tile - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < end

        STRIDE: tl.constexpr = 3 * H * D
        HALF: tl.constexpr = D // 2
        q_ptr = qkv_ptr + head * D
        k_ptr = q_ptr + H * D
        v_ptr = k_ptr + H * D
        qa = _load_part(q_ptr, cos_ptr, sin_ptr, rows, row_ok, 0, DA, STRIDE, HALF, ROPE)
        if DB > 0:
            qb = _load_part(q_ptr, cos_ptr, sin_ptr, rows, row_ok, DA, DB, STRIDE, HALF, ROPE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
        if DB > 0:
            acc_b = tl.zeros([BLOCK_M, DB], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            key_ok = keys < end
            ka = _load_part(k_ptr, cos_ptr, sin_ptr, keys, key_ok, 0, DA, STRIDE, HALF, ROPE)
            scores = tl.dot(qa, tl.trans(ka))
            if DB > 0:
                kb = _load_part(k_ptr, cos_ptr, sin_ptr, keys, key_ok, DA, DB, STRIDE, HALF, ROPE)
                scores = tl.dot(qb, tl.trans(kb), scores)
            scores = tl.where(key_ok[None, :], scores * qk_scale, float("-inf"))  # log2 units
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(qa.dtype)
            va = _load_part(v_ptr, cos_ptr, sin_ptr, keys, key_ok, 0, DA, STRIDE, HALF, False)
            acc_a = tl.dot(p, va, acc_a * alpha[:, None])
            if DB > 0:
                vb = _load_part(v_ptr, cos_ptr, sin_ptr, keys, key_ok, DA, DB, STRIDE, HALF, False)
                acc_b = tl.dot(p, vb, acc_b * alpha[:, None])
            m_i = m_new
        inv = 1.0 / l_i
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * (H * D) + head * D
        ok = row_ok[:, None]
        tl.store(out_rows + tl.arange(0, DA)[None, :], (acc_a * inv[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
        if DB > 0:
            tl.store(out_rows + DA + tl.arange(0, DB)[None, :], (acc_b * inv[:, None]).to(out_ptr.dtype.element_ty),
                     mask=ok)


def short_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, max_seqlen: int,
                    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Non-causal attention inside each segment of ``cu_seqlens`` (int32 ``[S + 1]``, on the
    device) over the packed projection ``qkv [T, 3 * H * D]``; returns ``[T, H, D]``, rows
    outside every segment unwritten. With ``cos``/``sin`` (fp32 ``[T, D / 2]``) q and k are
    rotated on load (pairs side by side). ``max_seqlen`` bounds every segment's length and
    picks the tiles (``config``), unless ``tiles`` gives them. Capturable: no host sync."""
    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    parts = head_dim_parts(head_dim)
    if qkv.dtype not in (torch.float16, torch.bfloat16) or parts is None or width != 3 * num_heads * head_dim:
        raise ValueError(f"short_attention needs fp16/bf16 qkv [T, 3 * H * D] with a head dim that splits into "
                         f"powers of two, got {qkv.dtype} {tuple(qkv.shape)} for {num_heads} heads")
    if not qkv.is_contiguous() or cu_seqlens.dtype != torch.int32:
        raise ValueError("short_attention needs a contiguous qkv and int32 cu_seqlens")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if out is None:
        out = torch.empty(rows, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    segments = cu_seqlens.shape[0] - 1
    if rows == 0 or segments == 0:
        return out
    block_m, block_n, warps, stages = tiles or config(max_seqlen)
    grid = (triton.cdiv(rows, block_m) + segments, num_heads)
    _short_attention_kernel[grid](
        qkv, cos if cos is not None else qkv, sin if sin is not None else qkv, out, cu_seqlens, segments,
        head_dim ** -0.5 * math.log2(math.e), H=num_heads, D=head_dim, DA=parts[0], DB=parts[1],
        BLOCK_M=block_m, BLOCK_N=block_n, SEG_BLOCK=triton.next_power_of_2(segments + 1), ROPE=cos is not None,
        num_warps=warps, num_stages=stages)
    return out
