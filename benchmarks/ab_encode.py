"""A/B of ``GraphedVisionEncoder``'s host path (``encode`` and the methods it calls) against
another version of ``vitgraph/encoder.py``, end to end, on one encoder, in one process.

    git show HEAD~1:vitgraph/encoder.py > /tmp/encoder_before.py
    python benchmarks/ab_encode.py /tmp/encoder_before.py --cases 1x256 1x1024 4x1024 16x256

The ``before`` file's ``encode``, ``_run_graph`` and ``_run_eager`` are swapped onto the one
encoder (same graphs, same buffers) for its turns. Each round times every case both ways
(median wall ms of ``--iters`` synchronised calls, as ``benchmarks/latency.py``), the two
strictly alternating (:func:`vitgraph.bench.common.alternating_ab`); the table shows the
median over rounds and the relative difference of the two outputs (0: the same kernels ran).
"""

import argparse
import importlib.util
import sys

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import PREHEAT_SECONDS, alternating_ab, print_table
from vitgraph.bench.latency import CASES

SWAPPED = ("encode", "_run_graph", "_run_eager")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="path of the other vitgraph/encoder.py")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--preheat", type=float, default=PREHEAT_SECONDS, help="seconds of calls before each case's rounds")
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("vitgraph.encoder_before", args.before)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before  # dataclasses look their module up there
    spec.loader.exec_module(before)
    methods = {"after": {name: getattr(GraphedVisionEncoder, name) for name in SWAPPED},
               "before": {name: getattr(before.GraphedVisionEncoder, name) for name in SWAPPED}}

    device = torch.device("cuda")
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0, progress=False)
    cfg = enc.config

    def encode(key, pixels, grids):
        for name, fn in methods[key].items():
            setattr(GraphedVisionEncoder, name, fn)
        return enc.encode(pixels, grids)

    cases = {name: CASES[name] for name in args.cases}
    results = alternating_ab(encode, ("before", "after"), cases, cfg.patch_width, device, args.rounds, args.iters,
                             args.preheat)
    rows = [[name, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}", f"{diff:.1e}"] for name, b, a, diff in results]
    print_table(["case", "before ms", "after ms", "delta ms", "rel diff"], rows)


if __name__ == "__main__":
    main()
