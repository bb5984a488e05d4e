"""FlashAttention 4's Hopper forward with its online softmax changed, to find what bounds it at
head_dim 80 (an experiment; vitgraph runs FA4's own softmax).

At head_dim 80 a score costs 2 x 80 multiply-adds in the two matmuls (about 0.08 cycles per
score per SM at the tensor cores' rate) and one MUFU ``ex2`` (16 per cycle per SM: 0.06
cycles), and each block rescales O (80 columns per 128 scores). Two variants, patched into
FA4's ``Softmax`` in this process only:

- ``--every N``: one exponential in every N of a thread's row fragment computed on the FMA
  units (FA4's own degree-3 ``ex2_emulation``, as its Blackwell kernels do), the rest on MUFU.
  A large N (1000) is the patched per-element loop with every exponential on MUFU.
- ``--rescale-threshold T``: a row keeps its running max until a block raises it by more than
  T (log2 units; FA4's Blackwell rule with T = 8), and O is rescaled only for such rows.

It times vitgraph's FA4 kernels (its tile and persistent choice per layout) in CUDA graphs,
with the error against an fp32 reference. One variant per process (FA4's compile cache does
not know the patch, so its disk cache is off here):

    for e in 0 1000 8 4 2; do python benchmarks/fa4_softmax_variants.py --every $e; done
    python benchmarks/fa4_softmax_variants.py --rescale-threshold 8

Needs flash-attn-4 (the ``fa4`` extra) and a Hopper GPU. Results: BENCHMARKS.md (Tried and
dropped).
"""
import argparse
import contextlib
import os

os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"  # kernels compiled here, with the patch

import torch  # noqa: E402

from vitgraph.ops import attention, fa4_persistent  # noqa: E402
from vitgraph.bench.common import graph_replay_us  # noqa: E402

H, D = 16, 80
LAYOUTS = {"1x256": [256], "1x1024": [1024], "16x256": [256] * 16, "8x448": [448] * 8, "4x1024": [1024] * 4,
           "1x4096": [4096], "1x9604": [9604]}


def patch_softmax(every: int, threshold: float) -> None:
    """Replace FA4's online softmax with one that emulates every ``every``-th exponential of a
    thread's row fragment (0: none; else the same math as FA4's, elementwise), and, with a
    ``threshold`` > 0, keeps a row's running max until a block raises it by more than that
    (log2 units), so that O is rescaled only then (FA4's Blackwell rule)."""
    import cutlass
    import cutlass.cute as cute
    import flash_attn.cute.utils as utils
    from cutlass import Boolean, Float32
    from flash_attn.cute.softmax import Softmax
    from quack import layout_utils

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool] = False,
                       check_inf: cutlass.Constexpr[bool] = True) -> cute.Tensor:
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        row_max, row_sum, scale_log2, arch = self.row_max, self.row_sum, self.scale_log2, self.arch
        for r in cutlass.range(cute.size(row_max), unroll_full=True):
            acc_S_row = acc_S_mn[r, None].load()
            row_max_cur = utils.fmax_reduce(
                acc_S_row, init_val=row_max[r] if cutlass.const_expr(not is_first) else None, arch=arch)
            row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
            row_max_prev = row_max[r]
            keep = Boolean(False)
            if cutlass.const_expr(threshold > 0.0 and not is_first):
                if (row_max_cur - row_max_prev) * scale_log2 <= threshold:
                    keep = Boolean(True)
                    row_max_cur = row_max_prev
            row_max[r] = row_max_cur
            if cutlass.const_expr(check_inf):
                row_max_cur = 0.0 if row_max_cur == -Float32.inf else row_max_cur
            row_max_cur_scaled = row_max_cur * scale_log2
            acc_S_mn[r, None].store(acc_S_row * scale_log2 - row_max_cur_scaled)
            if cutlass.const_expr(every == 0):
                acc_S_mn[r, None].store(cute.math.exp2(acc_S_mn[r, None].load(), fastmath=True))
            else:
                for i in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    if cutlass.const_expr(i % every == every - 1):
                        acc_S_mn[r, i] = utils.ex2_emulation(acc_S_mn[r, i])
                    else:
                        acc_S_mn[r, i] = cute.math.exp2(acc_S_mn[r, i], fastmath=True)
            acc_S_row_exp = acc_S_mn[r, None].load()
            if cutlass.const_expr(is_first):
                acc_S_row_sum = utils.fadd_reduce(acc_S_row_exp, init_val=None, arch=arch)
                row_scale[r] = 1.0
            else:
                row_scale[r] = cute.math.exp2((row_max_prev - row_max_cur) * scale_log2, fastmath=True)
                if keep:
                    row_scale[r] = 1.0
                acc_S_row_sum = utils.fadd_reduce(acc_S_row_exp, init_val=row_sum[r] * row_scale[r], arch=arch)
            row_sum[r] = acc_S_row_sum
        return row_scale

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
        for r in cutlass.range(cute.size(row_scale), unroll_full=True):
            if row_scale[r] != 1.0:
                acc_O_mn[r, None].store(acc_O_mn[r, None].load() * row_scale[r])

    Softmax.online_softmax = online_softmax
    if threshold > 0.0:
        Softmax.rescale_O = rescale_O


def reference(q, k, v, lens):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=0, help="emulate every N-th exp2 (0: FA4's own softmax)")
    parser.add_argument("--rescale-threshold", type=float, default=0.0,
                        help="rescale O only when a row's max grows by more than this (log2 units; 0: always)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    if args.every or args.rescale_threshold:
        patch_softmax(args.every, args.rescale_threshold)
    forward = attention._fa4_forward()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"every={args.every} rescale_threshold={args.rescale_threshold}", flush=True)
    for name in args.layouts:
        lens = LAYOUTS[name]
        total = sum(lens)
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        q, k, v = (torch.randn(total, H, D, device=device, dtype=torch.bfloat16) for _ in range(3))
        tile, persistent = attention._fa4_kernel(max(lens), H, device, total)

        def run():
            with fa4_persistent.persistent_tiles() if persistent else contextlib.nullcontext():
                return forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                               max_seqlen_k=max(lens), **attention.fa4_tile_kwargs(tile))[0]

        ref = reference(q, k, v, lens)
        err = ((run().float() - ref).norm() / ref.norm()).item()
        us, _ = graph_replay_us(run, inner=8, reps=21)
        flops = sum(4 * n * n * D * H for n in lens)
        print(f"{name:8s} tile={tile} persistent={int(persistent)}  {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s"
              f"  rel.err vs fp32 {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
