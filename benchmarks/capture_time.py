"""Capture time of the default engine, split: run it in fresh processes to see first-process costs.

    python benchmarks/capture_time.py            # one process: model build, capture, routing
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/capture_time.py   # Triton compiles again
    python benchmarks/capture_time.py 0          # compile_workers=0: no precompiling processes

On a fresh machine run it three times (cold everything; a new Triton cache only; all warm):
the differences split library loading from cold disks and Triton compiling.
"""
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402

t1 = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
workers = {"compile_workers": int(sys.argv[1])} if len(sys.argv) > 1 else {}
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False, **workers)
torch.cuda.synchronize()
t3 = time.perf_counter()
enc.capture()
t4 = time.perf_counter()
stats = enc.stats()
# "build": random weights, and loading the GEMM backend (quack imports the CuTe DSL: seconds).
print(f"import {t1 - t0:.1f} s | CUDA init {t2 - t1:.1f} s | build {t3 - t2:.1f} s | "
      f"capture {stats['capture_seconds']:.1f} s (of which routing {enc._routing_seconds:.1f} s; wall {t4 - t3:.1f} s) | "
      f"{len(stats['buckets'])} graphs, thresholds {stats['single_frame_packed_below']}, "
      f"faster next buckets {stats['faster_next_bucket']} | torch._dynamo imported: {'torch._dynamo' in sys.modules}")
print(f"precompile {stats['precompile']}")
