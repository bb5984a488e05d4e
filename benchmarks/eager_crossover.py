"""Where eager beats a padded replay: one graph step against the same step run eagerly.

    python benchmarks/eager_crossover.py                    # 24 batches of the serving mix, 2k-16k tokens
    python benchmarks/eager_crossover.py --batches 40 --rounds 5
    python benchmarks/eager_crossover.py --exact --profile --batches 6 --low 8192   # no padding; GPU time by kernel class

One graph encoder with every step replayed (``exact_eager_above=None``: buckets up to
16384 tokens) and one eager encoder on the same weights. The batches are runs of
consecutive requests of the serving benchmark's mix (``vitgraph.bench.serving``), spread
over the token range. Each is timed on both (median wall ms of synchronised ``encode``
calls, alternating which goes first per round); the table shows the bucket the graph
step pads to, the padding, and eager's time over the replay's. ``--exact`` adds each
batch's size to the budgets, so that the graphs pad nothing and the difference is eager's
own cost; ``--profile`` then splits one call of each by kernel class (CUDA time, µs) and
shows how long the GPU sat idle within the call's wall time.
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import KERNEL_CLASSES, kernel_class, median_ms, print_table
from vitgraph.bench.serving import request_grids
from vitgraph.engine.planner import budget_ladder
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


def profiled_us(run, pixels, grids) -> dict[str, float]:
    """One synchronised call under the profiler: wall µs, CUDA µs per kernel class, and idle µs."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run(pixels, grids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e6
    spent = defaultdict(float, wall=wall)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spent[kernel_class(event.name)] += event.device_time
    spent["idle"] = wall - sum(spent[c] for c, _ in KERNEL_CLASSES)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--low", type=int, default=2048)
    p.add_argument("--high", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact", action="store_true", help="a budget of each batch's size: the graphs pad nothing")
    p.add_argument("--profile", action="store_true", help="also split one call of each by kernel class")
    args = p.parse_args()

    device = torch.device("cuda")
    batches = batches_of_mix(args.batches, args.low, args.high, args.seed)
    budgets = None
    if args.exact:
        sizes = {sum(t * h * w for t, h, w in grids) for grids in batches}
        budgets = sorted(set(budget_ladder(256, args.high)) | sizes)
    graph = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0, progress=False,
                                             exact_eager_above=None, budgets=budgets)
    eager = GraphedVisionEncoder(graph.tower, device=device, dtype=graph.dtype, mode="eager")
    gen = torch.Generator().manual_seed(args.seed)
    rows, profiles = [], []
    for grids in batches:
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
        if args.profile:
            for key, run in runs.items():
                spent = profiled_us(run, pixels, grids)
                profiles.append([tokens, key] + [round(spent[c]) for c in ("wall", *dict(KERNEL_CLASSES), "idle")])
    print_table(["tokens", "frames", "graph buckets", "pad %", "graph ms", "eager ms", "eager vs graph %"], rows)
    if profiles:
        print_table(["tokens", "system", "wall µs", *dict(KERNEL_CLASSES), "idle µs"], profiles)


if __name__ == "__main__":
    main()
