"""A/A of two identical graph encoders: per-block timings in a chosen order of blocks.

    python benchmarks/ab_sequence.py --cases 4x1024 16x256 --orders ABBA AABB ABAB

Two encoders with the same settings and weights, ``A`` and ``B``; each order letter is one
block (the median wall ms of ``--iters`` synchronised ``encode`` calls after 3 warm-up calls,
as ``benchmarks/ab_setting.py`` times). Any difference between A's and B's medians is the
order's, not the code's: this is how the block order of ``vitgraph.bench.common.alternating_ab``
was checked (on an H200, ABBA gave A 0.18 ms more than B at ``4x1024``; ABAB and AABB gave
none).
"""

import argparse
import statistics

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import median_ms
from vitgraph.bench.latency import select_cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["4x1024", "16x256"])
    p.add_argument("--orders", nargs="+", default=["ABBA" * 4, "AABB" * 4, "AB" * 8])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--preset", default="qwen2-vl-2b")
    args = p.parse_args()
    device = torch.device("cuda")
    encoders = {key: GraphedVisionEncoder.from_config(args.preset, device=device, seed=0, progress=False)
                for key in "AB"}
    width = encoders["A"].config.patch_width
    for name, grids in select_cases(args.cases, []).items():
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), width).to(device, torch.bfloat16)
        for order in args.orders:
            times = [median_ms(lambda: encoders[key].encode(pixels, grids), device, args.iters, 3) for key in order]
            print(name, order[:8] + ("..." if len(order) > 8 else ""), " ".join(f"{k}{t:.2f}" for k, t in zip(order, times)))
            medians = {key: statistics.median(t for k, t in zip(order, times) if k == key) for key in "AB"}
            print(f"    median A {medians['A']:.3f}  B {medians['B']:.3f}  A - B {medians['A'] - medians['B']:+.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
