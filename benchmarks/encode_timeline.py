"""Where one ``encode`` call's wall time goes, on the host and on the GPU, for the default engine.

Host timestamps (``perf_counter``) at the call's entry, before and after each line of
``GraphBank._load``, around the replay's launch and at the return; CUDA events recorded at
the call's entry (the stream is idle, so it completes at once), around the replay and after
the output copy. Medians of 30 synchronised calls per case, µs:

* ``validate+plan``: entry to ``_load`` (input checks, the cached plan);
* ``load:pixels`` / ``load:sync`` / ``load:stage``: the copy of the pixels into the static
  buffer, the wait for the staging buffer, the copy of the metadata into it;
* ``launch``: ``replay()`` on the host; ``after``: the output copy and the return;
* GPU: entry to the replay's start (``gpu:head``: what the host's work before the launch costs
  the GPU), the replay, the output copy; ``tail``: the wall time past the last event.

    python benchmarks/encode_timeline.py 1x256 4x1024 16x256 video-8x16x28 1x4096
"""

import statistics
import sys
import time

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.latency import CASES

CALLS = 30

enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
bank = enc.bank
marks: dict[str, float] = {}
events: dict[str, torch.cuda.Event] = {}


def timed_load(bucket, pixels, staged, copy_metadata):
    meta, pinned, pinned_np = bank._meta_copy[bucket]
    marks["load"] = time.perf_counter()
    bank.static_pixels[:pixels.shape[0]].copy_(pixels, non_blocking=True)
    marks["pixels"] = time.perf_counter()
    bank._staged.synchronize()
    marks["sync"] = time.perf_counter()
    pinned_np[:] = staged
    if copy_metadata:
        meta.copy_(pinned, non_blocking=True)
        bank._staged.record()
    marks["stage"] = time.perf_counter()


def timed_replay(bucket):
    events["start"].record()
    out = replay(bucket)
    events["end"].record()
    marks["launched"] = time.perf_counter()
    return out


replay = bank.replay
bank._load = timed_load
bank.replay = timed_replay

print("case | validate+plan | load:pixels | load:sync | load:stage | launch | after | host total | "
      "gpu:head | gpu:replay | gpu:copy out | tail | wall   (µs, medians)")
for case in sys.argv[1:] or ["1x256", "4x1024", "16x256", "video-8x16x28", "1x4096"]:
    grids = CASES[case]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.tower.input_width, device="cuda",
                         dtype=torch.bfloat16)
    rows = []
    for i in range(CALLS + 5):
        events.update({k: torch.cuda.Event(enable_timing=True) for k in ("entry", "start", "end", "done")})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events["entry"].record()
        enc.encode(pixels, grids)
        t_ret = time.perf_counter()
        events["done"].record()
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        if i < 5:
            continue
        us = lambda a, b: (b - a) * 1e6
        gpu = lambda a, b: events[a].elapsed_time(events[b]) * 1e3
        head, run, out = gpu("entry", "start"), gpu("start", "end"), gpu("end", "done")
        wall = us(t0, t_end)
        rows.append([us(t0, marks["load"]), us(marks["load"], marks["pixels"]), us(marks["pixels"], marks["sync"]),
                     us(marks["sync"], marks["stage"]), us(marks["stage"], marks["launched"]),
                     us(marks["launched"], t_ret), us(t0, t_ret), head, run, out, wall - head - run - out, wall])
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"{case} | " + " | ".join(f"{v:.0f}" for v in med), flush=True)
