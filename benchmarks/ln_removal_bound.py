"""How much removing the add+LayerNorm kernels, or attention time, could save at most, end to end
(bounds, not models).

    python benchmarks/ln_removal_bound.py --variant stock   # the defaults
    python benchmarks/ln_removal_bound.py --variant bound   # no LayerNorm kernels (wrong numbers)
    python benchmarks/ln_removal_bound.py --variant bound --cases 1x256 1x1024
    python benchmarks/ln_removal_bound.py --variant stock --attention-share 0.75   # attention in 24 of 32 blocks
    python benchmarks/ln_removal_bound.py --variant bound --attention-share 0      # the GEMMs alone
    python benchmarks/ln_removal_bound.py --variant bound --split-as-stock --cases 1x256   # proj, fc2 split as stock

``bound`` captures a forward that skips every LayerNorm and adds the residual inside proj's
and fc2's cuBLAS GEMM (``x.addmm_``, beta = 1; their bias is dropped), so each block runs
four GEMMs and FlashAttention 4 and nothing else, in the layouts where quack runs qkv with
the rotary and fc1 with QuickGELU (the 256- and 512-row buckets and 576 rows up, packed
buckets; where the stock forward splits proj's and fc2's K, up to 896 rows, the bound runs
them whole). Its outputs are meaningless; its time is what those GEMMs and attention take
with no LayerNorm work at all, which no design that keeps them beats: carrying the LayerNorm
statistics through the GEMM epilogues costs epilogue work on top. Run the two variants in
alternating processes: at the H200's 700 W cap, two encoders in one process read
differently by up to 0.3 ms (BENCHMARKS.md).

``--attention-share F`` (either variant) runs attention in that share of the blocks, spread
evenly, and leaves the others' attention output unwritten (wrong numbers): 0.75 stands for an
attention kernel a third faster than FlashAttention 4 (its every call, launch and per-tile
costs included, a quarter cheaper), 0 for free attention. Like ``bound``, it keeps whatever the
board does at its power cap with the work that is left, which a kernel-level estimate cannot.
Each process prints how many attention calls it skipped, so a share that never engaged shows.

``--split-as-stock`` (with ``bound``) runs proj and fc2 as the stock forward does where it
splits their K (:func:`vitgraph.ops.gemm.linear_split_k`, up to 896 rows) and leaves the partial
products unsummed and the stream unchanged: the GEMMs as the defaults run them, with no
LayerNorm and no reduction at all.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from ab_setting import parse_settings

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import median_ms, preheat
from vitgraph.bench.latency import CASES, select_cases
from vitgraph.ops.gemm import fc1_kernel, linear_qkv_rope, linear_quick_gelu, linear_split_k
from vitgraph.models import qwen2_vl
from vitgraph.models.qwen2_vl import Qwen2VisionTower

DEFAULT_CASES = ["1x1024", "4x1024", "16x256", "video-8x16x28", "1x4096"]


def bound_forward(stock, split_as_stock: bool = False):
    """``forward_fused`` without LayerNorm kernels where the rotary runs in qkv's epilogue and
    fc1 on quack; ``stock`` elsewhere. ``split_as_stock``: proj and fc2 through
    ``linear_split_k`` where the stock forward does, their products dropped."""
    def forward(tower: Qwen2VisionTower, pixels, batch, blocks=None):
        paths = tower.fused_paths(batch)
        rows = pixels.shape[0]
        fc1 = tower.blocks[0].mlp.fc1.weight
        if (not paths.rope_epilogue or tower.blocks[0].act_name != "quick_gelu"
                or fc1_kernel(rows, fc1, tower.gemm_backend) is None):
            return stock(tower, pixels, batch, blocks)
        blocks = tower.blocks if blocks is None else blocks
        freq_h, freq_w = tower.rope_columns()
        pos_h, pos_w = tower.rope_rows(batch)
        x = tower.patch_embed(pixels)
        split = split_as_stock and not paths.bias_free  # the stock forward's split-K steps
        for block in blocks:
            attn, mlp = block.attn, block.mlp
            qkv = linear_qkv_rope(x, attn.qkv.weight, attn.qkv.bias, freq_h, freq_w, pos_h, pos_w)
            q, k, v = qkv.view(rows, 3, tower.config.num_heads, -1).unbind(1)
            out = qwen2_vl.attend(attn.backend, q, k, v, batch, padding_zeroed=True)
            del q, k, v, qkv
            if split:
                linear_split_k(out.reshape(rows, -1), attn.proj.weight, attn.proj.bias)  # dropped
            else:
                x.addmm_(out.reshape(rows, -1), attn.proj.weight.t())
            del out
            f = linear_quick_gelu(x, mlp.fc1.weight, mlp.fc1.bias, tower.gemm_backend)
            if split:
                linear_split_k(f, mlp.fc2.weight, mlp.fc2.bias)  # dropped
            else:
                x.addmm_(f, mlp.fc2.weight.t())
            del f
        return tower.merger.mlp(x.view(-1, tower.merger.merged_dim))
    return forward


def attend_share(attend, share: float, calls: dict):
    """``attend`` run in ``share`` of its calls, spread evenly (call ``c`` runs when
    ``floor((c + 1) * share)`` steps up): the forward calls it once per block, so every 32 blocks'
    worth of calls skip the same number whatever block a warm-up started at, for shares in
    steps of 1/32. Skipped calls return unwritten memory of the output's shape. ``calls``
    counts them: ``all`` (the next call's index) and ``skipped``."""

    def wrapped(backend, q, k, v, batch, padding_zeroed=False):
        c = calls["all"]
        calls["all"] += 1
        if int((c + 1) * share) > int(c * share):
            return attend(backend, q, k, v, batch, padding_zeroed)
        calls["skipped"] += 1
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return wrapped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("stock", "bound"), required=True)
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="a vitgraph setting for the stock variant (e.g. vitgraph.ops.gemm.BIAS_FREE_STREAM=False)")
    p.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help=f"from {list(CASES)}")
    p.add_argument("--rounds", type=int, default=3, help="passes over the cases; the median is kept")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--max-budget", type=int, default=4096)
    p.add_argument("--attention-share", type=float, default=1.0,
                   help="share of the blocks that run attention, in steps of 1/32 (default 1: all)")
    p.add_argument("--split-as-stock", action="store_true",
                   help="bound: proj and fc2 split as the stock forward splits them, products unsummed")
    p.add_argument("--preheat", type=float, default=0.0,
                   help="seconds of calls before each case's first round (the A/B harness uses 5)")
    args = p.parse_args()
    if not 0.0 <= args.attention_share <= 1.0 or (args.attention_share * 32) % 1:
        p.error("--attention-share must be k/32 for k in 0..32")

    for module, attr, _, value in parse_settings(args.set):
        setattr(module, attr, value)
    if args.variant == "bound":
        Qwen2VisionTower.forward_fused = bound_forward(Qwen2VisionTower.forward_fused, args.split_as_stock)
    elif args.split_as_stock:
        p.error("--split-as-stock needs --variant bound")
    calls = {"all": 0, "skipped": 0}
    if args.attention_share < 1.0:
        qwen2_vl.attend = attend_share(qwen2_vl.attend, args.attention_share, calls)
    device = torch.device("cuda")
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0, max_budget=args.max_budget,
                                           progress=False)
    cases = select_cases(args.cases)
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_width,
                                generator=gen).to(device, torch.bfloat16) for name, grids in cases.items()}
    times = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, grids in cases.items():
            if r == 0 and args.preheat:
                preheat(lambda: enc.encode(inputs[name], grids), device, args.preheat)
            times[name].append(median_ms(lambda: enc.encode(inputs[name], grids), device, args.iters, 5))
    result = {name: round(statistics.median(t), 3) for name, t in times.items()}
    print(json.dumps({"variant": args.variant, "attention_share": args.attention_share,
                      "split_as_stock": args.split_as_stock, "set": args.set,
                      "attention_calls_at_capture": calls, "ms": result}))


if __name__ == "__main__":
    main()
