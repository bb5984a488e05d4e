"""Triton kernels for the elementwise work of a block (the "fused" forward).

Four launches per block (LayerNorm twice, rotary, the activation) replace the plain forward's
elementwise ops (two LayerNorms, two residual adds, the rotary's half-dozen ops, a copy of v):

* :func:`add_layernorm`: ``x += y`` (in place), then ``LayerNorm(x)``, joining each residual add
  to the LayerNorm after it (or, where the GEMM before it added into ``x`` itself, normalizing
  ``x`` plus the biases kept aside); with ``quant``, an FP8 GEMM's input (:mod:`.fp8_kernels`);
* :func:`rotary_`: fp32 2-D rotary of q and k inside the packed ``qkv`` rows (each rotated pair
  side by side, read as one integer), in place (padding rows optionally zeroed, for kernels
  that read past a segment's end), or into a wider head dim whose extra lane masks padding keys
  (dense attention over a padded bucket, see :mod:`vitgraph.ops.attention`);
* :func:`activation_` (QuickGELU, GELU-tanh, SiLU) in place, and :func:`silu_mul` (SwiGLU's
  ``silu(gate) * up``); :func:`add_layernorm` with ``rms=True`` is its RMSNorm form;
* :func:`prefix_sums`: the fp32 running sums of the biases a residual stream keeps aside.

Arithmetic is fp32 inside, rounded once to the tensor dtype. Each kernel handles whole rows in one
program and never reads a row another program writes, so in-place updates are safe (``prefix_sums``
handles whole columns, into a new tensor). CUDA tensors, and CPU ones under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os
from collections import namedtuple
from dataclasses import dataclass

import torch

from . import fp8

PAD_KEY_SCORE = -16384.0  # extra-lane value of a padding key: q.k gains -16384, exp() of it is 0


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton's interpreter is on: the kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(device: torch.device | str) -> bool:
    """The kernels can run on tensors of ``device``: triton is there, on CUDA or the interpreter."""
    return available() and (torch.device(device).type == "cuda" or interpreted())


@dataclass(frozen=True)
class NormTuning:
    """How add+LayerNorm lays out its programs and launches: data an encoder derives from its
    device and its tower's width (:func:`norm_tuning`) and a tower holds."""

    # Hopper and later: let the kernel after it launch once every program has started
    # (griddepcontrol.launch_dependents): quack's GEMMs after it (launched with programmatic
    # dependent launch) overlap their launch and prologue with it. Up to this many rows (above,
    # it measured slower: benchmarks/HISTORY.md); 0: never.
    launch_dependents_max_rows: int = 0
    one_row_max_rows: int = 512  # one row per program, 8 warps, up to here: fills more SMs


def norm_tuning(arch: int | None) -> NormTuning:
    """The LayerNorm tuning on a device of compute capability major ``arch`` (None: not a GPU, where
    one row per program, which fills a GPU's SMs, only makes Triton's interpreter run more programs)."""
    hopper = arch is not None and arch >= 9  # griddepcontrol needs compute capability 9
    return NormTuning(launch_dependents_max_rows=2048 if hopper else 0, one_row_max_rows=512 if arch else 0)


DEFAULT_NORMS = NormTuning()
# From WIDE_MIN_ROWS rows of widths in WIDE_WIDTHS (one power-of-two block): (rows per program,
# warps) = WIDE_LAYOUT, measured faster at 1280 wide (benchmarks/HISTORY.md); else the width rule.
WIDE_MIN_ROWS = 2049
WIDE_LAYOUT = (2, 2)
WIDE_WIDTHS = (1025, 2048)


