"""SM clock and board power while the tower replays 1x4096, and while FA4 alone runs its attention.

    python benchmarks/power_clocks.py

Samples ``nvidia-smi`` every 50 ms through 4 s of back-to-back ``encode`` calls of one
4096-token image, then 4 s of replays of a graph of FA4's varlen kernel on the same layout
(4096 tokens in 16 slots): does the tower run at a lower clock than the kernel alone?
"""
import statistics
import time

import torch
from vitgraph import GraphedVisionEncoder
from vitgraph.attention import _fa4_forward
from vitgraph.bench.common import ClockSampler, graph_replay_us

smi = ClockSampler(period_ms=50)
marks = {}
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
px = torch.randn(4096, 1176, device="cuda", dtype=torch.bfloat16)
grids = [(1, 64, 64)]
for _ in range(20): enc.encode(px, grids)
torch.cuda.synchronize()
t = time.time(); marks["tower"] = [t]
while time.time() - t < 4:
    for _ in range(20): enc.encode(px, grids)
    torch.cuda.synchronize()
marks["tower"].append(time.time())
time.sleep(2)
T, H, D = 4096, 16, 80
qkv = torch.randn(T, 3, H, D, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, T] + [T] * 15, device="cuda", dtype=torch.int32)
fa4 = _fa4_forward()
fn = lambda: fa4(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T)
us, g = graph_replay_us(fn, inner=32)
t = time.time(); marks["fa4"] = [t]
while time.time() - t < 4:
    for _ in range(20): g.replay()
    torch.cuda.synchronize()
marks["fa4"].append(time.time())
print(f"fa4 alone {us:.1f} us per call")
time.sleep(0.2)
rows = smi.stop()
for name, (a, b) in marks.items():
    sel = [(c, p) for t, c, p in rows if a + 0.5 <= t <= b]
    if sel:
        print(f"{name}: {len(sel)} samples, SM clock median {statistics.median(c for c, _ in sel):.0f} MHz, "
              f"power median {statistics.median(p for _, p in sel):.0f} W")
    else:
        print(name, "no samples", a, b, rows[:2])
