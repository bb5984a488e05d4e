"""proj and fc2 of the bias-free residual stream: cuBLAS's ``addmm_`` against quack's GEMM.

Above ``SPLIT_K_MAX_ROWS`` rows the fused forward adds proj's and fc2's products into the
residual stream itself (``x += inp @ weight.T``, biases kept aside) and the LayerNorm after
reads the stream. Per layer and row count, µs per GEMM + that LayerNorm, in CUDA graphs, 8
weight sets rotated so weights stream from DRAM as in the tower:

- ``cublas``: ``x.addmm_(inp, weight.t())`` (what the tower runs by default);
- ``quack C <tile>``: quack's GEMM reading ``x`` as C and writing ``x`` in place (the product
  added in fp32 in the epilogue, one rounding; the form tried in the tower at commit e6a651b,
  benchmarks/HISTORY.md);
- ``quack reduce <tile>``: quack's ``add_to_output`` (the product rounded to bf16, then added
  into ``x`` by a TMA reduce-add store: two roundings).

Each line also gives the output's largest difference from cuBLAS's, over its largest value
(0: the same bits).

Usage: gemm_stream_add.py [M ...] [--tiles 128x160 256x160]. Needs quack-kernels (the ``fa4`` extra) and a Hopper GPU.
"""
import argparse

import torch

from vitgraph.ops import gemm, kernels
from vitgraph.bench.common import graph_per_call_us

LAYERS = {"proj": 1280, "fc2": 5120}  # K; both write the 1280-wide stream
SETS = 8
TILES = {"128x160": dict(tile_m=128, tile_n=160, pingpong=True, cluster_m=1, cluster_n=2),
         "128x160c21": dict(tile_m=128, tile_n=160, pingpong=True, cluster_m=2, cluster_n=1),
         "256x160": dict(tile_m=256, tile_n=160, pingpong=False, cluster_m=1, cluster_n=2),
         "256x128": dict(tile_m=256, tile_n=128, pingpong=False, cluster_m=2, cluster_n=1),
         "128x256": dict(tile_m=128, tile_n=256, pingpong=False, cluster_m=1, cluster_n=2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ms", nargs="*", type=int, default=[2048, 3584, 4096, 9604])
    parser.add_argument("--tiles", nargs="*", default=list(TILES), choices=list(TILES))
    parser.add_argument("--reduce", action="store_true", help="also time add_to_output (TMA reduce-add)")
    args = parser.parse_args()
    _, gemm_plain, _ = gemm._quack()
    dev, dt = "cuda", torch.bfloat16
    ln_w, ln_b = torch.ones(1280, device=dev, dtype=dt), torch.zeros(1280, device=dev, dtype=dt)
    offset = torch.randn(1280, device=dev) * 0.1
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; µs per GEMM + LayerNorm, "
          f"(max |diff| from cuBLAS / max |cuBLAS|)")

    def layernorm(x):
        return kernels.add_layernorm(x, None, ln_w, ln_b, 1e-6, offset=offset)

    def quack(tile, reduce):
        config = gemm._gemm_config(tuple(TILES[tile].items()))

        def add_(x, inp, w):
            if reduce:
                gemm_plain(inp, w.t(), x, add_to_output=True, config=config)
            else:
                gemm_plain(inp, w.t(), x, C=x, config=config)
            return x
        return add_

    variants = {"cublas": lambda x, inp, w: x.addmm_(inp, w.t())}
    for tile in args.tiles:
        variants[f"quack C {tile}"] = quack(tile, False)
        if args.reduce:
            variants[f"quack reduce {tile}"] = quack(tile, True)
    for m in args.ms:
        for layer, k in LAYERS.items():
            weights = [torch.randn(1280, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(SETS)]
            inp = torch.randn(m, k, device=dev, dtype=dt)
            x0 = torch.randn(m, 1280, device=dev, dtype=dt) * 4
            ref = variants["cublas"](x0.clone(), inp, weights[0]).float()
            cells = []
            for name, add_ in variants.items():
                got = add_(x0.clone(), inp, weights[0]).float()
                diff = ((got - ref).abs().max() / ref.abs().max()).item()
                x = x0.clone()
                us = graph_per_call_us([lambda w=w: layernorm(add_(x, inp, w)) for w in weights])
                cells.append((us, name, diff))
            base = cells[0][0]
            text = "; ".join(f"{name} {us:.1f} ({(us / base - 1) * 100:+.1f}%, {diff:.0e})" for us, name, diff in cells)
            print(f"M={m:5d} {layer:4s} {text}", flush=True)


if __name__ == "__main__":
    main()
