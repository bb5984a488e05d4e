"""qkv + rotary: the GEMM and a Triton pass, against the rotary in quack's GEMM epilogue.

Without the epilogue, the fused forward runs qkv (quack's GEMM from 2048 rows, cuBLAS below)
and then ``kernels.rotary_`` over q and k (in place, padding rows zeroed for FlashAttention 4).
``vitgraph.ops.gemm_rope.qkv_rope`` does both in one kernel. Both run on qkv weights in the
tower's interleaved order. Inside CUDA graphs, with 8 weight sets rotated so weights stream
from DRAM as in the 32-block tower, per call in µs:

- ``gemm+rotary``: the GEMM and the Triton pass;
- ``gemm``: the GEMM alone (what the epilogue has to hide);
- ``fused``: ``qkv_rope`` (through ``linear_qkv_rope``: the tile the tower picks for M rows).

Both outputs are checked against an fp32 reference computed in the checkpoint's order (its
columns then interleaved), and against each other.

With ``--tiles``, ``fused`` is timed once per quack tile configuration listed (e.g.
``128x160pp12``: a 128x160 pingpong tile in 1x2 clusters, vitgraph's; ``128x240coop21``), each
output checked against the reference, after ``gemm+rotary``; wave counts on the GPU's SMs are
printed beside. With ``--after-layernorm`` every timed call is preceded by the Triton
LayerNorm that feeds qkv in the tower: quack's kernels launch with programmatic dependent
launch (PDL), so back to back one's prologue overlaps the previous one's epilogue, which no
kernel ahead of them allows in the tower.

Usage: gemm_rope_epilogue.py [M ...] [--tiles CONFIG ...] [--after-layernorm]. Needs quack-kernels
(the ``fa4`` extra) and a Hopper GPU.
"""
import argparse
import dataclasses
import time

import torch

from vitgraph.ops import kernels
from vitgraph.bench.common import graph_per_call_us as per_call_us
from vitgraph.ops.gemm import linear_qkv, linear_qkv_rope
from vitgraph.config import PRESETS
from vitgraph.ops.gemm_rope import qkv_rope
from vitgraph.models.qwen2_vl import Qwen2VisionTower, interleave_order

HEADS, HEAD_DIM, EMBED = 16, 80, 1280
SETS = 8
PADDING = 0.05  # share of padding rows at the end, as in a bucket


