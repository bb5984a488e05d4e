"""SM clock and board power while the tower replays back to back, and while FA4 alone runs.

    python benchmarks/power_clocks.py                            # 1x4096, then FA4 alone on its layout
    python benchmarks/power_clocks.py --cases 1x256 1x1024 4x1024 16x256   # which cases hit the power cap?

Samples ``nvidia-smi`` every 50 ms through 4 s of back-to-back ``encode`` calls of each case
(after 2 s of rest, so each starts from a cool board), then, without ``--cases``, 4 s of
replays of a graph of FA4's varlen kernel on 4096 tokens in 16 slots: does the tower run at a
lower clock than the kernel alone? A case whose median power sits at the board's limit with
the SM clock below its peak is power-bound: there, time a kernel saves by hiding latency can
return as clock in the others, and only energy saved pays.
"""
import argparse
import statistics
import time

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.ops.attention import _fa4_forward
from vitgraph.bench.common import ClockSampler, graph_replay_us, held_replays
from vitgraph.bench.latency import select_cases

parser = argparse.ArgumentParser()
parser.add_argument("--cases", nargs="*", default=None, help="case names from vitgraph.bench.latency (default: 1x4096 "
                                                             "and FA4 alone)")
parser.add_argument("--seconds", type=float, default=4.0)
args = parser.parse_args()

smi = ClockSampler(period_ms=50)
marks, per_call = {}, {}
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
for name, grids in select_cases(args.cases or ["1x4096"]).items():
    tokens = sum(t * h * w for t, h, w in grids)
    px = torch.randn(tokens, enc.tower.input_width, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        enc.encode(px, grids)
    torch.cuda.synchronize()
    time.sleep(2)
    calls, t = 0, time.time()
    marks[name] = [t]
    while time.time() - t < args.seconds:
        for _ in range(20):
            enc.encode(px, grids)
        calls += 20
        torch.cuda.synchronize()
    marks[name].append(time.time())
    per_call[name] = (marks[name][1] - marks[name][0]) / calls * 1e3
if args.cases is None:
    time.sleep(2)
    T, H, D = 4096, 16, 80
    qkv = torch.randn(T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, T] + [T] * 15, device="cuda", dtype=torch.int32)
    fa4 = _fa4_forward()
    fn = lambda: fa4(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T)
    us, g = graph_replay_us(fn, inner=32)
    windows = held_replays(g, args.seconds)
    marks["fa4"] = [windows[0][0], windows[-1][1]]
    print(f"fa4 alone {us:.1f} us per call")
time.sleep(0.2)
rows = smi.stop()
for name, (a, b) in marks.items():
    sel = [(c, p) for t, c, p in rows if a + 0.5 <= t <= b]
    wall = f", {per_call[name]:.2f} ms per call" if name in per_call else ""
    if sel:
        print(f"{name}: {len(sel)} samples, SM clock median {statistics.median(c for c, _ in sel):.0f} MHz "
              f"(min {min(c for c, _ in sel):.0f}), power median {statistics.median(p for _, p in sel):.0f} W "
              f"(max {max(p for _, p in sel):.0f}){wall}")
    else:
        print(name, "no samples", a, b, rows[:2])
