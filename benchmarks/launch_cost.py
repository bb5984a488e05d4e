"""Host cost of launching a CUDA graph replay, and whether the GPU waits for it.

1. The default engine's graphs, per bucket: host µs inside ``GraphBank.replay`` (the device
   idle before each launch), the replay's GPU time (CUDA events) and the wall time from the
   launch to the end of the work. If wall ≈ GPU time, the launch overlaps the GPU's work.
2. Graphs of 32 calls of one op (cuDNN ragged attention, cuDNN dense attention + lane, a
   GEMM): host µs per launch.

    python benchmarks/launch_cost.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

from vitgraph import GraphedVisionEncoder, cudnn_attention
from vitgraph.ops.attention import LANE_PAD, dense_masked
from vitgraph.bench.common import graph_replay_us

H, D = 16, 80


def launch_times(launch, n=30):
    """Medians of: host µs of launch(), GPU ms between events around it, wall ms to completion."""
    host, gpu, wall = [], [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        launch()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        gpu.append(start.elapsed_time(end))
        wall.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(gpu), statistics.median(wall)


def main():
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
    bank = enc.bank
    print("engine graphs: host µs of the replay launch | GPU ms | wall ms from launch to done")
    for bucket in bank.buckets:
        if bucket.tokens in (256, 1024, 4096, 8192, 16384):
            host, gpu, wall = launch_times(lambda: bank.replay(bucket))
            print(f"  {bucket.name:>9s}: {host:7.1f} µs | {gpu:7.3f} | {wall:7.3f}", flush=True)

    tokens = 4096
    qkv = torch.randn(tokens, 3, H, D, device="cuda", dtype=torch.bfloat16)
    qd = torch.randn(tokens, H, D + LANE_PAD, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 1280, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3840, 1280, device="cuda", dtype=torch.bfloat16)
    cases = {"dense+lane": lambda: dense_masked(qd, qd, qkv[:, 2], D ** -0.5), "linear": lambda: F.linear(x, w)}
    if cudnn_attention.available():
        cu = torch.tensor([0, 1024, 2048, 3072, 4096] + [4096] * 12, device="cuda", dtype=torch.int32)
        meta = cudnn_attention.ragged_metadata(cu, H, D)
        cases["cudnn ragged"] = lambda: cudnn_attention.ragged_attention(qkv, meta, tokens)
    print("\ngraphs of 32 calls at 4096 tokens: host µs of the launch | GPU µs per call")
    for name, fn in cases.items():
        gpu_us, graph = graph_replay_us(fn, inner=32)
        host, _, _ = launch_times(graph.replay)
        print(f"  {name:14s} {host:7.1f} | {gpu_us:7.1f}", flush=True)


if __name__ == "__main__":
    main()