def _launches_dependents(t: torch.Tensor, tuning: NormTuning) -> bool:
    return t.shape[0] <= tuning.launch_dependents_max_rows and t.is_cuda and not interpreted()


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
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def store_fp8_rows(hf, q_ptr, scale_ptr, offs, r, mask, rows, ld, MIN: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr):  # ld: the scales' column stride
        # NaN kept (its row's scale NaN, as torch's); times 1/448; one IEEE reciprocal per row (GROUP: per
        # row and GROUP columns), then a product per value: vitgraph.ops.fp8.quantize_rows (quantize_groups)
        if GROUP == 0:
            amax = tl.reduce(tl.abs(hf), 1, _max_nan)[:, None]
            scale = tl.maximum(amax * (1.0 / 448.0), MIN, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + offs, (hf * tl.math.div_rn(1.0, scale)).to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(scale_ptr + r, scale, mask=r < rows)
        else:
            h3 = tl.reshape(hf, (ROWS, BLOCK_N // GROUP, GROUP))
            amax = tl.reduce(tl.abs(h3), 2, _max_nan)
            scale = tl.maximum(amax * (1.0 / 448.0), MIN, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + offs, tl.reshape(h3 * tl.math.div_rn(1.0, scale)[:, :, None], (ROWS, BLOCK_N))
                     .to(q_ptr.dtype.element_ty), mask=mask)
            g = tl.arange(0, BLOCK_N // GROUP)[None, :]  # scales [rows, ceil(N / GROUP)], column-major (cuBLAS's)
            tl.store(scale_ptr + g * ld + r, scale, mask=(r < rows) & (g * GROUP < N))

    @triton.jit
    def _add_layernorm_kernel(x_ptr, y_ptr, y_bias_ptr, offset_ptr, h_ptr, w_ptr, b_ptr, rows, eps,
                              N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_Y: tl.constexpr,
                              SPLITS: tl.constexpr, HAS_Y_BIAS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                              LAUNCH_DEPENDENTS: tl.constexpr, RMS: tl.constexpr = False, scale_ptr=None,
                              QUANT: tl.constexpr = False, MIN_SCALE: tl.constexpr = 0.0, GROUP: tl.constexpr = 0):
        if LAUNCH_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        mask = (r < rows) & (c < N)
        offs = r.to(tl.int64) * N + c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_Y:
            # y: SPLITS partial products [SPLITS, rows, N] (a split-K GEMM's), summed in fp32.
            y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            for s in tl.static_range(1, SPLITS):
                y += tl.load(y_ptr + s * rows * N + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_Y_BIAS:
                y += tl.load(y_bias_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            # Round the sum to the stream dtype first: the residual stream is stored rounded.
            x = (x.to(tl.float32) + y).to(x.dtype)
            tl.store(x_ptr + offs, x, mask=mask)
        xf = x.to(tl.float32)
        if HAS_OFFSET:  # the stream's biases, kept aside in fp32 (see add_layernorm)
            xf += tl.load(offset_ptr + c, mask=c < N, other=0.0)
        if RMS:
            # RMSNorm as Qwen2.5-VL has it: fp32 statistics, rounded, then times the weight.
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1)[:, None] / N + eps)
            w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            h = (xf * rstd).to(x.dtype).to(tl.float32) * w
        else:
            h = layernorm_rows(xf, mask, c, w_ptr, b_ptr, N, eps)
        if QUANT:  # e4m3 rows and their scales for an FP8 GEMM (vitgraph.ops.fp8_kernels)
            store_fp8_rows(h.to(x.dtype).to(tl.float32), h_ptr, scale_ptr, offs, r, mask, rows, rows, MIN_SCALE, ROWS,
                           BLOCK_N, N, GROUP)
        else:
            tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unpack_pair(v, dtype: tl.constexpr, BITS: tl.constexpr):
        """One rotated pair loaded as one 2 * BITS-bit integer -> its two values, fp32."""
        half_type = tl.int16 if BITS == 16 else tl.int32
        lo = v.to(half_type).to(dtype, bitcast=True)  # integer narrowing keeps the low bits
        hi = (v >> BITS).to(half_type).to(dtype, bitcast=True)
        return lo.to(tl.float32), hi.to(tl.float32)

    @triton.jit
    def _pack_pair(lo, hi, dtype: tl.constexpr, BITS: tl.constexpr):
        """Round two fp32 values to ``dtype`` and pack them into one 2 * BITS-bit integer."""
        half_type = tl.int16 if BITS == 16 else tl.int32
        pair_type = tl.int32 if BITS == 16 else tl.int64
        low_mask = (1 << BITS) - 1
        lo_bits = lo.to(dtype).to(half_type, bitcast=True).to(pair_type) & low_mask
        hi_bits = hi.to(dtype).to(half_type, bitcast=True).to(pair_type)
        return lo_bits | (hi_bits << BITS)

    @triton.jit
    def _rotary_kernel(pair_ptr, cos_ptr, sin_ptr, seg_ptr, q_ptr, k_ptr, rows, pad_score,
                       H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, LANE: tl.constexpr, ZERO_PAD: tl.constexpr,
                       BITS: tl.constexpr, FINITE_V: tl.constexpr = False):
        # qkv keeps the two dims a rotation mixes side by side (the tower's interleaved layout),
        # so it is read as one integer per pair: tile [rows, heads, pairs], contiguous, no gathers.
        dtype = q_ptr.dtype.element_ty
        half: tl.constexpr = D // 2
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        p = tl.arange(0, BLOCK_HALF)[None, None, :]
        r64 = r.to(tl.int64)
        row_ok = r < rows
        mask = row_ok & (h < H) & (p < half)
        # One angle per pair: cos/sin [rows, D/2].
        cos = tl.load(cos_ptr + r64 * half + p, mask=row_ok & (p < half), other=0.0)
        sin = tl.load(sin_ptr + r64 * half + p, mask=row_ok & (p < half), other=0.0)
        src = r64 * (3 * H * half) + h * half + p  # in pairs
        q0, q1 = _unpack_pair(tl.load(pair_ptr + src, mask=mask, other=0), dtype, BITS)
        k0, k1 = _unpack_pair(tl.load(pair_ptr + src + H * half, mask=mask, other=0), dtype, BITS)
        # (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): the reference's x * cos + rotate_half(x) * sin
        oq = _pack_pair(q0 * cos - q1 * sin, q1 * cos + q0 * sin, dtype, BITS)
        ok = _pack_pair(k0 * cos - k1 * sin, k1 * cos + k0 * sin, dtype, BITS)
        if ZERO_PAD:
            # Padding rows: q, k, v zeroed (they may hold NaN). With the lane (below) padding
            # keys then get exactly zero weight; kernels that load whole key tiles past a
            # segment's end weight those rows' v by 0, and 0 * NaN is NaN.
            pad = tl.load(seg_ptr + r, mask=row_ok, other=-1) < 0
            zero = tl.zeros_like(oq)
            oq, ok = tl.where(pad, zero, oq), tl.where(pad, zero, ok)
            if FINITE_V:
                # And v's non-finite values 0: a key tile past a segment's end weighs the next
                # segment's values 0, and 0 * NaN would carry one item's NaN into another's rows.
                v0, v1 = _unpack_pair(tl.load(pair_ptr + src + 2 * H * half, mask=mask, other=0), dtype, BITS)
                v0 = tl.where(((v0 - v0) == 0.0) & ~pad, v0, 0.0)  # x - x is 0 only for finite x
                v1 = tl.where(((v1 - v1) == 0.0) & ~pad, v1, 0.0)
                tl.store(pair_ptr + src + 2 * H * half, _pack_pair(v0, v1, dtype, BITS), mask=mask)
            else:
                tl.store(pair_ptr + src + 2 * H * half, zero, mask=mask & pad)
        if LANE:
            # New q, k [rows, H, DP]: the rotated pairs, then lanes whose first masks padding
            # keys: every real query gives a padding key (pad_score) exactly zero weight.
            dst = r64 * (H * DP // 2) + h * (DP // 2) + p  # in pairs
            tl.store(q_ptr.to(pair_ptr.dtype) + dst, oq, mask=mask)
            tl.store(k_ptr.to(pair_ptr.dtype) + dst, ok, mask=mask)
            lanes = tl.arange(0, DP - D)[None, None, :]  # the lanes past the head dim
            lane_mask = row_ok & (h < H)
            lane_dst = r64 * (H * DP) + h * DP + D + lanes
            tl.store(q_ptr + lane_dst, tl.where(lanes == 0, 1.0, 0.0).to(dtype), mask=lane_mask)
            tl.store(k_ptr + lane_dst, tl.where((lanes == 0) & pad, pad_score, 0.0).to(dtype), mask=lane_mask)
        else:
            tl.store(pair_ptr + src, oq, mask=mask)
            tl.store(pair_ptr + src + H * half, ok, mask=mask)

    @triton.jit
    def _activate(xf, ACT: tl.constexpr):
        if ACT == 0:  # quick_gelu
            return xf * tl.sigmoid(1.702 * xf)
        elif ACT == 1:  # gelu, tanh form: 0.5 x (1 + tanh(y)) == x * sigmoid(2 y)
            return xf * tl.sigmoid(1.5957691216057308 * (xf + 0.044715 * xf * xf * xf))
        else:  # silu
            return xf * tl.sigmoid(xf)

    @triton.jit
    def _activation_kernel(x_ptr, n, BLOCK: tl.constexpr, ACT: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + i, mask=mask, other=0.0)
        tl.store(x_ptr + i, _activate(x.to(tl.float32), ACT).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, width, BLOCK: tl.constexpr):
        # gu [T, 2 * width]: each row's gate, then its up; out [T, width] = silu(gate) * up.
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        src = (i // width) * (2 * width) + i % width
        g = tl.load(gu_ptr + src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + src + width, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _prefix_sums_kernel(x_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.arange(0, BLOCK_R)[:, None]
        c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (r < R) & (c < N)
        x = tl.load(x_ptr + r * N + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * N + c, tl.cumsum(x, axis=0), mask=mask)


def _rows_per_program(rows: int, width: int, per_program: int = 8192) -> int:
    # About 8k elements per program: enough bytes in flight, enough programs to fill the GPU.
    per = max(1, per_program // triton.next_power_of_2(width))
    return min(per, triton.next_power_of_2(max(rows, 1)))


LayerNormLaunch = namedtuple("LayerNormLaunch", ["rows", "warps"])  # rows per program, warps per program


def layernorm_launch(rows: int, width: int, tuning: NormTuning = DEFAULT_NORMS) -> LayerNormLaunch:
    """How :func:`add_layernorm` lays out ``rows`` rows of ``width`` over its programs."""
    if rows <= tuning.one_row_max_rows:
        return LayerNormLaunch(1, 8)
    if rows >= WIDE_MIN_ROWS and WIDE_WIDTHS[0] <= width <= WIDE_WIDTHS[1]:
        return LayerNormLaunch(*WIDE_LAYOUT)
    return LayerNormLaunch(_rows_per_program(rows, width), 8)


def add_layernorm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float, y_bias: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                  launch: LayerNormLaunch | None = None, rms: bool = False, tuning: NormTuning = DEFAULT_NORMS,
                  quant: bool = False, grouped: bool = False):
    """``x += y`` in place (when ``y`` is given), then return ``LayerNorm(x)``. ``x``: ``[T, N]``
    contiguous; ``y``: ``[T, N]``, or ``[S, T, N]`` partial products that are summed (in fp32,
    with ``y_bias [N]`` when given) before the add. ``offset``: fp32 ``[N]`` added to every row
    before the LayerNorm and not stored (``LayerNorm(x + offset)``), for a residual stream that
    keeps its biases aside (``FusedLoop.forward_fused``). ``tuning``: the tower's (:class:`NormTuning`);
    ``launch``: a layout other than the one it gives. ``quant``: the normalized rows, rounded to x's
    dtype, as e4m3 and their fp32 scales ``[T, 1]`` (``grouped``: per 128 columns too, column-major)."""
    rows, n = x.shape
    h = torch.empty_like(x, dtype=torch.float8_e4m3fn if quant else x.dtype)
    scale = fp8.empty_scales(rows, n, grouped, x.device) if quant else None
    if rows == 0:
        return (h, scale) if quant else h
    if y is not None and (not y.is_contiguous() or y.shape[-2:] != x.shape or y.dim() not in (2, 3)):
        raise ValueError(f"y must be a contiguous [T, N] or [S, T, N] tensor for x {tuple(x.shape)}, "
                         f"got {tuple(y.shape)}")
    if offset is not None and (offset.dtype != torch.float32 or offset.shape != (n,) or not offset.is_contiguous()):
        raise ValueError(f"offset must be a contiguous fp32 [{n}] tensor, got {offset.dtype} {tuple(offset.shape)}")
    launch = launch or layernorm_launch(rows, n, tuning)
    _add_layernorm_kernel[(triton.cdiv(rows, launch.rows),)](
        x, y if y is not None else x, y_bias if y_bias is not None else x, offset if offset is not None else x, h,
        weight, bias, rows, eps, N=n, BLOCK_N=triton.next_power_of_2(n), ROWS=launch.rows, HAS_Y=y is not None,
        SPLITS=y.shape[0] if y is not None and y.dim() == 3 else 1, HAS_Y_BIAS=y_bias is not None,
        HAS_OFFSET=offset is not None, LAUNCH_DEPENDENTS=_launches_dependents(x, tuning), RMS=rms, scale_ptr=scale,
        QUANT=quant, MIN_SCALE=fp8.MIN_SCALE, GROUP=fp8.kernel_group(grouped, n), num_warps=launch.warps)
    return (h, scale) if quant else h


_PAIR_TYPES = {16: torch.int32, 32: torch.int64}  # a rotated pair of 16- or 32-bit values, read as one integer


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            segment_ids: torch.Tensor | None = None, lane_dim: int | None = None, zero_padding: bool = False):
    """fp32 rotary of q and k in ``qkv [T, 3 * H * D]`` (contiguous, q's and k's head dims
    interleaved: :func:`vitgraph.models.tower_base.interleave_order`); ``cos``/``sin``: fp32
    ``[T, D/2]``, one angle per rotated pair (:meth:`vitgraph.models.rotary.RotaryFrequencies.rotary`).

    Without ``lane_dim``: rotates in place and returns ``(q, k, v)`` views ``[T, H, D]`` of ``qkv``;
    with ``zero_padding`` it also zeroes q, k and v of the rows whose ``segment_ids < 0``, and
    every non-finite value of v (FlashAttention 4 multiplies values past a segment's end by 0).
    With ``lane_dim = DP > D``: returns new ``q, k [T, H, DP]`` whose lane ``D`` masks padding keys
    (rows with ``segment_ids < 0``), and ``v``, a view of ``qkv`` with padding rows zeroed.
    """
    bits = qkv.element_size() * 8
    if bits not in _PAIR_TYPES or not qkv.is_floating_point():
        raise TypeError(f"rotary_ needs a 16- or 32-bit float qkv, got {qkv.dtype}")
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
            qkv.view(_PAIR_TYPES[bits]), cos, sin, segment_ids if segment_ids is not None else cos, q_out, k_out,
            rows, PAD_KEY_SCORE, H=num_heads, D=head_dim, DP=dp, BLOCK_H=block_h, BLOCK_HALF=block_half, ROWS=per,
            LANE=lane_dim is not None, ZERO_PAD=zero_padding or lane_dim is not None, BITS=bits,
            FINITE_V=zero_padding and lane_dim is None, num_warps=4)
    if lane_dim is None:
        return views
    return q_out, k_out, views[2]


FUSED_ACTIVATIONS = {"quick_gelu": 0, "gelu_pytorch_tanh": 1, "silu": 2}  # what activation_ computes


def activation_(x: torch.Tensor, name: str) -> torch.Tensor:
    """``name`` (one of ``FUSED_ACTIVATIONS``) of ``x`` in place, in fp32; ``x`` contiguous."""
    n = x.numel()
    if n:
        block = 4096
        _activation_kernel[(triton.cdiv(n, block),)](x, n, BLOCK=block, ACT=FUSED_ACTIVATIONS[name], num_warps=8)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2W]`` (contiguous; each row's gate, then its up),
    in fp32 and rounded once: ``[T, W]``."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, device=gate_up.device, dtype=gate_up.dtype)
    n = out.numel()
    if n:
        block = 4096
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate_up, out, n, width, BLOCK=block, num_warps=8)
    return out


def prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """fp32 running sums down the rows of ``x [R, N]`` (contiguous): ``torch.cumsum(x, 0,
    dtype=torch.float32)`` up to fp32 rounding, in one short kernel. torch's scan walks each
    column's rows in sequence, slow even for ``[64, 1280]`` (benchmarks/HISTORY.md); here each program loads
    all rows of a column block at once and scans them in registers."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [R, N] tensor, got {tuple(x.shape)}")
    rows, n = x.shape
    out = torch.empty(rows, n, device=x.device, dtype=torch.float32)
    if out.numel():
        block_r = triton.next_power_of_2(rows)
        block_n = max(16, min(triton.next_power_of_2(n), 8192 // block_r))  # at most 8k fp32 per program
        _prefix_sums_kernel[(triton.cdiv(n, block_n),)](x, out, rows, n, BLOCK_R=block_r, BLOCK_N=block_n,
                                                        num_warps=4)
    return out
