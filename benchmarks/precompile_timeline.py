"""Where a cold start's kernel precompile spends its time: each worker's start, build and jobs.

    D=$(mktemp -d); TRITON_CACHE_DIR=$D/t FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$D/f \
        QUACK_CACHE_DIR=$D/q python benchmarks/precompile_timeline.py

Builds the default encoder and captures it with vitgraph's debug log on: the precompile's
lines (one per worker: seconds to start Python, torch and vitgraph, to build its one-block
tower and resolve the encoder's choices, and per job, imports of quack and the CuTe DSL
included; then the summary), each stamped with the milliseconds since this script started.
With no kernel on disk the workers start when the encoder does, before its build. Needs the ``fa4`` extra and a Hopper GPU; run it on empty
caches, as above, to see the cold path.
"""
import logging
import time

logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(message)s")
logging.getLogger("vitgraph").setLevel(logging.DEBUG)
t0 = time.perf_counter()
import torch  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402

torch.zeros(1, device="cuda")
t1 = time.perf_counter()
print(f"imports {t1 - t0:.1f} s")
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False)
t2 = time.perf_counter()
print(f"build {t2 - t1:.1f} s")
enc.capture()
stats = enc.stats()
print(f"capture {time.perf_counter() - t2:.1f} s (precompile {stats['precompile']['seconds']:.1f} s of it): "
      f"{stats['precompile']}")
