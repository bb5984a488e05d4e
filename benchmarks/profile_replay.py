"""Top CUDA kernels of one replay (and one eager forward) for a case, via torch.profiler.

    python benchmarks/profile_replay.py 4x1024
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vitgraph.bench.latency import CASES  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402

case = sys.argv[1] if len(sys.argv) > 1 else "4x1024"
grids = CASES[case]
budgets = [int(sys.argv[2])] if len(sys.argv) > 2 else None
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False,
                                       **({"budgets": budgets} if budgets else {}))
pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, device="cuda", dtype=torch.bfloat16)
for mode, fn in [("graph", lambda: enc.encode(pixels, grids)),
                 ("eager-forward", lambda: enc.tower(pixels, enc.tower.build_batch(grids).to(enc.device)))]:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    print(f"== {case} {mode}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
