"""add+LayerNorm at small row counts: rows per program and warps, inside CUDA graphs.

    python benchmarks/layernorm_programs.py 256 512 1024 4096

``kernels.add_layernorm`` gave each program about 8k elements (4 rows of 1280, 8 warps): at
256 rows, 64 programs for 132 SMs. This times the kernel (with a ``[T, N]`` y, and with
two split-K partials plus a bias) for 1, 2 and 4 rows per program and 4 or 8 warps, µs per
call (10 calls per graph replay, median of 15 replays).
"""

import argparse

import torch
import triton

from vitgraph import kernels
from vitgraph.bench.common import graph_replay_us

WIDTH = 1280


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", type=int, default=[256, 512, 1024, 4096])
    args = p.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    w, b = torch.ones(WIDTH, device=dev, dtype=bf16), torch.zeros(WIDTH, device=dev, dtype=bf16)
    for rows in args.rows:
        x = torch.randn(rows, WIDTH, device=dev, dtype=bf16)
        h = torch.empty_like(x)
        inputs = {"y": (torch.randn(rows, WIDTH, device=dev, dtype=bf16), None),
                  "2 partials + bias": (torch.randn(2, rows, WIDTH, device=dev, dtype=bf16), b)}
        default = (1 if rows <= kernels.LAYERNORM_ONE_ROW_MAX_ROWS else kernels._rows_per_program(rows, WIDTH), 8)
        for name, (y, y_bias) in inputs.items():
            cells = []
            for per in (1, 2, 4):
                for warps in (4, 8):
                    def run(per=per, warps=warps, y=y, y_bias=y_bias):
                        kernels._add_layernorm_kernel[(triton.cdiv(rows, per),)](
                            x, y, y_bias if y_bias is not None else x, h, w, b, rows, 1e-6, N=WIDTH,
                            BLOCK_N=triton.next_power_of_2(WIDTH), ROWS=per, HAS_Y=True,
                            SPLITS=y.shape[0] if y.dim() == 3 else 1, HAS_Y_BIAS=y_bias is not None,
                            num_warps=warps)
                    us, _ = graph_replay_us(run)
                    mark = "*" if (per, warps) == default else " "
                    cells.append(f"{per}r/{warps}w{mark} {us:5.2f}")
            print(f"rows {rows:5d} {name:<18} " + "  ".join(cells))
    print("(* = the current choice)")


if __name__ == "__main__":
    main()
