"""Where the GPU time of one ``encode`` goes, by kernel class, for the default engine.

    python benchmarks/profile_replay.py 1x256 1x1024 4x1024     # case names from vitgraph.bench.latency
    python benchmarks/profile_replay.py --top 4x1024             # also the top kernels of each case
    python benchmarks/profile_replay.py --top --frames 16x24 20x20   # single frames of HxW patches

Kernel classes: attention (flash/cuDNN), GEMM (cuBLAS/cuBLASLt/CUTLASS), fused (vitgraph's
Triton kernels), other (copies, fills, unfused elementwise).
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import KERNEL_CLASSES, kernel_class
from vitgraph.bench.latency import select_cases


parser = argparse.ArgumentParser()
parser.add_argument("cases", nargs="*", default=["1x256", "1x1024", "4x1024", "16x256"])
parser.add_argument("--top", action="store_true")
parser.add_argument("--frames", nargs="*", default=[], help="more cases: one frame of HxW patches each")
parser.add_argument("--blas", help="torch.backends.cuda.preferred_blas_library(...) first, e.g. cublaslt")
parser.add_argument("--host", action="store_true", help="split each call's wall time: host work before the "
                    "replay, the replay on the GPU (events), the rest")
args = parser.parse_args()

if args.blas:
    torch.backends.cuda.preferred_blas_library(args.blas)
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
stats = enc.stats()
print(f"captured {len(enc.buckets)} graphs in {stats['capture_seconds']:.1f} s, pool {stats['pool_bytes'] / 2**20:.0f} MiB,"
      f" attention {stats['attention']}")
marks = {}
if args.host:
    replay = enc.bank.replay

    def timed_replay(bucket):
        if "start" not in marks:
            return replay(bucket)
        marks["launch"] = time.perf_counter()
        marks["start"].record()
        out = replay(bucket)
        marks["end"].record()
        return out

    enc.bank.replay = timed_replay
cases = select_cases(args.cases, args.frames)
for case, grids in cases.items():
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(5):
            enc.encode(pixels, grids)
        torch.cuda.synchronize()
        walls, before, gpu = [], [], []
        for _ in range(20):
            marks.update(start=torch.cuda.Event(enable_timing=True), end=torch.cuda.Event(enable_timing=True))
            t0 = time.perf_counter()
            enc.encode(pixels, grids)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            if "launch" in marks:
                before.append(marks.pop("launch") - t0)
                gpu.append(marks["start"].elapsed_time(marks["end"]) * 1e-3)
            marks.pop("start", None)
        marks.pop("start", None)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                enc.encode(pixels, grids)
            torch.cuda.synchronize()
    per_class = defaultdict(float)
    per_kernel = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_class[kernel_class(evt.name)] += evt.device_time / 5
            per_kernel[evt.name] += evt.device_time / 5
    total = sum(per_class.values())
    wall = sorted(walls)[len(walls) // 2] * 1e6
    parts = "  ".join(f"{c} {per_class[c]:7.0f}" for c, _ in KERNEL_CLASSES)
    print(f"== {case:<14} wall {wall:7.0f} us   kernels {total:7.0f} us   {parts}")
    if before:
        med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6
        print(f"   host before replay {med(before):6.0f} us   replay on GPU {med(gpu):7.0f} us"
              f"   (one-replay cases only)")
    if args.top:
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]:
            print(f"   {us:8.0f} us  {kernel_class(name):<9} {name[:110]}")
