"""Single frames of many sizes: end-to-end ``encode`` latency with the routing measured at
capture (``route_single_frames``, on by default) against always using the dense bucket.

One engine; the "dense" column clears its measured thresholds (and plan cache) first.

    python benchmarks/single_frames.py
"""
import statistics
import time

import torch

from vitgraph import GraphedVisionEncoder

SIDES = [(30, 30), (32, 32), (34, 34), (36, 36), (40, 40), (44, 44), (46, 46), (48, 48), (52, 52), (56, 56),
         (60, 60), (64, 64), (66, 66), (68, 68), (72, 72), (76, 76), (80, 80), (84, 84), (88, 88), (90, 90),
         (54, 96), (40, 72)]


def latency_ms(enc, pixels, grid, n=20):
    for _ in range(3):
        enc.encode(pixels, grid)
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc.encode(pixels, grid)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    # One-frame buckets up to exact_eager_above whatever the backend (with fa4 the default
    # stops them at 2048 tokens), so the "dense" column has a dense graph to compare with.
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, dense_max_tokens=8192)
    stats = enc.stats()
    thresholds = stats["single_frame_packed_below"]
    print(f"capture {stats['capture_seconds']:.1f} s (routing {enc._routing_seconds:.2f} s); "
          f"packed below: {thresholds}")
    inputs = {}
    for h, w in SIDES:
        grid = [(1, h, w)]
        inputs[(h, w)] = (torch.randn(h * w, 1176, device="cuda", dtype=torch.bfloat16), grid)
    routed = {k: (enc.plan(g).steps[0].bucket.name, latency_ms(enc, p, g)) for k, (p, g) in inputs.items()}
    enc._packed_single_below = {}
    enc._prepared.clear()
    dense = {k: (enc.plan(g).steps[0].bucket.name, latency_ms(enc, p, g)) for k, (p, g) in inputs.items()}
    print(f"{'frame':>8} {'tokens':>6} {'routed':>9} {'ms':>7} {'dense':>9} {'ms':>7} {'change':>7}")
    for (h, w), (bucket, ms) in routed.items():
        dbucket, dms = dense[(h, w)]
        print(f"{h:>3}x{w:<4} {h * w:>6} {bucket:>9} {ms:7.2f} {dbucket:>9} {dms:7.2f} {100 * (ms / dms - 1):+6.1f}%")


if __name__ == "__main__":
    main()
