"""cuDNN ragged attention inside CUDA graphs: does a tighter max_seqlen or fewer segment slots pay? (needs nvidia-cudnn-frontend)"""
import torch

from vitgraph.bench.common import graph_replay_us
from vitgraph.ops import cudnn_attention as ca

H, D = 16, 80

def graph_time(fn, reps=32, iters=20):
    return graph_replay_us(fn, inner=reps, reps=iters)[0]

CASES = [("4x1024", [1024] * 4, 4096), ("16x256", [256] * 16, 4096), ("8x448", [448] * 8, 3584),
         ("1x1024 in 1152", [1024], 1152), ("2x2048", [2048] * 2, 4096), ("mixed 1024+512x4+256x4", [1024] + [512] * 4 + [256] * 4, 4096)]
for name, lens, T in CASES:
    qkv = torch.randn(T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    ref = None
    row = []
    for slots, smax in [(16, T), (16, max(T // 4, max(lens))), (16, max(lens)), (len(lens), max(lens))]:
        if slots < len(lens):
            continue
        cu = torch.full((slots + 1,), sum(lens), dtype=torch.int32, device="cuda")
        cu[0] = 0
        cu[1:len(lens) + 1] = torch.tensor(lens, device="cuda").cumsum(0)
        meta = ca.ragged_metadata(cu, H, D)
        box = {}
        def fn():
            box["o"] = ca.ragged_attention(qkv, meta, smax)
        t = graph_time(fn)
        o = box["o"][:sum(lens)].float()
        if ref is None:
            ref = o
        err = ((o - ref).norm() / ref.norm()).item()
        row.append(f"S={slots:2d} smax={smax:5d}: {t:6.1f} us (err {err:.1e})")
    print(f"{name:24s} " + " | ".join(row), flush=True)
