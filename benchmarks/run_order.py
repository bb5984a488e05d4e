"""Does what runs before a timing change it? vitgraph's graph path timed in three states.

    python benchmarks/run_order.py                       # 1x256 1x1024 4x1024, 3 rounds
    python benchmarks/run_order.py --cases 1x256 --rounds 5

``benchmarks/latency.py`` times each case's systems one after another: transformers' eager
tower, vitgraph's eager path, then the graphs. Graph-only runs and ``ab_setting.py`` A/Bs
read the small cases 0.15-0.25 ms lower on the same machine. Per round and case this
times ``vitgraph_graph`` exactly as ``latency.py`` does (5 warm-ups, 30 synchronised calls,
median) in three states:

- ``after_eager``: right after timing ``hf_eager`` and ``vitgraph_eager`` on the case, as
  ``latency.py`` runs it;
- ``after_sleep``: after 2 s with the GPU idle;
- ``hot``: after 0.5 s of back-to-back graph calls.

It samples the SM clock and board power with ``nvidia-smi`` every 20 ms and prints, per
state, the median wall time of the 30 calls, of the first and last 10, and the median SM
clock over the timed calls: a state whose first calls are slow at a low clock is one the
GPU's clock governor has not left yet.
"""

import argparse
import statistics
import time

import torch

from vitgraph.bench import common
from vitgraph.bench.latency import CASES


def timed_calls(fn, device, iters: int, warmup: int) -> tuple[list[float], float, float]:
    """Per-call wall ms of ``iters`` synchronised calls after ``warmup`` (as ``median_ms``),
    with the host times the timed calls began and ended."""
    for _ in range(warmup):
        fn()
    common.sync(device)
    begin = time.time()
    times = common.call_times_ms(fn, device, iters, warmup=0)
    return times, begin, time.time()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=["1x256", "1x1024", "4x1024"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    common.add_model_args(p)
    args = p.parse_args()
    common.resolve_model_args(args)
    runners, eager_enc, _ = common.build_systems(args, ["hf_eager", "vitgraph_eager", "vitgraph_graph"], 16384)
    device, width = eager_enc.device, eager_enc.config.patch_width
    graph = runners["vitgraph_graph"]
    sampler = common.ClockSampler()
    windows = []  # (case, state, per-call ms, begin, end)
    gen = torch.Generator().manual_seed(0)
    for name in args.cases:
        grids = CASES[name]
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, generator=gen).to(device, eager_enc.dtype)
        call = lambda: graph(pixels, grids)  # noqa: E731
        for _ in range(args.rounds):
            for system in ("hf_eager", "vitgraph_eager"):
                common.median_ms(lambda: runners[system](pixels, grids), device, args.iters, args.warmup)
            windows.append((name, "after_eager", *timed_calls(call, device, args.iters, args.warmup)))
            time.sleep(2.0)
            windows.append((name, "after_sleep", *timed_calls(call, device, args.iters, args.warmup)))
            until = time.perf_counter() + 0.5
            while time.perf_counter() < until:
                call()
            common.sync(device)
            windows.append((name, "hot", *timed_calls(call, device, args.iters, args.warmup)))
    samples = sampler.stop()

    rows = []
    for name in args.cases:
        for state in ("after_eager", "after_sleep", "hot"):
            mine = [w for w in windows if w[0] == name and w[1] == state]
            clocks = [c for _, _, _, a, b in mine for t, c, _ in samples if a <= t <= b]
            watts = [w for _, _, _, a, b in mine for t, _, w in samples if a <= t <= b]
            rows.append([name, state,
                         statistics.median(statistics.median(w[2]) for w in mine),
                         statistics.median(statistics.median(w[2][:10]) for w in mine),
                         statistics.median(statistics.median(w[2][-10:]) for w in mine),
                         statistics.median(clocks) if clocks else None,
                         statistics.median(watts) if watts else None])
    print(f"{torch.cuda.get_device_name(device)}, {args.rounds} rounds; medians over rounds; "
          f"{len(samples)} clock samples")
    common.print_table(["case", "state", "ms (30 calls)", "first 10", "last 10", "SM MHz", "W"], rows)


if __name__ == "__main__":
    main()