def reference(x, w, b, cos, sin, keep):
    qkv = (x.float() @ w.float().T + b.float()).view(x.shape[0], 3, HEADS, HEAD_DIM)
    half = HEAD_DIM // 2
    c, s = cos[:, None, :], sin[:, None, :]
    for i in range(2):
        t = qkv[:, i]
        qkv[:, i] = t * c + torch.cat((-t[..., half:], t[..., :half]), -1) * s
    return (qkv.view(x.shape[0], -1) * keep[:, None]).nan_to_num()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ms", nargs="*", type=int, default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--tiles", nargs="*", help="quack configurations to time fused with, e.g. 128x240coop21")
    parser.add_argument("--after-layernorm", action="store_true",
                        help="with --tiles: time each call after the LayerNorm that feeds qkv in the tower")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    tower = Qwen2VisionTower(dataclasses.replace(PRESETS["qwen2-vl-2b"], depth=1))  # for its rotary tables
    inv_freq = tower.inv_freq
    freq_h, freq_w = tower.to(dev).rope_columns()
    order = interleave_order(HEADS, HEAD_DIM).to(dev)
    ws = [torch.randn(3 * EMBED, EMBED, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(SETS)]
    bs = [torch.randn(3 * EMBED, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
    wis, bis = [w[order].contiguous() for w in ws], [b[order].contiguous() for b in bs]
    if args.tiles:
        return sweep(args.ms, args.tiles, freq_h, freq_w, wis, bis, args.after_layernorm)
    print(f"{'M':>6} {'gemm+rotary':>12} {'gemm':>8} {'fused':>8} {'saved':>8}   err fused/ref  err current/ref  fused vs current")
    for m in args.ms:
        x = torch.randn(m, EMBED, device=dev, dtype=torch.bfloat16)
        real = m - int(m * PADDING) // 4 * 4
        side = 128
        pos = torch.stack([torch.arange(m, device=dev) // side, torch.arange(m, device=dev) % side], 1).int()
        pos[real:] = 0
        seg = torch.where(torch.arange(m, device=dev) < real, 0, -1).int()
        angles = (pos.float()[..., None] * inv_freq.to(dev)).flatten(1)  # [m, HEAD_DIM/2]
        cos, sin = angles.cos(), angles.sin()
        pos_h = torch.where(seg >= 0, pos[:, 0].float(), -1.0)
        pos_w = pos[:, 1].float().contiguous()

        def current(w, b):
            qkv = linear_qkv(x, w, b, "quack")
            kernels.rotary_(qkv, cos, sin, HEADS, seg, zero_padding=True)
            return qkv

        def fused(w, b):  # with the tile the tower picks for m rows
            return linear_qkv_rope(x, w, b, freq_h, freq_w, pos_h, pos_w)

        start = time.perf_counter()
        got = fused(wis[0], bis[0])
        torch.cuda.synchronize()
        if time.perf_counter() - start > 0.5:
            print(f"  first fused call {time.perf_counter() - start:.1f} s (compile or disk-cache load)", flush=True)
        # The reference in the checkpoint's order, its columns then interleaved as the tower keeps them.
        ref = reference(x, ws[0], bs[0], torch.cat((cos, cos), -1), torch.cat((sin, sin), -1),
                        (seg >= 0).float())[:, order]
        cur = current(wis[0], bis[0]).float()
        got = got.float()

        def rel(a, b):
            return ((a - b).norm() / b.norm()).item()

        t_cur = per_call_us([lambda w=w, b=b: current(w, b) for w, b in zip(wis, bis)])
        t_gemm = per_call_us([lambda w=w, b=b: linear_qkv(x, w, b, "quack") for w, b in zip(wis, bis)])
        t_fused = per_call_us([lambda w=w, b=b: fused(w, b) for w, b in zip(wis, bis)])
        print(f"{m:6d} {t_cur:12.1f} {t_gemm:8.1f} {t_fused:8.1f} {t_cur - t_fused:+8.1f}   "
              f"{rel(got, ref):.2e}      {rel(cur, ref):.2e}       {rel(got, cur):.2e}", flush=True)
        assert rel(got, ref) < 1e-2 and rel(cur, ref) < 1e-2, "an output does not match the reference"
        assert torch.all(got[real:] == 0), "padding rows not zeroed"


def parse_tile(text: str):
    """``128x240coop21`` -> quack's GemmConfig (tile, pingpong or cooperative, cluster M and N)."""
    import re

    from quack.gemm_config import GemmConfig

    match = re.fullmatch(r"(\d+)x(\d+)(pp|coop)(\d)(\d)", text)
    if not match:
        raise SystemExit(f"bad tile {text!r}: expected e.g. 128x160pp12")
    tm, tn, kind, cm, cn = match.groups()
    return GemmConfig(tile_m=int(tm), tile_n=int(tn), pingpong=kind == "pp", cluster_m=int(cm), cluster_n=int(cn),
                      swap_ab=False, is_dynamic_persistent=False)


def sweep(ms, tiles, freq_h, freq_w, wis, bis, after_layernorm: bool) -> None:
    dev = wis[0].device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = wis[0].shape[0]
    gamma, beta = torch.ones(EMBED, device=dev, dtype=torch.bfloat16), torch.zeros(EMBED, device=dev, dtype=torch.bfloat16)
    for m in ms:
        residual = torch.randn(m, EMBED, device=dev, dtype=torch.bfloat16)
        x = kernels.add_layernorm(residual, None, gamma, beta, 1e-6)

        def fed(qkv_of):  # qkv of x, after the LayerNorm that writes x when asked
            if not after_layernorm:
                return qkv_of(x)
            return qkv_of(kernels.add_layernorm(residual, None, gamma, beta, 1e-6))

        pos = torch.stack([torch.arange(m, device=dev) // 128, torch.arange(m, device=dev) % 128], 1).float()
        pos_h, pos_w = pos[:, 0].contiguous(), pos[:, 1].contiguous()
        cos = sin = torch.ones(m, HEAD_DIM // 2, device=dev)
        seg = torch.zeros(m, device=dev, dtype=torch.int32)

        def current(x, w, b):  # the tower below QUACK_ROPE_MIN_ROWS rows: the GEMM, then the Triton pass
            qkv = linear_qkv(x, w, b, "quack")
            kernels.rotary_(qkv, cos, sin, HEADS, seg, zero_padding=True)
            return qkv

        us = per_call_us([lambda w=w, b=b: fed(lambda x: current(x, w, b)) for w, b in zip(wis, bis)])
        ref = None
        row = [f"gemm+rotary {us:6.1f} us"]
        if after_layernorm:
            alone = per_call_us([lambda: kernels.add_layernorm(residual, None, gamma, beta, 1e-6)] * len(wis))
            row.insert(0, f"layernorm alone {alone:5.1f} us")
        for text in tiles:
            cfg = parse_tile(text)
            try:
                got = qkv_rope(x, wis[0], bis[0], freq_h, freq_w, pos_h, pos_w, cfg).float()
                torch.cuda.synchronize()
            except Exception as exc:  # an invalid configuration is reported, not fatal
                row.append(f"{text} failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            ref = got if ref is None else ref
            err = ((got - ref).norm() / ref.norm()).item()
            us = per_call_us([lambda w=w, b=b, cfg=cfg: fed(lambda x: qkv_rope(x, w, b, freq_h, freq_w, pos_h, pos_w, cfg))
                              for w, b in zip(wis, bis)])
            tiles_mn = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
            row.append(f"{text} {us:6.1f} us ({tiles_mn / sms:.2f} waves, vs first {err:.0e})")
        print(f"M={m:5d} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
