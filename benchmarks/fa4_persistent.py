"""FlashAttention 4's Hopper varlen forward with persistent CTAs (``vitgraph.fa4_persistent``)
against FA4's own one-tile-per-CTA scheduler, in CUDA graphs, 16 segment slots as in
vitgraph's packed buckets, q/k/v strided views of one qkv tensor as in the tower.

    python benchmarks/fa4_persistent.py
    python benchmarks/fa4_persistent.py --batched --exact-slots   # batched long frames, as eager calls
    python benchmarks/fa4_persistent.py --tiles 128x128 128x192 128x256 --layouts 16x256 8x448   # other tiles
    python benchmarks/fa4_persistent.py --lean --layouts 16x256 4x1024   # LEAN_ADVANCE off vs on
    python benchmarks/fa4_persistent.py --setting OWN_O_SMEM=False,True   # any fa4_persistent setting, value by value

Each layout runs with the tile vitgraph picks for it (128-row tiles up to 2048-token frames,
FA4's own 192-row tiles above) and, for comparison, persistent with either tile: with O in
its own shared memory (the default) and through Q's buffer behind a barrier between tiles
(``OWN_O_SMEM = False``). Output is compared with FA4's own kernel: the tile math is the
same, so it must match bitwise, on every one of the timed replays' last output too. With
``--tiles``, each layout runs FA4's own and the persistent kernel (own O) with each tile
given; outputs are compared with the first tile's FA4 output (another key-tile width sums
in another order, so only within bf16 rounding). Needs flash-attn-4 (the ``fa4`` extra)
and a Hopper GPU.
"""
import argparse
import ast
import contextlib

import torch
from flash_attn.cute.interface import _flash_attn_fwd

from vitgraph import fa4_persistent
from vitgraph.attention import FA4_SHORT_SEQLEN, FA4_SHORT_TILE, fa4_tile_kwargs
from vitgraph.bench.common import graph_replay_us

H, D, SLOTS = 16, 80, 16
LAYOUTS = {"16x256": [256] * 16, "8x448": [448] * 8, "4x1024": [1024] * 4, "1x256": [256], "1x1024": [1024],
           "2x2048": [2048] * 2, "1x4096": [4096], "1x9604": [9604], "mixed 1x3000+4x256": [3000] + [256] * 4}
# Batched steps of several long frames, as a server's encoder loop builds them (10-16k tokens).
BATCHED = {"5000+4000+3000": [5000, 4000, 3000], "2x6000": [6000] * 2, "4x3000": [3000] * 4,
           "6x2500": [2500] * 6, "5000+8x400": [5000] + [400] * 8}


def attend(q, k, v, cu, lens, tile, persistent: bool):
    """FA4's varlen forward over the ``lens`` frames, with ``tile``, persistent or FA4's own."""
    with fa4_persistent.persistent_tiles() if persistent else contextlib.nullcontext():
        return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                               max_seqlen_k=max(lens), **fa4_tile_kwargs(tile))[0]


