"""How fast can the SMs read from L2, and how close do the 256-row GEMMs come to it?

At 256 rows a block's GEMMs run far below the tensor cores' rate, and weights held in L2
barely help them (``l2_prefetch.py --copies``), so DRAM is not their limit. This measures the
next level: bytes delivered from L2 into the SMs per second, by a Triton kernel whose
programs each sum one slice of a buffer that stays in L2, ``reuse`` programs per slice (as
the row tiles of a GEMM each read the same weight columns). Then it times fc1 at 256 rows
(cuBLAS, and quack's 64-row tile with QuickGELU where the ``fa4`` extra is installed) with
its weight resident in L2 too, so their operand traffic can be set against that ceiling.

Usage: l2_bandwidth.py
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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

    rows, k, n = 256, 1280, 5120
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    gemms = {"cuBLAS fc1 (no QuickGELU)": lambda: F.linear(x, w, b)}
    try:
        from vitgraph import gemm

        if gemm.quack_available(x.device):
            gemms["quack fc1 + QuickGELU, 64x160 2x1"] = lambda: gemm.linear_quick_gelu(x, w, b, "quack")
    except Exception as err:  # noqa: BLE001 - report and time cuBLAS alone
        print(f"quack unavailable: {err}")
    print(f"fc1 at {rows} rows, weight ({n * k * 2 / 2**20:.1f} MiB) resident in L2:")
    for name, fn in gemms.items():
        us, _ = graph_replay_us(fn, inner=20, reps=15)
        tflops = 2 * rows * k * n / (us * 1e-6) / 1e12
        print(f"  {name}: {us:.2f} µs, {tflops:.0f} TFLOP/s")
    # quack's 64x160 tile in 2x1 clusters: 4 row tiles x 32 column tiles; each cluster of two
    # row tiles loads a weight tile once (multicast), every CTA loads its 64 input rows.
    weight_mib = n * k * 2 / 2**20
    input_mib = rows * k * 2 / 2**20
    traffic = weight_mib * (rows // 64) / 2 + input_mib * (n // 160)
    print(f"  quack tile's operand traffic from L2: {traffic:.1f} MiB "
          f"(weights {weight_mib:.1f} MiB x 2 cluster loads, input {input_mib:.2f} MiB x {n // 160} column tiles)")
    if len(gemms) > 1:
        print(f"  at the best L2 rate that traffic takes {traffic * 2**20 / (best * 1e12) * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
