"""What a GEMM pays to sum each row of its input while its main loop streams the rows through.

    python benchmarks/gemm_row_stats.py 1024 4096                     # on an H200: check, then time
    CUTE_DSL_ARCH=sm_90a python benchmarks/gemm_row_stats.py --compile-only   # trace and compile, no GPU

The LayerNorm ahead of qkv and fc1 reads the residual stream and writes its normalized rows,
which the GEMM then reads. Folded into the GEMM (``LN(x) Wᵀ = rstd·x(γ∘W)ᵀ − rstd·μ·Σ(γ∘W) +
(Wβ + b)``), the LayerNorm kernel is left with each row's mean and spread to find. But the GEMM
reads every row whole, all of K being the hidden width: its A tiles pass through shared memory
anyway. This measures what summing them there costs: quack's Hopper GEMM (bias epilogue)
whose MMA warps, while each WGMMA runs, also read their stage's A tile from shared memory and
sum each row's values and squares in fp32 (written to ``[M]`` vectors for the check), against
the same GEMM without that work. Each timed inside CUDA graphs with 8 weight sets rotated (as
streamed in the tower), µs per call; the sums are checked against torch's.

A prototype for measurement, not a tower kernel: no folded epilogue, no rotary or QuickGELU.
Needs the ``fa4`` extra's quack-kernels and CuTe DSL (``--compile-only`` too).
"""

import argparse
import functools
import os

import torch

TILES = {  # name: (tile_m, tile_n, pingpong, cluster_m, cluster_n), the tower's tiles
    "128x160pp12": (128, 160, True, 1, 2),   # fc1 (and qkv at 4096 rows)
    "128x240coop12": (128, 240, False, 1, 2),  # qkv at 1024 rows
}
LAYERS = {"fc1": 5120, "qkv": 3840}  # N; K is the hidden width
WIDTH = 1280
SETS = 8
CHAINS = 8  # independent fp32 partial sums per statistic and thread


