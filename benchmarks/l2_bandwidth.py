"""How fast can the SMs read from L2, and how close do the 256-row GEMMs come to it?

At 256 rows a block's GEMMs run far below the tensor cores' rate, and weights held in L2
barely help them (``l2_prefetch.py --copies``), so DRAM is not their limit. This measures the
next level: bytes delivered from L2 into the SMs per second, by a Triton kernel whose
programs each sum one slice of a buffer that stays in L2, ``reuse`` programs per slice (as
the row tiles of a GEMM each read the same weight columns). Then it times fc1 at 256 rows
(cuBLAS, and quack's 64-row tile with QuickGELU where the ``fa4`` extra is installed) with
its weight resident in L2 too. TMA-fed GEMMs take bytes in faster than plain loads, so it also
times quack's fc1 tiles at 4096 rows (many waves) and counts the operand bytes each SM took
in per second. Last, the block's four GEMMs at 256 rows: each CTA's operand intake (its input
rows and weight rows over all of K; TMA multicast saves L2 reads, not what each SM receives)
at the best rate per SM measured, the time no schedule of those tiles can beat.

Usage: l2_bandwidth.py
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vitgraph.ops import gemm
from vitgraph.bench.common import graph_replay_us


@triton.jit
def _sum_slices(src_ptr, sink_ptr, slice_elems, slices, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = (pid % slices).to(tl.int64) * slice_elems
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, slice_elems, BLOCK):
        acc += tl.load(src_ptr + base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc))


def read_tb_per_s(mib: float, slices: int, reuse: int, block: int, warps: int) -> tuple[float, float]:
    """(µs per call, TB/s delivered) of ``slices * reuse`` programs reading ``mib`` MiB (each
    slice ``reuse`` times)."""
    elems = int(mib * 2**20 / 2) // (slices * block) * (slices * block)
    src = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty(slices * reuse, device="cuda", dtype=torch.float32)
    slice_elems = elems // slices

    def run():
        _sum_slices[(slices * reuse,)](src, sink, slice_elems, slices, BLOCK=block, num_warps=warps)

    us, _ = graph_replay_us(run, inner=20, reps=15)
    return us, elems * 2 * reuse / (us * 1e-6) / 1e12


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB")
    print("L2-resident reads (one buffer, every replay reads it again):")
    print("  MiB  slices reuse programs  block warps |     µs   TB/s delivered")
    best = 0.0
    for mib, slices, reuse in [(12.5, 32, 4), (12.5, 32, 2), (12.5, 128, 1), (25.0, 132, 1), (25.0, 264, 1),
                               (25.0, 132, 4), (6.25, 66, 4)]:
        for block, warps in [(4096, 4), (8192, 8), (16384, 8)]:
            us, rate = read_tb_per_s(mib, slices, reuse, block, warps)
            best = max(best, rate)
            print(f"{mib:5.2f} {slices:7d} {reuse:5d} {slices * reuse:8d} {block:6d} {warps:5d} | {us:6.1f} {rate:8.2f}")
    print("DRAM reads (1 GiB, each byte once):")
    for block, warps in [(8192, 8), (16384, 8)]:
        us, rate = read_tb_per_s(1024.0, 132 * 8, 1, block, warps)
        print(f"  block {block} warps {warps}: {us:.1f} µs, {rate:.2f} TB/s")
    print(f"best L2 rate: {best:.2f} TB/s")

    intake = quack_intake_gb_per_sm(props.multi_processor_count)
    fc1_at_256_rows()
    per_sm = max([best * 1e3 / props.multi_processor_count] + list(intake.values()))
    print(f"256-row bucket: each CTA's operand intake (input rows + weight rows, all of K; multicast "
          f"does not reduce it) at the best rate per SM measured above, {per_sm:.1f} GB/s:")
    total = 0.0
    for name, (tile_m, tile_n, k, splits) in BLOCK_TILES_256.items():
        kib = (tile_m + tile_n) * (k // splits) * 2 / 1024
        us = kib * 1024 / (per_sm * 1e9) * 1e6
        total += us
        print(f"  {name:5s} {tile_m}x{tile_n} tile, K {k}/{splits}: {kib:6.1f} KiB per CTA, {us:5.2f} µs")
    print(f"  the block's four GEMMs: {total:.1f} µs")


# The 256-row bucket's GEMM tiles (rows x columns of the output, K, K's splits): quack's for qkv and
# fc1 (vitgraph.ops.gemm), cuBLAS's for proj and fc2 as its kernel name gives them
# (nvjet_sm90_tst_80x64_...: 80 output features x 64 tokens), on K's halves (vitgraph.ops.gemm.SPLIT_K).
BLOCK_TILES_256 = {"qkv": (64, 128, 1280, 1), "proj": (64, 80, 1280, 2), "fc1": (64, 160, 1280, 1),
                   "fc2": (64, 80, 5120, 2)}


def _fc1_operands(rows: int):
    """fc1's input, weight and bias (bf16) for ``rows`` rows."""
    k, n = 1280, 5120
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return x, w, torch.zeros(n, device="cuda", dtype=torch.bfloat16)


