"""Host cost of each torch call ``encode`` makes around a replay, on this machine's host (µs, medians).

Before a replay starts, the GPU waits for every host step of the call (``encode_timeline.py``:
``gpu:head``). This times each kind of step alone, 2000 times (300 for the replay): the
``inference_mode`` scope, the stream lookup and event calls, the pixels' slice and copy into
the static buffer, the staging write, the output's allocation and copy, and a replay of a
graph of 224 tiny kernels (the launch of a graph with as many nodes as the tower's, without
their parameters).

    python benchmarks/host_calls.py
"""
import statistics, time, threading
import numpy as np
import torch

dev = torch.device("cuda")
px = torch.randn(256, 1176, device=dev, dtype=torch.bfloat16)
px32 = px.float()
static = torch.empty(16384, 1176, device=dev, dtype=torch.bfloat16)
out_static = torch.empty(4096, 1536, device=dev, dtype=torch.bfloat16)
ev = torch.cuda.Event(); ev.record()
stream = torch.cuda.current_stream()
pinned = torch.empty(4096, dtype=torch.int32).pin_memory(); pinned_np = pinned.numpy(); staged = np.zeros(4096, np.int32)
lock = threading.Lock()
# a graph of 224 tiny kernels
g = torch.cuda.CUDAGraph(); x = torch.zeros(1024, device=dev)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3): x.add_(1)
torch.cuda.synchronize()
with torch.cuda.graph(g):
    for _ in range(224): x.add_(1)
torch.cuda.synchronize()

def t(name, fn, n=2000):
    ts = []
    for _ in range(n):
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    torch.cuda.synchronize()
    print(f"{name:42s} {statistics.median(ts)*1e6:7.2f}")

def im():
    with torch.inference_mode(): pass
def lk():
    with lock: pass
t("inference_mode enter/exit", im)
t("lock", lk)
t("current_stream(dev)", lambda: torch.cuda.current_stream(dev))
t("current_stream()", lambda: torch.cuda.current_stream())
t("stream.wait_event(ev)", lambda: stream.wait_event(ev))
t("ev.record(stream)", lambda: ev.record(stream))
t("ev.synchronize() (done)", lambda: ev.synchronize())
t("ev.query()", lambda: ev.query())
t("static[:256] slice", lambda: static[:256])
t("static[:256].copy_(px bf16)", lambda: static[:256].copy_(px, non_blocking=True))
t("static[:256].copy_(px fp32)", lambda: static[:256].copy_(px32, non_blocking=True))
sl = static[:256]
t("sl.copy_(px) (view made once)", lambda: sl.copy_(px, non_blocking=True))
t("pinned_np[:] = staged", lambda: pinned_np.__setitem__(slice(None), staged))
t("px.data_ptr()", lambda: px.data_ptr())
t("torch.empty(64,1536)", lambda: torch.empty(64, 1536, device=dev, dtype=torch.bfloat16))
o = torch.empty(64, 1536, device=dev, dtype=torch.bfloat16)
t("o.copy_(out_static[:64])", lambda: o.copy_(out_static[:64]))
t("g.replay() 224 nodes", lambda: g.replay(), n=300)
t("px.dtype/ndim/shape/device checks", lambda: (px.dtype.is_floating_point, px.ndim, px.shape[1], px.device.type))
