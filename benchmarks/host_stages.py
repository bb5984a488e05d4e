"""Host time of one ``encode``, stage by stage (validation, allocation, plan, copies, replay
launch, output copy), for the default engine on random weights.

    python benchmarks/host_stages.py
"""
import time
import torch
from vitgraph import GraphedVisionEncoder
from vitgraph.validation import check_pixels, check_rows, normalize_grid

enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6

def stages(grids):
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        enc.encode(pixels, grids)
    torch.cuda.synchronize()
    prep = enc._prepare(normalize_grid(grids, 2))
    step, staged = prep.plan.steps[0], prep.staged[0]
    out = torch.empty(pixels.shape[0] // 4, 1536, device="cuda", dtype=torch.bfloat16)
    parts = {k: [] for k in ("validate", "empty", "prepare", "load", "replay", "copy_out", "encode")}
    for _ in range(40):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        check_pixels(pixels, 1176); g = normalize_grid(grids, 2); check_rows(pixels, g)
        t1 = time.perf_counter(); r = torch.empty(pixels.shape[0] // 4, 1536, device="cuda", dtype=torch.bfloat16)
        t2 = time.perf_counter(); enc._prepare(g)
        t3 = time.perf_counter(); enc.bank.load(step.bucket, pixels, staged)
        t4 = time.perf_counter(); o = enc.bank.replay(step.bucket)
        t5 = time.perf_counter(); out.copy_(o[:out.shape[0]])
        t6 = time.perf_counter(); torch.cuda.synchronize()
        t7 = time.perf_counter(); enc.encode(pixels, grids); t8 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t8 - t7)):
            parts[k].append(v)
        del r
    print(f"{str(grids)[:40]:40s} " + "  ".join(f"{k} {med(v):5.0f}" for k, v in parts.items()) + "  us (host)")

for grids in ([(1, 16, 16)], [(1, 32, 32)], [(1, 32, 32)] * 4, [(1, 16, 16)] * 16, [(8, 16, 28)]):
    stages(grids)
