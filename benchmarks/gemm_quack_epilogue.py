"""CuTe-DSL GEMMs (quack-kernels) with the epilogue fused, against cuBLAS plus a Triton pass.

The tower's block runs four GEMMs through cuBLAS (``F.linear`` with bias) and QuickGELU as a
separate Triton pass over fc1's output (84 MB read and written at 4096 tokens). quack's Hopper
GEMM takes an activation in its epilogue; QuickGELU is not one of its own, so this script
registers ``x * sigmoid(1.702 x)`` (quack's own sigmoid) in its activation table. For each of
the block's GEMMs at a few token counts, inside CUDA graphs, with 8 weight sets rotated so
weights stream from DRAM as in the 32-block tower:

- ``cublas``: ``F.linear`` (+ ``kernels.quick_gelu_`` for fc1): what the tower runs;
- ``quack <config>``: quack's GEMM with the bias (and for fc1 QuickGELU) in the epilogue,
  for each of a set of Hopper tile/cluster configurations (each compiled once, any M).

Usage: gemm_quack_epilogue.py [M ...] [--layers fc1 ...] [--vitgraph-tile]. Needs quack-kernels (the ``fa4`` extra) and a Hopper GPU.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from vitgraph.ops import kernels
from vitgraph.bench.common import graph_per_call_us as per_call_us

LAYERS = {"qkv": (1280, 3840), "proj": (1280, 1280), "fc1": (1280, 5120), "fc2": (5120, 1280)}
SETS = 8


def register_quick_gelu() -> None:
    import cutlass.cute as cute
    from cutlass import const_expr
    from cutlass.cutlass_dsl import dsl_user_op
    from quack import activation

    @dsl_user_op
    def quick_gelu(x, *, loc=None, ip=None):
        if const_expr(not isinstance(x, tuple)):
            return x * activation.sigmoid(1.702 * x)
        s = activation.sigmoid(cute.arch.mul_packed_f32x2((1.702, 1.702), x))
        return cute.arch.mul_packed_f32x2(x, s)

    activation.act_fn_map["quick_gelu"] = quick_gelu


def configs():
    from quack.gemm_config import GemmConfig

    out = []
    for tile_m, tile_n, pingpong in [(128, 128, True), (128, 192, True), (192, 128, True), (128, 160, True),
                                     (256, 128, False), (256, 160, False), (256, 192, False), (128, 256, False)]:
        for cluster_m, cluster_n in [(2, 1), (1, 2)]:
            out.append(GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m,
                                  cluster_n=cluster_n, swap_ab=False, is_dynamic_persistent=False))
    # 64-row tiles: one warpgroup's MMA per tile, for a few hundred rows (more CTAs than 128-row tiles)
    for tile_n, pingpong in [(128, True), (160, True), (256, True), (128, False)]:
        # 4x1: four 64-row tiles share each weight tile; 2x2: weight tiles and input tiles both shared by two
        for cluster_m, cluster_n in [(2, 1), (1, 2), (4, 1), (2, 2)]:
            out.append(GemmConfig(tile_m=64, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m,
                                  cluster_n=cluster_n, swap_ab=False, is_dynamic_persistent=False))
    for cluster_m, cluster_n in [(2, 1), (1, 2)]:  # swapped operands: small M becomes the N tile
        out.append(GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=cluster_m, cluster_n=cluster_n,
                              swap_ab=True, is_dynamic_persistent=False))
    return out


def vitgraph_config(name: str, m: int, n: int, device):
    """The GemmConfig the tower's quack GEMM for layer ``name`` runs with at ``m`` rows (fc1's
    tile follows vitgraph.ops.gemm's wave model; plain qkv keeps QUACK_TILE)."""
    from vitgraph.ops.gemm import _config, fc1_tile, plain_config

    return _config(fc1_tile, m, n, device) if name == "fc1" else plain_config()


def label(c) -> str:
    return (f"{c.tile_m}x{c.tile_n} {'pp' if c.pingpong else 'coop'} c{c.cluster_m}{c.cluster_n}"
            f"{' swap' if c.swap_ab else ''}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ms", nargs="*", type=int, default=[256, 1024, 4096])
    parser.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--vitgraph-tile", action="store_true", help="only the tile vitgraph.ops.gemm uses")
    parser.add_argument("--tiles", nargs="*", help="only configurations whose label starts with one of these, e.g. 256x160")
    args = parser.parse_args()

    from quack.gemm_interface import gemm_act_tuned, gemm_tuned

    register_quick_gelu()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    totals = {}
    broken = set()
    for m in args.ms:
        totals[m] = {"cublas": 0.0, "best": 0.0}
        for name in args.layers:
            k, n = LAYERS[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
            bs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
            act = name == "fc1"

            def cublas(w, b):
                y = F.linear(x, w, b)
                return kernels.quick_gelu_(y) if act else y

            ref = cublas(ws[0], bs[0]).float()
            base = per_call_us([lambda w=w, b=b: cublas(w, b) for w, b in zip(ws, bs)])
            results = []
            for cfg in (configs() if not args.vitgraph_tile else [vitgraph_config(name, m, n, dev)]):
                if label(cfg) in broken or (args.tiles and not label(cfg).startswith(tuple(args.tiles))):
                    continue

                def quack(w, b, cfg=cfg):
                    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                    if act:
                        gemm_act_tuned.fn(x, w.t(), None, out, None, b, "quick_gelu", config=cfg)
                    else:
                        gemm_tuned.fn(x, w.t(), out, bias=b, config=cfg)
                    return out

                try:
                    start = time.perf_counter()
                    got = quack(ws[0], bs[0]).float()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - start
                    if first_s > 0.2:  # the first call of a config compiles it (or loads quack's disk cache)
                        print(f"  {label(cfg)} {name}: first call {first_s:.1f} s", flush=True)
                    err = ((got - ref).norm() / ref.norm()).item()
                    us = per_call_us([lambda w=w, b=b: quack(w, b) for w, b in zip(ws, bs)])
                except Exception as exc:  # an invalid configuration is reported, not fatal
                    print(f"  {label(cfg)}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                    broken.add(label(cfg))
                    continue
                results.append((us, label(cfg), err))
            results.sort()
            best = min([base] + [r[0] for r in results])
            totals[m]["cublas"] += base
            totals[m]["best"] += best
            shown = "; ".join(f"{lab} {us:.1f} (err {err:.1e})" for us, lab, err in results[:3])
            print("  all: " + "; ".join(f"{lab} {us:.1f}" for us, lab, _ in results), flush=True)
            print(f"M={m:5d} {name:4s}{'+gelu' if act else '     '} cublas {base:7.1f} | quack best: {shown}",
                  flush=True)
    print("\nper block (qkv+proj+fc1+QuickGELU+fc2), µs: M, cuBLAS + Triton, best of cuBLAS/quack per layer")
    for m, t in totals.items():
        print(f"  M={m:5d} {t['cublas']:8.1f} {t['best']:8.1f}  ({(t['best'] / t['cublas'] - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
