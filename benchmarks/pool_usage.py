"""The graphs' shared pool against one eager forward's activation peak, default buckets.

    python benchmarks/pool_usage.py                 # the defaults
    python benchmarks/pool_usage.py --bias-free off # tuning gemm.bias_free off (change 41's other branch)

The target is a pool of at most 1.2x the peak of the largest bucket; a pool far above it
means an allocation order that fragments the pool's first segment (see benchmarks/HISTORY.md, change 41).
"""

import argparse

import torch

import vitgraph
from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import eager_peak_bytes

parser = argparse.ArgumentParser()
parser.add_argument("--bias-free", choices=("on", "off"), default="on")
parser.add_argument("--max-budget", type=int, default=16384)
args = parser.parse_args()

enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", dtype=torch.bfloat16, seed=0,
                                       max_budget=args.max_budget, progress=False,
                                       tuning={"gemm.bias_free": args.bias_free == "on"})
stats = enc.stats()
pool, peak = stats["pool_bytes"] - stats["pool_workspace_bytes"], eager_peak_bytes(enc)  # activations alone
print(f"vitgraph at {vitgraph.__file__}: gemm.bias_free {args.bias_free}, {len(enc.buckets)} graphs, "
      f"pool {pool / 2**20:.1f} MiB, eager peak {peak / 2**20:.1f} MiB, ratio {pool / peak:.2f}")
