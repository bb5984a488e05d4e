"""Is a replay's GPU time the same as its kernels run eagerly? Where does an ``encode``'s wall
time go beyond the kernels?

For each case: the default engine's bucket for it, with the case's metadata loaded, timed
three ways: the graph's replay (CUDA events around ``replay()`` only), the sum of its kernels'
times (torch.profiler, per call), and the same forward run eagerly on the same static
buffers (``GraphBank.run_eager``: the same kernels, launched one by one). Also the median
wall time of a whole ``encode`` and of an eager forward at the case's exact shape. The
kernels whose per-call time differs most between graph and eager are listed.

    python benchmarks/graph_vs_eager.py 1x256 1x4096 4x1024 16x256 video-8x16x28
"""

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import median_ms
from vitgraph.bench.latency import CASES

REPS = 30


def kernel_times(fn, calls: int = 5, warm: int = 10):
    """Per call of ``fn`` (each profiled alone, right after ``warm`` unprofiled calls so the
    GPU runs at the clock it holds under load): µs of each kernel name (mean), and the median
    of the call's span on the GPU (first kernel start to last kernel end), of the time some
    kernel ran (the union of their intervals), and of the largest idle gaps with their
    neighbours."""
    per_kernel = defaultdict(float)
    spans, busies, gaps = [], [], []
    for _ in range(calls):
        for _ in range(warm):
            fn()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        busy, reach, idle = 0.0, None, []
        for prev, evt in zip([None] + kernels[:-1], kernels):
            per_kernel[evt.name] += evt.device_time / calls
            start, end = evt.time_range.start, evt.time_range.end
            if reach is None or start >= reach:
                if reach is not None:
                    idle.append((start - reach, prev.name, evt.name))
                busy += end - start
                reach = end
            elif end > reach:
                busy += end - reach
                reach = end
        spans.append(reach - kernels[0].time_range.start)
        busies.append(busy)
        gaps.append(idle)
    middle = sorted(range(calls), key=lambda i: spans[i])[calls // 2]
    return per_kernel, statistics.median(spans), statistics.median(busies), gaps[middle]


def event_ms(fn) -> float:
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=["1x256", "1x4096", "4x1024", "16x256", "video-8x16x28"])
    parser.add_argument("--top", type=int, default=6, help="kernels listed per case")
    args = parser.parse_args()
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
    bank, tower = enc.bank, enc.tower
    rows = []
    for case in args.cases:
        grids = CASES[case]
        tokens = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(tokens, tower.input_width, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            encode_wall = median_ms(lambda: enc.encode(pixels, grids), enc.device, REPS, 3)
            batch = tower.build_batch(grids).to("cuda")
            exact_wall = median_ms(lambda: tower(pixels, batch), enc.device, REPS, 3)
            prepared = enc._prepare(grids)
            if len(prepared.plan.steps) != 1 or prepared.plan.steps[0].bucket is None:
                print(f"{case}: not one replay, skipped")
                continue
            step, staged = prepared.plan.steps[0], prepared.staged[0]
            bucket = step.bucket
            bank.load(bucket, pixels, staged)
            torch.cuda.synchronize()
            replay_gpu = event_ms(lambda: bank.replay(bucket))
            eager_gpu = event_ms(lambda: bank.run_eager(bucket))
            graph_k, span, busy, idle = kernel_times(lambda: bank.replay(bucket))
            eager_k, *_ = kernel_times(lambda: bank.run_eager(bucket), warm=1)
            replay_hot = event_ms(lambda: bank.replay(bucket))
        graph_sum, eager_sum = sum(graph_k.values()) / 1e3, sum(eager_k.values()) / 1e3
        print(f"== {case}: profiled replay span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f}, idle "
              f"{(span - busy) / 1e3:.3f} in {len(idle)} gaps; replay GPU by events again {replay_hot:.3f}")
        by_pair = defaultdict(lambda: [0.0, 0])
        for us, before, after in idle:
            key = (before[:60], after[:60])
            by_pair[key][0] += us
            by_pair[key][1] += 1
        for (before, after), (us, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"   idle {us:7.1f} us over {n:3d} gaps: {before} -> {after}")
        rows.append((case, bucket.name, encode_wall, replay_gpu, graph_sum, eager_gpu, eager_sum, exact_wall))
        print(f"== {case} in {bucket.name}: encode wall {encode_wall:.3f} ms, replay GPU {replay_gpu:.3f}, "
              f"graph kernels {graph_sum:.3f} ({len(graph_k)} names), eager on the bucket GPU {eager_gpu:.3f} "
              f"kernels {eager_sum:.3f}, eager exact shape wall {exact_wall:.3f}", flush=True)
        names = set(graph_k) | set(eager_k)
        diffs = sorted(names, key=lambda n: -abs(graph_k.get(n, 0.0) - eager_k.get(n, 0.0)))
        for name in diffs[:args.top]:
            print(f"   graph {graph_k.get(name, 0.0):8.1f} us  eager {eager_k.get(name, 0.0):8.1f} us  {name[:120]}")
    print("\ncase | bucket | encode wall | replay GPU | graph kernel sum | gaps in replay | eager GPU (bucket) |"
          " eager kernel sum | eager exact wall   (ms)")
    for case, name, wall, replay, gsum, egpu, esum, exact in rows:
        print(f"{case} | {name} | {wall:.3f} | {replay:.3f} | {gsum:.3f} | {replay - gsum:.3f} | {egpu:.3f} | "
              f"{esum:.3f} | {exact:.3f}")


if __name__ == "__main__":
    main()
