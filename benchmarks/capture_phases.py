"""Capture time per phase: warm-up forwards, launches under capture, graph instantiation, empty_cache.

    python benchmarks/capture_phases.py

Times the real ``GraphBank`` capture of the default buckets through hooks, without copying any
of its code: forward hooks on the tower split each forward into a warm-up (not capturing; the
hook synchronises its stream, so the warm-up's GPU work is counted there rather than in the
next ``empty_cache``) or launches under capture; ``torch.cuda.graph.__exit__`` (capture end and
instantiation) and ``torch.cuda.empty_cache`` are wrapped.
"""
import time

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import CallTimer

timer = CallTimer()
torch.cuda.empty_cache = timer.wrap("empty_cache", torch.cuda.empty_cache)
torch.cuda.graph.__exit__ = timer.wrap("capture end + instantiate", torch.cuda.graph.__exit__)

enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False)
forward_state = {}


def before_forward(module, args):
    forward_state["start"] = time.perf_counter()
    forward_state["capturing"] = torch.cuda.is_current_stream_capturing()


def after_forward(module, args, output):
    if forward_state["capturing"]:
        name = "capture launches"
    else:
        torch.cuda.current_stream().synchronize()
        name = "warm-up forwards (host+gpu)"
    timer.add(name, time.perf_counter() - forward_state["start"])


enc.tower.register_forward_pre_hook(before_forward)
enc.tower.register_forward_hook(after_forward)
torch.cuda.synchronize()
start = time.perf_counter()
enc.capture()
total = time.perf_counter() - start
print(f"capture {total:.2f} s of {len(enc.stats()['buckets'])} graphs; routing {enc._routing_seconds:.2f} s; "
      + ", ".join(f"{k} {v:.2f} s ({timer.calls[k]} calls)" for k, v in timer.seconds.items()))
