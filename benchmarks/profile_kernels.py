"""Where a forward's time goes, by kernel class: the per-kernel profile that chooses what to speed up.

    python benchmarks/profile_kernels.py                                   # qwen2.5-vl-7b and qwen2-vl-2b
    python benchmarks/profile_kernels.py --presets qwen2.5-vl-7b --cases 1x4096 16x256 --json out.json
    python benchmarks/profile_kernels.py --presets tiny --device cpu --calls 2   # runs anywhere (CPU ops)

The encoder runs eagerly (the kernels its graphs replay, launched one by one, at the call's exact
shapes) under torch's profiler; each device kernel's time is summed into a class by its name
(GEMMs by kernel name too, attention, norms, rotary, activation, gathers, copies) and divided by
the calls: ms per call per class, then the ten costliest kernels.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import kernel_class, write_json
from vitgraph.bench.latency import CASES
from vitgraph.ops.backend_names import PRECISIONS

def profile_case(enc: GraphedVisionEncoder, grids, calls: int) -> dict:
    """ms per call per class, and the costliest kernels, for ``calls`` eager encodes of ``grids``."""
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.shape.patch_width).to(enc.device, enc.dtype)
    enc.encode(pixels, grids)  # warm: JIT compiles and library plans stay out of the profile
    cuda = enc.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            enc.encode(pixels, grids)
        if cuda:
            torch.cuda.synchronize(enc.device)
    per_class, per_kernel = defaultdict(float), defaultdict(float)
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or (not cuda and event.key.startswith("ProfilerStep")):
            continue
        per_class[kernel_class(event.key)] += us / 1e3 / calls
        per_kernel[event.key] += us / 1e3 / calls
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return {"ms_per_class": dict(per_class), "total_ms": sum(per_class.values()), "top_kernels": top}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-vl-7b", "qwen2-vl-2b"], help="towers to profile")
    parser.add_argument("--cases", nargs="+", default=["1x4096", "16x256"], choices=sorted(CASES), help="inputs")
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--calls", type=int, default=5, help="profiled calls per case (default 5)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS, help="the blocks' GEMMs (default bf16)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    result = {}
    for preset in args.presets:
        enc = GraphedVisionEncoder.from_config(preset, device=args.device, mode="eager", progress=False,
                                               precision=args.precision)
        for case in args.cases:
            entry = result[f"{preset} {case}"] = profile_case(enc, CASES[case], args.calls)
            print(f"\n{preset} {case} ({enc.device}, {str(enc.dtype).removeprefix('torch.')}, {args.precision}, "
                  f"attention {enc.attention}): {entry['total_ms']:.2f} ms of kernels per call")
            for name, ms in sorted(entry["ms_per_class"].items(), key=lambda kv: -kv[1]):
                print(f"  {name:<10} {ms:8.3f} ms")
            for name, ms in entry["top_kernels"][:8]:
                print(f"    {ms:8.3f} ms  {name[:100]}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
