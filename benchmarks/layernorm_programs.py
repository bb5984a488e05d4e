"""add+LayerNorm layouts inside CUDA graphs: rows per program and warps.

    python benchmarks/layernorm_programs.py 256 512 1024 4096
    python benchmarks/layernorm_programs.py 4096 --cold          # x read from DRAM, as in the tower

Times ``kernels.add_layernorm`` at width 1280 for each layout (``--per`` rows per program,
``--warps`` warps), µs per call (10 calls per graph replay, median of 15 replays). Inputs: ``offset`` (the
bias-free stream from 897 rows: read x, write h), ``y`` (a ``[T, N]`` y added into x) and two
split-K partials plus a bias (up to 896 rows). ``--cold``: each call follows a 128 MiB write
that evicts L2, as x and y come from DRAM in the tower (the write's own time, measured alone,
is subtracted).
"""

import argparse

import torch
import triton

from vitgraph.ops import kernels
from vitgraph.bench.common import graph_replay_us

WIDTH = 1280


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", type=int, default=[256, 512, 1024, 4096])
    p.add_argument("--cold", action="store_true", help="evict L2 before each call")
    p.add_argument("--per", nargs="+", type=int, default=[1, 2, 4, 8], help="rows per program")
    p.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--inputs", nargs="+", default=["offset", "y", "partials"], choices=["offset", "y", "partials"])
    args = p.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "(L2 evicted before each call)" if args.cold else "")
    w, b = torch.ones(WIDTH, device=dev, dtype=bf16), torch.zeros(WIDTH, device=dev, dtype=bf16)
    scratch = torch.empty(128 << 20, device=dev, dtype=torch.uint8)
    flush_us = graph_replay_us(lambda: scratch.fill_(1))[0] if args.cold else 0.0
    if args.cold:
        print(f"the L2-evicting write alone: {flush_us:.2f} us (subtracted)")
    for rows in args.rows:
        x = torch.randn(rows, WIDTH, device=dev, dtype=bf16)
        inputs = {"offset": dict(offset=torch.randn(WIDTH, device=dev)),
                  "y": dict(y=torch.randn(rows, WIDTH, device=dev, dtype=bf16)),
                  "partials": dict(y=torch.randn(2, rows, WIDTH, device=dev, dtype=bf16), y_bias=b)}
        default = kernels.layernorm_launch(rows, WIDTH)
        for name in args.inputs:
            cells = []
            for per in args.per:
                for warps in args.warps:
                    launch = kernels.LayerNormLaunch(per, warps)

                    def run(launch=launch, extra=inputs[name]):
                        if args.cold:
                            scratch.fill_(1)
                        kernels.add_layernorm(x, extra.get("y"), w, b, 1e-6, extra.get("y_bias"),
                                              extra.get("offset"), launch=launch)
                    us = graph_replay_us(run)[0] - flush_us
                    mark = "*" if launch == default else " "
                    cells.append(f"{per}r/{warps}w{mark} {us:5.2f}")
            print(f"rows {rows:5d} {name:<8} " + "  ".join(cells), flush=True)
    print("(* = the current choice)")


if __name__ == "__main__":
    main()
