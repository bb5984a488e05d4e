"""Capture time per phase: warm-up forward, launches under capture, graph instantiation, empty_cache.

    python benchmarks/capture_phases.py

Replaces ``GraphBank._capture_one`` with a copy that synchronises after the warm-up forward and
times each phase (the warm-up's GPU work is then counted in the warm-up, where the real
capture waits for it in ``empty_cache``), then captures the default buckets.
"""
import time
from collections import defaultdict

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.capture import graphs as G

acc = defaultdict(float)
orig_empty = torch.cuda.empty_cache
def timed_empty():
    s = time.perf_counter(); orig_empty(); acc["empty_cache"] += time.perf_counter() - s
torch.cuda.empty_cache = timed_empty

def capture_one(self, bucket, pool):
    pixels, batch = self.pixels_view(bucket), self.batch_view(bucket)
    stream = self._stream
    stream.wait_stream(torch.cuda.current_stream(self.device))
    with torch.inference_mode():
        s = time.perf_counter()
        with torch.cuda.stream(stream):
            if pool is None and G._arena_usable():
                peak = self.activation_peak(bucket)
                arena = G._round_up(peak + peak // G.ARENA_MARGIN, G.ARENA_ALIGN)
            else:
                self.model(pixels, batch)
                arena = 0
        torch.cuda.current_stream(self.device).wait_stream(stream)
        stream.synchronize()
        acc["warmup (host+gpu)"] += time.perf_counter() - s
        graph = torch.cuda.CUDAGraph()
        s = time.perf_counter()
        ctx = torch.cuda.graph(graph, pool=pool, stream=stream)
        ctx.__enter__()
        if arena:
            torch.empty(arena, dtype=torch.uint8, device=self.device)
        result = self.model(pixels, batch)
        output = self.static_output[:result.shape[0]]
        output.copy_(result)
        del result
        acc["capture launches"] += time.perf_counter() - s
        s = time.perf_counter()
        ctx.__exit__(None, None, None)
        acc["capture end + instantiate"] += time.perf_counter() - s
    return G.CapturedGraph(bucket, graph, output)
G.GraphBank._capture_one = capture_one

enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False)
torch.cuda.synchronize()
s = time.perf_counter(); enc.capture(); total = time.perf_counter() - s
print(f"capture {total:.2f} s; routing {enc._routing_seconds:.2f} s; " + ", ".join(f"{k} {v:.2f} s" for k, v in acc.items()))
