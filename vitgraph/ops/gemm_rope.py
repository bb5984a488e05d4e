"""qkv with the bias and the 2-D rotary in one CuTe-DSL GEMM epilogue (quack-kernels, Hopper).

The fused forward otherwise runs the qkv GEMM and then a Triton pass that reads q and k back,
rotates them in fp32 and writes them again (42 MB at 4096 tokens, one launch per block). Here
the rotation is applied to the fp32 accumulator before the one bf16 store.

A rotation mixes two dims of a head. The tower keeps qkv's weight rows with those two side by
side (:func:`vitgraph.models.tower_base.interleave_order`), and the Hopper accumulator keeps
adjacent columns of a row in adjacent registers of one thread, so each pair rotates in place.

Angles come from two per-row vectors (the patch's row and column position, ``-1`` for padding
rows, whose q, k and v are zeroed) and two per-column vectors (the frequency that multiplies
each position, 0 where it does not apply: :meth:`vitgraph.models.fused_loop.FusedLoop.rope_columns`), so
``pos_h * freq_h + pos_w * freq_w`` is the same single fp32 product the reference takes. The
angle is reduced to ``[-pi, pi]`` and its cosine and sine taken with the hardware
approximations (absolute error about 1e-6, far below bf16's step). v's columns have zero
frequencies and pass through unrotated, their non-finite values zeroed (what the fused
forward's FlashAttention 4 path needs to keep items apart).
"""

import functools
import hashlib
import inspect
import math

import torch


TWO_PI_HI = 6.2831854820251465  # float32(2 pi)
TWO_PI_LO = 2 * math.pi - TWO_PI_HI  # the rest, for a two-step reduction


def _epilogue_source() -> bytes:
    """What the compiled kernel depends on beyond quack's own sources (those key quack's cache)."""
    return (inspect.getsource(_gemm_rope_class) + repr((TWO_PI_HI, TWO_PI_LO))).encode()


