"""A/A of identical graph encoders: per-block timings in a chosen order of blocks.

    python benchmarks/ab_sequence.py --cases 4x1024 16x256 --orders ABBAABBA AABBAABB ABABABAB
    python benchmarks/ab_sequence.py --cases 4x1024 --orders ABCDABCDABCD   # four encoders
    python benchmarks/ab_sequence.py --cases 4x1024 --orders ABCD ABCD --preheat 5 --clocks

Encoders with the same settings and weights, one per letter (``A``, ``B``, ...); each letter
of an order is one block (the median wall ms of ``--iters`` synchronised ``encode`` calls
after 3 warm-up calls, as ``benchmarks/ab_setting.py`` times). Any difference between the
encoders' medians is the order's, the time's or the instance's, not the code's. ``--clocks``
adds each block's median SM clock and board power (``nvidia-smi`` every 50 ms).

On an H200 (``h200-ab-sequence-*.log``) the block that ran about 1 s after a cool start read
0.3-0.9 ms slow at ``4x1024``, whichever encoder it was: the board's power first reached
its cap there and the clock dipped below the level it then held. Rotating the order moved
the slow block with the position, waiting 15 s after the builds (``--settle``) did not
remove it, and 5 s of calls first (``--preheat``) did: identical encoders then agreed within
0.08 ms. That is why ``vitgraph.bench.common.alternating_ab`` preheats.
"""

import argparse
import statistics
import time

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import ClockSampler, median_ms, preheat, window_medians
from vitgraph.bench.latency import select_cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["4x1024", "16x256"])
    p.add_argument("--orders", nargs="+", default=["ABBA" * 4, "AABB" * 4, "AB" * 8],
                   help="block orders; each letter names an encoder (A, B, C, ...: as many as the letters used)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--preset", default="qwen2-vl-2b")
    p.add_argument("--settle", type=float, default=0.0, help="seconds to wait after the last build before timing")
    p.add_argument("--preheat", type=float, default=0.0,
                   help="seconds of back-to-back calls of the first encoder before each order is timed")
    p.add_argument("--clocks", action="store_true", help="each block's median SM clock (MHz) and board power (W), "
                                                         "from nvidia-smi every 50 ms")
    args = p.parse_args()
    device = torch.device("cuda")
    keys = sorted(set("".join(args.orders)))
    encoders = {key: GraphedVisionEncoder.from_config(args.preset, device=device, seed=0, progress=False)
                for key in keys}
    width = encoders[keys[0]].config.patch_width
    if args.settle:
        print(f"encoders built in order {''.join(keys)}; waiting {args.settle:g} s", flush=True)
        time.sleep(args.settle)
    for name, grids in select_cases(args.cases, []).items():
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), width).to(device, torch.bfloat16)
        for order in args.orders:
            preheat(lambda: encoders[keys[0]].encode(pixels, grids), device, args.preheat)
            sampler = ClockSampler(period_ms=50) if args.clocks else None
            times, windows = [], []
            for key in order:
                begin = time.time()
                times.append(median_ms(lambda: encoders[key].encode(pixels, grids), device, args.iters, 3))
                windows.append((begin, time.time()))
            print(name, order[:8] + ("..." if len(order) > 8 else ""), " ".join(f"{k}{t:.2f}" for k, t in zip(order, times)))
            if sampler:
                samples = sampler.stop()
                cells = []
                for key, (begin, end) in zip(order, windows):
                    mhz, watts = window_medians(samples, begin, end)
                    cells.append(f"{key}{mhz or 0:.0f}MHz/{watts or 0:.0f}W")
                print("    clocks " + " ".join(cells))
            medians = {key: statistics.median(t for k, t in zip(order, times) if k == key) for key in keys if key in order}
            print("    median " + "  ".join(f"{key} {ms:.3f}" for key, ms in medians.items()) + " ms", flush=True)


if __name__ == "__main__":
    main()
