"""Short-frame attention in CUDA graphs: vitgraph's Triton kernel (rotary fused in) against
FlashAttention 4 with the rotary pass before it, per packed layout, µs per call.

    python benchmarks/short_attention.py            # the default tiles and a sweep of others

Columns: ``fa4+rot`` is the fused forward's path below ``QUACK_ROPE_MIN_ROWS`` rows (the
Triton rotary kernel, padding zeroed, then FA4 with vitgraph's tile rule); ``fa4`` is FA4
alone (where qkv's GEMM applies the rotary); ``tri+rot``/``tri`` the Triton kernel with and
without the rotary, default tiles; then the sweep, with the rotary. Each layout sits in a
bucket of 16 segment slots (64 for 64-token frames) whose rows round up to 256. Needs a
CUDA GPU; the FA4 columns need flash-attn-4.
"""
import torch

from vitgraph import kernels
from vitgraph.attention import _has_fa4, fa4_tile
from vitgraph.bench.common import graph_replay_us
from vitgraph.short_attention import config, short_attention

H, D = 16, 80
LAYOUTS = {"1x256": [256], "1x512": [512], "1x1024": [1024], "16x256": [256] * 16, "8x448": [448] * 8,
           "4x1024": [1024] * 4, "64x64": [64] * 64, "2x2048": [2048] * 2, "1x2048+8x256": [2048] + [256] * 8,
           "4x576": [576] * 4, "1x2048": [2048]}
SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2),
         (128, 128, 8, 2), (128, 32, 4, 2), (128, 64, 8, 3), (32, 64, 4, 2)]


def main():
    fa4 = _has_fa4(torch.device("cuda"))
    if fa4:
        from flash_attn.cute.interface import _flash_attn_fwd
    print(f"{'layout':14s} {'fa4+rot':>8s} {'fa4':>8s} {'tri+rot':>8s} {'tri':>8s}  err   | sweep (tri+rot)", flush=True)
    for name, lens in LAYOUTS.items():
        total = sum(lens)
        slots = 64 if len(lens) > 16 else 16
        rows = -(-total // 256) * 256
        cu = torch.full((slots + 1,), total, dtype=torch.int32)
        cu[0] = 0
        cu[1:len(lens) + 1] = torch.tensor(lens).cumsum(0)
        cu = cu.cuda()
        seg = torch.full((rows,), -1, dtype=torch.int32)
        seg[:total] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
        seg = seg.cuda()
        g = torch.Generator(device="cuda").manual_seed(0)
        source = torch.randn(rows, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
        angles = torch.rand(rows, D // 2, device="cuda", generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
        qkv = source.clone()
        # A short-frame bucket bounds its frames (vitgraph's cap above 2048 tokens); else the budget.
        max_seqlen = min(rows, 2048) if max(lens) <= 2048 else rows
        cells = {}
        if fa4:
            tile = fa4_tile(max_seqlen, H, qkv.device)

            def fa4_only():
                q, k, v = qkv.view(rows, 3, H, D).unbind(1)
                return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                       max_seqlen_k=max_seqlen, **tile)[0]

            def fa4_rot():
                qkv.copy_(source)  # the rotary is in place: rotate the same inputs every call
                kernels.rotary_(qkv, cos, sin, H, seg, zero_padding=True)
                return fa4_only()

            ref = fa4_rot()[:total].float()
            copy_us, _ = graph_replay_us(lambda: qkv.copy_(source))
            cells["fa4+rot"] = graph_replay_us(fa4_rot)[0] - copy_us
            cells["fa4"] = graph_replay_us(fa4_only)[0]
        out = torch.empty(rows, H, D, device="cuda", dtype=torch.bfloat16)
        got = short_attention(source, cu, H, max_seqlen, cos, sin, out=out)[:total].float()
        err = ((got - ref).norm() / ref.norm()).item() if fa4 else float("nan")
        cells["tri+rot"] = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, cos, sin, out=out))[0]
        cells["tri"] = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, out=out))[0]
        sweep = []
        for tiles in SWEEP:
            try:
                us = graph_replay_us(lambda: short_attention(source, cu, H, max_seqlen, cos, sin, out=out,
                                                             tiles=tiles))[0]
                sweep.append(f"{tiles[0]}x{tiles[1]}w{tiles[2]}s{tiles[3]} {us:6.1f}")
            except Exception as exc:  # e.g. out of shared memory
                sweep.append(f"{tiles}: {type(exc).__name__}")
        row = " ".join(f"{cells.get(k, float('nan')):8.1f}" for k in ("fa4+rot", "fa4", "tri+rot", "tri"))
        print(f"{name:14s} {row} {err:.0e} | default {config(max_seqlen)} | " + " | ".join(sweep), flush=True)


if __name__ == "__main__":
    main()
