"""proj / fc2 with the residual add in quack's epilogue, against cuBLAS then the fused add + LayerNorm.

Each of the block's two residual updates is ``x += linear(inp)`` followed by ``LayerNorm(x)``:

- ``cublas``: ``F.linear`` (bias in cuBLAS's epilogue), then ``kernels.add_layernorm(x, y)``
  (reads x and y, writes x and the LayerNorm): what the tower runs;
- ``quack``: quack's GEMM with the bias in its epilogue and ``add_to_output`` (the tile rounded
  to bf16, then added into x by a TMA reduce-add store: one add per element, the rounding the
  separate add makes), with vitgraph's tile; then ``kernels.add_layernorm(x, None)`` (reads
  x, writes the LayerNorm).

µs per pair, in CUDA graphs, 8 weight sets rotated so weights stream from DRAM as in the tower.
Usage: gemm_residual_epilogue.py [M ...]. Needs quack-kernels (the ``fa4`` extra) and a Hopper GPU.
"""
import argparse

import torch
import torch.nn.functional as F

from vitgraph.ops import gemm, kernels
from vitgraph.bench.common import graph_per_call_us

LAYERS = {"proj": 1280, "fc2": 5120}  # input width; both write the 1280-wide residual stream
SETS = 8


def linear_add_(x, inp, weight, bias):
    """``x += inp @ weight.T + bias`` in one quack GEMM."""
    _, gemm_plain, _ = gemm._quack()
    gemm_plain(inp, weight.t(), x, bias=bias, add_to_output=True, config=gemm.plain_config())
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ms", nargs="*", type=int, default=[1024, 1536, 2048, 4096, 8192])
    args = parser.parse_args()
    gemm._quack()
    dev, dt = "cuda", torch.bfloat16
    ln_w, ln_b = torch.ones(1280, device=dev, dtype=dt), torch.zeros(1280, device=dev, dtype=dt)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; µs per GEMM + LayerNorm")
    for m in args.ms:
        for layer, width in LAYERS.items():
            weights = [(torch.randn(1280, width, device=dev, dtype=dt) * 0.03,
                        torch.randn(1280, device=dev, dtype=dt) * 0.1) for _ in range(SETS)]
            inp = torch.randn(m, width, device=dev, dtype=dt)
            x = torch.randn(m, 1280, device=dev, dtype=dt)
            ref = x.clone()
            kernels.add_layernorm(ref, F.linear(inp, *weights[0]), ln_w, ln_b, 1e-6)
            got = linear_add_(x.clone(), inp, *weights[0])
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            cublas = graph_per_call_us([
                lambda w=w, b=b: kernels.add_layernorm(x, F.linear(inp, w, b), ln_w, ln_b, 1e-6) for w, b in weights])
            quack = graph_per_call_us([
                lambda w=w, b=b: kernels.add_layernorm(linear_add_(x, inp, w, b), None, ln_w, ln_b, 1e-6)
                for w, b in weights])
            print(f"M={m:5d} {layer:4s} cublas+add_layernorm {cublas:7.1f} | quack add+layernorm {quack:7.1f} "
                  f"({(quack / cublas - 1) * 100:+.1f}%) rel err of x {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
