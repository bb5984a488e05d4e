"""Short-frame attention in CUDA graphs: an experimental Triton kernel (rotary optionally
fused in) against FlashAttention 4 with the rotary pass before it, per packed layout, µs per
call. Measured and not adopted (BENCHMARKS.md, "Tried and not kept"): without the rotary it
only matches FA4 on frames of 256-576 tokens and loses from 1024; with the rotary fused it is
3-4x slower; it wins only on tiny frames (64 tokens).

    python benchmarks/short_attention.py                # the default tiles and a sweep of others
    python benchmarks/short_attention.py 1x256 16x256   # some layouts only

The kernel: programs are ``(query tile, head)``; query tiles are numbered across the
segments of ``cu_seqlens`` by a prefix sum in each program, so the grid is static for a
graph; key tiles past a segment's end are masked on load; the head dim splits into two
power-of-two parts (80 = 64 + 16) so no MMA runs on padding lanes.

Columns: ``fa4+rot`` is the fused forward's path below ``QUACK_ROPE_MIN_ROWS`` rows (the
Triton rotary kernel, padding zeroed, then FA4 with vitgraph's tile rule); ``fa4`` is FA4
alone (where qkv's GEMM applies the rotary); ``tri+rot``/``tri`` the Triton kernel with and
without the rotary, default tiles; then the sweep, with / without the rotary. Each layout
sits in a bucket of 16 segment slots (64 for 64-token frames) whose rows round up to 256.
Needs a CUDA GPU; the FA4 columns need flash-attn-4.
"""
import math
import sys

import torch
import triton
import triton.language as tl

from vitgraph.ops import kernels
from vitgraph.ops.attention import _has_fa4, fa4_tile
from vitgraph.bench.common import graph_replay_us


def head_dim_parts(head_dim: int) -> tuple[int, int] | None:
    """``head_dim`` as ``a + b``, ``a`` the largest power of two in it and ``b`` 0 or a power
    of two of at least 16 (an MMA's depth); None where it does not split so."""
    a = 1 << (head_dim.bit_length() - 1)
    b = head_dim - a
    if a < 16 or (b and (b < 16 or b & (b - 1))):
        return None
    return a, b


def config(max_seqlen: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for segments of at most ``max_seqlen`` tokens."""
    if max_seqlen <= 256:
        return 64, 64, 4, 2
    return 128, 64, 8, 2


@triton.jit
def _load_part(qkv_ptr, cos_ptr, sin_ptr, rows, row_ok, col0: tl.constexpr, WIDTH: tl.constexpr,
               STRIDE: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
    """Columns ``[col0, col0 + WIDTH)`` of ``rows`` (the q or k of one head starts at
    ``qkv_ptr``), rotated when ``ROPE``: ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``
    per side-by-side pair, in fp32, rounded back."""
    r = rows.to(tl.int64)[:, None]
    ok = row_ok[:, None]
    if ROPE:
        # [rows, pairs, 2]: contiguous loads, the pair split in registers.
        p = (col0 // 2 + tl.arange(0, WIDTH // 2))[None, :]
        two = tl.arange(0, 2)[None, None, :]
        x = tl.load(qkv_ptr + (r * STRIDE + 2 * p)[:, :, None] + two, mask=ok[:, :, None], other=0.0)
        x0, x1 = tl.split(x.to(tl.float32))
        cos = tl.load(cos_ptr + r * HALF + p, mask=ok, other=0.0)
        sin = tl.load(sin_ptr + r * HALF + p, mask=ok, other=0.0)
        rotated = tl.join(x0 * cos - x1 * sin, x1 * cos + x0 * sin)
        return tl.reshape(rotated, (rows.shape[0], WIDTH)).to(x.dtype)
    c = col0 + tl.arange(0, WIDTH)[None, :]
    return tl.load(qkv_ptr + r * STRIDE + c, mask=ok, other=0.0)


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


H, D = 16, 80
LAYOUTS = {"1x256": [256], "1x512": [512], "1x1024": [1024], "16x256": [256] * 16, "8x448": [448] * 8,
           "4x1024": [1024] * 4, "64x64": [64] * 64, "2x2048": [2048] * 2, "1x2048+8x256": [2048] + [256] * 8,
           "4x576": [576] * 4, "1x2048": [2048]}
SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 2),
         (128, 32, 4, 2), (128, 128, 8, 3)]


def main():
    fa4 = _has_fa4(torch.device("cuda"))
    if fa4:
        from flash_attn.cute.interface import _flash_attn_fwd
    print(f"{'layout':14s} {'fa4+rot':>8s} {'fa4':>8s} {'tri+rot':>8s} {'tri':>8s}  err   | sweep (tri+rot / tri)", flush=True)
    chosen = sys.argv[1:] or list(LAYOUTS)
    for name, lens in ((name, LAYOUTS[name]) for name in chosen):
        total = sum(lens)
        slots = 64 if len(lens) > 16 else 16
        rows = -(-total // 256) * 256
        cu = torch.full((slots + 1,), total, dtype=torch.int32)
        cu[0] = 0
        cu[1:len(lens) + 1] = torch.tensor(lens).cumsum(0)
        cu = cu.cuda()
        seg = torch.full((rows,), -1, dtype=torch.int32)
        seg[:total] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
        seg = seg.cuda()
        g = torch.Generator(device="cuda").manual_seed(0)
        source = torch.randn(rows, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
        angles = torch.rand(rows, D // 2, device="cuda", generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
        qkv = source.clone()
        # A short-frame bucket bounds its frames (vitgraph's cap above 2048 tokens); else the budget.
        max_seqlen = min(rows, 2048) if max(lens) <= 2048 else rows
        cells = {}
        if fa4:
            tile = fa4_tile(max_seqlen, H, qkv.device)

            def fa4_only():
                q, k, v = qkv.view(rows, 3, H, D).unbind(1)
                return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                       max_seqlen_k=max_seqlen, **tile)[0]

            def fa4_rot():
                qkv.copy_(source)  # the rotary is in place: rotate the same inputs every call
                kernels.rotary_(qkv, cos, sin, H, seg, zero_padding=True)
                return fa4_only()

            ref = fa4_rot()[:total].float()
            copy_us, _ = graph_replay_us(lambda: qkv.copy_(source))
            cells["fa4+rot"] = graph_replay_us(fa4_rot)[0] - copy_us
            cells["fa4"] = graph_replay_us(fa4_only)[0]
        out = torch.empty(rows, H, D, device="cuda", dtype=torch.bfloat16)
        got = short_attention(source, cu, H, max_seqlen, cos, sin, out=out)[:total].float()
        err = ((got - ref).norm() / ref.norm()).item() if fa4 else float("nan")
        cells["tri+rot"] = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, cos, sin, out=out))[0]
        cells["tri"] = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, out=out))[0]
        sweep = []
        for tiles in SWEEP:
            try:
                rot = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, cos, sin, out=out,
                                                              tiles=tiles))[0]
                plain = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, out=out, tiles=tiles))[0]
                sweep.append(f"{tiles[0]}x{tiles[1]}w{tiles[2]}s{tiles[3]} {rot:5.1f}/{plain:5.1f}")
            except Exception as exc:  # e.g. out of shared memory
                sweep.append(f"{tiles}: {type(exc).__name__}")
        row = " ".join(f"{cells.get(k, float('nan')):8.1f}" for k in ("fa4+rot", "fa4", "tri+rot", "tri"))
        print(f"{name:14s} {row} {err:.0e} | default {config(max_seqlen)} | " + " | ".join(sweep), flush=True)


if __name__ == "__main__":
    main()
