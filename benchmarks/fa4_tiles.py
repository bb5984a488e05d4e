"""FlashAttention 4's varlen forward in CUDA graphs: its default Hopper tile at head_dim 80
(192x144) against 128-row tiles, per packed layout (16 slots, as in vitgraph's packed buckets).

Uses FA4's internal ``_flash_attn_fwd`` (the public varlen function takes no tile size).
Needs flash-attn-4 (the ``fa4`` extra) and a Hopper GPU. Log: results/h200-fa4-tiles.log.
"""
import torch
from flash_attn.cute.interface import _flash_attn_fwd

from vitgraph.bench.common import graph_replay_us

H, D = 16, 80
LAYOUTS = {"16x256": [256] * 16, "8x448": [448] * 8, "4x1024": [1024] * 4, "1x256": [256], "1x576": [576],
           "1x1024": [1024], "1x1600": [1600], "1x2048": [2048], "2x2048": [2048] * 2, "1x4096": [4096],
           "1x9604": [9604], "mixed 1x3000+4x256": [3000] + [256] * 4, "mixed 1x2048+8x256": [2048] + [256] * 8}
TILES = [None, (128, 128), (128, 144), (128, 176)]
for name, lens in LAYOUTS.items():
    total = sum(lens)
    slots = 16
    cu = torch.zeros(slots + 1, dtype=torch.int32)
    cu[1:len(lens) + 1] = torch.tensor(lens).cumsum(0)
    cu[len(lens) + 1:] = total
    cu = cu.cuda()
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    row = []
    ref = None
    for tile in TILES:
        def run(tile=tile):
            return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total, max_seqlen_k=total,
                                   tile_mn=tile)[0]
        try:
            out = run()
            if ref is None:
                ref = out.float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us, _ = graph_replay_us(run, inner=8, reps=15)
            row.append(f"{tile or 'default'} {us:7.1f} (err {err:.0e})")
        except Exception as exc:
            row.append(f"{tile}: {type(exc).__name__} {str(exc)[:80]}")
    print(f"{name:20s} " + " | ".join(row), flush=True)