def vitgraph_tile(lens):
    """The tile vitgraph takes for these frames: 128-row up to 2048-token frames, else FA4's own."""
    return FA4_SHORT_TILE if max(lens) <= FA4_SHORT_SEQLEN else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batched", action="store_true", help="batched steps of long frames instead")
    parser.add_argument("--exact-slots", action="store_true",
                        help="one segment slot per frame (an eager call) instead of 16 (a packed bucket)")
    parser.add_argument("--tiles", nargs="*", default=None, help="MxN query x key tiles to compare, e.g. 128x192")
    parser.add_argument("--layouts", nargs="*", default=None, help=f"a subset of {list(LAYOUTS)}")
    parser.add_argument("--lean", action="store_true",
                        help="the persistent kernel (own O) with fa4_persistent.LEAN_ADVANCE off and on")
    parser.add_argument("--setting", default=None,
                        help="NAME=V1,V2,...: the persistent kernel (own O) with each value of that "
                             "fa4_persistent setting (Python literals), e.g. OWN_O_SMEM=False,True")
    args = parser.parse_args()
    if args.lean:
        args.setting = "LEAN_ADVANCE=False,True"
    layouts = BATCHED if args.batched else LAYOUTS
    if args.layouts:
        layouts = {name: layouts[name] for name in args.layouts}
    for name, lens in layouts.items():
        total = sum(lens)
        slots = len(lens) if args.exact_slots else SLOTS
        cu = torch.zeros(slots + 1, dtype=torch.int32)
        cu[1:len(lens) + 1] = torch.tensor(lens).cumsum(0)
        cu[len(lens) + 1:] = total
        cu = cu.cuda()
        q, k, v = torch.randn(total, 3, H, D, device="cuda", dtype=torch.bfloat16).unbind(1)
        if args.setting:
            setting, values = args.setting.split("=")
            compare_setting(name, lens, cu, q, k, v, setting, [ast.literal_eval(x) for x in values.split(",")])
            continue
        if args.tiles:
            compare_tiles(name, lens, cu, q, k, v, [tuple(int(x) for x in t.split("x")) for t in args.tiles])
            continue
        tile = vitgraph_tile(lens)
        row, ref = [], None
        for variant in ("FA4 own", "persistent, O via Q", "persistent, own O"):
            fa4_persistent.OWN_O_SMEM = variant.endswith("own O")
            box = {}

            def run(persistent=variant != "FA4 own"):
                box["out"] = attend(q, k, v, cu, lens, tile, persistent)
            run()
            out = box["out"]
            torch.cuda.synchronize()
            ref = out.clone() if ref is None else ref
            us, _ = graph_replay_us(run, inner=8, reps=15)
            last = box["out"]  # the graph's last call, after its last replay
            same = all(torch.equal(o, ref) for o in (out, last))
            err = max(((o.float() - ref.float()).norm() / ref.float().norm()).item() for o in (out, last))
            row.append(f"{variant} {us:7.1f} ({'bitwise' if same else f'rel err {err:.1e}'})")
        print(f"{name:20s} tile {tile or 'FA4 default'} | " + " | ".join(row), flush=True)


def compare_setting(name, lens, cu, q, k, v, setting, values) -> None:
    """One row per layout: the persistent kernel (own O, vitgraph's tile) with each value of a
    fa4_persistent setting, µs per call. The settings do not change the math, so the outputs
    must match bitwise, on the timed replays' last output too."""
    fa4_persistent.OWN_O_SMEM = True
    default = getattr(fa4_persistent, setting)
    tile = vitgraph_tile(lens)
    row, ref = [], None
    for value in values:
        setattr(fa4_persistent, setting, value)
        box = {}

        def run():
            box["out"] = attend(q, k, v, cu, lens, tile, persistent=True)
        run()
        out = box["out"].clone()
        ref = out if ref is None else ref
        us, _ = graph_replay_us(run, inner=8, reps=15)
        same = torch.equal(out, ref) and torch.equal(box["out"], ref)
        row.append(f"{setting}={value} {us:7.1f} ({'bitwise' if same else 'DIFFERS'})")
    setattr(fa4_persistent, setting, default)
    print(f"{name:20s} tile {tile or 'FA4 default'} | " + " | ".join(row), flush=True)


def compare_tiles(name, lens, cu, q, k, v, tiles) -> None:
    """One row per tile: FA4's own scheduler and the persistent one (own O), µs per call."""
    fa4_persistent.OWN_O_SMEM = True
    ref = None
    for tile in tiles:
        row = []
        for persistent in (False, True):
            def run():
                return attend(q, k, v, cu, lens, tile, persistent)
            try:
                out = run().float()
                ref = out if ref is None else ref
                err = ((out - ref).norm() / ref.norm()).item()
                us, _ = graph_replay_us(run, inner=8, reps=15)
                row.append(f"{'persistent' if persistent else 'FA4 own'} {us:7.1f} (rel err {err:.1e})")
            except Exception as exc:  # a tile FA4 cannot build at this head dim
                row.append(f"{'persistent' if persistent else 'FA4 own'}: {type(exc).__name__} {str(exc)[:60]}")
        print(f"{name:20s} tile {tile[0]}x{tile[1]} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