@functools.cache
def _gemm_class(with_stats: bool):
    import cutlass
    import cutlass.cute as cute
    from typing import NamedTuple
    from cutlass import Boolean, Float32, const_expr
    from quack import sm90_utils
    from quack.cute_dsl_utils import mlir_namedtuple
    from quack.epi_composable import ComposableEpiMixin
    from quack.epi_ops import RowVecLoad
    from quack.gemm_sm90 import GemmSm90
    from quack.rounding import RoundingMode
    from cutlass.cute.nvgpu import warpgroup

    class BiasStatsEpilogue(ComposableEpiMixin):
        _epi_ops = (RowVecLoad("mBias"),)
        _extra_param_fields = (("mSum", cute.Tensor, None), ("mSq", cute.Tensor, None))

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            mBias: cute.Tensor
            mSum: cute.Tensor
            mSq: cute.Tensor

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            self.rounding_mode = RoundingMode.RN
            return self.EpilogueParams(**self._epi_ops_to_params_dict(args), mSum=args.mSum, mSq=args.mSq)

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD: cute.Tensor, tRS_rC=None):
            bias = epi_loop_tensors["mBias"]
            for i in cutlass.range(cute.size(tRS_rD), unroll_full=True):
                tRS_rD[i] = tRS_rD[i] + bias[i]
            return None

    class GemmRowStatsSm90(BiasStatsEpilogue, GemmSm90):
        """The A tile of each stage is summed per row by the MMA warps that consume it."""

        def _stats_threads_per_row(self):
            consumers = 128 if self.pingpong else 128 * self.mma_warp_groups
            return consumers // self.cta_tile_shape_mnk[0]

        @cute.jit
        def _row_partials(self, stage, p1: cute.Tensor, p2: cute.Tensor):
            # CHAINS independent partial sums per statistic: a single running sum would make each
            # stage's 32-64 adds one dependent chain, longer than the WGMMA it should hide behind.
            sA = self._stats_sA  # (bM, bK, stages), swizzled
            tpr = const_expr(self._stats_threads_per_row())
            cols = const_expr(self.cta_tile_shape_mnk[2] // tpr)
            tidx = cute.arch.thread_idx()[0]
            if const_expr(self.pingpong):
                tidx = tidx % 128
            row, part = tidx // tpr, tidx % tpr
            view = cute.local_tile(sA[row, None, stage], (cols,), (part,))
            frag = cute.make_rmem_tensor(cols, sA.element_type)
            cute.autovec_copy(view, frag)
            for j in cutlass.range_constexpr(cols):
                v = Float32(frag[j])
                p1[j % CHAINS] = p1[j % CHAINS] + v
                p2[j % CHAINS] = p2[j % CHAINS] + v * v

        @cute.jit
        def mma(self, ab_pipeline, ab_read_state, mma_fn, acc, acc_slow, k_tile_cnt, warp_group_idx):
            # GemmSm90.mma (fp8 slow accumulation left out), with the row sums of each stage's A.
            p1 = cute.make_rmem_tensor(CHAINS, Float32)
            p2 = cute.make_rmem_tensor(CHAINS, Float32)
            p1.fill(0.0)
            p2.fill(0.0)
            k_pipe_mmas = 1
            ab_release_state = ab_read_state.clone()
            num_prologue_mma = min(k_pipe_mmas, k_tile_cnt)
            peek_ab_full_status = Boolean(True)
            if 0 < k_tile_cnt:
                peek_ab_full_status = ab_pipeline.consumer_try_wait(ab_read_state)
            zero_init = Boolean(True)
            for k_tile in cutlass.range(num_prologue_mma):
                ab_pipeline.consumer_wait(ab_read_state, peek_ab_full_status)
                mma_fn(A_idx=ab_read_state.index, B_idx=ab_read_state.index, zero_init=zero_init)
                if const_expr(with_stats):
                    self._row_partials(ab_read_state.index, p1, p2)
                zero_init = Boolean(False)
                ab_read_state.advance()
                peek_ab_full_status = Boolean(True)
                if k_tile + 1 < k_tile_cnt:
                    peek_ab_full_status = ab_pipeline.consumer_try_wait(ab_read_state)
            for k_tile in cutlass.range(num_prologue_mma, k_tile_cnt, unroll=1):
                ab_pipeline.consumer_wait(ab_read_state, peek_ab_full_status)
                mma_fn(A_idx=ab_read_state.index, B_idx=ab_read_state.index, zero_init=zero_init)
                if const_expr(with_stats):
                    self._row_partials(ab_read_state.index, p1, p2)
                zero_init = Boolean(False)
                warpgroup.wait_group(k_pipe_mmas)
                ab_pipeline.consumer_release(ab_release_state)
                ab_read_state.advance()
                ab_release_state.advance()
                peek_ab_full_status = Boolean(True)
                if k_tile + 1 < k_tile_cnt:
                    peek_ab_full_status = ab_pipeline.consumer_try_wait(ab_read_state)
            if const_expr(self.pingpong):
                self.pingpong_barrier_arrive(1 - warp_group_idx, stage="mma")
            warpgroup.wait_group(0)
            for k_tile in cutlass.range(num_prologue_mma, unroll=1):
                ab_pipeline.consumer_release(ab_release_state)
                ab_release_state.advance()
            self._stats_sums = (p1, p2)
            return ab_read_state

        @cute.jit
        def epi_visit_acc(self, params, acc, tiled_mma, tile_coord_mnkl, tidx):
            if const_expr(with_stats):
                p1, p2 = self._stats_sums
                s1, s2 = Float32(0.0), Float32(0.0)
                for j in cutlass.range_constexpr(CHAINS):
                    s1, s2 = s1 + p1[j], s2 + p2[j]
                tpr = const_expr(self._stats_threads_per_row())
                for i in cutlass.range_constexpr(tpr.bit_length() - 1):
                    s1 = s1 + cute.arch.shuffle_sync_bfly(s1, offset=1 << i)
                    s2 = s2 + cute.arch.shuffle_sync_bfly(s2, offset=1 << i)
                t = tidx
                if const_expr(self.pingpong):
                    t = tidx % 128
                row = tile_coord_mnkl[0] * self.cta_tile_shape_mnk[0] + t // tpr
                # Every CTA of a row tile found the same sums; the first column tile writes them.
                if tile_coord_mnkl[1] == 0 and t % tpr == 0 and row < params.mSum.shape[1]:
                    params.mSum[tile_coord_mnkl[3], row] = s1
                    params.mSq[tile_coord_mnkl[3], row] = s2

    return GemmRowStatsSm90, sm90_utils


@functools.cache
def _compiler():
    from cutlass import BFloat16, Float32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_gemm_tensors, make_fake_scheduler_args

    @functools.cache
    def compile_kernel(with_stats: bool, tile: tuple, capacity: tuple):
        gemm_cls, sm90_utils = _gemm_class(with_stats)
        tile_m, tile_n, pingpong, cluster_m, cluster_n = tile
        m_a, m_b, m_d, _, m, n, _, l = make_fake_gemm_tensors(BFloat16, BFloat16, BFloat16, None, "k", "k", "n", None)
        epi_args = gemm_cls.EpilogueArguments(
            mBias=make_fake_tensor(BFloat16, (l, n), leading_dim=1, divisibility=4),
            mSum=make_fake_tensor(Float32, (l, m), leading_dim=1, divisibility=4),
            mSq=make_fake_tensor(Float32, (l, m), leading_dim=1, divisibility=4))
        # The MMA warps need the A tiles in shared memory: take them where the kernel partitions them.
        partition = sm90_utils.partition_fragment_ABC

        def capture(thr_mma, shape_mnk, sA, sB, swap_AB=False):
            capture.gemm._stats_sA = sA
            return partition(thr_mma, shape_mnk, sA, sB, swap_AB)

        original_init = gemm_cls.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            capture.gemm = self

        gemm_cls.__init__ = init
        sm90_utils.partition_fragment_ABC = capture
        try:
            return compile_gemm_kernel(
                gemm_cls, BFloat16, (tile_m, tile_n), (cluster_m, cluster_n, 1), pingpong, True, False, False,
                capacity, m_a, m_b, m_d, None, epi_args, make_fake_scheduler_args(False, False, l), None)
        finally:
            sm90_utils.partition_fragment_ABC = partition
            gemm_cls.__init__ = original_init

    return compile_kernel


def linear_row_stats(x, weight, bias, tile: tuple, with_stats: bool):
    """``x @ weight.T + bias`` (bf16) and, with ``with_stats``, fp32 row sums and sums of squares of x."""
    from quack.cute_dsl_utils import get_max_active_clusters
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    kernel = _compiler()(with_stats, tile, (9, 0))
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    sums = torch.zeros(1, x.shape[0], device=x.device, dtype=torch.float32)
    squares = torch.zeros(1, x.shape[0], device=x.device, dtype=torch.float32)
    a, b, d = (t.unsqueeze(0).permute(1, 2, 0) for t in (x, weight, out))
    epi_args = _gemm_class(with_stats)[0].EpilogueArguments(mBias=bias[None], mSum=sums, mSq=squares)
    cluster = tile[3] * tile[4]
    kernel(a, b, d, None, epi_args, make_scheduler_args(get_max_active_clusters(cluster), 8, None), None, None)
    return out, sums[0], squares[0]


def compile_only(tiles) -> None:
    import time

    for name in tiles:
        for with_stats in (False, True):
            start = time.perf_counter()
            _compiler()(with_stats, TILES[name], (9, 0))
            print(f"{name} {'with' if with_stats else 'without'} row sums: compiled in {time.perf_counter() - start:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", type=int, default=[1024, 4096])
    p.add_argument("--tiles", nargs="*", default=list(TILES), choices=list(TILES))
    p.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--compile-only", action="store_true", help="trace and compile for sm_90a, no GPU needed")
    args = p.parse_args()
    if args.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        compile_only(args.tiles)
        return
    from vitgraph.bench.common import graph_per_call_us

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("layer rows tile            | no sums µs  sums µs  delta | max rel err: out, row sums, sums of squares")
    for layer in args.layers:
        n = LAYERS[layer]
        weights = [torch.randn(n, WIDTH, device=dev, dtype=bf16) / WIDTH ** 0.5 for _ in range(SETS)]
        biases = [0.1 * torch.randn(n, device=dev, dtype=bf16) for _ in range(SETS)]
        for m in args.rows:
            x = (torch.randn(m, WIDTH, device=dev) + 0.5).to(bf16)
            ref = torch.nn.functional.linear(x, weights[0], biases[0]).float()
            ref_sum, ref_sq = x.float().sum(1), (x.float() ** 2).sum(1)
            for name in args.tiles:
                tile = TILES[name]
                out, s1, s2 = linear_row_stats(x, weights[0], biases[0], tile, True)
                plain, _, _ = linear_row_stats(x, weights[0], biases[0], tile, False)
                errs = [((a.float() - b).abs().max() / b.abs().max()).item()
                        for a, b in ((out, ref), (s1, ref_sum), (s2, ref_sq))]
                same = torch.equal(out, plain)
                us = [graph_per_call_us([lambda i=i, w=w: linear_row_stats(x, weights[i], biases[i], tile, w)
                                         for i in range(SETS)]) for w in (False, True)]
                print(f"{layer:5s} {m:4d} {name:15s} | {us[0]:9.2f} {us[1]:8.2f} {us[1] - us[0]:+6.2f} | "
                      f"{errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}{'' if same else '  (outputs differ!)'}")


if __name__ == "__main__":
    main()
