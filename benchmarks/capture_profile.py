"""Host profile (cProfile) of capturing the default buckets: where the capture's host time goes.

    python benchmarks/capture_profile.py
"""
import cProfile
import io
import pstats
import time

import torch

from vitgraph import GraphedVisionEncoder
enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False, capture=False)
torch.cuda.synchronize()
pr = cProfile.Profile()
s = time.perf_counter()
pr.enable(); enc.capture(); pr.disable()
print(f"capture {time.perf_counter()-s:.2f} s")
st = io.StringIO(); ps = pstats.Stats(pr, stream=st).sort_stats("tottime"); ps.print_stats(22); print(st.getvalue()[-6000:])
st = io.StringIO(); ps = pstats.Stats(pr, stream=st).sort_stats("cumulative"); ps.print_stats(40); print(st.getvalue()[-9000:])
