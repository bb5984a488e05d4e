"""The graph encoder's exact-shape eager fallback against the eager encoder, on one tower.

    python benchmarks/fallback_vs_eager.py
    python benchmarks/fallback_vs_eager.py --between 1x256 4x1024   # each timed call after those calls

A single frame above ``exact_eager_above`` (8192 tokens) runs eagerly in both encoders, through
the same forward of the same tower, so the two should take the same time and give the same
bits. The serving benchmark's slowest calls at 5 req/s (one 1920x1080 photo, 10764 tokens)
read 2-3 ms longer in the graph encoder than in the eager one, in either order of the systems
(``h200-serving-order.log``). This times both, alternating, hot: each timed call alone, or
(``--between``) right after one call of each given case through the same encoder, as in the
serving loop, where the graph encoder's other calls are replays and the eager one's are not.
Synchronised wall time, median of ``--reps`` per encoder.
"""

import argparse
import statistics
import time

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.latency import CASES

FRAMES = [(1, 78, 138), (1, 64, 102), (1, 128, 60)]  # 1920x1080, 1440x900, 828x1792 after smart_resize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=16)
    parser.add_argument("--between", nargs="*", default=[], choices=sorted(CASES), metavar="CASE")
    args = parser.parse_args()
    graph = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", dtype=torch.bfloat16, seed=0, progress=False)
    eager = GraphedVisionEncoder(graph.tower, device=graph.device, dtype=graph.dtype, mode="eager")
    between = []
    for name in args.between:
        grids = CASES[name]
        tokens = sum(t * h * w for t, h, w in grids)
        between.append((torch.randn(tokens, 1176, device="cuda", dtype=torch.bfloat16), grids))
    print(f"attention {graph.attention}, GEMMs {graph.tower.gemm_backend}; between: {args.between or 'nothing'}")
    for grid in FRAMES:
        tokens = grid[0] * grid[1] * grid[2]
        pixels = torch.randn(tokens, 1176, device="cuda", dtype=torch.bfloat16)
        equal = torch.equal(graph.encode(pixels, [grid]), eager.encode(pixels, [grid]))
        times = {"graph encoder": [], "eager encoder": []}
        for rep in range(args.reps):
            pairs = [("graph encoder", graph), ("eager encoder", eager)]
            for name, encoder in pairs if rep % 2 == 0 else pairs[::-1]:
                for before_pixels, before_grids in between:
                    encoder.encode(before_pixels, before_grids)
                torch.cuda.synchronize()
                start = time.perf_counter()
                encoder.encode(pixels, [grid])
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) * 1e3)
        print(f"{tokens:6d} tokens {grid}: bitwise equal {equal}; " + "; ".join(
            f"{name} {statistics.median(v):.2f} ms (min {min(v):.2f}, max {max(v):.2f})" for name, v in times.items()))
    print(f"graph encoder's eager fallbacks: {graph.stats()['eager_fallbacks']}")


if __name__ == "__main__":
    main()
