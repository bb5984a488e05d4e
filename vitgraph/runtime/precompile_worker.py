"""A kernel-compiling worker process (:mod:`vitgraph.runtime.precompile` starts them): builds a
one-block tower of the encoder's shape (by its tower's recipe), configured as the encoder's,
and runs each kernel of its share once, so that the kernel lands in its library's disk cache."""

from __future__ import annotations

import base64
import json
import pickle
import sys
import time

import torch

from ..engine.planner import Bucket, padded_batch
from .precompile import _persists, _synchronize, kernel_jobs


def worker_main(spec_json: str) -> None:
    """A worker: compile (or load) each job's kernel of the spec :func:`precompile` wrote."""
    import importlib

    spec = json.loads(spec_json)
    timings = {"start_s": round(time.time() - spec["started"], 2)}  # Python, torch and vitgraph imports
    lap = time.perf_counter()
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, spec["dtype"])
    module, _, function = spec["recipe"]["builder"].partition(":")  # from this package's own encoder: trusted
    tower = getattr(importlib.import_module(module), function)(**spec["recipe"]["kwargs"], device=device, dtype=dtype)
    from .options import EngineOptions, buckets_for, configure_tower
    from .tuning import derive_tuning

    if "options" in spec:  # started before the encoder chose anything: choose as it will
        # The tuning as the encoder derives it: from the device and the widths (which a
        # one-block tower shares), with the encoder's changes by name.
        options = EngineOptions(**spec["options"])
        tuning = derive_tuning(tower.shape, device, options.tuning, tower=tower)  # as the encoder's
        attention, tuning = configure_tower(tower, options, tuning, device, dtype)
        index, count = spec["share"]
        every = [j for j in kernel_jobs(tower, buckets_for(tower, options, attention, device, tuning))
                 if _persists(j.op)]
        jobs = [(j.op, j.bucket) for j in every[index::count]]
    else:  # the encoder's choices, already resolved, and its kernel tuning exactly
        tower.configure(spec["attention"], spec["fused"], pickle.loads(base64.b64decode(spec["kernel_tuning"])))
        jobs = [(op, Bucket(tokens, segments, max_seqlen)) for op, tokens, segments, max_seqlen in spec["jobs"]]
    timings["build_s"] = round(time.perf_counter() - lap, 2)
    with torch.inference_mode():
        for op, bucket in jobs:
            lap = time.perf_counter()
            tower.run_jit_kernel(op, padded_batch(tower, bucket).to(device))
            _synchronize(device)
            timings[f"{op}@{bucket.name}_s"] = round(time.perf_counter() - lap, 2)
    timings["dynamo_imported"] = "torch._dynamo" in sys.modules
    print(json.dumps(timings), flush=True)

