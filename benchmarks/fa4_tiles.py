"""FlashAttention 4's varlen forward in CUDA graphs: its default Hopper tile at head_dim 80
(192x144, PV from shared memory) against other tiles, per packed layout (16 slots, as in
vitgraph's packed buckets).

    python benchmarks/fa4_tiles.py                 # default vs 128-row tiles (h200-fa4-tiles.log)
    python benchmarks/fa4_tiles.py --sweep         # more tiles and PV / overlap flags (h200-fa4-tile-sweep.log)

A tile is ``m x n`` plus ``rs`` (the PV matmul takes P from registers) and ``ol`` (intra
warpgroup overlap); with ``tile_mn`` FA4 defaults both flags to on, which its own heuristic
turns off for 192-row tiles at this head dim. Uses FA4's internal ``_flash_attn_fwd`` (the
public varlen function takes no tile). Needs flash-attn-4 (the ``fa4`` extra) and a Hopper GPU.
"""
import sys

import torch
from flash_attn.cute.interface import _flash_attn_fwd

from vitgraph.ops.attention import fa4_tile_kwargs
from vitgraph.bench.common import graph_replay_us

H, D = 16, 80
LAYOUTS = {"16x256": [256] * 16, "8x448": [448] * 8, "4x1024": [1024] * 4, "1x256": [256], "1x576": [576],
           "1x1024": [1024], "1x1600": [1600], "1x2048": [2048], "2x2048": [2048] * 2, "1x4096": [4096],
           "1x9604": [9604], "mixed 1x3000+4x256": [3000] + [256] * 4, "mixed 1x2048+8x256": [2048] + [256] * 8}
TILES = [None, (128, 128), (128, 144), (128, 176)]
if "--sweep" in sys.argv:
    LAYOUTS = {k: LAYOUTS[k] for k in ("16x256", "4x1024", "1x2048", "1x4096", "1x9604", "mixed 1x3000+4x256")}
    LAYOUTS["1x2600"] = [2600]
    TILES = [None, (128, 128), (128, 128, False, True), (128, 112), (128, 96), (128, 128, True, False),
             (192, 128, False, True), (192, 160, False, True), (192, 112, False, True), (192, 144, False, False)]


def tile_name(tile):
    if tile is None:
        return "default"
    m, n, *flags = tile
    return f"{m}x{n}" + ("" if not flags else f" rs={int(flags[0])} ol={int(flags[1])}")


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
                                   **fa4_tile_kwargs(tile))[0]
        try:
            out = run()
            if ref is None:
                ref = out.float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us, _ = graph_replay_us(run, inner=8, reps=15)
            row.append(f"{tile_name(tile)} {us:7.1f} (err {err:.0e})")
        except Exception as exc:
            row.append(f"{tile_name(tile)}: {type(exc).__name__} {str(exc)[:80]}")
    print(f"{name:20s} " + " | ".join(row), flush=True)
