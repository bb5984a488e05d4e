"""proj and fc2 as a split-K *batched* cuBLAS GEMM whose partial products the next add+LayerNorm sums.

    python benchmarks/gemm_batched_split_k.py 256 512 1024 2048 4096
    python benchmarks/gemm_batched_split_k.py 256 512 --layers qkv fc1   # the GEMM alone (their consumers differ)

At a few hundred rows, proj (1280 -> 1280) and fc2 (5120 -> 1280) have 20-80 output tiles
of 128x128 for 132 SMs. Splitting K into S slices as one strided-batched GEMM (``torch.bmm``
over views of the input and the weight: no copies) gives S times the tiles; the
add+LayerNorm kernel that follows sums the S partials in fp32, with the bias
(``kernels.add_layernorm(x, partials, ..., y_bias=bias)``). Partials in bf16 or fp32
(``bmm(..., out_dtype=torch.float32)``). Timed per GEMM + add_layernorm pair, µs, inside
CUDA graphs with 8 weight sets rotated so that weights stream from DRAM as in the tower;
the GEMM alone too ("pair" is the GEMM alone for qkv and fc1, whose consumers differ). Error:
the LayerNorm output (the sum, for qkv and fc1) against the unsplit path's.

``--quack 64x128pp21 ...`` also times quack's Hopper GEMM over the same views (one batched
call, bf16 partials; tiles as in ``gemm_rope_epilogue.py --tiles``). quack's kernels launch
as PDL kernels and wait for the grid ahead before their first load; ``--after-fc1`` puts
fc1 with QuickGELU (vitgraph's quack path, which signals its dependents after its main loop)
ahead of every fc2 timed, as in the tower, so that overlap counts as it would there.
"""

import argparse

import torch
import torch.nn.functional as F

from vitgraph.ops import kernels
from vitgraph.bench.common import graph_per_call_us, rel_err

WIDTH = 1280
SETS = 8
LAYERS = {"proj": (1280, 1280), "fc2": (5120, 1280), "qkv": (1280, 3840), "fc1": (1280, 5120)}  # (K, N)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", type=int, default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--splits", nargs="*", type=int, default=[2, 3, 4, 5, 8])
    p.add_argument("--layers", nargs="*", default=["proj", "fc2"], choices=list(LAYERS))
    p.add_argument("--quack", nargs="*", default=[], help="quack tiles to time too, e.g. 64x128pp21")
    p.add_argument("--after-fc1", action="store_true", help="fc2: run fc1 + QuickGELU (quack) ahead of each call")
    args = p.parse_args()
    quack_configs = []
    if args.quack:
        from gemm_rope_epilogue import parse_tile
        from quack.gemm_interface import gemm_tuned

        quack_configs = [(text, parse_tile(text)) for text in args.quack]
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    ln_w, ln_b = torch.ones(WIDTH, device=dev, dtype=bf16), torch.zeros(WIDTH, device=dev, dtype=bf16)
    summary = {}
    for layer in args.layers:
        k, n = LAYERS[layer]
        # In the tower proj follows FlashAttention, which lets nothing launch early; here the
        # add+LayerNorm of the call before would (for quack's PDL kernels), unless told not to.
        kernels.LAYERNORM_LAUNCHES_DEPENDENTS = layer != "proj"
        weights = [torch.randn(n, k, device=dev, dtype=bf16) / k ** 0.5 for _ in range(SETS)]
        biases = [0.1 * torch.randn(n, device=dev, dtype=bf16) for _ in range(SETS)]
        chained = args.after_fc1 and layer == "fc2"
        if chained:
            from vitgraph.ops.gemm import linear_quick_gelu

            fc1 = [(torch.randn(k, WIDTH, device=dev, dtype=bf16) / WIDTH ** 0.5,
                    0.1 * torch.randn(k, device=dev, dtype=bf16)) for _ in range(SETS)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=bf16)
            resid = torch.randn(m, WIDTH, device=dev, dtype=bf16)
            if chained:
                h = torch.randn(m, WIDTH, device=dev, dtype=bf16)

                def source(i):  # fc2's input, written by the kernel ahead of it in the tower
                    return linear_quick_gelu(h, *fc1[i], "quack")
            else:
                def source(i):
                    return x

            def pair(i, y, y_bias=None):  # the GEMM's consumer; only proj and fc2 feed an add+LayerNorm
                if n != WIDTH:
                    return y
                return kernels.add_layernorm(resid, y, ln_w, ln_b, 1e-6, y_bias=y_bias)

            base_gemm = graph_per_call_us([lambda i=i: F.linear(source(i), weights[i], biases[i]) for i in range(SETS)])
            base = graph_per_call_us([lambda i=i: pair(i, F.linear(source(i), weights[i], biases[i]))
                                      for i in range(SETS)])
            start = resid.clone()
            x = source(0)
            ref = F.linear(x, weights[0], biases[0])
            if n == WIDTH:
                ref = kernels.add_layernorm(start.clone(), ref, ln_w, ln_b, 1e-6)
            rows = [f"{layer:>4} M={m:5d}  cuBLAS: gemm {base_gemm:6.1f}  pair {base:6.1f}"]
            best = (base, "unsplit")
            for s in args.splits:
                if k % (8 * s):
                    continue
                ws = [w.view(n, s, k // s).permute(1, 2, 0) for w in weights]  # [S, K/S, N], no copy

                def split(i, s=s):
                    return source(i).view(m, s, k // s).transpose(0, 1)  # [S, M, K/S], no copy

                variants = [(name, None, out_dtype) for name, out_dtype in (("bf16", None), ("fp32", torch.float32))]
                variants += [(f"quack {text}", cfg, None) for text, cfg in quack_configs]
                for name, cfg, out_dtype in variants:
                    def gemm(i, ws=ws, out_dtype=out_dtype, cfg=cfg, s=s):
                        if cfg is not None:
                            out = torch.empty(s, m, n, device=dev, dtype=bf16)
                            gemm_tuned.fn(split(i), ws[i], out, config=cfg)
                            return out
                        return torch.bmm(split(i), ws[i]) if out_dtype is None else \
                            torch.bmm(split(i), ws[i], out_dtype=out_dtype)
                    try:
                        gemm(0)
                    except (TypeError, RuntimeError, ValueError, AssertionError) as err:
                        rows.append(f"      S={s} {name}: unavailable ({str(err)[:60]})")
                        continue
                    g_us = graph_per_call_us([lambda i=i: gemm(i) for i in range(SETS)])
                    p_us = graph_per_call_us([lambda i=i: pair(i, gemm(i), biases[i]) for i in range(SETS)])
                    got = gemm(0).sum(0) + biases[0] if n != WIDTH else \
                        kernels.add_layernorm(start.clone(), gemm(0), ln_w, ln_b, 1e-6, y_bias=biases[0])
                    rows.append(f"      S={s} {name}: gemm {g_us:6.1f}  pair {p_us:6.1f}  err {rel_err(got, ref):.1e}")
                    best = min(best, (p_us, f"S={s} {name}"))
            print("\n".join(rows))
            summary[(layer, m)] = (base, *best)
    print("\nbest per pair (GEMM + add+LayerNorm), µs:")
    for (layer, m), (base, us, how) in summary.items():
        print(f"  {layer:>4} M={m:5d}: cuBLAS {base:6.1f} -> {us:6.1f} ({how}, {100 * (us / base - 1):+.0f}%)")


if __name__ == "__main__":
    main()
