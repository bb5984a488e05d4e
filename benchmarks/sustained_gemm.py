"""The GEMM ceiling in a burst (as ``latency.py`` measures it) against the rate held back to back.

    python benchmarks/sustained_gemm.py                 # 8 s per shape
    python benchmarks/sustained_gemm.py --seconds 4

``latency.py``'s floor divides FLOPs by the rate of one 8192³ bf16 GEMM timed for 13 calls
(about 20 ms of work), too short to heat the board. A 4096-token encode runs ~10 ms of
GEMMs and attention back to back, at the H200's 700 W cap. Per shape (the ceiling's 8192³
and the tower's fc1 at 4096 rows, 4096x1280 @ 1280x5120), after the ceiling's burst taken
by ``measure_ceilings`` itself, this runs the GEMM back to back for ``--seconds`` (CUDA graphs
of 20 calls, weights rotated over 4 sets so that fc1's stream from DRAM as in the tower)
and reports the rate, SM clock and board power per half-second window (``nvidia-smi``
every 20 ms), and the floor of each 4096-token case recomputed with the held 8192³ rate.
"""

import argparse
import statistics
import time

import torch

from vitgraph.bench import common
from vitgraph.bench.latency import CASES
from vitgraph.config import PRESETS

CEILING = "8192^3"  # the shape of latency.py's GEMM ceiling
SHAPES = {CEILING: (8192, 8192, 8192), "fc1 4096 rows": (4096, 1280, 5120)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args()
    device = torch.device("cuda")
    burst = common.measure_ceilings(device)["gemm_tflops"]  # latency.py's ceiling, as it measures it
    sampler = common.ClockSampler()
    held = {}
    for name, (m, k, n) in SHAPES.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        weights = [torch.randn(k, n, device=device, dtype=torch.bfloat16) for _ in range(4)]
        flops = 2 * m * k * n
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        calls = 20
        graph = torch.cuda.CUDAGraph()
        torch.matmul(a, weights[0], out=out)  # cuBLAS workspace and handle before capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for i in range(calls):
                torch.matmul(a, weights[i % len(weights)], out=out)
        torch.cuda.synchronize()
        time.sleep(2.0)  # start from an idle board
        held[name] = [(a, b, replays * calls * flops / (ms * 1e9))
                      for a, b, ms, replays in common.held_replays(graph, args.seconds)]
    samples = sampler.stop()

    print(f"{torch.cuda.get_device_name(device)}, {args.seconds:.0f} s back to back per shape; TFLOP/s")
    for name, windows in held.items():
        rows = []
        first = windows[0][0]
        for a, b, rate in windows:
            rows.append([f"{a - first:.1f}-{b - first:.1f} s", rate, *common.window_medians(samples, a, b)])
        if name == CEILING:
            print(f"\n{name}: burst (common.measure_ceilings, as latency.py) {burst:.0f} TFLOP/s")
        else:
            print(f"\n{name}:")
        common.print_table(["window", "TFLOP/s", "SM MHz", "W"], rows)
    windows = held[CEILING]
    steady = statistics.median(rate for _, _, rate in windows[len(windows) // 2:])
    cfg = PRESETS["qwen2-vl-2b"]
    rows = []
    for case in ("1x4096", "4x1024", "16x256", "video-8x16x28", "1x9604"):
        flops = common.case_flops(cfg, CASES[case])
        rows.append([case, flops / (burst * 1e9), flops / (steady * 1e9)])
    print(f"\nfloor (FLOPs / rate), ms: burst {burst:.0f} against held {steady:.0f} TFLOP/s "
          f"(median of the second half's windows)")
    common.print_table(["case", "floor, burst rate", "floor, held rate"], rows)


if __name__ == "__main__":
    main()
