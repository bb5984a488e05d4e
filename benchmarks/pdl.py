"""Programmatic dependent launch of vitgraph's Triton kernels: on against off, one process.

    python benchmarks/pdl.py                    # the latency suite's cases, 2B model, random weights
    python benchmarks/pdl.py --cases 1x256 1x4096 --rounds 7

Two graph encoders with the same weights, captured with ``kernels.PDL_ENABLED`` on and
off. Each round times every case on both (median wall ms of ``--iters`` synchronised
``encode`` calls, as ``benchmarks/latency.py``), alternating which goes first; the table
shows the median over rounds. Outputs of the two encoders must be bitwise equal.
"""

import argparse
import statistics

import torch

from vitgraph import GraphedVisionEncoder, kernels
from vitgraph.bench.common import median_ms, print_table
from vitgraph.bench.latency import CASES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda")
    encoders = {}
    for pdl in (True, False):
        kernels.PDL_ENABLED = pdl
        encoders["on" if pdl else "off"] = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0,
                                                                            progress=False)
    cfg = encoders["on"].config
    # Single frames are routed by timings taken at capture; use one routing for both.
    encoders["off"]._packed_single_below = dict(encoders["on"]._packed_single_below)

    def encode(key, pixels, grids):
        kernels.PDL_ENABLED = key == "on"  # eager calls (1x9604) launch at call time
        return encoders[key].encode(pixels, grids)

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.cases:
        grids = CASES[name]
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_width, generator=gen).to(device, torch.bfloat16)
        outs = {key: encode(key, pixels, grids).clone() for key in encoders}
        equal = torch.equal(outs["on"], outs["off"])
        times = {"on": [], "off": []}
        for r in range(args.rounds):
            for key in (("on", "off") if r % 2 == 0 else ("off", "on")):
                times[key].append(median_ms(lambda: encode(key, pixels, grids), device, args.iters, 3))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        rows.append([name, off, on, on - off, "yes" if equal else "NO"])
    print_table(["case", "PDL off ms", "PDL on ms", "delta ms", "bitwise equal"], rows)


if __name__ == "__main__":
    main()
