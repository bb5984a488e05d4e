"""Where a process's capture time goes: Triton compiles, CuTe-DSL compiles (FA4, quack), per bucket.

    python benchmarks/capture_breakdown.py --fa4          # the defaults with flash-attn-4 / quack
    TRITON_CACHE_DIR=$(mktemp -d) FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$(mktemp -d) \
        QUACK_CACHE_DIR=$(mktemp -d) python benchmarks/capture_breakdown.py --fa4   # every kernel compiles

Wraps ``triton.compiler.compile`` and ``cutlass.cute.compile`` with timers. With ``--fa4`` the
CuTe DSL is imported before the encoder (its own line), so FA4's disk cache stays off in this
script unless ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` is set: its compiles then show up
every time.
"""
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import triton.compiler as tc  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402
from vitgraph.bench.common import CallTimer  # noqa: E402
from vitgraph.engine import graphs  # noqa: E402

timer = CallTimer()
tc.compile = timer.wrap("triton_compile", tc.compile)

t1 = time.perf_counter()
cute_import = 0.0
if "--fa4" in sys.argv:
    s = time.perf_counter()
    import cutlass.cute  # noqa: E402
    import flash_attn.cute  # noqa: E402,F401
    cute_import = time.perf_counter() - s
    cutlass.cute.compile = timer.wrap("cute_compile", cutlass.cute.compile)
per_bucket = []
orig = graphs.GraphBank._capture_one


def capture_one(self, bucket, pool):
    s = time.perf_counter()
    out = orig(self, bucket, pool)
    torch.cuda.synchronize()
    per_bucket.append((bucket.name, bucket.max_segments, time.perf_counter() - s))
    return out


graphs.GraphBank._capture_one = capture_one
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
attn = "fa4" if "--fa4" in sys.argv else "cudnn"
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False, attention=attn)
torch.cuda.synchronize()
t3 = time.perf_counter()
enc.capture()
t4 = time.perf_counter()
stats = enc.stats()
slow = sorted(per_bucket, key=lambda r: -r[2])[:6]
dense = sum(t for _, seg, t in per_bucket if seg == 1)
packed = sum(t for _, seg, t in per_bucket if seg > 1)
print(f"[{attn}] import {t1 - t0:.1f}s cute-import {cute_import:.1f}s | CUDA init {t2 - t1:.1f}s | weights {t3 - t2:.1f}s | "
      f"capture {stats['capture_seconds']:.1f}s (routing {enc._routing_seconds:.1f}s; wall {t4 - t3:.1f}s) | "
      f"graphs packed {packed:.1f}s dense {dense:.1f}s | "
      + " ".join(f"{k} {t:.1f}s/{timer.calls[k]}" for k, t in timer.seconds.items())
      + " | slowest: " + ", ".join(f"{n}x{s} {t:.2f}" for n, s, t in slow), flush=True)