def _quack_fc1_tile(x, w, b, tile: dict):
    """fc1 + QuickGELU through quack's GEMM in ``tile`` (as :func:`vitgraph.ops.gemm.linear_quick_gelu`
    calls it, with the tile given instead of picked)."""
    gemm_act, _, name = gemm._quack()
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    config = gemm._gemm_config(tuple(tile.items()))
    return lambda: gemm_act(x, w.t(), None, out, None, b, name, config=config)


def quack_intake_gb_per_sm(sms: int) -> dict:
    """GB/s per SM of operand bytes that quack's TMA-fed fc1 tiles take in at 4096 rows
    (many waves; weight and input held in L2); {} without quack."""
    if not gemm.quack_available("cuda"):
        print("quack unavailable: no TMA-fed rate measured")
        return {}
    x, w, b = _fc1_operands(4096)
    rows, k = x.shape
    n = w.shape[0]
    print(f"quack fc1 + QuickGELU at {rows} rows: operand bytes taken in per SM")
    rates = {}
    for tile_m, tile_n in [(128, 128), (128, 160)]:
        tile = dict(tile_m=tile_m, tile_n=tile_n, pingpong=True, cluster_m=1, cluster_n=2)
        us, _ = graph_replay_us(_quack_fc1_tile(x, w, b, tile), inner=20, reps=15)
        tiles = -(-rows // tile_m) * -(-n // tile_n)
        moved = tiles * (tile_m + tile_n) * k * 2
        rates[f"{tile_m}x{tile_n}"] = moved / (us * 1e-6) / sms / 1e9
        print(f"  {tile_m}x{tile_n}: {us:.1f} µs, {tiles} tiles, {moved / (us * 1e-6) / 1e12:.2f} TB/s, "
              f"{rates[f'{tile_m}x{tile_n}']:.1f} GB/s per SM")
    return rates


def fc1_at_256_rows() -> None:
    x, w, b = _fc1_operands(256)
    rows, k = x.shape
    n = w.shape[0]
    gemms = {"cuBLAS fc1 (no QuickGELU)": lambda: F.linear(x, w, b)}
    if gemm.quack_available(x.device):  # the tower's call: quack's 64x160 tile in 2x1 clusters at 256 rows
        gemms["quack fc1 + QuickGELU, 64x160 2x1"] = lambda: gemm.linear_quick_gelu(x, w, b, "quack")
    print(f"fc1 at {rows} rows, weight ({n * k * 2 / 2**20:.1f} MiB) resident in L2:")
    for name, fn in gemms.items():
        us, _ = graph_replay_us(fn, inner=20, reps=15)
        print(f"  {name}: {us:.2f} µs, {2 * rows * k * n / (us * 1e-6) / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
