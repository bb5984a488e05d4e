"""Where eager beats a padded replay: one graph step against the same step run eagerly.

    python benchmarks/eager_crossover.py                    # 24 batches of the serving mix, 2k-16k tokens
    python benchmarks/eager_crossover.py --batches 40 --rounds 5

One graph encoder with every step replayed (``exact_eager_above=None``: buckets up to
16384 tokens) and one eager encoder on the same weights. The batches are runs of
consecutive requests of the serving benchmark's mix (``vitgraph.bench.serving``), spread
over the token range. Each is timed on both (median wall ms of synchronised ``encode``
calls, alternating which goes first per round); the table shows the bucket the graph
step pads to, the padding, and eager's time over the replay's.
"""

import argparse
import statistics

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import median_ms, print_table
from vitgraph.bench.serving import request_grids
from vitgraph.preprocess import MAX_PIXELS


def batches_of_mix(count: int, low: int, high: int, seed: int) -> list[list[tuple[int, int, int]]]:
    """``count`` runs of consecutive requests of ``low``-``high`` tokens, spread evenly over that range."""
    grids = request_grids(400, seed, MAX_PIXELS)
    found = {}
    for start in range(len(grids)):
        batch, tokens = [], 0
        for grid in grids[start:start + 6]:
            tokens += grid[0] * grid[1] * grid[2]
            batch.append(grid)
            if tokens > high:
                break
            if tokens >= low:
                found.setdefault(tokens, list(batch))
    ordered = [found[t] for t in sorted(found)]
    step = max(1, len(ordered) // count)
    return ordered[::step][:count]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--low", type=int, default=2048)
    p.add_argument("--high", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device("cuda")
    graph = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0, progress=False,
                                             exact_eager_above=None)
    eager = GraphedVisionEncoder(graph.tower, device=device, dtype=graph.dtype, mode="eager")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for grids in batches_of_mix(args.batches, args.low, args.high, args.seed):
        tokens = sum(t * h * w for t, h, w in grids)
        plan = graph.plan(grids)
        pixels = torch.randn(tokens, graph.config.patch_width, generator=gen).to(device, graph.dtype)
        runs = {"graph": graph.encode, "eager": eager.encode}
        times = {key: [] for key in runs}
        for r in range(args.rounds):
            for key in (("graph", "eager") if r % 2 == 0 else ("eager", "graph")):
                times[key].append(median_ms(lambda: runs[key](pixels, grids), device, args.iters, 2))
        g, e = statistics.median(times["graph"]), statistics.median(times["eager"])
        buckets = "+".join(s.bucket.name if s.bucket else "eager" for s in plan.steps)
        padded = sum(s.padded_tokens for s in plan.steps)
        rows.append([tokens, sum(t for t, _, _ in grids), buckets, 100 * padded / (tokens + padded), g, e,
                     100 * (e / g - 1)])
    print_table(["tokens", "frames", "graph buckets", "pad %", "graph ms", "eager ms", "eager vs graph %"], rows)


if __name__ == "__main__":
    main()