@functools.cache
def _gemm_rope_class():
    """quack's Hopper GEMM with an epilogue of bias, rotary and padding-row zeroing."""
    from typing import NamedTuple

    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from quack.cute_dsl_utils import mlir_namedtuple
    from quack.epi_composable import ComposableEpiMixin
    from quack.epi_ops import ColVecLoad, RowVecLoad
    from quack.gemm_sm90 import GemmSm90
    from quack.rounding import RoundingMode

    inv_two_pi = 1.0 / (2 * math.pi)

    class RopeEpilogue(ComposableEpiMixin):
        _epi_ops = (RowVecLoad("mBias"), RowVecLoad("mFreqH"), RowVecLoad("mFreqW"),
                    ColVecLoad("mPosH"), ColVecLoad("mPosW"))

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            mBias: cute.Tensor
            mFreqH: cute.Tensor
            mFreqW: cute.Tensor
            mPosH: cute.Tensor
            mPosW: cute.Tensor

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            self.rounding_mode = RoundingMode.RN
            return self.EpilogueParams(**self._epi_ops_to_params_dict(args))

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD: cute.Tensor, tRS_rC=None):
            bias, freq_h, freq_w = epi_loop_tensors["mBias"], epi_loop_tensors["mFreqH"], epi_loop_tensors["mFreqW"]
            pos_h, pos_w = epi_loop_tensors["mPosH"], epi_loop_tensors["mPosW"]
            # Registers 2i and 2i + 1 hold adjacent columns of one row: one rotated pair.
            for i in cutlass.range(cute.size(tRS_rD) // 2, unroll_full=True):
                a, b = 2 * i, 2 * i + 1
                x0 = tRS_rD[a] + bias[a]
                x1 = tRS_rD[b] + bias[b]
                angle = pos_h[a] * freq_h[a] + pos_w[a] * freq_w[a]
                turns = Float32(cute.math.floor(angle * inv_two_pi + 0.5))
                reduced = (angle - turns * TWO_PI_HI) - turns * TWO_PI_LO
                rotated = freq_h[a] + freq_w[a] > 0.0  # q's and k's columns; v's have no frequency
                cos = Float32(cute.math.cos(reduced, fastmath=True))
                sin = Float32(cute.math.sin(reduced, fastmath=True))
                # v keeps finite values only (x - x is 0 only then): FA4 weighs 0 past a segment, 0 * NaN is NaN.
                y0 = Float32(cutlass.select_(rotated, x0 * cos - x1 * sin,
                                             cutlass.select_(x0 - x0 == 0.0, x0, Float32(0.0))))
                y1 = Float32(cutlass.select_(rotated, x1 * cos + x0 * sin,
                                             cutlass.select_(x1 - x1 == 0.0, x1, Float32(0.0))))
                keep = pos_h[a] >= 0.0  # padding rows may hold NaN: select, never multiply
                tRS_rD[a] = Float32(cutlass.select_(keep, y0, 0.0))
                tRS_rD[b] = Float32(cutlass.select_(keep, y1, 0.0))
            return None

    class GemmRopeSm90(RopeEpilogue, GemmSm90):
        pass

    return GemmRopeSm90


@functools.cache
def _compiler():
    from cutlass import BFloat16, Float32
    from quack.cache import jit_cache
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_gemm_tensors, make_fake_scheduler_args

    @jit_cache
    def compile_gemm_rope(source_sha: str, tile_mn: tuple, cluster_mnk: tuple, pingpong: bool, device_capacity: tuple):
        # source_sha is part of quack's disk-cache key: an edit of the epilogue never loads a stale kernel.
        gemm_cls = _gemm_rope_class()
        m_a, m_b, m_d, _, m, n, _, l = make_fake_gemm_tensors(BFloat16, BFloat16, BFloat16, None, "k", "k", "n", None)
        epi_args = gemm_cls.EpilogueArguments(
            mBias=make_fake_tensor(BFloat16, (l, n), leading_dim=1, divisibility=4),
            mFreqH=make_fake_tensor(Float32, (l, n), leading_dim=1, divisibility=4),
            mFreqW=make_fake_tensor(Float32, (l, n), leading_dim=1, divisibility=4),
            mPosH=make_fake_tensor(Float32, (l, m), leading_dim=1, divisibility=4),
            mPosW=make_fake_tensor(Float32, (l, m), leading_dim=1, divisibility=4),
        )
        return compile_gemm_kernel(
            gemm_cls, BFloat16, tile_mn, cluster_mnk, pingpong, True, False, False, device_capacity,
            m_a, m_b, m_d, None, epi_args, make_fake_scheduler_args(False, False, l), None)

    return compile_gemm_rope, hashlib.sha256(_epilogue_source()).hexdigest()[:16]


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, freq_h: torch.Tensor, freq_w: torch.Tensor,
             pos_h: torch.Tensor, pos_w: torch.Tensor, config) -> torch.Tensor:
    """``x @ weight.T + bias`` with q and k rotated, padding rows and v's non-finite values zeroed,
    one kernel.

    ``weight [N, K]``/``bias [N]``: qkv with each rotated pair of columns side by side;
    ``freq_h``/``freq_w``: fp32 ``[N]`` per-column frequencies; ``pos_h``/``pos_w``: fp32
    ``[M]`` positions, ``pos_h < 0`` on padding rows; ``config``: a quack ``GemmConfig``.
    Returns bf16 ``[M, N]``.
    """
    from quack.cute_dsl_utils import get_device_capacity, get_max_active_clusters
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise TypeError(f"qkv_rope is compiled for bf16, got x {x.dtype} and weight {weight.dtype}")

    compile_gemm_rope, source_sha = _compiler()
    capacity = get_device_capacity(x.device)
    cluster = (config.cluster_m, config.cluster_n, 1)
    kernel = compile_gemm_rope(source_sha, (config.tile_m, config.tile_n), cluster, config.pingpong, capacity)
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    # quack's operands are (rows, K, batch) views; batch 1.
    a, b, d = (t.unsqueeze(0).permute(1, 2, 0) for t in (x, weight, out))
    epi_args = _gemm_rope_class().EpilogueArguments(
        mBias=bias[None], mFreqH=freq_h[None], mFreqW=freq_w[None], mPosH=pos_h[None], mPosW=pos_w[None])
    scheduler = make_scheduler_args(get_max_active_clusters(cluster[0] * cluster[1]), 8, None)
    kernel(a, b, d, None, epi_args, scheduler, None, None)
    return out
